"""The rank's side of the client: its session with the node's daemon (`session`), the connection and
stream under it (`transport`), and the turn hand-over on its device (`device_turns`). The Horovod
hook (`crossover.plugins.hook`) is its one user."""
