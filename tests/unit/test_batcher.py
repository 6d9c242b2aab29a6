"""Tests for the pure micro-batcher, driven by a simulated clock.

The property tests replay random arrival streams through the loops a worker
can run (add, poll, sleep until next_deadline; or add, and take whenever a
simulated model is free) so the latency bound can be checked exactly: the
clock is a float we own, not wall time.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.batcher import DEFAULT_BUCKET_BOUNDS, Batch, Item, MicroBatcher

# Coarse bounds for the worked examples, whose bucket indices are easy to follow.
POW2 = (16, 32, 64, 128, 256)

# No example database: other people share this tree, and the clock is simulated
# so there is nothing slow to rerun.
PROPS = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def mk(item_id: str, cost: int, at: float, tenant: str = "t") -> Item:
    return Item(id=item_id, tenant=tenant, cost=cost, enqueued_at=at)


def upper_bound(bounds: Sequence[int], bucket: int) -> float:
    return bounds[bucket] if bucket < len(bounds) else math.inf


def bucket_index(bounds: Sequence[int], cost: int) -> int:
    # Written out independently of the batcher so the test checks, not echoes.
    for i, bound in enumerate(bounds):
        if cost <= bound:
            return i
    return len(bounds)


def padded_tokens(groups: Sequence[Sequence[Item]]) -> int:
    return sum(max(it.cost for it in g) * len(g) for g in groups)


# --------------------------------------------------------------------------
# Simulated worker loop


@dataclass
class Arrival:
    gap: float  # seconds after the previous arrival
    tenant: str
    cost: int
    lag_frac: float  # enqueued_at = arrival time - lag_frac * max_wait
    cancel_back: int | None  # also cancel the item this many arrivals back


@dataclass
class Run:
    emitted: list[tuple[float, str, list[Batch]]] = field(default_factory=list)
    removed: list[Item] = field(default_factory=list)
    items: list[Item] = field(default_factory=list)

    @property
    def batches(self) -> list[Batch]:
        return [b for _, _, bs in self.emitted for b in bs]


def simulate(
    batcher: MicroBatcher,
    arrivals: Sequence[Arrival],
    *,
    keep_up: bool,
    drain_at_end: bool,
    max_wait_ms: float,
) -> Run:
    """Replay arrivals; if keep_up, also wake at every next_deadline()."""
    run = Run()
    wait_s = max_wait_ms / 1000

    def poll(now: float) -> None:
        batches = batcher.poll(now)
        run.emitted.append((now, "poll", batches))
        # Nothing overdue may survive a poll, or a worker sleeping until
        # next_deadline() would wake into the past.
        deadline = batcher.next_deadline()
        assert deadline is None or deadline > now

    now = 0.0
    for n, arr in enumerate(arrivals):
        t = now + arr.gap
        if keep_up:
            while (deadline := batcher.next_deadline()) is not None and deadline <= t:
                assert deadline >= now, "a deadline slipped into the past"
                now = deadline
                poll(now)
        now = t
        item = Item(
            id=f"e{n}",
            tenant=arr.tenant,
            cost=arr.cost,
            enqueued_at=now - arr.lag_frac * wait_s,
            payload=n,
        )
        run.items.append(item)
        batcher.add(item)
        if arr.cancel_back is not None and arr.cancel_back <= n:
            victim = run.items[n - arr.cancel_back].id
            held = victim in batcher
            got = batcher.remove([victim, "never-added"])
            assert [it.id for it in got] == ([victim] if held else [])
            run.removed.extend(got)
        poll(now)

    if drain_at_end:
        run.emitted.append((now, "drain", batcher.drain(now)))
    else:
        while (deadline := batcher.next_deadline()) is not None:
            now = max(now, deadline)
            poll(now)
    assert len(batcher) == 0
    assert batcher.next_deadline() is None
    return run


def check_run(
    run: Run,
    *,
    max_batch_size: int,
    max_wait_ms: float,
    isolate: bool,
    bounds: Sequence[int],
    keep_up: bool,
) -> None:
    wait_s = max_wait_ms / 1000

    # Conservation: every item leaves exactly once, in a batch or via remove().
    out = Counter(it.id for b in run.batches for it in b.items)
    out.update(it.id for it in run.removed)
    assert out == Counter(it.id for it in run.items)

    for now, source, batches in run.emitted:
        oldest = [b.oldest_enqueued_at for b in batches]
        assert oldest == sorted(oldest), "most urgent batch must come first"
        for b in batches:
            assert b.closed_at == now
            assert 1 <= len(b.items) <= max_batch_size
            if source == "drain":
                assert b.close_reason == "drain"
            else:
                assert b.close_reason in ("size", "age")
            if b.close_reason == "size":
                assert len(b.items) == max_batch_size
            if b.close_reason == "age":
                assert b.oldest_enqueued_at + wait_s <= now

            if isolate:
                assert {it.tenant for it in b.items} == {b.tenant}
            else:
                assert b.tenant is None

            # Long never pulled into short; and the label is the longest item's.
            assert all(it.cost <= upper_bound(bounds, b.bucket) for it in b.items)
            assert max(bucket_index(bounds, it.cost) for it in b.items) == b.bucket

            keys = [(it.enqueued_at, int(it.payload)) for it in b.items]
            assert keys == sorted(keys), "items within a batch go oldest first"

            if keep_up:
                for it in b.items:
                    assert b.closed_at <= it.enqueued_at + wait_s, (it, b.closed_at)


def check_fifo(run: Run, *, isolate: bool, bounds: Sequence[int]) -> None:
    """With in-order arrivals no item of a group leaves after a younger one.

    Compared per poll() call, not per position in its result: one poll may
    return a top-up batch carrying a group's newer items ahead of that group's
    own size batch, because results are sorted by each batch's oldest item.
    """
    left_at: dict[int, int] = {}
    for call, (_, _, batches) in enumerate(run.emitted):
        for b in batches:
            for it in b.items:
                left_at[int(it.payload)] = call
    last_call: dict[tuple[str | None, int], int] = {}
    for it in run.items:  # arrival order == enqueue order here
        n = int(it.payload)
        if n not in left_at:
            continue  # cancelled
        key = (it.tenant if isolate else None, bucket_index(bounds, it.cost))
        assert left_at[n] >= last_call.get(key, 0), f"{it.id} overtaken in {key}"
        last_call[key] = left_at[n]


# Mostly short inputs, some long ones, and the exact bucket edges.
costs = st.one_of(
    st.integers(0, 32),
    st.integers(0, 32),
    st.integers(0, 32),
    st.integers(100, 400),
    st.sampled_from([0, 1, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257]),
)
# Bursts (zero gap) as well as gaps longer than any max_wait below.
gaps = st.one_of(st.just(0.0), st.floats(0, 0.01), st.floats(0, 0.2))
bounds_choices = st.sampled_from(
    [DEFAULT_BUCKET_BOUNDS, POW2, (), (1,), (8, 1024), (16, 32, 64, 128, 256, 512, 1024)]
)


@dataclass
class Scenario:
    max_batch_size: int
    max_wait_ms: float
    isolate: bool
    bounds: tuple[int, ...]
    top_up: bool
    arrivals: list[Arrival]


@st.composite
def scenarios(draw: st.DrawFn, out_of_order: bool) -> Scenario:
    max_wait_ms = draw(st.sampled_from([0.0, 1.0, 10.0, 50.0]) | st.floats(0, 100))
    lag = st.floats(0, 0.9) if out_of_order and max_wait_ms > 0 else st.just(0.0)
    arrival = st.builds(
        Arrival,
        gap=gaps,
        tenant=st.sampled_from(["a", "b", "c"]),
        cost=costs,
        lag_frac=lag,
        cancel_back=st.none() | st.none() | st.none() | st.integers(0, 12),
    )
    return Scenario(
        max_batch_size=draw(st.integers(1, 8)),
        max_wait_ms=max_wait_ms,
        isolate=draw(st.booleans()),
        bounds=draw(bounds_choices),
        top_up=draw(st.booleans()),
        arrivals=draw(st.lists(arrival, max_size=120)),
    )


def run_scenario(sc: Scenario, *, keep_up: bool, drain: bool) -> Run:
    batcher = MicroBatcher(
        max_batch_size=sc.max_batch_size,
        max_wait_ms=sc.max_wait_ms,
        isolate_tenants=sc.isolate,
        bucket_bounds=sc.bounds,
        top_up=sc.top_up,
    )
    run = simulate(
        batcher,
        sc.arrivals,
        keep_up=keep_up,
        drain_at_end=drain,
        max_wait_ms=sc.max_wait_ms,
    )
    check_run(
        run,
        max_batch_size=sc.max_batch_size,
        max_wait_ms=sc.max_wait_ms,
        isolate=sc.isolate,
        bounds=sc.bounds,
        keep_up=keep_up,
    )
    return run


@PROPS
@given(sc=scenarios(out_of_order=False), drain=st.booleans())
def test_keeping_up_meets_every_deadline_in_order(sc: Scenario, drain: bool) -> None:
    run = run_scenario(sc, keep_up=True, drain=drain)
    check_fifo(run, isolate=sc.isolate, bounds=sc.bounds)


@PROPS
@given(sc=scenarios(out_of_order=True), drain=st.booleans())
def test_out_of_order_arrivals_still_meet_deadlines(sc: Scenario, drain: bool) -> None:
    run_scenario(sc, keep_up=True, drain=drain)


@PROPS
@given(sc=scenarios(out_of_order=True))
def test_lagging_driver_loses_nothing(sc: Scenario) -> None:
    # Polls only when something arrives, like a worker stuck in a long forward
    # pass: deadlines are missed but batches stay well formed.
    run_scenario(sc, keep_up=False, drain=True)


# --------------------------------------------------------------------------
# The worker's loop: take() whenever a simulated model is free


def simulate_take(
    batcher: MicroBatcher,
    arrivals: Sequence[Arrival],
    *,
    max_wait_ms: float,
    model_s: tuple[float, float],
    isolate: bool,
    bounds: Sequence[int],
    top_up: bool,
    drain_at_end: bool,
) -> Run:
    """Replay arrivals against a model that runs one batch at a time for
    ``fixed + per_item * size`` simulated seconds and asks for the next batch
    the moment it is free, as workers/worker.py does."""
    run = Run()
    wait_s = max_wait_ms / 1000
    fixed, per_item = model_s
    held: dict[str, Item] = {}
    now = 0.0  # the simulated clock: arrivals, deadlines and batch starts
    arrived_at = 0.0
    free_at = 0.0

    def key(it: Item) -> tuple[str | None, int]:
        return (it.tenant if isolate else None, bucket_index(bounds, it.cost))

    def check_take(at: float, batch: Batch) -> None:
        for it in batch.items:
            del held[it.id]
        groups: dict[tuple[str | None, int], list[Item]] = {}
        for it in held.values():
            groups.setdefault(key(it), []).append(it)
        for (tenant, bucket), members in groups.items():
            head = min(it.enqueued_at for it in members)
            # The most urgent ready group went first.
            if len(members) >= batcher.max_batch_size or head + wait_s <= at:
                assert head >= batch.oldest_enqueued_at, (tenant, bucket, batch)
            # A partial batch took all of its group (and, topped up, every shorter item).
            if len(batch.items) < batcher.max_batch_size and tenant == batch.tenant:
                assert bucket > batch.bucket or (not top_up and bucket < batch.bucket), batch

    def run_model_until(t: float) -> None:
        nonlocal now, free_at
        while (at := max(now, free_at)) <= t:
            batch = batcher.take(at)
            if batch is None:
                # The model is free and nothing was ready: nothing may be overdue.
                deadline = batcher.next_deadline()
                assert deadline is None or deadline > at
                if deadline is None or deadline > t:
                    return
                now = deadline
                continue
            check_take(at, batch)
            run.emitted.append((at, "take", [batch]))
            now, free_at = at, at + fixed + per_item * len(batch.items)

    for n, arr in enumerate(arrivals):
        arrived_at += arr.gap
        run_model_until(arrived_at)
        now = arrived_at
        item = Item(id=f"e{n}", tenant=arr.tenant, cost=arr.cost,
                    enqueued_at=now - arr.lag_frac * wait_s, payload=n)
        run.items.append(item)
        batcher.add(item)
        held[item.id] = item
        if arr.cancel_back is not None and arr.cancel_back <= n:
            victim = run.items[n - arr.cancel_back].id
            for it in batcher.remove([victim]):
                run.removed.append(it)
                del held[it.id]
    if drain_at_end:
        run.emitted.append((now, "drain", batcher.drain(now)))
    else:
        run_model_until(math.inf)
    assert len(batcher) == 0
    return run


@PROPS
@given(
    sc=scenarios(out_of_order=True),
    model=st.sampled_from([(0.0, 0.0), (0.001, 0.0005), (0.02, 0.01), (0.2, 0.05)]),
    drain=st.booleans(),
)
def test_taking_when_the_model_is_free_keeps_the_batcher_guarantees(
    sc: Scenario, model: tuple[float, float], drain: bool
) -> None:
    batcher = MicroBatcher(max_batch_size=sc.max_batch_size, max_wait_ms=sc.max_wait_ms,
                           isolate_tenants=sc.isolate, bucket_bounds=sc.bounds, top_up=sc.top_up)
    run = simulate_take(batcher, sc.arrivals, max_wait_ms=sc.max_wait_ms, model_s=model,
                        isolate=sc.isolate, bounds=sc.bounds, top_up=sc.top_up, drain_at_end=drain)
    # An instant model is free at every deadline: then no item waits past its own.
    check_run(run, max_batch_size=sc.max_batch_size, max_wait_ms=sc.max_wait_ms, isolate=sc.isolate,
              bounds=sc.bounds, keep_up=model == (0.0, 0.0))


def test_take_waits_for_size_or_age_and_never_before() -> None:
    b = MicroBatcher(max_batch_size=3, max_wait_ms=50)
    b.add(mk("e0", 10, 1.0))
    b.add(mk("e1", 10, 1.01))
    assert b.take(1.02) is None
    deadline = b.next_deadline()
    assert deadline == 1.0 + 0.05
    assert b.take(math.nextafter(deadline, 0)) is None
    b.add(mk("e2", 10, 1.03))
    sized = b.take(1.03)
    assert sized is not None and sized.close_reason == "size" and sized.closed_at == 1.03
    assert [it.id for it in sized.items] == ["e0", "e1", "e2"]
    b.add(mk("e3", 10, 1.04))
    assert b.take(1.04 + 0.05) == Batch(items=(mk("e3", 10, 1.04),), close_reason="age", bucket=2,
                                        tenant="t", closed_at=1.04 + 0.05)
    assert b.take(10.0) is None and len(b) == 0


def test_take_under_a_backlog_ships_full_length_matched_batches() -> None:
    # Every item overdue, as when a worker starts on a backlog: eager polling
    # would close each group as it is read; take() leaves them growing.
    b = MicroBatcher(max_batch_size=4, max_wait_ms=10, top_up=False)
    costs = [20, 200, 22, 20, 150, 21, 20, 200, 200, 20]
    for n, cost in enumerate(costs):
        b.add(mk(f"e{n}", cost, n * 0.001))
    first = b.take(1.0)
    assert first is not None and first.close_reason == "size"
    assert [it.id for it in first.items] == ["e0", "e3", "e6", "e9"]  # the cost-20 group
    b.add(mk("late", 199, 0.5))  # joins the long group (181-203) while the model runs
    second = b.take(2.0)
    assert second is not None and second.close_reason == "size"
    assert [it.id for it in second.items] == ["e1", "e7", "e8", "late"]
    rest = [b.take(3.0), b.take(3.0), b.take(3.0)]
    assert [([it.id for it in x.items], x.close_reason) for x in rest if x] == [
        (["e2", "e5"], "age"), (["e4"], "age")]
    assert rest[2] is None and len(b) == 0


def test_take_gives_the_most_urgent_ready_batch_first() -> None:
    b = MicroBatcher(max_batch_size=2, max_wait_ms=50)
    b.add(mk("full-1", 10, 0.04, tenant="x"))
    b.add(mk("full-2", 10, 0.045, tenant="x"))
    b.add(mk("old", 10, 0.0, tenant="y"))
    b.add(mk("young", 10, 0.03, tenant="z"))
    order = [b.take(0.05), b.take(0.05), b.take(0.05)]
    assert [(x.items[0].id, x.close_reason) for x in order if x] == [("old", "age"), ("full-1", "size")]
    assert order[2] is None  # "young" is due at 0.08
    late = b.take(0.08)
    assert late is not None and [it.id for it in late.items] == ["young"]


def test_take_never_mixes_isolated_tenants() -> None:
    b = MicroBatcher(max_batch_size=4, max_wait_ms=10)
    for n in range(6):
        b.add(mk(f"e{n}", 20, 0.0, tenant="ab"[n % 2]))
    batches = [b.take(1.0), b.take(1.0)]
    assert sorted(x.tenant for x in batches if x) == ["a", "b"]
    assert all(len({it.tenant for it in x.items}) == 1 for x in batches if x)


@PROPS
@given(st.lists(st.tuples(st.sampled_from("ab"), costs), min_size=2, max_size=60))
def test_without_isolation_tenants_share_batches(
    arrivals: list[tuple[str, int]],
) -> None:
    batcher = MicroBatcher(max_batch_size=64, max_wait_ms=10, isolate_tenants=False)
    for n, (tenant, cost) in enumerate(arrivals):
        batcher.add(mk(f"e{n}", cost, 0.0, tenant))
    batches = batcher.poll(0.01)
    assert sum(len(b.items) for b in batches) == len(arrivals)
    # Grouping ignores tenants entirely: one group per bucket, none per tenant.
    buckets = {bucket_index(DEFAULT_BUCKET_BOUNDS, c) for _, c in arrivals}
    assert len(batches) <= len(buckets)
    assert all(b.tenant is None for b in batches)


# --------------------------------------------------------------------------
# Deterministic examples


def test_size_close_fires_before_age() -> None:
    b = MicroBatcher(max_batch_size=3, max_wait_ms=100)
    for n, at in enumerate([0.0, 0.01, 0.02]):
        b.add(mk(f"e{n}", 10, at))
    # Size batches are handed out whatever `now` says.
    (batch,) = b.poll(0.0)
    assert batch.close_reason == "size"
    assert [it.id for it in batch.items] == ["e0", "e1", "e2"]
    assert batch.closed_at == 0.0
    assert len(b) == 0 and b.next_deadline() is None


def test_size_close_splits_an_overfull_group_and_ages_the_rest() -> None:
    b = MicroBatcher(max_batch_size=2, max_wait_ms=50)
    for n in range(5):
        b.add(mk(f"e{n}", 10, n * 0.001))
    sized = b.poll(0.004)
    assert [[it.id for it in x.items] for x in sized] == [["e0", "e1"], ["e2", "e3"]]
    assert {x.close_reason for x in sized} == {"size"}
    assert b.next_deadline() == 0.004 + 0.05
    (aged,) = b.poll(0.004 + 0.05)
    assert aged.close_reason == "age" and [it.id for it in aged.items] == ["e4"]


def test_age_close_ships_a_partial_batch_exactly_at_the_deadline() -> None:
    b = MicroBatcher(max_batch_size=4, max_wait_ms=50, bucket_bounds=POW2)
    b.add(mk("e0", 10, 1.0))
    b.add(mk("e1", 12, 1.01))
    deadline = b.next_deadline()
    assert deadline == 1.0 + 0.05
    assert b.poll(math.nextafter(deadline, 0)) == []
    (batch,) = b.poll(deadline)
    assert batch.close_reason == "age"
    assert [it.id for it in batch.items] == ["e0", "e1"]
    assert batch.oldest_enqueued_at == 1.0 and batch.max_cost == 12
    assert len(b) == 0


def test_zero_wait_closes_on_the_first_poll() -> None:
    b = MicroBatcher(max_batch_size=8, max_wait_ms=0)
    b.add(mk("e0", 10, 2.0))
    assert b.next_deadline() == 2.0
    (batch,) = b.poll(2.0)
    assert batch.close_reason == "age"


def test_age_close_tops_up_with_shorter_items_of_the_same_tenant() -> None:
    b = MicroBatcher(max_batch_size=4, max_wait_ms=50, bucket_bounds=POW2)
    b.add(mk("long", 200, 0.0))
    b.add(mk("short1", 10, 0.01))
    b.add(mk("mid", 40, 0.02))
    b.add(mk("other-tenant", 10, 0.0, tenant="u"))
    batches = b.poll(0.05)
    by_tenant = {x.tenant: x for x in batches}
    assert [it.id for it in by_tenant["t"].items] == ["long", "short1", "mid"]
    assert by_tenant["t"].bucket == 4 and by_tenant["t"].max_cost == 200
    assert [it.id for it in by_tenant["u"].items] == ["other-tenant"]
    assert len(b) == 0


def test_age_close_never_pulls_a_longer_item_into_a_short_batch() -> None:
    b = MicroBatcher(max_batch_size=4, max_wait_ms=50, bucket_bounds=POW2)
    b.add(mk("short", 10, 0.0))
    b.add(mk("long", 200, 0.03))
    (batch,) = b.poll(0.05)
    assert [it.id for it in batch.items] == ["short"] and batch.bucket == 0
    # The long item keeps its own deadline.
    assert b.next_deadline() == 0.03 + 0.05


def test_top_up_takes_the_oldest_shorter_items_first() -> None:
    b = MicroBatcher(max_batch_size=3, max_wait_ms=50, bucket_bounds=POW2)
    b.add(mk("long", 300, 0.0))
    b.add(mk("b0-new", 5, 0.03))
    b.add(mk("b1-old", 20, 0.01))
    b.add(mk("b0-old", 5, 0.02))
    (batch,) = b.poll(0.05)
    assert [it.id for it in batch.items] == ["long", "b1-old", "b0-old"]
    assert batch.bucket == 5  # overflow bucket: every shorter item qualifies
    assert [it.id for it in b.drain(0.05)[0].items] == ["b0-new"]


def test_top_up_can_be_turned_off() -> None:
    b = MicroBatcher(max_batch_size=4, max_wait_ms=50, top_up=False)
    b.add(mk("long", 200, 0.0))
    b.add(mk("short", 10, 0.01))
    (batch,) = b.poll(0.05)
    assert [it.id for it in batch.items] == ["long"]
    assert len(b) == 1


def test_without_isolation_one_batch_mixes_tenants() -> None:
    b = MicroBatcher(max_batch_size=2, max_wait_ms=50, isolate_tenants=False)
    b.add(mk("a", 10, 0.0, tenant="a"))
    b.add(mk("b", 10, 0.0, tenant="b"))
    (batch,) = b.poll(0.0)
    assert batch.tenant is None
    assert {it.tenant for it in batch.items} == {"a", "b"}


def test_isolated_tenants_never_share_a_size_batch() -> None:
    b = MicroBatcher(max_batch_size=2, max_wait_ms=50)
    b.add(mk("a", 10, 0.0, tenant="a"))
    b.add(mk("b", 10, 0.0, tenant="b"))
    assert b.poll(0.0) == []
    assert {x.tenant for x in b.poll(0.05)} == {"a", "b"}


def test_poll_returns_the_most_urgent_batch_first() -> None:
    b = MicroBatcher(max_batch_size=2, max_wait_ms=50)
    b.add(mk("late-size-1", 10, 0.04, tenant="x"))
    b.add(mk("late-size-2", 10, 0.045, tenant="x"))
    b.add(mk("old", 10, 0.0, tenant="y"))
    b.add(mk("older", 100, -0.01, tenant="z"))
    batches = b.poll(0.05)
    assert [x.items[0].id for x in batches] == ["older", "old", "late-size-1"]


def test_out_of_order_item_goes_to_the_front_of_its_group() -> None:
    b = MicroBatcher(max_batch_size=2, max_wait_ms=50)
    b.add(mk("e1", 10, 0.02))
    b.add(mk("e2", 10, 0.03))
    b.add(mk("e0", 10, 0.01))  # redelivered, enqueued earlier
    assert b.next_deadline() == 0.01 + 0.05
    (size,) = b.poll(0.03)
    assert [it.id for it in size.items] == ["e0", "e1"]


def test_drain_flushes_everything_with_reason_drain() -> None:
    b = MicroBatcher(max_batch_size=3, max_wait_ms=1000)
    n = 0
    for tenant in ("a", "b"):
        for cost in (5, 5, 5, 5, 5, 20, 300):
            b.add(mk(f"e{n}", cost, n * 0.001, tenant))
            n += 1
    held = len(b)
    batches = b.drain(0.5)
    assert {x.close_reason for x in batches} == {"drain"}
    assert all(len(x.items) <= 3 for x in batches)
    assert sorted(it.id for x in batches for it in x.items) == sorted(
        f"e{i}" for i in range(held)
    )
    assert all({it.tenant for it in x.items} == {x.tenant} for x in batches)
    assert len(b) == 0 and b.next_deadline() is None
    assert b.drain(0.5) == [] and b.poll(10.0) == []


def test_remove_drops_cancelled_items() -> None:
    b = MicroBatcher(max_batch_size=3, max_wait_ms=50)
    b.add(mk("e0", 10, 0.0))
    b.add(mk("e1", 10, 0.01))
    assert [it.id for it in b.remove({"e0", "unknown"})] == ["e0"]
    assert len(b) == 1 and "e0" not in b and "e1" in b
    # The remaining item's deadline is its own, not the cancelled one's.
    assert b.next_deadline() == 0.01 + 0.05
    b.add(mk("e2", 10, 0.02))
    b.add(mk("e3", 10, 0.03))
    # Cancelling the item that filled the group un-readies the size batch.
    assert [it.id for it in b.remove(["e3"])] == ["e3"]
    assert b.poll(0.03) == []
    (batch,) = b.poll(0.01 + 0.05)
    assert [it.id for it in batch.items] == ["e1", "e2"]
    assert b.remove(["e1"]) == []  # already handed out: a harmless no-op


def test_remove_rejects_a_bare_string() -> None:
    b = MicroBatcher(max_batch_size=3, max_wait_ms=50)
    with pytest.raises(TypeError):
        b.remove("e0")


@pytest.mark.parametrize("seed", range(5))
def test_length_buckets_at_least_halve_padding(seed: int) -> None:
    rng = random.Random(seed)
    max_batch_size = 8
    n = 400
    costs_ = [
        rng.randint(10, 30) if rng.random() < 0.8 else rng.randint(130, 260)
        for _ in range(n)
    ]
    rng.shuffle(costs_)
    b = MicroBatcher(max_batch_size=max_batch_size, max_wait_ms=50)
    arrivals = [
        Arrival(
            gap=rng.uniform(0, 0.0005),
            tenant="t",
            cost=c,
            lag_frac=0.0,
            cancel_back=None,
        )
        for c in costs_
    ]
    run = simulate(b, arrivals, keep_up=True, drain_at_end=True, max_wait_ms=50)
    bucketed = padded_tokens([x.items for x in run.batches])
    items = [it for x in run.batches for it in x.items]
    assert len(items) == n
    in_arrival_order = [
        run.items[i : i + max_batch_size] for i in range(0, n, max_batch_size)
    ]
    assert 2 * bucketed <= padded_tokens(in_arrival_order)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_batch_size": 0, "max_wait_ms": 10},
        {"max_batch_size": -1, "max_wait_ms": 10},
        {"max_batch_size": 2.5, "max_wait_ms": 10},
        {"max_batch_size": True, "max_wait_ms": 10},
        {"max_batch_size": 4, "max_wait_ms": -1},
        {"max_batch_size": 4, "max_wait_ms": math.nan},
        {"max_batch_size": 4, "max_wait_ms": math.inf},
        {"max_batch_size": 4, "max_wait_ms": 10, "bucket_bounds": (16, 16)},
        {"max_batch_size": 4, "max_wait_ms": 10, "bucket_bounds": (32, 16)},
        {"max_batch_size": 4, "max_wait_ms": 10, "bucket_bounds": (0, 16)},
        {"max_batch_size": 4, "max_wait_ms": 10, "bucket_bounds": (-8,)},
        {"max_batch_size": 4, "max_wait_ms": 10, "bucket_bounds": (8.5,)},
    ],
)
def test_constructor_rejects_bad_arguments(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        MicroBatcher(**kwargs)  # type: ignore[arg-type]


def test_empty_bounds_means_one_bucket() -> None:
    b = MicroBatcher(max_batch_size=2, max_wait_ms=10, bucket_bounds=())
    b.add(mk("short", 1, 0.0))
    b.add(mk("long", 10_000, 0.0))
    (batch,) = b.poll(0.0)
    assert batch.bucket == 0 and len(batch.items) == 2


@pytest.mark.parametrize(
    "bad",
    [mk("e0", -1, 0.0), mk("e0", 1, math.nan), mk("e0", 1, math.inf)],
)
def test_add_rejects_bad_items(bad: Item) -> None:
    b = MicroBatcher(max_batch_size=2, max_wait_ms=10)
    with pytest.raises(ValueError):
        b.add(bad)
    assert len(b) == 0


def test_add_rejects_an_id_already_held() -> None:
    b = MicroBatcher(max_batch_size=4, max_wait_ms=10)
    b.add(mk("e0", 1, 0.0))
    with pytest.raises(ValueError):
        b.add(mk("e0", 1, 0.001))
    assert len(b) == 1
    b.poll(1.0)
    b.add(mk("e0", 1, 1.0))  # once handed out, the id may come back


def test_bucket_of_matches_the_documented_rule() -> None:
    b = MicroBatcher(max_batch_size=1, max_wait_ms=0)
    assert b.bucket_bounds == DEFAULT_BUCKET_BOUNDS
    for cost in [0, 1, 8, 9, 15, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257, 4096, 4097, 10**6]:
        assert b.bucket_of(cost) == bucket_index(DEFAULT_BUCKET_BOUNDS, cost)


def test_default_buckets_are_fine_enough_to_pad_like_sorted_batches() -> None:
    bounds = DEFAULT_BUCKET_BOUNDS
    assert bounds[0] == 8 and bounds[-1] == 4096
    assert all(lo < hi for lo, hi in zip(bounds, bounds[1:], strict=False))
    # Any two items sharing a bucket above the first differ by less than ~20 % in cost.
    assert max(hi / lo for lo, hi in zip(bounds, bounds[1:], strict=False)) <= 1.2


def test_payload_is_carried_but_not_compared() -> None:
    a = Item(id="e0", tenant="t", cost=1, enqueued_at=0.0, payload=b"x")
    assert a == Item(id="e0", tenant="t", cost=1, enqueued_at=0.0, payload=b"y")
    b = MicroBatcher(max_batch_size=1, max_wait_ms=0)
    b.add(a)
    assert b.poll(0.0)[0].items[0].payload == b"x"


def test_an_empty_batch_cannot_be_built() -> None:
    with pytest.raises(ValueError):
        Batch(items=(), close_reason="age", bucket=0, tenant=None, closed_at=0.0)


# --- priorities: the online lane before bulk -----------------------------------------------------


def test_an_online_item_runs_before_older_overdue_bulk_items_and_never_shares_their_batch() -> None:
    batcher: MicroBatcher = MicroBatcher(max_batch_size=4, max_wait_ms=10)
    for i in range(6):
        batcher.add(Item(id=f"bulk{i}", tenant="t", cost=10, enqueued_at=0.0 + i * 0.001, priority=1))
    batcher.add(Item(id="online", tenant="t", cost=10, enqueued_at=5.0))
    # The bulk items are long overdue; the online one is not due yet: nothing runs before it.
    assert batcher.take(5.001) is None
    assert batcher.next_deadline() == 5.0 + 0.01
    first = batcher.take(5.01)
    assert first is not None and [item.id for item in first.items] == ["online"]
    second = batcher.take(5.01)
    assert second is not None and [item.id for item in second.items] == ["bulk0", "bulk1", "bulk2", "bulk3"]
    assert second.tenant == "t"


def test_bulk_items_run_when_no_online_item_is_held() -> None:
    batcher: MicroBatcher = MicroBatcher(max_batch_size=8, max_wait_ms=10)
    batcher.add(Item(id="b", tenant="t", cost=10, enqueued_at=0.0, priority=1))
    assert batcher.next_deadline() == 0.01
    batch = batcher.take(0.01)
    assert batch is not None and batch.close_reason == "age" and batch.items[0].id == "b"


def test_take_with_a_priority_limit_answers_only_a_batch_that_urgent() -> None:
    batcher: MicroBatcher = MicroBatcher(max_batch_size=8, max_wait_ms=10)
    batcher.add(Item(id="b", tenant="t", cost=10, enqueued_at=0.0, priority=1))
    assert batcher.take(1.0, max_priority=0) is None
    batcher.add(Item(id="o", tenant="t", cost=10, enqueued_at=0.5))
    batch = batcher.take(1.0, max_priority=0)
    assert batch is not None and [item.id for item in batch.items] == ["o"]
