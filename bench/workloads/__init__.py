"""Training scripts only the benchmarks run, by path under `horovodrun`."""
