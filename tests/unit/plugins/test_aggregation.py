"""Aggregation selection and the optimizer builder, in process with a fake Horovod."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from crossover.plugins import aggregation
from crossover.plugins.aggregation import (
    AdasumFacts,
    AdasumOptimizer,
    AggregationError,
    adasum_path,
    api,
    distributed_optimizer,
    resolve_algorithm,
    set_aggregation,
    weight_scale,
)
from crossover.plugins.aggregation.process_state import STATE
from crossover.settings import AggregationSettings, LBBSPSettings, SettingError
from tests.unit.plugins._aggregation_fixtures import FakeHvd, FakeProcessSet, _clean, fake_factory, sgd  # noqa: F401

# --- selection and settings ---------------------------------------------------


def test_default_is_horovods_own_behaviour():
    assert aggregation.current_rule() is None


def test_environment_then_code(monkeypatch):
    monkeypatch.setenv("CROSSOVER_AGGREGATION", "Adasum")
    assert aggregation.current_rule() == "adasum"
    set_aggregation("weighted")
    assert aggregation.current_rule() == "weighted"
    set_aggregation(None)
    assert aggregation.current_rule() == "adasum"


@pytest.mark.parametrize(("name", "value"), [
    ("CROSSOVER_AGGREGATION", "mean"),
    ("CROSSOVER_ADASUM_IMPL", "fast"),
    ("CROSSOVER_ADASUM_ALGORITHM", "ring"),
    ("CROSSOVER_LBBSP_PERIOD", "0"),
    ("CROSSOVER_LBBSP_PERIOD", "ten"),
    ("CROSSOVER_LBBSP_MAX_BATCH", "64,x"),
    ("CROSSOVER_LBBSP_MAX_BATCH", "0"),
    ("CROSSOVER_LBBSP_METHOD", "narx"),
])
def test_bad_settings_name_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingError, match=name):
        AggregationSettings.from_env()


def test_settings_parse(monkeypatch):
    monkeypatch.setenv("CROSSOVER_LBBSP_MAX_BATCH", "64, 64,32")
    monkeypatch.setenv("CROSSOVER_LBBSP_PERIOD", "4")
    settings = AggregationSettings.from_env()
    assert settings.lbbsp.max_batch == (64, 64, 32)
    assert settings.lbbsp.period == 4
    assert settings.rule == ""


def test_the_sampler_is_tuned_by_the_environment_unless_given_its_own_lbbsp_settings(monkeypatch):
    monkeypatch.setenv("CROSSOVER_LBBSP_PERIOD", "7")
    monkeypatch.setenv("CROSSOVER_LBBSP_MAX_BATCH", "40")
    monkeypatch.setenv("CROSSOVER_LBBSP_MIN_GAIN", "0.25")
    set_aggregation("weighted")
    aggregation.batch_sampler(100, 64, process_set=FakeProcessSet(0, 2))
    state = STATE.lbbsp.state
    assert (state.controller.config.period, state.controller.config.max_batch, state.min_gain) == (7, 40, 0.25)
    own = dataclasses.replace(aggregation.settings().lbbsp, period=3, max_batch=(40, 30), method="numerical")
    aggregation.batch_sampler(100, 64, lbbsp=own, process_set=FakeProcessSet(1, 2))
    config = STATE.lbbsp.state.controller.config
    assert (config.period, config.max_batch, config.method) == (3, (40, 30), "numerical")
    with pytest.raises(AggregationError, match="unknown LB-BSP method 'narx'"):
        aggregation.batch_sampler(100, 64, lbbsp=LBBSPSettings(method="narx"), process_set=FakeProcessSet(0, 2))


def test_set_aggregation_rejects_unknown_names():
    with pytest.raises(AggregationError, match="unknown aggregation rule 'avg'"):
        set_aggregation("avg")
    with pytest.raises(AggregationError, match="adasum_impl"):
        set_aggregation("adasum", adasum_impl="cuda")


# --- pure decisions -----------------------------------------------------------

NATIVE_OK = dict(size=4, global_set=True, mpi_enabled=True)


@pytest.mark.parametrize(("facts", "impl", "path", "reason"), [
    (NATIVE_OK, "auto", "native", "MPI controller"),
    ({**NATIVE_OK, "mpi_enabled": False}, "auto", "plugin", "MPI controller"),
    ({**NATIVE_OK, "global_set": False}, "auto", "plugin", "process sets"),
    ({**NATIVE_OK, "size": 3}, "auto", "plugin", "power-of-two number of ranks, this group has 3"),
    ({**NATIVE_OK, "size": 6}, "auto", "plugin", "has 6"),
    (NATIVE_OK, "plugin", "plugin", "CROSSOVER_ADASUM_IMPL=plugin"),
    ({**NATIVE_OK, "size": 1, "mpi_enabled": False}, "auto", "native", "MPI controller"),
    ({**NATIVE_OK, "size": 8, "cuda": True, "nccl_built": True, "local_size": 4}, "auto", "native", "MPI"),
    ({**NATIVE_OK, "size": 12, "cuda": True, "nccl_built": True, "local_size": 4}, "auto", "plugin", "nodes"),
    ({**NATIVE_OK, "size": 12, "cuda": True, "nccl_built": True, "local_size": 3}, "auto", "native", "MPI"),
    ({**NATIVE_OK, "size": 6, "cuda": True, "nccl_built": True, "local_size": 4}, "auto", "plugin", "nodes"),
    ({**NATIVE_OK, "size": 8, "cuda": True, "nccl_built": True, "local_size": 4, "homogeneous": False}, "auto",
     "plugin", "nodes"),
    ({**NATIVE_OK, "size": 6, "cuda": True, "local_size": 2}, "auto", "plugin", "has 6"),
])
def test_adasum_path(facts, impl, path, reason):
    decision = adasum_path(AdasumFacts(**facts), impl)
    assert decision.path == path
    assert reason in decision.reason


def test_native_adasum_forced_where_it_cannot_run_is_an_error():
    with pytest.raises(AggregationError, match="MPI controller.*auto"):
        adasum_path(AdasumFacts(size=2, global_set=True, mpi_enabled=False), "native")


def test_resolve_algorithm():
    assert resolve_algorithm("auto", 3) == "allgather"
    assert resolve_algorithm("auto", 8) == "allgather"
    assert resolve_algorithm("auto", 9) == "recursive_doubling"
    assert resolve_algorithm("recursive_doubling", 2) == "recursive_doubling"
    with pytest.raises(AggregationError):
        resolve_algorithm("ring", 2)


def test_weight_scale_makes_the_average_a_weighted_sum():
    sizes = [5, 11, 16]
    grads = [torch.tensor([1.0, 2.0]), torch.tensor([-3.0, 0.5]), torch.tensor([0.25, 4.0])]
    average = sum(weight_scale(b, sum(sizes), 3) * g for b, g in zip(sizes, grads)) / 3
    expected = sum(b / 32 * g for b, g in zip(sizes, grads))
    torch.testing.assert_close(average, expected)
    with pytest.raises(AggregationError):
        weight_scale(1, 0, 3)


def test_no_rule_passes_everything_through_unchanged():
    model = nn.Linear(3, 2)
    seen = {}

    def factory(*args, **kwargs):
        seen.update(args=args, kwargs=kwargs)
        return "built"

    opt = sgd(model)
    assert distributed_optimizer(FakeHvd(), factory, opt, ("np",), {"op": "sum"}) == "built"
    assert seen == {"args": (opt, "np"), "kwargs": {"op": "sum"}}


@pytest.mark.parametrize(("rule", "op"), [("average", "avg"), ("sum", "sum")])
def test_average_and_sum_set_horovods_op(rule, op):
    set_aggregation(rule)
    opt = distributed_optimizer(FakeHvd(), fake_factory, sgd(nn.Linear(3, 2)), (None, None, 2), {"op": "adasum"})
    assert opt.given["op"] == op
    assert opt.given["backward_passes_per_step"] == 2  # positional arguments survive
    assert aggregation.aggregation_of(opt) == rule


def test_predivide_with_a_non_averaging_rule_is_an_error():
    set_aggregation("sum")
    with pytest.raises(AggregationError, match="gradient_predivide_factor=2.0"):
        distributed_optimizer(FakeHvd(), fake_factory, sgd(nn.Linear(3, 2)), (), {"gradient_predivide_factor": 2.0})


def test_adasum_native_where_it_applies_plugin_elsewhere():
    set_aggregation("adasum")
    native = distributed_optimizer(FakeHvd(size=2, mpi=True), fake_factory, sgd(nn.Linear(3, 2)))
    assert native.given["op"] == "adasum"
    assert aggregation.aggregation_of(native) == "adasum:native"
    plugin = distributed_optimizer(FakeHvd(size=2, mpi=False), fake_factory, sgd(nn.Linear(3, 2)))
    assert isinstance(plugin, AdasumOptimizer)
    assert aggregation.aggregation_of(plugin) == "adasum:plugin/allgather"
    set_aggregation("adasum", adasum_impl="plugin", adasum_algorithm="recursive_doubling")
    forced = distributed_optimizer(FakeHvd(size=2, mpi=True), fake_factory, sgd(nn.Linear(3, 2)))
    assert aggregation.aggregation_of(forced) == "adasum:plugin/recursive_doubling"


def test_weighted_keeps_horovods_averaging_optimizer():
    set_aggregation("weighted")
    opt = distributed_optimizer(FakeHvd(), fake_factory, sgd(nn.Linear(3, 2)), (), {"op": "sum"})
    assert opt.given["op"] == "avg"
    assert aggregation.aggregation_of(opt) == "weighted"
    assert opt.step.__func__ is not None  # a bound method: LR schedulers can still wrap it


@pytest.mark.parametrize("rule", ["weighted", "adasum"])
def test_ranks_outside_the_process_set_get_horovods_optimizer(rule):
    set_aggregation(rule)
    outside = FakeProcessSet(0, 2, set_id=1, member=False)
    opt = distributed_optimizer(FakeHvd(size=3), fake_factory, sgd(nn.Linear(3, 2)), (), {"process_set": outside})
    assert aggregation.aggregation_of(opt) is None
    assert opt.given["process_set"] is outside


def test_a_nested_call_passes_through():
    set_aggregation("sum")
    hvd = FakeHvd()

    def hooked(optimizer, **kwargs):  # a factory that itself goes through the plugin, as the hook does
        return distributed_optimizer(hvd, fake_factory, optimizer, (), kwargs)

    opt = distributed_optimizer(hvd, hooked, sgd(nn.Linear(3, 2)), (), {"op": "avg"})
    assert opt.given["op"] == "sum"


def test_every_rule_the_setting_accepts_has_a_builder_and_no_other():
    from crossover.settings import AGGREGATION_RULES

    assert sorted(api._RULES) == sorted(AGGREGATION_RULES)  # noqa: SLF001 - the registry itself


def test_every_exported_name_resolves_and_no_other_does():
    # The package loads its front (`api`) on first use: each name of its one list must be found there.
    assert all(getattr(aggregation, name) is not None for name in aggregation.__all__)
    assert sorted(dir(aggregation)) == sorted(aggregation.__all__)
    with pytest.raises(AttributeError):
        aggregation.no_such_rule  # noqa: B018 - the lookup is the test
