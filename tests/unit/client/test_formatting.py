"""What `crossover queue` and `crossover jobs` show of names a client chose: plain, escaped text."""
from __future__ import annotations

from rich.console import Console

from crossover.client.cli.formatting import jobs_table, queue_tables, shown, to_json
from crossover.client.replies import JobList, QueueState
from crossover.protos import crossover_v1_pb2 as pb

HOSTILE = "[/bold]\x1b[2J\x1b]0;pwned\x07[link=http://x]y[/link]"


def _render(tables) -> str:
    console = Console(record=True, width=300, force_terminal=True, color_system="truecolor")
    for t in tables:
        console.print(t)
    return console.export_text(styles=False)


def test_a_name_is_never_markup_nor_a_terminal_escape():
    rank = pb.RankState(job_name=HOSTILE, rank=0, pid=1, phase=pb.COMPUTE)
    state = pb.QueueState(devices=[pb.DeviceState(index=0, kind="cpu", name="cpu0[red]", holders=[rank],
                                                  order=[HOSTILE])])
    jobs = pb.JobList(jobs=[pb.JobState(job_name=HOSTILE, job_id="id\x1b[31m", world_size=1, ranks=[rank])])
    out = _render([*queue_tables(QueueState.from_pb(state)), jobs_table(JobList.from_pb(jobs))])
    assert "\x1b" not in out and "\x07" not in out
    assert out.count("[/bold]\\x1b[2J\\x1b]0;pwned\\x07[link=http://x]y[/link]") == 2
    assert "cpu0[red]" in out and "id\\x1b" in out


def test_a_long_name_is_cut():
    assert len(shown("x" * 5000).plain) == 80
    assert shown("résumé-β").plain == "résumé-β"


def test_json_keeps_numbers_numbers_and_unmeasured_figures_null():
    state = pb.QueueState()
    dev = state.devices.add(index=0, kind="cpu", name="core 0", utilization=-1.0)
    dev.holders.add(job_name="a", rank=1, pid=42, iteration=283, rss_bytes=359_493_632, cpu_percent=-1.0)
    record = QueueState.from_pb(state)
    out = to_json("queue", record)
    d = out["devices"][0]
    r = d["holders"][0]
    assert r["iteration"] == 283 and r["rss_bytes"] == 359_493_632 and r["pid"] == 42
    assert d["utilization"] is None and r["cpu_percent"] is None
    assert "job_id" in r
    assert queue_tables(record)  # the tables read the same record


def test_an_80_column_queue_drops_columns_by_priority_instead_of_cutting_values():
    state = pb.QueueState()
    dev = state.devices.add(index=0, kind="gpu", name="NVIDIA H100 80GB HBM3", utilization=93.0)
    for k in range(3):
        dev.waiting.add(job_name=f"resnet50-imagenet-{k}", rank=12, pid=1234567, iteration=123456, phase=pb.WAITING,
                        mean_compute_s=0.1234, mean_comm_s=0.2345, wait_fraction=0.5, cpu_percent=99.0,
                        rss_bytes=3_600_000_000, gpu_memory_bytes=42_000_000_000)
    data = QueueState.from_pb(state)
    console = Console(record=True, width=80, force_terminal=False)
    for t in queue_tables(data, 80):
        console.print(t)
    text = console.export_text()
    lines = [line for line in text.splitlines() if line.strip()]
    assert max(map(len, lines)) <= 80
    assert "…" not in "".join(lines[1:])  # no header or value cut (the title may be)
    assert "resnet50-imagenet-2" in text and "comp ms" in text and "pid" not in text
    wide = Console(record=True, width=200)
    for t in queue_tables(data):
        wide.print(t)
    shown = wide.export_text()
    assert all(col in shown for col in ("pid", "rss", "gpu mem", "cpu%", "comm ms", "iter")), shown


def test_a_70_column_queue_of_short_names_drops_columns_instead_of_cutting_iter_and_wait():
    """Columns with a minimum width (the mark, job, phase) wider than their cells count at that width."""
    state = pb.QueueState()
    dev = state.devices.add(index=0, kind="cpu", name="cpu0", utilization=-1.0)
    for k in range(2):
        dev.others.add(job_name="a", rank=k, pid=4242, iteration=7, phase=pb.COMM, mean_compute_s=0.1,
                       mean_comm_s=0.2, wait_fraction=0.07, cpu_percent=5.0, rss_bytes=300_000_000, user="root")
    for width in (60, 70):
        console = Console(record=True, width=width, force_terminal=False)
        for t in queue_tables(QueueState.from_pb(state), width):
            console.print(t)
        lines = [line for line in console.export_text().splitlines() if line.strip()]
        assert "…" not in "".join(lines[1:]), "\n".join(lines)


def test_the_tables_say_what_the_records_hold():
    """A device's title (drain, memory, order, sharing, isolation), a rank's cap and a job's class, from records."""
    state = pb.QueueState()
    dev = state.devices.add(index=0, kind="gpu", name="H100", utilization=93.0, memory_total_bytes=80 << 30,
                            memory_used_bytes=61 << 30, memory_free_bytes=19 << 30, draining=True,
                            refused_while_draining=2, order=["prod", "sweep"], sharing="scheduled",
                            sharing_reason="grants pay")
    prod = dev.holders.add(job_id="id-prod", job_name="prod", rank=0, phase=pb.COMPUTE, priority=pb.PRIORITY_HIGH,
                           handover="device", memory_cap_bytes=0, gpu_memory_bytes=50 << 30, framework="ddp")
    sweep = dev.waiting.add(job_id="id-sweep", job_name="sweep", rank=1, phase=pb.WAITING, priority=pb.PRIORITY_LOW,
                            gpu_memory_bytes=9 << 30)
    dev.isolation.CopyFrom(pb.Isolation(window="shared", target=0.97, budget=0.2, reference_s=0.1, current_s=0.11,
                                        kept=0.91, lower_share={"sweep": 0.15}))
    queue = _render(queue_tables(QueueState.from_pb(state)))
    title = " ".join(queue.split("┏")[0].split())  # the title, however rich wrapped it
    assert title == ("device 0 (gpu H100) DRAINING (2 new ranks refused, unscheduled) util 93% mem 61 GiB/80 GiB "
                     "(19 GiB free; prod 50 GiB, sweep 9 GiB) order prod → sweep scheduled (grants pay) "
                     "protect [shared] alone 100 ms, now 110 ms (0.91x, target 0.97); lower budget 0.20 s/s "
                     "(held: sweep 0.15)"), title
    holder, waiter = (line for line in queue.splitlines() if "prod (ddp)" in line or "│#1" in line)
    assert "compute" in holder and "device" in holder and holder.rstrip("│ ").endswith("0 B"), holder
    assert "waiting" in waiter and " cpu " in waiter and waiter.rstrip("│ ").endswith("-"), waiter
    jobs = pb.JobList(jobs=[pb.JobState(job_id="id-prod", job_name="prod", world_size=1, priority=pb.PRIORITY_HIGH,
                                        weight=2.0, class_set_by="operator", ranks=[prod]),
                            pb.JobState(job_id="id-sweep", job_name="sweep", world_size=1, priority=pb.PRIORITY_LOW,
                                        ranks=[sweep])])
    table = _render([jobs_table(JobList.from_pb(jobs))])
    assert "high x2 (operator)" in table and "d0 50 GiB (cap 0 B)" in table and "0:compute" in table, table
    assert " low " in table and "d0 9 GiB " in table and "1:waiting" in table, table
