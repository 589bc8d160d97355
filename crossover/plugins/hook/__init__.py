"""The Horovod hook: what `import crossover.auto` installs on `horovod.torch`. The optimizer hook chain
(`horovod_torch`, `optimizer_hooks`, `composed_optimizer`), the phases a rank reports to its daemon
(`phase_tracking`, `phase_reporter`, `horovod_waits`), turns ended on a CUDA device (`cuda_turns`) and
the plugin's `CROSSOVER_*` settings (`settings`). The aggregation rules are `crossover.plugins.aggregation`."""
