"""The group_async parameter service on a real TCP socket, driven by real leader links (threads here;
the multi-process behaviour is in tests/multiprocess/test_group_async_training.py)."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from crossover.plugins.group_async.codec import Codec
from crossover.plugins.group_async.link import ServiceError, ServiceLink
from crossover.plugins.group_async.service import GlobalModel, ParameterService

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


def test_a_restarted_service_resumes_from_the_newest_model(tmp_path: Path):
    state = GlobalModel(bound=4, state_dir=tmp_path)
    with serving(state) as address:
        link = _link(address, 0, torch.zeros(3))
        for _ in range(3):
            link.exchange(link.base + torch.tensor([1.0, 2.0, 3.0]))
    again = GlobalModel(bound=4, state_dir=tmp_path)
    assert again.resumed_from == 3 and again.model is not None
    assert np.allclose(again.model, [3.0, 6.0, 9.0])
    assert list(tmp_path.glob("model-*.npy")) == [tmp_path / "model-3.npy"]


def test_an_update_whose_answer_was_lost_is_counted_once(tmp_path: Path):
    state = GlobalModel(bound=4, state_dir=tmp_path)
    with serving(state) as address:
        link = _link(address, 0, torch.zeros(2))
        # The service applies exchange 0 (+1), then the answer is lost: the leader still holds it in flight.
        link.in_flight = (link.seq, torch.ones(2))
        state.exchange(0, link.seq, "fp32", np.ones(2, dtype=np.float32).tobytes(), 2, wait=False)
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
