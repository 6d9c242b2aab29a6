"""Routing a job to a version (sluice.routing.route): explicit, pin, then weighted hash."""

from __future__ import annotations

from collections import Counter

import pytest

from sluice.errors import Conflict, Forbidden, NotFound, NotServable, ServiceUnavailable
from sluice.routing import ModelInfo, RoutingSnapshot, VersionInfo, hash_unit, route


def version(name: str, state: str = "stable", model: str = "m") -> VersionInfo:
    return VersionInfo(model=model, version=name, state=state, artifact=f"synthetic:?v={name}", sha256="0" * 64)


def snapshot(
    weights: dict[str, float],
    *,
    states: dict[str, str] | None = None,
    pins: dict[tuple[str, str], str] | None = None,
) -> RoutingSnapshot:
    """Model `m` with a version per name in weights or states; a name starting with `ghost` has a
    weight but no version (as a stale weight row would)."""
    states = states or {}
    names = sorted(n for n in set(weights) | set(states) if not n.startswith("ghost"))
    versions = {n: version(n, states.get(n, "stable")) for n in names}
    return RoutingSnapshot(models={"m": ModelInfo(name="m", kind="synthetic", versions=versions, weights=weights)},
                           pins=pins or {})


def test_weighted_distribution_follows_the_weights_over_many_keys() -> None:
    snap = snapshot({"v1": 70.0, "v2": 25.0, "v3": 5.0})
    counts = Counter(route(snap, model="m", tenant="t", routing_key=f"key-{i}").version.version
                     for i in range(10_000))
    assert set(counts) == {"v1", "v2", "v3"}
    for name, share in (("v1", 0.70), ("v2", 0.25), ("v3", 0.05)):
        assert abs(counts[name] / 10_000 - share) < 0.02, counts


def test_weights_need_not_sum_to_100() -> None:
    snap = snapshot({"v1": 1.0, "v2": 1.0})
    counts = Counter(route(snap, model="m", tenant=f"t{i}").version.version for i in range(10_000))
    assert abs(counts["v1"] - 5_000) < 300, counts


def test_the_same_key_always_lands_on_the_same_version() -> None:
    snap = snapshot({"v1": 50.0, "v2": 50.0})
    for i in range(200):
        first = route(snap, model="m", tenant="t", routing_key=f"k{i}")
        again = [route(snap, model="m", tenant="other", routing_key=f"k{i}") for _ in range(3)]
        assert {d.version.version for d in again} == {first.version.version}
        assert first.reason == "weighted"


def test_without_a_routing_key_the_tenant_is_the_key() -> None:
    snap = snapshot({"v1": 50.0, "v2": 50.0})
    for i in range(100):
        by_tenant = route(snap, model="m", tenant=f"tenant{i}")
        by_key = route(snap, model="m", tenant="someone-else", routing_key=f"tenant{i}")
        assert by_tenant.version == by_key.version


def test_a_small_canary_moves_only_a_small_share_of_keys() -> None:
    before = snapshot({"v1": 100.0, "v2": 0.0})
    after = snapshot({"v1": 95.0, "v2": 5.0})
    moved = sum(
        route(before, model="m", tenant="t", routing_key=f"k{i}").version
        != route(after, model="m", tenant="t", routing_key=f"k{i}").version
        for i in range(10_000)
    )
    assert 300 < moved < 700


def test_hash_unit_is_stable_and_in_range() -> None:
    points = [hash_unit("m", f"k{i}") for i in range(1000)]
    assert all(0.0 <= p < 1.0 for p in points)
    assert points == [hash_unit("m", f"k{i}") for i in range(1000)]
    assert hash_unit("m", "k") != hash_unit("other-model", "k")


def test_zero_weights_retired_and_unknown_versions_get_no_traffic() -> None:
    snap = snapshot({"v1": 100.0, "v2": 0.0, "v3": 50.0, "ghost": 50.0}, states={"v3": "retired"})
    seen = {route(snap, model="m", tenant="t", routing_key=f"k{i}").version.version for i in range(2000)}
    assert seen == {"v1"}


def test_explicit_version_is_honoured_even_without_weight() -> None:
    snap = snapshot({"v1": 100.0}, states={"v2": "canary"})
    decision = route(snap, model="m", tenant="t", version="v2")
    assert (decision.version.version, decision.reason) == ("v2", "explicit")


@pytest.mark.parametrize("state", ["staged", "shadow"])
def test_a_tenant_naming_a_staged_or_shadow_version_is_403_not_servable(state: str) -> None:
    snap = snapshot({"v1": 100.0, "v2": 5.0}, states={"v2": state}, pins={("acme", "m"): "v2"})
    for kwargs in ({"tenant": "t", "version": "v2"}, {"tenant": "acme"}, {"tenant": "acme", "version": "v2"}):
        with pytest.raises(NotServable) as raised:
            route(snap, model="m", **kwargs)  # type: ignore[arg-type]
        assert (raised.value.status, raised.value.code) == (403, "not_servable")


@pytest.mark.parametrize("state", ["staged", "shadow"])
def test_an_admin_may_name_a_staged_or_shadow_version(state: str) -> None:
    snap = snapshot({"v1": 100.0}, states={"v2": state}, pins={("admin", "m"): "v2"})
    assert route(snap, model="m", tenant="t", version="v2", admin=True).version.version == "v2"
    assert route(snap, model="m", tenant="admin", admin=True).version.version == "v2"


def test_a_pin_wins_over_weights_and_is_not_moved_by_a_weight_change() -> None:
    pins = {("acme", "m"): "v1"}
    for weights in ({"v1": 100.0, "v2": 0.0}, {"v1": 0.0, "v2": 100.0}, {"v2": 1.0}):
        snap = snapshot(weights, states={"v1": "stable", "v2": "stable"}, pins=pins)
        for i in range(50):
            decision = route(snap, model="m", tenant="acme", routing_key=f"k{i}")
            assert (decision.version.version, decision.reason) == ("v1", "pin")
        # Another tenant is routed by weight.
        assert route(snap, model="m", tenant="other").reason == "weighted"


def test_a_pinned_tenant_may_name_its_own_version() -> None:
    snap = snapshot({"v1": 100.0, "v2": 0.0}, pins={("acme", "m"): "v2"})
    decision = route(snap, model="m", tenant="acme", version="v2")
    assert (decision.version.version, decision.reason) == ("v2", "explicit")


def test_a_pinned_tenant_asking_for_another_version_is_403() -> None:
    snap = snapshot({"v1": 100.0, "v2": 0.0}, pins={("acme", "m"): "v1"})
    with pytest.raises(Forbidden) as raised:
        route(snap, model="m", tenant="acme", version="v2")
    assert raised.value.status == 403


def test_unknown_model_is_404() -> None:
    with pytest.raises(NotFound) as raised:
        route(snapshot({"v1": 100.0}), model="nope", tenant="t")
    assert raised.value.status == 404


def test_unknown_explicit_version_is_404() -> None:
    with pytest.raises(NotFound):
        route(snapshot({"v1": 100.0}), model="m", tenant="t", version="v9")


def test_pin_to_a_version_that_is_gone_is_404() -> None:
    with pytest.raises(NotFound):
        route(snapshot({"v1": 100.0}, pins={("acme", "m"): "v9"}), model="m", tenant="acme")


def test_retired_version_explicit_or_pinned_is_409() -> None:
    snap = snapshot({"v1": 100.0}, states={"v2": "retired"}, pins={("acme", "m"): "v2"})
    with pytest.raises(Conflict) as raised:
        route(snap, model="m", tenant="t", version="v2")
    assert raised.value.status == 409
    with pytest.raises(Conflict):
        route(snap, model="m", tenant="acme")


@pytest.mark.parametrize("weights, states", [
    ({}, {"v1": "stable"}),
    ({"v1": 0.0}, {}),
    ({"v1": 100.0}, {"v1": "retired"}),
    ({"ghost": 100.0}, {"v1": "stable"}),
], ids=["no-weights", "all-zero", "only-retired", "unknown-version"])
def test_no_servable_weighted_version_is_503(weights: dict[str, float], states: dict[str, str]) -> None:
    snap = snapshot(weights, states=states)
    with pytest.raises(ServiceUnavailable) as raised:
        route(snap, model="m", tenant="t")
    assert raised.value.status == 503 and raised.value.code == "no_servable_version"
