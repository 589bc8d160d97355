"""Training scripts that tests, benchmarks and the demo run under `horovodrun`, by path."""
