"""The wire contract `crossover.v1`: the .proto, its generated stubs, the session socket's framing,
and the one protocol version every request carries."""

PROTOCOL_VERSION = 1  # RegisterRequest and every Admin request carry it; the daemon refuses another
STEERING_CALLS = ("SetPolicy", "Drain", "Resume")  # Admin calls that change the daemon: its admin socket only
