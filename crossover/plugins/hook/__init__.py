"""The Horovod hook: what `import crossover.auto` installs on `horovod.torch`. The optimizer hook chain
(`horovod_torch`, `optimizer_hooks`, `composed_optimizer`), the phases a rank reports to its daemon
(`phase_tracking`, `phase_reporter`, `horovod_waits`) and turns ended on a CUDA device (`cuda_turns`). The
plugin's `CROSSOVER_*` settings are `crossover.settings`; the aggregation rules are
`crossover.plugins.aggregation`."""
