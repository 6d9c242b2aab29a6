"""The placement rules of scheduler/placement.py, one by one, and invariants over random demands."""

from __future__ import annotations

import random

from scheduler.placement import Budget, GroupPlan, Placer, Want

MB = 2**20
TWO = Budget(processes=2, threads_per_process=1, memory_per_process=8000 * MB, pack_across_tiers=False)


def want(tier: str = "latency", floor: int = 1, replicas: int = 1, weights: str = "w", size: int = 100,
         serving: bool = True) -> Want:
    return Want(tier=tier, floor=floor, replicas=replicas, weights=weights, resident_bytes=size * MB,  # type: ignore[arg-type]
                config=f"config of {weights}", serving=serving)


def members(placed: object) -> dict[str, set[str]]:
    groups = placed.groups  # type: ignore[attr-defined]
    return {name: {f"{m}/{v}" for m, v in group.versions} for name, group in groups.items()}


def test_twelve_latency_versions_at_their_floor_share_one_process() -> None:
    wants = {(f"m{i}", "v1"): want(weights=f"w{i % 3}") for i in range(12)}
    placed = Placer().place(wants, TWO)
    assert list(placed.groups) == ["g1"] and len(placed.groups["g1"].versions) == 12
    assert all(placed.replicas(key) == 1 for key in wants) and not placed.not_served
    assert placed.groups["g1"].threads == 1 and placed.groups["g1"].tier == "latency"


def test_tiers_get_processes_of_their_own_unless_packed_across() -> None:
    wants = {("chat", "v1"): want(), ("nightly", "v1"): want(tier="batch")}
    apart = Placer().place(wants, TWO)
    assert sorted(group.tier for group in apart.groups.values()) == ["batch", "latency"]
    together = Placer().place(wants, Budget(processes=2, threads_per_process=1, memory_per_process=8000 * MB,
                                            pack_across_tiers=True))
    assert [group.tier for group in together.groups.values()] == ["mixed"]


def test_scale_up_opens_a_process_for_that_version_and_scale_down_closes_it() -> None:
    placer = Placer()
    wants = {("a", "v1"): want(), ("b", "v1"): want()}
    placer.place(wants, TWO)
    up = placer.place({**wants, ("a", "v1"): want(replicas=2)}, TWO)
    assert members(up) == {"g1": {"a/v1", "b/v1"}, "g2": {"a/v1"}}
    assert any(line.startswith("g2 opened (latency): + a/v1 (scale-up to 2)") for line in up.changes), up.changes
    down = placer.place(wants, TWO)
    assert members(down) == {"g1": {"a/v1", "b/v1"}}
    assert "g2 closed: it serves no version" in down.changes
    again = placer.place({**wants, ("b", "v1"): want(replicas=2)}, TWO)
    assert members(again) == {"g1": {"a/v1", "b/v1"}, "g3": {"b/v1"}}, "a group id is never reused"


def test_scale_up_beyond_the_budget_stops_and_the_latency_pool_gets_the_spare_first() -> None:
    wants = {("chat", "v1"): want(replicas=3), ("nightly", "v1"): want(tier="batch", replicas=3)}
    placed = Placer().place(wants, Budget(processes=3, threads_per_process=1, memory_per_process=8000 * MB,
                                          pack_across_tiers=False))
    assert placed.replicas(("chat", "v1")) == 2 and placed.replicas(("nightly", "v1")) == 1
    assert len(placed.groups) == 3


def test_the_spare_passes_between_tiers_within_the_budget_and_the_change_says_nothing_of_it() -> None:
    three = Budget(processes=3, threads_per_process=1, memory_per_process=8000 * MB, pack_across_tiers=False)
    placer = Placer()
    placer.place({("chat", "v1"): want(replicas=2), ("nightly", "v1"): want(tier="batch", replicas=2)}, three)
    # Chat's burst is over: its second process empties and closes, and nightly opens one.
    moved = placer.place({("chat", "v1"): want(), ("nightly", "v1"): want(tier="batch", replicas=2)}, three)
    assert moved.replicas(("nightly", "v1")) == 2 and len(moved.groups) == 3
    assert not any("over the" in line for line in moved.changes), moved.changes


def test_a_floor_is_placed_even_over_the_budget_and_the_change_says_so() -> None:
    placed = Placer().place({("big", "v1"): want(floor=3, replicas=3)}, TWO)
    assert placed.replicas(("big", "v1")) == 3 and len(placed.groups) == 3
    assert any("over the 2-process budget to keep big/v1 served" in line for line in placed.changes), placed.changes


def test_clones_share_weights_and_a_full_process_opens_another() -> None:
    budget = Budget(processes=1, threads_per_process=2, memory_per_process=1000 * MB, pack_across_tiers=True)
    clones = {("m", f"v{i}"): want(weights="same", size=600) for i in range(5)}
    placed = Placer().place(clones, budget)
    assert list(placed.groups) == ["g1"], "five clones of one artifact count its memory once"
    other = Placer().place({**clones, ("n", "v1"): want(weights="other", size=600)}, budget)
    assert members(other) == {"g1": {f"m/v{i}" for i in range(5)}, "g2": {"n/v1"}}


def test_a_version_larger_than_a_process_may_hold_is_not_served_with_why() -> None:
    placed = Placer().place({("huge", "v1"): want(size=9000), ("ok", "v1"): want()}, TWO)
    assert placed.replicas(("huge", "v1")) == 0 and placed.replicas(("ok", "v1")) == 1
    assert "exceed the 8000 MB one process may hold" in placed.not_served[("huge", "v1")]
    assert placed.to_plan(at=1.0).not_served == {"huge/v1": placed.not_served[("huge", "v1")]}


def test_serving_versions_take_scale_up_room_before_shadows() -> None:
    wants = {("a", "shadow"): want(replicas=2, serving=False), ("b", "stable"): want(replicas=2)}
    placed = Placer().place(wants, Budget(processes=2, threads_per_process=1, memory_per_process=250 * MB,
                                          pack_across_tiers=False))
    # Memory lets g1 hold only two copies: b/stable's second copy comes before the shadow's.
    assert placed.replicas(("b", "stable")) == 2


def test_the_same_demand_twice_changes_nothing_and_a_resumed_placer_keeps_the_groups() -> None:
    wants = {("a", "v1"): want(replicas=2), ("b", "v1"): want(), ("c", "v1"): want(tier="batch")}
    placer = Placer()
    first = placer.place(wants, TWO)
    second = placer.place(wants, TWO)
    assert second.changes == () and second.groups == first.groups
    resumed = Placer(groups={name: GroupPlan(tier=g.tier, threads=g.threads, versions=g.versions)
                             for name, g in first.groups.items()}).place(wants, TWO)
    assert resumed.groups == first.groups and resumed.changes == ()


def test_a_version_no_longer_wanted_leaves_and_the_plan_carries_configs() -> None:
    placer = Placer()
    placer.place({("a", "v1"): want(), ("b", "v1"): want(weights="b")}, TWO)
    placed = placer.place({("b", "v1"): want(weights="b")}, TWO)
    assert members(placed) == {"g1": {"b/v1"}} and "g1: - a/v1 (no longer placed)" in placed.changes
    plan = placed.to_plan(at=5.0)
    assert [(p.model, p.version, p.config) for p in plan.groups["g1"].versions] == [("b", "v1", "config of b")]


def test_random_demands_keep_every_floor_tiers_apart_and_memory_bounded() -> None:
    rng = random.Random(7)
    placer = Placer()
    for _ in range(200):
        budget = Budget(processes=rng.randint(1, 4), threads_per_process=1, memory_per_process=1000 * MB,
                        pack_across_tiers=False)
        wants = {}
        for i in range(rng.randint(1, 10)):
            floor = rng.randint(0, 2)
            wants[(f"m{i}", "v1")] = want(tier=rng.choice(["latency", "batch"]), floor=floor,
                                          replicas=floor + rng.randint(0, 2), weights=f"w{rng.randint(0, 3)}",
                                          size=rng.choice([100, 300, 900]))
        placed = placer.place(wants, budget)
        for key, wanted in wants.items():
            assert wanted.floor <= placed.replicas(key) <= max(wanted.replicas, wanted.floor), (key, wanted)
        for group in placed.groups.values():
            assert group.versions and group.tier in ("latency", "batch")
            assert {wants[key].tier for key in group.versions} == {group.tier}
            sizes = {wants[key].weights: wants[key].resident_bytes for key in group.versions}
            assert sum(sizes.values()) <= budget.memory_per_process or len(group.versions) == 1
