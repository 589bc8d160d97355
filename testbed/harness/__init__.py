"""Real processes for tests, benchmarks and the demo: one daemon launcher with one readiness
probe, horovodrun jobs, and the checks read from a daemon's event log.

Every process starts in its own session so its whole group can be killed, even when
the caller fails half way.
"""
