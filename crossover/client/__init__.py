"""The client side of the wire, cut by who uses it.

- `rank/`: a training rank's session with its node's crossoverd and the transports under it
  (used by the Horovod hook, `crossover.plugins.hook`).
- `admin.py`, `replies.py` and `cli/`: the operator's side, a typed `AdminClient` of the daemon's Admin
  service, the records it answers with, and the `crossover` command (one module per command) that uses
  it and reads event logs.
"""
