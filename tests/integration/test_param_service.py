"""The group_async parameter service on a real TCP socket, driven by real leader links (threads here;
the multi-process behaviour is in tests/multiprocess/test_group_async_training.py)."""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from crossover.plugins.aggregation.group_async.codec import Codec
from crossover.plugins.aggregation.group_async.global_model import GlobalModel
from crossover.plugins.aggregation.group_async.link import ServiceError, ServiceLink
from crossover.plugins.aggregation.group_async.schedule import PRICED_AFTER, Schedule
from crossover.plugins.aggregation.group_async.service import ParameterService

pytestmark = pytest.mark.timeout(60)
TOKEN = "t0ken"


@contextmanager
def serving(state: GlobalModel) -> Iterator[tuple[str, int]]:
    server = ParameterService(("127.0.0.1", 0), state, TOKEN)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server.server_address[0], server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def _link(address: tuple[str, int], group: int, start: torch.Tensor, token: str = TOKEN) -> ServiceLink:
    link = ServiceLink(address, token, group, Codec("fp32"), timeout_s=20.0)
    link.start(start)
    return link


def test_a_group_past_the_bound_waits_until_the_slowest_exchanges():
    state = GlobalModel(bound=1)
    with serving(state) as address:
        zero = torch.zeros(4)
        fast, slow = _link(address, 0, zero), _link(address, 2, zero)
        fast.exchange(torch.ones(4))  # clock 1, slow at 0: gap 1, within the bound
        returned = threading.Event()

        def push() -> None:
            fast.exchange(fast.base + 1)  # clock 2: gap 2 > 1, must wait
            returned.set()

        waiter = threading.Thread(target=push)
        waiter.start()
        assert not returned.wait(0.5), "a group two exchanges ahead with bound 1 was not held"
        slow.exchange(torch.full((4,), 10.0))
        assert returned.wait(5.0)
        waiter.join()
        assert max(fast.gaps + slow.gaps) <= 1
        assert state.version == 3 and np.allclose(state.model, 12.0)  # 1 + 1 + 10: every update, once


def test_many_groups_at_random_paces_never_see_a_gap_above_the_bound():
    state = GlobalModel(bound=2)
    with serving(state) as address:
        links = [_link(address, g, torch.zeros(8)) for g in range(3)]

        def run(link: ServiceLink, pause: float) -> None:
            for _ in range(12):
                time.sleep(pause)
                link.exchange(link.base + 1)
            link.park()

        threads = [threading.Thread(target=run, args=(link, pause)) for link, pause in zip(links, (0.0, 0.01, 0.05))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        gaps = [g for link in links for g in link.gaps]
        assert len(gaps) == 36 and max(gaps) <= 2, gaps
        assert np.allclose(state.model, 36.0)


def _priced(state: GlobalModel, cost_s: float) -> None:
    """Price a staged service's profile stage with `PRICED_AFTER` exchanges of group 0, each costing `cost_s`."""
    for seq in range(PRICED_AFTER):
        assert state.schedule.stage.name == "profile" and state.clock.bound == 2
        state.exchange(0, seq, np.zeros(state.model.size, dtype=np.float32), wait=False, cost_s=cost_s)


def test_a_staged_service_goes_coarse_on_dear_exchanges_then_fine_once_the_model_slows_and_a_restart_keeps_it(
        tmp_path: Path):
    def staged() -> GlobalModel:
        return GlobalModel(bound=2, state_dir=tmp_path, schedule=Schedule("staged", 0.05, 2, window_s=0.2))

    state = staged()
    state.hello(0, np.zeros(4, dtype=np.float32).tobytes(), 4)
    _priced(state, 0.04)  # four fifths of the period
    assert state.clock.bound == 4, "the coarse stage's bound is twice the configured one"
    with serving(state) as address:
        link = _link(address, 1, torch.zeros(4))
        link.exchange(link.base + 1)  # the first window starts here
        assert link.stage == "coarse"
        time.sleep(0.25)
        link.exchange(link.base + 50)  # a norm of 100 in a quarter second: the peak
        assert link.stage == "coarse" and state.clock.bound == 4
        time.sleep(0.25)
        link.exchange(link.base + 0.5)  # a hundredth of that: progress has flattened
        assert link.stage == "fine" and state.clock.bound == 2
        assert [s["to"] for s in state.stats()["switches"]] == ["coarse", "fine"]
    again = staged()
    assert again.schedule.stage.name == "fine" and again.clock.bound == 2, "a restart does not go back"


def test_a_staged_service_goes_straight_to_fine_where_the_leaders_exchanges_cost_little():
    state = GlobalModel(bound=2, schedule=Schedule("staged", 0.5, 2))
    state.hello(0, np.zeros(3, dtype=np.float32).tobytes(), 3)
    _priced(state, 0.004)
    assert state.clock.bound == 2 and state.schedule.stage.name == "fine"
    assert state.stats()["switches"] == [{"version": PRICED_AFTER, "to": "fine", "exchange_s": pytest.approx(0.004)}]


def test_a_restarted_service_resumes_from_the_newest_model(tmp_path: Path):
    state = GlobalModel(bound=4, state_dir=tmp_path)
    with serving(state) as address:
        link = _link(address, 0, torch.zeros(3))
        for _ in range(3):
            link.exchange(link.base + torch.tensor([1.0, 2.0, 3.0]))
    again = GlobalModel(bound=4, state_dir=tmp_path)
    assert again.resumed_from == 3 and again.model is not None
    assert np.allclose(again.model, [3.0, 6.0, 9.0])
    # two files used in turn, whatever the number of exchanges
    assert sorted(p.name for p in tmp_path.glob("model-*")) == ["model-a.f32", "model-b.f32"]


def test_a_service_resumes_from_the_one_file_an_older_service_kept(tmp_path: Path):
    np.save(tmp_path / "model-7.npy", np.array([1.0, 2.0], dtype=np.float32))
    (tmp_path / "global.json").write_text(json.dumps({"model": "model-7.npy", "version": 7, "last_seq": {"0": 6},
                                                      "clocks": {"0": 7}}))
    state = GlobalModel(bound=4, state_dir=tmp_path)
    assert state.version == 7 and np.allclose(state.model, [1.0, 2.0])
    state.exchange(0, 7, np.ones(2, dtype=np.float32), wait=False)
    assert np.allclose(GlobalModel(bound=4, state_dir=tmp_path).model, [2.0, 3.0])


@pytest.mark.parametrize("persisted", [False, True])
def test_a_leader_on_the_services_node_exchanges_through_shared_memory(tmp_path: Path, persisted: bool):
    state = GlobalModel(bound=4, state_dir=tmp_path if persisted else None)
    with serving(state) as address:
        local = ServiceLink(address, TOKEN, 0, Codec("fp32"), timeout_s=20.0, shared_memory=True)
        local.start(torch.zeros(5))
        remote = _link(address, 2, torch.zeros(5))
        assert local.local and not remote.local
        params = [torch.ones(2, 2), torch.full((1,), 2.0)]  # a model's parameters, not one flat tensor
        model = local.exchange(params, scale=0.5)
        assert model is not None and model.tolist() == [0.5] * 4 + [1.0]
        model = remote.exchange(torch.full((5,), 4.0))
        assert model is not None and model.tolist() == [4.5] * 4 + [5.0]
        # counted from the answer (0.5, 1): half of 2.5 and 5 more
        again = local.exchange([p * 3 for p in params], scale=0.5)
        assert again is not None and again.tolist() == [5.75] * 4 + [7.5]
        assert local.pull() is not None and local.base.tolist() == [5.75] * 4 + [7.5]
        local.rebase(torch.zeros(5))
        assert local.exchange(torch.ones(5)).tolist() == [6.75] * 4 + [8.5]
        assert state.version == 4


def test_shared_buffers_leave_no_file_behind_and_a_lost_answer_is_counted_once(tmp_path: Path):
    before = set(Path("/dev/shm").glob("crossover-slot-*"))
    state = GlobalModel(bound=4)
    with serving(state) as address:
        link = ServiceLink(address, TOKEN, 0, Codec("fp32"), timeout_s=20.0, shared_memory=True)
        link.start(torch.zeros(3))
        assert link.local and set(Path("/dev/shm").glob("crossover-slot-*")) == before
        assert link.exchange(torch.ones(3)).tolist() == [1.0] * 3
        # The next update reaches the service and is applied, then the answer is lost.
        real_call = link._call

        def lose_the_answer(header, payload=b""):
            reply = real_call(header, payload)
            if header["op"] == "exchange":
                raise ConnectionResetError("answer lost")
            return reply

        link._call = lose_the_answer  # type: ignore[method-assign]
        assert link.exchange(torch.full((3,), 3.0)) is None and state.version == 2
        link._call = real_call  # type: ignore[method-assign]
        model = link.exchange(torch.full((3,), 6.0))  # learned 5 since its base of 1: 2 of it was applied
        assert model is not None and model.tolist() == [6.0] * 3 and state.version == 3
        assert link.outages == 1 and link.local


def test_a_service_that_cannot_map_the_buffers_keeps_the_leader_on_tcp(tmp_path: Path):
    state = GlobalModel(bound=4)
    with serving(state) as address:
        link = ServiceLink(address, TOKEN, 0, Codec("fp32"), timeout_s=20.0, shared_memory=True)
        real_call = link._call

        def forged(header, payload=b""):
            if header["op"] == "slots":
                header = {**header, "slots": [{**slot, "ino": slot["ino"] + 1} for slot in header["slots"]]}
            return real_call(header, payload)

        link._call = forged  # type: ignore[method-assign]
        link.start(torch.zeros(2))
        assert not link.local
        assert link.exchange(torch.ones(2)).tolist() == [1.0, 1.0]


def test_an_update_whose_answer_was_lost_is_counted_once(tmp_path: Path):
    state = GlobalModel(bound=4, state_dir=tmp_path)
    with serving(state) as address:
        link = _link(address, 0, torch.zeros(2))
        # The service applies exchange 0 (+1), then the answer is lost: the leader still holds it in flight.
        link.in_flight = (link.seq, torch.ones(2))
        state.exchange(0, link.seq, np.ones(2, dtype=np.float32), wait=False)
        link._drop(ConnectionResetError("answer lost"))
        model = link.exchange(torch.full((2,), 3.0))  # the group has learned 3 in all since its base of 0
        assert model is not None and np.allclose(model.numpy(), 3.0), model
        assert state.version == 2 and link.outages == 1


def test_a_wrong_token_is_refused():
    with serving(GlobalModel(bound=1)) as address:
        link = ServiceLink(address, "not-the-token", 0, Codec("fp32"))
        with pytest.raises(ServiceError, match="unauthenticated"):
            link._call({"op": "stats"})


def test_groups_report_running_totals_so_an_epoch_is_counted_once(tmp_path: Path):
    state = GlobalModel(bound=4, state_dir=tmp_path)
    with serving(state) as address:
        fast = _link(address, 0, torch.zeros(2))
        slow = _link(address, 2, torch.zeros(2))
        assert fast.progress(epoch=0, taken=64) == 64
        assert fast.progress(epoch=0, taken=64) == 64  # a repeat (or a retry after a lost answer) counts once
        assert slow.progress(epoch=0, taken=32) == 96
        fast.exchange(fast.base + 1, epoch=0, taken=128)  # an exchange reports progress too
        assert fast.consumed == 160
        assert fast.progress(epoch=1, taken=64) == 64  # a new epoch counts from zero
        assert state.stats()["samples"] == {"0": {"0": 128, "2": 32}, "1": {"0": 64}}
    again = GlobalModel(bound=4, state_dir=tmp_path)  # what the last exchange saved survives a restart
    assert again.taken[0] == {0: 128, 2: 32}


@pytest.mark.parametrize("kind", ["fp16", "topk"])
def test_a_remote_leader_with_a_lossy_codec_is_answered_with_differences_that_lose_nothing(kind: str):
    state = GlobalModel(bound=8)
    with serving(state) as address:
        writer = _link(address, 0, torch.zeros(1000))
        reader = ServiceLink(address, TOKEN, 2, Codec(kind, 0.1), timeout_s=20.0)
        reader.start(torch.zeros(1000))
        assert reader.exchange(reader.base) is not None and reader.answer_bytes == [4000]  # first: whole
        writer.exchange(torch.randn(1000, generator=torch.Generator().manual_seed(3)))
        writer.park()  # done: the reader's exchanges need not wait for it
        truth = torch.from_numpy(state.model.copy())
        errors = []
        for _ in range(12):  # the reader learns nothing itself: its model is its base
            model = reader.exchange(reader.base.clone())
            assert model is not None
            errors.append(float((model - truth).abs().max()))
        assert max(reader.answer_bytes[1:]) == (2000 if kind == "fp16" else 800)  # fp16, or 10 % as index+value
        assert errors[-1] <= 1e-6 < errors[0], errors  # what one answer left out, a later one carried


@pytest.mark.parametrize("kind", ["fp16", "topk"])
def test_a_lossy_exchange_whose_answer_was_lost_is_counted_once(kind: str, tmp_path: Path):
    """The service applies an fp16 or top-k update whose answer the leader never sees; the leader re-attaches
    and exchanges again. What the service holds plus what top-k has not sent yet is what the leader learned:
    nothing twice (top-k's residual must not also carry what the retry's update carries again), since the
    group goes on from the model that exchange returns."""
    state = GlobalModel(bound=4, state_dir=tmp_path)
    with serving(state) as address:
        link = ServiceLink(address, TOKEN, 0, Codec(kind, fraction=0.5), timeout_s=20.0)
        link.start(torch.zeros(4))
        model = torch.tensor([1.0, 2.0, 3.0, 4.0])
        real_call = link._call

        def lose_the_answer(header, payload=b""):
            reply = real_call(header, payload)  # the service applied it
            if header["op"] == "exchange":
                raise ConnectionResetError("answer lost")
            return reply

        link._call = lose_the_answer  # type: ignore[method-assign]
        assert link.exchange(model) is None and link.outages == 1
        link._call = real_call  # type: ignore[method-assign]
        assert link.exchange(model) is not None  # the group then trains on what this returns: no second chance
        unsent = link.codec.residual if kind == "topk" else torch.zeros(4)
        assert state.model is not None and unsent is not None
        assert np.allclose(state.model + unsent.numpy(), model.numpy(), atol=1e-3), (state.model, unsent)
