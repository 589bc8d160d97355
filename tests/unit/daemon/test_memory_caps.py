"""The memory rules by class (`policies.memory`): reservations, caps and their reasons, from made-up devices."""
from __future__ import annotations

import pytest

from crossover.daemon.policies.classes import Priority
from crossover.daemon.policies.memory import (
    MemoryCap,
    MemoryRules,
    Reservation,
    caps,
    parse_reservation,
)
from crossover.figures import format_bytes, parse_size

GiB = 1 << 30
HIGH, NORMAL, LOW = Priority.HIGH, Priority.NORMAL, Priority.LOW


def rules(*texts: str) -> MemoryRules:
    return MemoryRules.parse(list(texts))


@pytest.mark.parametrize("text, parsed", [
    ("50%", (0.5, 0)), ("100%", (1.0, 0)), ("40GiB", (0.0, 40 * GiB)), ("40G", (0.0, 40 * GiB)),
    ("512MiB", (0.0, 512 << 20)), ("1.5GB", (0.0, 1_500_000_000)), ("4096", (0.0, 4096)), (" 2 gib ", (0.0, 2 * GiB)),
])
def test_sizes_parse(text: str, parsed: tuple[float, int]) -> None:
    assert parse_size(text) == parsed


@pytest.mark.parametrize("text, says", [
    ("0%", "above 0%"), ("101%", "at most 100%"), ("lots", "share of the device"), ("5 parsecs", "share of the device"),
    ("0GiB", "no memory"), ("", "share of the device"),
])
def test_bad_sizes_say_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_size(text)


def test_reservations_parse_and_read_back() -> None:
    assert parse_reservation("high=50%") == Reservation(HIGH, 0.5)
    assert str(parse_reservation("normal=20GiB")) == "normal=20 GiB"
    assert str(rules("high=60%", "low=1GiB")) == "high=60%, low=1 GiB"
    for bad, says in (("high", "CLASS=SIZE"), ("urgent=5%", "high, normal, low"),
                      ("high=much", "reservation 'high=much'")):
        with pytest.raises(ValueError, match=says):
            parse_reservation(bad)
    with pytest.raises(ValueError, match="reserved twice"):
        rules("high=10%", "high=20%")
    with pytest.raises(ValueError, match="more than 100%"):
        rules("high=60%", "normal=50%")


def test_nothing_changes_without_a_reservation_or_alone() -> None:
    assert caps(80 * GiB, {"a": HIGH, "b": LOW}, MemoryRules()) == {"a": MemoryCap(), "b": MemoryCap()}
    assert caps(80 * GiB, {"b": LOW}, rules("high=50%")) == {"b": MemoryCap()}
    assert caps(80 * GiB, {"a": HIGH}, rules("high=50%")) == {"a": MemoryCap()}
    assert caps(0, {"a": HIGH, "b": LOW}, rules("high=50%")) == {"a": MemoryCap(), "b": MemoryCap()}


def test_a_reservation_caps_the_classes_below_and_says_why() -> None:
    got = caps(80 * GiB, {"prod": HIGH, "batch": LOW}, rules("high=60%"))
    assert got["prod"] == MemoryCap()
    assert got["batch"].limit == 80 * GiB - int(0.6 * 80 * GiB)
    assert got["batch"].why.startswith("32 GiB of 80 GiB, as high reserves 48 GiB and the rest is left to it")
    assert "crossoverd --reserve" in got["batch"].why


def test_a_reservation_guards_only_against_lower_classes() -> None:
    got = caps(80 * GiB, {"a": HIGH, "b": HIGH, "n": NORMAL}, rules("normal=25%"))
    assert got["a"] == got["b"] == got["n"] == MemoryCap()  # normal's reservation never caps high, nor itself
    got = caps(80 * GiB, {"h": HIGH, "n": NORMAL, "l": LOW}, rules("normal=25%"))
    assert got["h"] == got["n"] == MemoryCap()
    assert got["l"].limit == 60 * GiB


def test_capped_jobs_split_what_is_left_and_never_eat_into_a_reservation() -> None:
    total = 80 * GiB
    two = caps(total, {"p": HIGH, "x": LOW, "y": NORMAL}, rules("high=50%"))
    assert two["x"].limit == two["y"].limit == 20 * GiB and "split among 2 capped jobs" in two["x"].why
    nested = caps(total, {"p": HIGH, "n": NORMAL, "l1": LOW, "l2": LOW}, rules("high=50%", "normal=20%"))
    free = total - 40 * GiB - 16 * GiB
    assert nested["l1"].limit == nested["l2"].limit == free // 3
    assert nested["n"].limit == free // 3 + 16 * GiB
    assert nested["n"].limit + nested["l1"].limit + nested["l2"].limit <= total - 40 * GiB  # high's is whole
    assert nested["l1"].limit + nested["l2"].limit <= total - 40 * GiB - 16 * GiB  # and normal's against low


def test_a_job_leaving_frees_its_reservation_and_a_class_change_moves_it() -> None:
    r = rules("high=50%")
    before = caps(80 * GiB, {"p": HIGH, "b": LOW}, r)
    assert before["b"].limit == 40 * GiB
    assert caps(80 * GiB, {"b": LOW}, r)["b"] == MemoryCap()  # p left
    swapped = caps(80 * GiB, {"p": LOW, "b": HIGH}, r)  # the operator swapped their classes mid-run
    assert swapped["b"] == MemoryCap() and swapped["p"].limit == 40 * GiB


def test_reservations_in_bytes_past_a_small_device_hold_all_of_it() -> None:
    got = caps(16 * GiB, {"p": HIGH, "b": LOW}, rules("high=40GiB"))
    assert got["b"].limit == 0 and "high reserves 16 GiB" in got["b"].why


def held_top_down(total: int, r: MemoryRules, present: set[Priority]) -> dict[Priority, int]:
    """The oracle's reading of what the active reservations hold: from the top, each within what is left."""
    held, left = {}, total
    for res in sorted((x for x in r.reservations if x.priority in present), key=lambda x: -x.priority):
        held[res.priority] = min(res.on(total), left)
        left -= held[res.priority]
    return held


def test_caps_of_any_mix_respect_every_active_reservation() -> None:
    import random

    rnd = random.Random(7)
    for _ in range(500):
        total = rnd.randint(1, 200) * GiB
        texts = []
        for p in rnd.sample([HIGH, NORMAL, LOW], rnd.randint(1, 3)):
            texts.append(f"{p}={rnd.randint(1, 300)}GiB" if rnd.random() < 0.4 else f"{p}={rnd.randint(1, 33)}%")
        r = rules(*texts)
        jobs = {f"j{i}": rnd.choice([HIGH, NORMAL, LOW]) for i in range(rnd.randint(1, 6))}
        got = caps(total, jobs, r)
        held = held_top_down(total, r, set(jobs.values()))
        assert sum(held.values()) <= total
        for res in held:
            below = sum(got[j].limit or 0 for j, p in jobs.items() if p < res)
            assert below <= total - sum(b for q, b in held.items() if q >= res), (total, texts, jobs, got)
        for j, p in jobs.items():
            if any(q > p for q in held):
                assert got[j].limit is not None and got[j].limit >= 0, (texts, jobs, got)  # capped, maybe at 0
            else:
                assert got[j] == MemoryCap()
            for k, q in jobs.items():
                if got[j].limit is not None and got[k].limit is not None and p > q:
                    assert got[j].limit >= got[k].limit - len(jobs), (texts, jobs, got)  # never less than lower


def test_a_lower_class_reservation_takes_nothing_from_a_higher_capped_class() -> None:
    got = caps(100 * GiB, {"h": HIGH, "n": NORMAL, "l": LOW}, rules("high=50%", "low=20%"))
    assert got["n"].limit == got["l"].limit == 25 * GiB  # low's 20 % fits in its equal half of what high leaves


def test_byte_reservations_past_the_device_are_held_from_the_top() -> None:
    got = caps(80 * GiB, {"h": HIGH, "n": NORMAL, "l": LOW}, rules("high=60GiB", "normal=40GiB"))
    assert got["n"].limit == 20 * GiB and got["l"].limit == 0  # normal holds what high left; low gets nothing
    assert "normal reserves 20 GiB" in got["l"].why


def test_bytes_read_as_a_person_writes_them() -> None:
    assert [format_bytes(n) for n in (0, 1023, 1024, 512 << 20, 48 * GiB, 3 * GiB // 2, 2 << 40)] == [
        "0 B", "1023 B", "1 KiB", "512 MiB", "48 GiB", "1.5 GiB", "2 TiB"]
