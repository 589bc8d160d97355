"""What the benchmarks share.

- `bench.lib.results`: the checkout (`ROOT`), the machine a run was on, its commit, result files.
- `bench.lib.jobs`: real `horovodrun` jobs (through `testbed.harness`, like the tests).
- `bench.lib.judge`: statistics and the table of a benchmark's checks.
- `bench.lib.plot`: matplotlib on the Agg backend, figures saved as PNG.
"""
