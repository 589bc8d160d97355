"""The plugin's work per iteration under real Horovod, counted, not timed (issue 52's guard).

A `horovodrun` job with `import crossover.auto` trains 160 parameter tensors through Horovod's own
DistributedOptimizer against a real crossoverd, in each state a rank can be in, and counts its training
thread's calls into `crossover/` and the frames that thread sends (`testbed/workloads/hot_path_counts.py`).
Horovod calls the plugin's wrappers of its waits once per tensor (its allreduce and its synchronize); those
must stay one call each, a flag read inside. Only an outranked rank also checks for a yield at each
gradient. Any other work per tensor, or more work per iteration than pinned, fails naming the functions.
"""
from __future__ import annotations

import json

import pytest

from testbed.harness.jobs import horovodrun, with_import

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

TENSORS = 160
# Called once per tensor by Horovod itself: its allreduce_async_ and synchronize, which the plugin wraps.
HOROVOD_PER_TENSOR = {"horovod_waits._allreduce_async_", "horovod_waits._synchronize", "horovod_waits._wait"}
# The check at each gradient of an outranked rank: the chain's hook and the tracker's flag read.
YIELD_CHECK = {"optimizer_hooks.HookChain._on_gradient", "phase_tracking.GradientYields.on_gradient"}
# Calls into crossover/ per iteration beyond those, and the frames the training thread sends, as measured at the
# fix, with a few calls to spare in a granted rank's grant wait (a heartbeat's answer may wake it). Late reports
# are batched every second in these runs: at most one batch in the 40 measured iterations. An outranked rank
# also pays each yield the higher class asks for (a release and a request: up to PER_YIELD calls, two frames).
PINNED_CALLS = {"passthrough": 50, "leased": 50, "granted": 62, "outranked": 62}
PINNED_FRAMES = {"passthrough": 0.05, "leased": 0.05, "granted": 2.05, "outranked": 2.05}
PER_YIELD = 30


def _counts(tmp_path, name: str, socket, state: str, env: dict[str, str], np: int = 2) -> dict:
    """Rank 0's counts; with two ranks (each alone on its device) Horovod allreduces and synchronizes every
    tensor through the plugin's wrappers, which a one-rank Horovod never calls."""
    script = with_import(tmp_path, "hot_path_counts.py")
    job = horovodrun(name, script, tmp_path, np=np, args=("--state", state, "--tensors", str(TENSORS)),
                     env={"CROSSOVER_SOCKET": str(socket), "CROSSOVER_REPORT_INTERVAL": "1", "CROSSOVER_PIN": "0",
                          **env})
    try:
        assert job.wait(120) == 0, job.output()[-3000:]
    finally:
        job.kill()
    return json.loads((job.out / "counts0.json").read_text())


def _check(state: str, counts: dict) -> None:
    calls: dict[str, float] = counts["calls"]
    report = ", ".join(f"{name} {n:g}" for name, n in sorted(calls.items(), key=lambda kv: -kv[1]))
    allowed = HOROVOD_PER_TENSOR | (YIELD_CHECK if state == "outranked" else set())
    per_tensor = {name: n for name, n in calls.items() if n >= TENSORS // 2}
    extra = {name: n for name, n in per_tensor.items() if name not in allowed}
    assert not extra, (f"{state}: work per parameter tensor on the hot path, {extra} calls per iteration at "
                       f"{TENSORS} tensors (allowed per tensor: {sorted(allowed)})")
    for name in per_tensor:
        assert calls[name] <= TENSORS, f"{state}: {name} runs {calls[name]:g} times per iteration, more than " \
                                       "once per tensor"
    if state == "outranked":
        assert YIELD_CHECK <= set(per_tensor), f"outranked: no yield check at the gradients ({report})"
    rest = sum(n for name, n in calls.items() if name not in per_tensor)
    yields = counts["yields"]
    pinned_calls, pinned_frames = PINNED_CALLS[state] + PER_YIELD * yields, PINNED_FRAMES[state] + 2 * yields
    assert rest <= pinned_calls, (f"{state}: {rest:g} calls into crossover/ per iteration besides the per-tensor "
                                  f"ones, pinned at {pinned_calls:g} ({yields:g} yields): {report}")
    assert counts["frames"] <= pinned_frames, (f"{state}: {counts['frames']:g} frames sent per iteration, pinned "
                                               f"at {pinned_frames:g} ({yields:g} yields)")


@pytest.mark.parametrize("state, policy, env", [
    ("passthrough", "passthrough", {}),
    ("leased", "exclusive", {}),
    ("granted", "exclusive", {"CROSSOVER_LEASE": "0"}),
])
def test_a_rank_nobody_outranks_works_per_tensor_only_in_horovods_own_calls(daemon_factory, tmp_path, state,
                                                                             policy, env):
    d = daemon_factory("--cpu-devices", "2", "--policy", policy)
    counts = _counts(tmp_path, state, d.socket, state, env)
    print(json.dumps(counts))
    _check(state, counts)


def test_an_outranked_rank_adds_one_flag_read_per_gradient(daemon_factory, jobs, tmp_path):
    d = daemon_factory("--cpu-devices", "1", "--policy", "crossover")
    prod = horovodrun("prod", with_import(tmp_path), tmp_path, np=1, args=("--iters", "100000"), stoppable=True,
                      env={"CROSSOVER_SOCKET": str(d.socket), "CROSSOVER_PIN": "0"})
    jobs.append(prod)
    try:
        counts = _counts(tmp_path, "sweep", d.socket, "outranked",
                         {"CROSSOVER_PRIORITY": "low", "CROSSOVER_LEASE": "0"}, np=1)
    finally:
        prod.stop()
    print(json.dumps(counts))
    _check("outranked", counts)
