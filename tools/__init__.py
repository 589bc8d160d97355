"""What the repository uses around the product, never installed with it: the emulated cluster,
the simulator, fault injection, the harness that starts real daemons and jobs for tests,
benchmarks and the demo, and the workloads they share."""
