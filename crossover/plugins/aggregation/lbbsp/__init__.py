"""LB-BSP (Chen et al., SoCC 2020): per-rank batch sizes that follow each rank's speed.

Rank ``i`` trains on ``b_i`` samples of each global batch of ``B = Σ b_i``
(:class:`~.sampler.LBBSPSampler`) and the update is ``Σ (b_i / B)·g_i``, the
mean gradient over all ``B`` samples. The plugin keeps Horovod's optimizer
with ``op=hvd.Average`` and scales each rank's gradient by ``b_i·n/B``
(:mod:`.weighting`): ``(1/n)·Σ b_i·n/B·g_i = Σ (b_i/B)·g_i``. Not
``op=hvd.Sum`` with a per-rank ``prescale_factor = b_i/B``, because
``DistributedOptimizer`` derives its prescale factor from the one, global
``gradient_predivide_factor``; the Average route keeps that option, fp16
compression and Horovod's tensor fusion and overlap as they are. The
gradients must be means over the rank's batch (the default
``reduction="mean"`` of PyTorch losses).

Every ``period`` steps all ranks share their per-step compute times
(:mod:`.exchange`), feed the same list to their own
:class:`~.controller.BatchSizeController` (speed estimates and proposals,
:mod:`.estimators`), and so all adopt the same new sizes for the same
following global batch (:mod:`.adoption`: the size hysteresis *and* an
iteration shorter by at least ``CROSSOVER_LBBSP_MIN_GAIN`` and by more than
the measurements' scatter, so that a job without stragglers does not chase
measurement noise). The exchange is a tensor allgather rather than
``hvd.allgather_object`` because the latter has no ``process_set`` argument
in Horovod 0.28. The first step is not measured (one-off start-up costs),
and the controller leaves out each rank's next ``CROSSOVER_LBBSP_WARMUP``
measurements: a job's first steps are not its pace.

Modules: :mod:`.config`, :mod:`.apportion`, :mod:`.estimators`,
:mod:`.controller`, :mod:`.adoption`, :mod:`.sampler`, :mod:`.state`,
:mod:`.exchange`, :mod:`.weighting`, :mod:`.replay`.
"""
