"""`HostStager`'s logic with a recording device and a recording Horovod: what is enqueued when, and what comes back.

Real Horovod ranks go through it in `tests/multiprocess/test_host_staging_ranks.py`."""
from __future__ import annotations

import threading
from typing import Any

import pytest

from crossover.plugins.hook.host_staging import HostStager, StagedHandle, StagingStopped, horovod_reduces_on_gpu, stages


class Device:
    """Host copies are lists; a mark is a gate the test opens; copies back are recorded."""

    def __init__(self) -> None:
        self.marks: list[threading.Event] = []
        self.marked: list[int] = []  # how many tensors each mark covered
        self.waiting = threading.Event()  # the thread has taken a handle and waits on its mark
        self.copied_back: list[tuple[Any, Any]] = []

    def to_host(self, tensor: list[float]) -> list[float]:
        return list(tensor)

    def mark(self, tensors: list[list[float]]) -> threading.Event:
        self.marked.append(len(tensors))
        self.marks.append(threading.Event())
        return self.marks[-1]

    def wait(self, mark: threading.Event) -> None:
        self.waiting.set()
        assert mark.wait(10)

    def copy_back(self, tensor: list[float], host: list[float]) -> None:
        self.copied_back.append((tensor, host))
        tensor[:] = host


class Horovod:
    """Enqueue doubles the host tensor in place (a two-rank sum); handles are ints, done when polled twice."""

    def __init__(self, fail_on: str = "") -> None:
        self.enqueued: list[tuple[Any, tuple, dict]] = []
        self.fail_on = fail_on
        self.polls: dict[int, int] = {}

    def enqueue(self, host: list[float], *args: Any, **kwargs: Any) -> int:
        if kwargs.get("name") == self.fail_on:
            raise RuntimeError("Horovod has been shut down")
        self.enqueued.append((host, args, kwargs))
        host[:] = [2 * x for x in host]
        return len(self.enqueued)

    def enqueue_grouped(self, hosts: list[list[float]], *args: Any, **kwargs: Any) -> int:
        self.enqueued.append((hosts, args, kwargs))
        for host in hosts:
            host[:] = [2 * x for x in host]
        return len(self.enqueued)

    def poll(self, handle: int) -> bool:
        self.polls[handle] = self.polls.get(handle, 0) + 1
        return self.polls[handle] >= 2

    def synchronize(self, handle: int) -> Any:
        return self.enqueued[handle - 1][0]


@pytest.fixture()
def staged():
    device, hvd = Device(), Horovod()
    stager = HostStager(hvd.enqueue, hvd.enqueue_grouped, device=device)
    yield stager, device, hvd
    for mark in device.marks:
        mark.set()
    stager.close()


def test_a_tensor_is_enqueued_only_once_its_host_copy_is_marked_done_and_comes_back_reduced(staged):
    stager, device, hvd = staged
    grad = [1.0, 2.0]
    handle = stager.allreduce_async_(grad, None, "g0", op=1, prescale_factor=0.5)
    assert isinstance(handle, StagedHandle)
    assert not handle.enqueued.wait(0.1) and hvd.enqueued == []  # the copy out has not finished
    assert stager.poll(handle, hvd.poll) is False
    device.marks[0].set()
    assert stager.synchronize(handle, hvd.synchronize) is grad
    assert grad == [2.0, 4.0]
    host, args, kwargs = hvd.enqueued[0]
    assert host is not grad and args == (None, "g0") and kwargs == {"op": 1, "prescale_factor": 0.5}


def test_nothing_is_copied_back_before_synchronize(staged):
    stager, device, hvd = staged
    grad = [3.0]
    handle = stager.allreduce_async_(grad, name="g")
    device.marks[0].set()
    assert handle.enqueued.wait(5)
    assert grad == [3.0] and device.copied_back == []  # reduced on the host only
    stager.synchronize(handle, hvd.synchronize)
    assert grad == [6.0] and len(device.copied_back) == 1


def test_a_group_is_marked_once_enqueued_together_and_returned_as_a_list(staged):
    stager, device, hvd = staged
    a, b = [1.0], [5.0]
    handle = stager.grouped_allreduce_async_((a, b), name="group")
    assert device.marked == [2]
    device.marks[0].set()
    out = stager.synchronize(handle, hvd.synchronize)
    assert out == [a, b] and out[0] is a and out[1] is b and a == [2.0] and b == [10.0]
    assert len(hvd.enqueued) == 1 and len(hvd.enqueued[0][0]) == 2


def test_poll_is_false_until_enqueued_then_horovods_own(staged):
    stager, device, hvd = staged
    handle = stager.allreduce_async_([1.0], name="p")
    assert stager.poll(handle, hvd.poll) is False and hvd.polls == {}
    device.marks[0].set()
    assert handle.enqueued.wait(5)
    assert stager.poll(handle, hvd.poll) is False  # Horovod's first poll: not done
    assert stager.poll(handle, hvd.poll) is True


def test_handles_are_enqueued_in_the_order_they_were_staged(staged):
    stager, device, hvd = staged
    handles = [stager.allreduce_async_([float(k)], name=f"t{k}") for k in range(5)]
    for mark in device.marks:
        mark.set()
    for h in handles:
        stager.synchronize(h, hvd.synchronize)
    assert [kwargs["name"] for _, _, kwargs in hvd.enqueued] == [f"t{k}" for k in range(5)]


def test_an_enqueue_that_fails_is_raised_by_synchronize_and_later_tensors_still_go_through():
    device, hvd = Device(), Horovod(fail_on="bad")
    stager = HostStager(hvd.enqueue, hvd.enqueue_grouped, device=device)
    try:
        bad = stager.allreduce_async_([1.0], name="bad")
        good = stager.allreduce_async_([1.0], name="good")
        for mark in device.marks:
            mark.set()
        assert bad.enqueued.wait(5) and stager.poll(bad, hvd.poll) is True  # done: its synchronize raises
        with pytest.raises(RuntimeError, match="shut down"):
            stager.synchronize(bad, hvd.synchronize)
        assert stager.synchronize(good, hvd.synchronize) == [2.0]
    finally:
        stager.close()


def test_close_stops_the_thread_and_a_later_tensor_starts_it_again(staged):
    stager, device, hvd = staged
    first = stager.allreduce_async_([1.0], name="a")
    device.marks[0].set()
    stager.synchronize(first, hvd.synchronize)
    old = stager._thread
    stager.close()
    assert old is not None and not old.is_alive() and stager._thread is None
    again = stager.allreduce_async_([4.0], name="b")
    device.marks[1].set()
    assert stager.synchronize(again, hvd.synchronize) == [8.0]
    assert stager._thread is not None and stager._thread is not old


def test_close_fails_what_was_never_handed_over_and_a_new_thread_serves_what_comes_after():
    device, hvd = Device(), Horovod()
    stager = HostStager(hvd.enqueue, hvd.enqueue_grouped, device=device)
    try:
        first = stager.allreduce_async_([1.0], name="first")
        assert device.waiting.wait(10)  # the thread has it, and waits on its mark
        stuck = stager.allreduce_async_([2.0], name="stuck")  # never reached by the thread
        closer = threading.Thread(target=stager.close, args=("Horovod was initialised again",))
        closer.start()
        assert stuck.enqueued.wait(10)  # failed by close, which now waits for the thread to finish `first`
        device.marks[0].set()
        closer.join(10)
        assert not closer.is_alive()
        with pytest.raises(StagingStopped, match="initialised again"):
            stager.synchronize(stuck, hvd.synchronize)
        assert stager.poll(stuck, hvd.poll) is True  # done: its synchronize raises at once
        assert stager.synchronize(first, hvd.synchronize) == [2.0]
        later = stager.allreduce_async_([3.0], name="later")
        device.marks[-1].set()
        assert stager.synchronize(later, hvd.synchronize) == [6.0]
    finally:
        for mark in device.marks:
            mark.set()
        stager.close()


def test_only_named_allreduces_other_than_adasum_are_staged():
    hvd_ops = pytest.importorskip("horovod.torch.mpi_ops")
    assert stages((), {"name": "grad.w"}) and stages((None, "grad.w"), {})
    assert stages((), {"name": "g", "op": hvd_ops.Average}) and stages((None, "g", hvd_ops.Sum), {})
    assert not stages((), {}) and not stages((None, None), {}) and not stages((), {"name": ""})
    assert not stages((), {"name": "g", "op": hvd_ops.Adasum}) and not stages((None, "g", hvd_ops.Adasum), {})


class _Build:
    def __init__(self, **built: Any) -> None:
        for name in ("nccl_built", "ddl_built", "rocm_built"):
            value = built.get(name, 0)
            setattr(self, name, (lambda v=value: v) if not isinstance(value, Exception) else self._raise(value))

    @staticmethod
    def _raise(exc: Exception):
        def probe() -> int:
            raise exc
        return probe


def test_only_a_horovod_without_a_gpu_reduction_needs_staging():
    assert horovod_reduces_on_gpu(_Build()) is False
    assert horovod_reduces_on_gpu(_Build(nccl_built=2)) is True
    assert horovod_reduces_on_gpu(_Build(rocm_built=True)) is True
    assert horovod_reduces_on_gpu(_Build(nccl_built=ValueError("not initialised"))) is False
    assert horovod_reduces_on_gpu(object()) is False


class _Gpu:
    """A tensor as the wrappers see it: only whether it is on a GPU."""

    is_cuda = True


class _Session:
    def __init__(self, shares_device: bool) -> None:
        self.shares_device = shares_device


class _RecordingStager:
    def __init__(self) -> None:
        self.staged: list[tuple[Any, ...]] = []

    def allreduce_async_(self, tensor: Any, *args: Any, **kwargs: Any) -> str:
        self.staged.append((tensor, args, kwargs))
        return "staged"

    def grouped_allreduce_async_(self, tensors: Any, *args: Any, **kwargs: Any) -> str:
        self.staged.append((tensors, args, kwargs))
        return "staged group"


@pytest.mark.parametrize("shares, tensor, kwargs, staged", [
    (True, _Gpu(), {"name": "grad.w"}, True),
    (False, _Gpu(), {"name": "grad.w"}, False),  # alone on the device: Horovod's own path
    (True, [1.0], {"name": "grad.w"}, False),  # not on a GPU
    (True, _Gpu(), {}, False),  # unnamed
])
def test_the_wrappers_stage_a_named_gpu_allreduce_only_while_the_device_is_shared(monkeypatch, shares, tensor, kwargs,
                                                                                  staged):
    from crossover.plugins.hook import horovod_waits
    from crossover.plugins.hook.runtime import RUNTIME

    stager = _RecordingStager()
    monkeypatch.setattr(RUNTIME, "stager", stager)
    monkeypatch.setattr(RUNTIME, "session", _Session(shares))
    monkeypatch.setattr(RUNTIME, "original_waits", {"allreduce_async_": lambda *a, **k: "horovod",
                                                    "grouped_allreduce_async_": lambda *a, **k: "horovod group"})
    assert horovod_waits._allreduce_async_(tensor, **kwargs) == ("staged" if staged else "horovod")
    assert horovod_waits._grouped_allreduce_async_([tensor, tensor], **kwargs) == (
        "staged group" if staged else "horovod group")
    assert len(stager.staged) == (2 if staged else 0)


def test_without_a_stager_every_allreduce_is_horovods(monkeypatch):
    from crossover.plugins.hook import horovod_waits
    from crossover.plugins.hook.runtime import RUNTIME

    monkeypatch.setattr(RUNTIME, "stager", None)
    monkeypatch.setattr(RUNTIME, "session", _Session(True))
    monkeypatch.setattr(RUNTIME, "original_waits", {"allreduce_async_": lambda *a, **k: "horovod"})
    assert horovod_waits._allreduce_async_(_Gpu(), name="g") == "horovod"


def test_horovods_synchronize_and_poll_hand_a_staged_handle_to_its_stager_and_others_to_horovod(monkeypatch, staged):
    from crossover.plugins.hook import horovod_waits
    from crossover.plugins.hook.runtime import RUNTIME

    stager, device, hvd = staged
    monkeypatch.setattr(RUNTIME, "phases", None)
    monkeypatch.setattr(RUNTIME, "original_waits", {"synchronize": hvd.synchronize, "poll": hvd.poll})
    handle = stager.allreduce_async_([5.0], name="w")
    assert horovod_waits._poll(handle) is False  # its copy out has not finished
    device.marks[0].set()
    assert horovod_waits._synchronize(handle) == [10.0]
    hvd.enqueued.append(([7.0], (), {}))
    assert horovod_waits._synchronize(len(hvd.enqueued)) == [7.0]  # Horovod's own handle, Horovod's own wait


def test_a_horovod_re_init_fails_what_staging_has_not_handed_over(monkeypatch):
    from crossover.plugins.hook import horovod_waits
    from crossover.plugins.hook.runtime import RUNTIME

    device, hvd = Device(), Horovod()
    stager = HostStager(hvd.enqueue, hvd.enqueue_grouped, device=device)
    inits: list[int] = []
    monkeypatch.setattr(RUNTIME, "stager", stager)
    monkeypatch.setattr(RUNTIME, "on_init", None)
    monkeypatch.setattr(RUNTIME, "original_waits", {"init": lambda: inits.append(1)})
    try:
        first = stager.allreduce_async_([1.0], name="first")
        assert device.waiting.wait(10)
        stale = stager.allreduce_async_([2.0], name="stale")  # still queued behind `first`
        reinit = threading.Thread(target=horovod_waits._init)
        reinit.start()
        assert stale.enqueued.wait(10)  # failed by the re-init's close, which waits for `first`
        device.marks[0].set()
        reinit.join(10)
        assert not reinit.is_alive() and inits == [1]
        with pytest.raises(StagingStopped, match="initialised again"):
            stager.synchronize(stale, hvd.synchronize)
        assert first.enqueued.is_set() and first.error is None
    finally:
        for mark in device.marks:
            mark.set()
        stager.close()
