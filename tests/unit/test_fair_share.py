"""Deficit round robin, release planning and the batcher's priority, ageing and fairness:
sluice/fair_share.py and its use in sluice/batcher.py."""

from __future__ import annotations

from collections import Counter

import pytest

from sluice.batcher import Item, MicroBatcher
from sluice.fair_share import DeficitRoundRobin, HeldQueue, effective_priority, model_quantum, plan_release


def _serve(turns: DeficitRoundRobin[str], ready: set[str], cost: dict[str, float], rounds: int) -> Counter[str]:
    served: Counter[str] = Counter()
    for _ in range(rounds):
        tenant = turns.pick(ready)
        assert tenant is not None
        served[tenant] += cost[tenant]
        turns.charge(tenant, cost[tenant])
    return served


def test_equal_shares_get_equal_model_time_whatever_their_batches_cost() -> None:
    turns: DeficitRoundRobin[str] = DeficitRoundRobin(quantum=0.02)
    served = _serve(turns, {"a", "b"}, {"a": 0.3, "b": 0.05}, rounds=600)
    assert served["a"] == pytest.approx(served["b"], rel=0.1)


def test_shares_weight_model_time() -> None:
    turns: DeficitRoundRobin[str] = DeficitRoundRobin(quantum=0.02, shares={"a": 3.0})
    served = _serve(turns, {"a", "b"}, {"a": 0.1, "b": 0.1}, rounds=800)
    assert served["a"] / served["b"] == pytest.approx(3.0, rel=0.1)


def test_a_tenant_that_becomes_ready_waits_at_most_one_turn_of_the_flood() -> None:
    turns: DeficitRoundRobin[str] = DeficitRoundRobin(quantum=0.02)
    _serve(turns, {"flood"}, {"flood": 0.1}, rounds=1000)
    # The flood's thousand batches bought it no credit over a newcomer.
    first = turns.pick({"flood", "newcomer"})
    if first == "flood":
        turns.charge("flood", 0.1)
        first = turns.pick({"flood", "newcomer"})
    assert first == "newcomer"


def test_idle_time_earns_no_burst() -> None:
    turns: DeficitRoundRobin[str] = DeficitRoundRobin(quantum=0.02)
    _serve(turns, {"a"}, {"a": 0.1}, rounds=50)
    served = _serve(turns, {"a", "b"}, {"a": 0.1, "b": 0.1}, rounds=100)
    assert abs(served["a"] - served["b"]) <= 0.2 + 1e-9


def test_effective_priority_ages_to_the_most_urgent_with_work() -> None:
    assert effective_priority(2, waited_s=9.9, ageing_s=10.0, most_urgent=0) == 2
    assert effective_priority(2, waited_s=10.0, ageing_s=10.0, most_urgent=0) == 0
    assert effective_priority(2, waited_s=10.0, ageing_s=10.0, most_urgent=1) == 1
    assert effective_priority(1, waited_s=60.0, ageing_s=10.0, most_urgent=1) == 1


def _queue(priority: int, tenant: str, count: int, *, at: float = 100.0, cost: int = 10,
           share: float = 1.0) -> HeldQueue:
    return HeldQueue(priority=priority, tenant=tenant, count=count, head_enqueued_at=at, head_cost=cost, share=share)


def test_release_takes_the_most_urgent_priority_first_then_tenants_in_turn() -> None:
    turns: DeficitRoundRobin[str] = DeficitRoundRobin(quantum=10)
    queues = [_queue(2, "a", 100), _queue(1, "a", 100), _queue(1, "b", 3), _queue(0, "c", 2)]
    plan = plan_release(queues, want=10, now=101.0, turns=turns, ageing_s=10.0)
    order = [(queue.priority, queue.tenant) for queue, count in plan for _ in range(count)]
    assert order[:2] == [(0, "c"), (0, "c")]
    # Priority 1 next, a and b alternating until b runs out; nothing of priority 2.
    assert Counter(order[2:]) == Counter({(1, "b"): 3, (1, "a"): 5})
    assert order[2:8].count((1, "b")) == 3


def test_release_ages_a_starved_queue_to_the_front() -> None:
    turns: DeficitRoundRobin[str] = DeficitRoundRobin(quantum=10)
    queues = [_queue(0, "a", 100, at=100.0), _queue(2, "b", 1, at=80.0)]
    plan = plan_release(queues, want=3, now=100.5, turns=turns, ageing_s=10.0)
    assert (2, "b") in [(queue.priority, queue.tenant) for queue, _ in plan]


def test_release_puts_an_aged_job_ahead_of_its_tenants_older_urgent_flood() -> None:
    turns: DeficitRoundRobin[str] = DeficitRoundRobin(quantum=10)
    queues = [_queue(0, "a", 500, at=90.0), _queue(2, "a", 1, at=95.0)]
    assert [(q.priority, n) for q, n in plan_release(queues, want=1, now=94.0, turns=turns, ageing_s=10.0)] == [(0, 1)]
    assert [(q.priority, n) for q, n in plan_release(queues, want=1, now=105.0, turns=turns, ageing_s=10.0)] == [(2, 1)]


def test_release_weights_tenants_by_share() -> None:
    turns: DeficitRoundRobin[str] = DeficitRoundRobin(quantum=10)
    queues = [_queue(1, "a", 1000, share=2.0), _queue(1, "b", 1000)]
    plan = plan_release(queues, want=300, now=100.0, turns=turns, ageing_s=10.0)
    released = Counter({queue.tenant: 0 for queue, _ in plan})
    for queue, count in plan:
        released[queue.tenant] += count
    assert released["a"] / released["b"] == pytest.approx(2.0, rel=0.05)


def _item(i: int, tenant: str, *, at: float, job_priority: int = 1) -> Item[None]:
    return Item(id=f"{tenant}-{i}", tenant=tenant, cost=10, enqueued_at=at, job_priority=job_priority)


def test_batcher_serves_the_urgent_job_priority_among_ready_groups() -> None:
    batcher: MicroBatcher[None] = MicroBatcher(max_batch_size=4, max_wait_ms=10, bucket_bounds=())
    for i in range(8):
        batcher.add(_item(i, "a", at=0.0, job_priority=2))
    batcher.add(_item(99, "a", at=0.5, job_priority=0))
    # Before the urgent item's window closes, the model is not kept idle: priority 2 runs.
    first = batcher.take(0.505)
    assert first is not None and first.items[0].job_priority == 2
    second = batcher.take(0.52)
    assert second is not None and [item.job_priority for item in second.items] == [0]


def test_batcher_ageing_bounds_the_wait_of_the_lowest_priority() -> None:
    batcher: MicroBatcher[None] = MicroBatcher(max_batch_size=2, max_wait_ms=0, bucket_bounds=(), ageing_s=5.0)
    batcher.add(_item(0, "low", at=0.0, job_priority=2))
    now, i = 0.0, 0
    while True:
        # A steady flood of urgent work, always ready.
        batcher.add(_item(i, "urgent", at=now, job_priority=0))
        batcher.add(_item(i + 1, "urgent", at=now, job_priority=0))
        i += 2
        batch = batcher.take(now)
        assert batch is not None
        if batch.items[0].tenant == "low":
            break
        now += 0.1
    assert 5.0 <= now <= 5.2


def test_batcher_gives_tenants_turns_instead_of_oldest_first() -> None:
    turns: DeficitRoundRobin[str] = DeficitRoundRobin(quantum=0.02)
    batcher: MicroBatcher[None] = MicroBatcher(max_batch_size=4, max_wait_ms=0, bucket_bounds=(), turns=turns)
    for i in range(40):
        batcher.add(_item(i, "flood", at=0.0))
    batcher.add(_item(0, "single", at=5.0))
    served = []
    for _ in range(3):
        batch = batcher.take(6.0)
        assert batch is not None
        served.append(batch.tenant)
        turns.charge(batch.tenant or "", 0.1)
    assert "single" in served[:2]


def test_batcher_fills_a_mixed_batch_fairly_without_isolation() -> None:
    turns: DeficitRoundRobin[str] = DeficitRoundRobin(quantum=0.02, shares={"b": 1.0})
    batcher: MicroBatcher[None] = MicroBatcher(max_batch_size=4, max_wait_ms=0, bucket_bounds=(),
                                               isolate_tenants=False, turns=turns)
    for i in range(20):
        batcher.add(_item(i, "flood", at=float(i) / 100))
    batcher.add(_item(0, "b", at=1.0))
    batch = batcher.take(2.0)
    assert batch is not None
    assert Counter(item.tenant for item in batch.items) == Counter({"flood": 3, "b": 1})
    # The rest stay held in arrival order.
    rest = batcher.take(2.0)
    assert rest is not None and [item.id for item in rest.items] == ["flood-3", "flood-4", "flood-5", "flood-6"]


def test_a_tenant_within_its_share_goes_before_one_over_it_whatever_its_debt() -> None:
    turns: DeficitRoundRobin[str] = DeficitRoundRobin(quantum=model_quantum(0.01))
    batcher: MicroBatcher[None] = MicroBatcher(max_batch_size=16, max_wait_ms=10, bucket_bounds=(), turns=turns)
    for i in range(100):
        batcher.add(_item(i, "flood", at=0.0))

    def limit(tenant: str) -> int | None:  # the flood is over its share, the trickle within
        return 2 if tenant == "flood" else None

    now = 1.0
    for n in range(20):
        batcher.add(_item(2 * n, "trickle", at=now))
        first = batcher.take(now + 0.001, limit=limit)
        assert first is not None and first.tenant == "trickle", n
        turns.charge("trickle", 0.005)
        # Its next job arrived while that one ran: its 5 ms batch overdrew its turn, yet it goes
        # ahead of the flood again, whose two-item slices run in between.
        batcher.add(_item(2 * n + 1, "trickle", at=now + 0.003))
        second = batcher.take(now + 0.006, limit=limit)
        assert second is not None and second.tenant == "trickle", n
        turns.charge("trickle", 0.005)
        third = batcher.take(now + 0.011, limit=limit)
        assert third is not None and third.tenant == "flood" and len(third.items) == 2
        turns.charge("flood", 0.008)
        now += 0.03


def test_a_turn_on_the_model_is_a_quarter_slice_so_a_slice_overdraws_it() -> None:
    assert model_quantum(0.010) == pytest.approx(0.0025)
    assert model_quantum(0.0) > 0
    turns: DeficitRoundRobin[str] = DeficitRoundRobin(quantum=model_quantum(0.010))
    # Two heavy tenants with slices of 8 ms alternate slice by slice.
    order = []
    for _ in range(6):
        tenant = turns.pick({"a", "b"})
        assert tenant is not None
        order.append(tenant)
        turns.charge(tenant, 0.008)
    assert all(x != y for x, y in zip(order, order[1:], strict=False)), order
