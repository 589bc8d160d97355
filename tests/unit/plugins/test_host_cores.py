"""CROSSOVER_HOST_CORES: the compute thread on the device's cores, every other thread on host cores."""
from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import pytest

from crossover.plugins.hook import rank_session
from crossover.plugins.hook.rank_session import affinity_plan
from crossover.plugins.hook.runtime import RUNTIME
from crossover.settings import PluginSettings, SettingError, parse_cpu_list


@pytest.mark.parametrize("raw,cores", [("", ()), ("3", (3,)), ("2-4,8", (2, 3, 4, 8)), ("1,0,1", (0, 1)),
                                       (" 5 - 6 ", (5, 6))])
def test_cpu_lists_parse_like_the_kernels(raw: str, cores: tuple[int, ...]) -> None:
    assert parse_cpu_list(raw) == cores


@pytest.mark.parametrize("raw", ["a", "4-2", "-1", "1-x"])
def test_a_bad_cpu_list_is_refused_with_the_variable_named(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CROSSOVER_HOST_CORES", raw)
    with pytest.raises(SettingError, match="CROSSOVER_HOST_CORES"):
        PluginSettings.from_env()


def test_the_variable_reaches_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CROSSOVER_HOST_CORES", "2-3")
    assert PluginSettings.from_env().host_cores == (2, 3)


def test_without_host_cores_every_thread_is_on_the_device() -> None:
    plan = affinity_plan([10, 11, 12], 10, {0}, set(), {0, 1, 2})
    assert plan == {10: {0}, 11: {0}, 12: {0}}


def test_with_host_cores_only_the_compute_thread_stays_on_the_device() -> None:
    plan = affinity_plan([10, 11, 12], 11, {0}, {2, 3}, {0, 1, 2, 3})
    assert plan == {10: {2, 3}, 11: {0}, 12: {2, 3}}


def test_host_cores_that_do_not_exist_or_are_device_cores_are_ignored() -> None:
    assert affinity_plan([1, 2], 1, {0}, {0, 7}, {0, 1}) == {1: {0}, 2: {0}}
    assert affinity_plan([1, 2], 1, {0}, {1, 7}, {0, 1}) == {1: {0}, 2: {1}}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to put threads on different ones")
def test_pin_moves_the_real_threads_of_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    device, host = sorted(os.sched_getaffinity(0))[:2]
    before, threads_before = os.sched_getaffinity(0), torch.get_num_threads()
    release, started = threading.Event(), threading.Event()
    native: list[int] = []

    def helper() -> None:
        native.append(threading.get_native_id())
        started.set()
        release.wait(10)

    worker = threading.Thread(target=helper)
    worker.start()
    started.wait(10)
    monkeypatch.setattr(RUNTIME, "settings", PluginSettings(target="unix:///x", host_cores=(host,)))
    try:
        rank_session.pin(SimpleNamespace(cpu_affinity=[device], device=0))
        assert os.sched_getaffinity(threading.main_thread().native_id) == {device}
        assert os.sched_getaffinity(native[0]) == {host}
    finally:
        release.set()
        worker.join(10)
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), before)
            except OSError:
                pass
        torch.set_num_threads(threads_before)


def test_the_bench_keeps_two_device_cores_beside_the_host_cores() -> None:
    from bench.emulated.cli import host_cores_plan

    assert host_cores_plan("", set(range(16))) == ((), {})
    devices, env = host_cores_plan("2-15", set(range(16)))
    assert devices == (0, 1) and env == {"CROSSOVER_HOST_CORES": ",".join(map(str, range(2, 16)))}
    assert host_cores_plan("0-3", set(range(8)))[0] == (4, 5)
    with pytest.raises(ValueError, match="leaves 1 of the 2 usable cores"):
        host_cores_plan("1", {0, 1})
    with pytest.raises(ValueError, match="not usable"):
        host_cores_plan("2-3", {0, 1})
