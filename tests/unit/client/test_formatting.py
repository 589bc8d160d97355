"""What `crossover queue` and `crossover jobs` show of names a client chose: plain, escaped text."""
from __future__ import annotations

from rich.console import Console

from crossover.client.cli.formatting import jobs_table, queue_tables, shown

HOSTILE = "[/bold]\x1b[2J\x1b]0;pwned\x07[link=http://x]y[/link]"


def _render(tables) -> str:
    console = Console(record=True, width=300, force_terminal=True, color_system="truecolor")
    for t in tables:
        console.print(t)
    return console.export_text(styles=False)


def test_a_name_is_never_markup_nor_a_terminal_escape():
    rank = {"job_name": HOSTILE, "rank": 0, "pid": 1, "phase": "COMPUTE"}
    state = {"devices": [{"index": 0, "kind": "cpu", "name": "cpu0[red]", "holders": [rank], "order": [HOSTILE]}],
             "jobs": [{"job_name": HOSTILE, "job_id": "id\x1b[31m", "world_size": 1, "ranks": [rank]}]}
    out = _render([*queue_tables(state), jobs_table(state)])
    assert "\x1b" not in out and "\x07" not in out
    assert out.count("[/bold]\\x1b[2J\\x1b]0;pwned\\x07[link=http://x]y[/link]") == 2
    assert "cpu0[red]" in out and "id\\x1b" in out


def test_a_long_name_is_cut():
    assert len(shown("x" * 5000).plain) == 80
    assert shown("résumé-β").plain == "résumé-β"


def test_json_keeps_numbers_numbers_and_unmeasured_figures_null():
    from crossover.client.cli.formatting import to_json
    from crossover.protos import crossover_v1_pb2 as pb

    state = pb.QueueState()
    dev = state.devices.add(index=0, kind="cpu", name="core 0", utilization=-1.0)
    dev.holders.add(job_name="a", rank=1, pid=42, iteration=283, rss_bytes=359_493_632, cpu_percent=-1.0)
    out = to_json("queue", state)
    d = out["devices"][0]
    r = d["holders"][0]
    assert r["iteration"] == 283 and r["rss_bytes"] == 359_493_632 and r["pid"] == 42
    assert d["utilization"] is None and r["cpu_percent"] is None
    assert "job_id" in r
    assert queue_tables(out)  # the tables read the same dict


def test_an_80_column_queue_drops_columns_by_priority_instead_of_cutting_values():
    from crossover.client.cli.formatting import to_json
    from crossover.protos import crossover_v1_pb2 as pb

    state = pb.QueueState()
    dev = state.devices.add(index=0, kind="gpu", name="NVIDIA H100 80GB HBM3", utilization=93.0)
    for k in range(3):
        dev.waiting.add(job_name=f"resnet50-imagenet-{k}", rank=12, pid=1234567, iteration=123456, phase=pb.WAITING,
                        mean_compute_s=0.1234, mean_comm_s=0.2345, wait_fraction=0.5, cpu_percent=99.0,
                        rss_bytes=3_600_000_000, gpu_memory_bytes=42_000_000_000)
    data = to_json("queue", state)
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
    from crossover.client.cli.formatting import to_json
    from crossover.protos import crossover_v1_pb2 as pb

    state = pb.QueueState()
    dev = state.devices.add(index=0, kind="cpu", name="cpu0", utilization=-1.0)
    for k in range(2):
        dev.others.add(job_name="a", rank=k, pid=4242, iteration=7, phase=pb.COMM, mean_compute_s=0.1,
                       mean_comm_s=0.2, wait_fraction=0.07, cpu_percent=5.0, rss_bytes=300_000_000, user="root")
    for width in (60, 70):
        console = Console(record=True, width=width, force_terminal=False)
        for t in queue_tables(to_json("queue", state), width):
            console.print(t)
        lines = [line for line in console.export_text().splitlines() if line.strip()]
        assert "…" not in "".join(lines[1:]), "\n".join(lines)
