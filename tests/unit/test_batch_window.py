"""The batcher's adaptive window (sluice/batch_window.py): a batch waits only while another job of
its lane is expected within `max_wait_ms`, and never past it."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.batch_window import ArrivalGaps, waited_window_s
from sluice.batcher import Item, MicroBatcher


def item(n: int, at: float, *, priority: int = 0) -> Item[None]:
    return Item(id=f"j{n}", tenant="t", cost=10, enqueued_at=at, priority=priority)


def test_the_gap_is_the_mean_over_the_recent_arrivals_and_unknown_for_fewer_than_two() -> None:
    gaps = ArrivalGaps(keep=4, horizon_s=1.0)
    assert gaps.mean_gap_s() == math.inf
    gaps.add(100.0)
    assert gaps.mean_gap_s() == math.inf
    for at in (100.01, 100.02, 100.03):
        gaps.add(at)
    assert gaps.mean_gap_s() == pytest.approx(0.01)
    gaps.add(100.5)  # only the last four are kept: 100.01 .. 100.5
    assert gaps.mean_gap_s() == pytest.approx(0.49 / 3)


def test_a_job_after_a_quiet_spell_has_no_gap_and_order_does_not_matter() -> None:
    gaps = ArrivalGaps(keep=8, horizon_s=1.0)
    for at in (10.0, 10.01, 10.02):
        gaps.add(at)
    gaps.add(15.0)  # the others are beyond the horizon of the newest
    assert gaps.mean_gap_s() == math.inf
    late = ArrivalGaps(keep=8, horizon_s=1.0)
    for at in (20.03, 20.0, 20.02, 20.01):  # a reclaimed job, read after younger ones
        late.add(at)
    assert late.mean_gap_s() == pytest.approx(0.01)


@pytest.mark.parametrize(("gap", "expected"), [(math.inf, 0.0), (0.05, 0.0), (0.01, 0.0), (0.004, 0.006),
                                               (0.0, 0.01)])
def test_the_window_is_what_the_gap_leaves_of_the_max_wait(gap: float, expected: float) -> None:
    assert waited_window_s(0.01, gap) == pytest.approx(expected)


def test_a_lone_job_runs_at_once_and_a_fast_lane_waits_most_of_the_window() -> None:
    batcher: MicroBatcher[None] = MicroBatcher(max_batch_size=8, max_wait_ms=10, adaptive_wait=True)
    batcher.add(item(0, 50.0))
    assert batcher.next_deadline() == 50.0
    batch = batcher.take(50.0)
    assert batch is not None and [i.id for i in batch.items] == ["j0"] and batch.close_reason == "age"
    for n in range(1, 4):  # every 2 ms: a batch waits 8 of its 10 ms for the next
        batcher.add(item(n, 60.0 + 0.002 * n))
    deadline = batcher.next_deadline()
    assert deadline == pytest.approx(60.002 + 0.008)
    assert deadline is not None and batcher.take(deadline - 1e-6) is None
    batch = batcher.take(deadline)
    assert batch is not None and len(batch.items) == 3


def test_without_adaptive_wait_the_window_is_the_max_wait() -> None:
    batcher: MicroBatcher[None] = MicroBatcher(max_batch_size=8, max_wait_ms=10)
    batcher.add(item(0, 50.0))
    assert batcher.next_deadline() == pytest.approx(50.01)
    assert batcher.take(50.0) is None


def test_each_lane_waits_by_its_own_arrivals() -> None:
    batcher: MicroBatcher[None] = MicroBatcher(max_batch_size=64, max_wait_ms=10, adaptive_wait=True)
    for n in range(20):  # a bulk read: many jobs enqueued within a few ms
        batcher.add(item(n, 70.0 + 0.0001 * n, priority=1))
    batcher.add(item(100, 70.5))  # one online job
    assert batcher.window_s(1) == pytest.approx(0.0099)
    assert batcher.window_s(0) == 0.0
    batch = batcher.take(70.5)
    assert batch is not None and [i.id for i in batch.items] == ["j100"]
    assert [b.close_reason for b in batcher.poll(70.5)] == ["age"]


@settings(max_examples=200, deadline=None)
@given(gaps=st.lists(st.floats(min_value=0.0, max_value=0.05), min_size=1, max_size=60),
       max_wait_ms=st.floats(min_value=0.0, max_value=50.0))
def test_no_job_waits_past_max_wait_ms(gaps: list[float], max_wait_ms: float) -> None:
    """Driven like the worker: take whenever something is due, else sleep to the next deadline
    or the next arrival, whichever comes first."""
    batcher: MicroBatcher[None] = MicroBatcher(max_batch_size=4, max_wait_ms=max_wait_ms, adaptive_wait=True)
    arrivals, at = [], 0.0
    for gap in gaps:
        at += gap
        arrivals.append(at)
    now, n = 0.0, 0
    while n < len(arrivals) or len(batcher):
        while n < len(arrivals) and arrivals[n] <= now:
            batcher.add(item(n, arrivals[n]))
            n += 1
        while (batch := batcher.take(now)) is not None:
            assert now - batch.oldest_enqueued_at <= max_wait_ms / 1000 + 1e-9
            assert 0.0 <= batcher.window_s(0) <= max_wait_ms / 1000
        deadline = batcher.next_deadline()
        upcoming = [t for t in (deadline, arrivals[n] if n < len(arrivals) else None) if t is not None]
        now = max(now, min(upcoming)) if upcoming else now
