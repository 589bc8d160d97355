"""The rank's and the operator's side of the wire: the session a rank keeps with its
node's crossoverd, the transports under it, the rank's phase reporter, the plugin's
settings and the `crossover` CLI."""
