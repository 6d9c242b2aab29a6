"""The circuit breaker's state machine, breaker-aware routing, shadow sampling, quality proxies."""

from __future__ import annotations

import pytest

from sluice.breaker import BreakerState, CircuitBreaker, Health
from sluice.errors import ServiceUnavailable
from sluice.quality import LOW_CONFIDENCE_P, agreement, proxies, summarise_quality
from sluice.routing import ModelInfo, RoutingSnapshot, VersionInfo, route, shadow_target


def _breaker() -> CircuitBreaker:
    return CircuitBreaker(error_rate=0.5, min_samples=10, window_s=30, no_worker_grace_s=5, open_s=10,
                          probe_every_s=1)


def _outcomes(at: float, ok: int, failed: int) -> list[tuple[float, bool]]:
    return [(at, True)] * ok + [(at, False)] * failed


def test_error_rate_opens_only_with_enough_samples() -> None:
    breaker = _breaker()
    assert breaker.observe(100, Health(live_workers=1, outcomes=_outcomes(99, 0, 9))) is BreakerState.closed
    assert breaker.observe(101, Health(live_workers=1, outcomes=_outcomes(100, 5, 5))) is BreakerState.open
    assert "error rate" in breaker.reason
    assert not breaker.admits(101)


def test_low_error_rate_stays_closed() -> None:
    breaker = _breaker()
    assert breaker.observe(100, Health(live_workers=2, outcomes=_outcomes(99, 60, 20))) is BreakerState.closed
    assert breaker.admits(100)


def test_old_outcomes_fall_out_of_the_window() -> None:
    breaker = _breaker()
    assert breaker.observe(100, Health(live_workers=1, outcomes=_outcomes(50, 0, 50))) is BreakerState.closed


def test_no_live_workers_opens_after_the_grace_period() -> None:
    breaker = _breaker()
    assert breaker.observe(0, Health(live_workers=0, outcomes=[])) is BreakerState.closed
    assert breaker.observe(4.9, Health(live_workers=0, outcomes=[])) is BreakerState.closed
    assert breaker.observe(5.0, Health(live_workers=0, outcomes=[])) is BreakerState.open
    assert breaker.reason == "no live workers"


def test_a_version_the_scheduler_scaled_to_zero_is_waiting_not_broken() -> None:
    breaker = _breaker()
    for now in (0.0, 5.0, 60.0):
        assert breaker.observe(now, Health(live_workers=0, outcomes=[], scaled_to_zero=True)) is BreakerState.closed
    # Once the scheduler wants workers again, their absence counts from then.
    assert breaker.observe(61.0, Health(live_workers=0, outcomes=[])) is BreakerState.closed
    assert breaker.observe(66.0, Health(live_workers=0, outcomes=[])) is BreakerState.open


def test_a_worker_coming_back_resets_the_grace_period() -> None:
    breaker = _breaker()
    breaker.observe(0, Health(live_workers=0, outcomes=[]))
    breaker.observe(3, Health(live_workers=1, outcomes=[]))
    assert breaker.observe(7, Health(live_workers=0, outcomes=[])) is BreakerState.closed


def test_half_open_probe_success_closes_and_old_errors_do_not_reopen() -> None:
    breaker = _breaker()
    failures = _outcomes(100, 0, 20)
    breaker.observe(100, Health(live_workers=1, outcomes=failures))
    assert breaker.observe(109, Health(live_workers=1, outcomes=failures)) is BreakerState.open
    assert breaker.observe(110, Health(live_workers=1, outcomes=failures)) is BreakerState.half_open
    assert breaker.take_probe(110.0)
    assert not breaker.admits(110.5) and not breaker.take_probe(110.5), "one probe per probe interval"
    assert breaker.take_probe(111.0)
    probe = [*failures, (111.5, True)]
    assert breaker.observe(112, Health(live_workers=1, outcomes=probe)) is BreakerState.closed
    assert breaker.observe(113, Health(live_workers=1, outcomes=probe)) is BreakerState.closed


def _half_open() -> CircuitBreaker:
    breaker = _breaker()
    breaker.observe(100, Health(live_workers=1, outcomes=_outcomes(100, 0, 20)))
    breaker.observe(110, Health(live_workers=1, outcomes=[]))
    assert breaker.state is BreakerState.half_open
    return breaker


def test_asking_whether_a_half_open_breaker_admits_spends_no_probe() -> None:
    breaker = _half_open()
    assert all(breaker.admits(110.0 + i / 100) for i in range(50))
    assert breaker.take_probe(110.5), "only the job routed to the version takes the slot"
    assert not breaker.admits(110.6)


def test_a_closed_breaker_has_no_probe_to_take() -> None:
    breaker = _breaker()
    assert not breaker.take_probe(100.0)
    assert breaker.admits(100.0)


def test_a_returned_probe_frees_the_slot_unless_a_later_one_holds_it() -> None:
    breaker = _half_open()
    assert breaker.take_probe(110.0)
    breaker.return_probe(110.0)
    assert breaker.admits(110.2) and breaker.take_probe(110.2)
    # A probe returned after a later one was taken leaves the later one's slot alone.
    assert breaker.take_probe(111.3)
    breaker.return_probe(110.2)
    assert not breaker.admits(111.5)


def test_half_open_probe_failure_reopens() -> None:
    breaker = _breaker()
    breaker.observe(100, Health(live_workers=1, outcomes=_outcomes(100, 0, 20)))
    breaker.observe(110, Health(live_workers=1, outcomes=[]))
    assert breaker.state is BreakerState.half_open
    assert breaker.observe(112, Health(live_workers=1, outcomes=[(111, False)])) is BreakerState.open
    assert breaker.reason == "half-open probe failed"


def _snapshot(states: dict[str, str], weights: dict[str, float]) -> RoutingSnapshot:
    versions = {v: VersionInfo(model="m", version=v, state=s, artifact="a", sha256="0" * 64) for v, s in states.items()}
    return RoutingSnapshot(models={"m": ModelInfo(name="m", kind="synthetic", versions=versions, weights=weights)},
                           pins={("pinned", "m"): "v2"})


def test_unpinned_traffic_of_an_open_version_falls_back_to_stable() -> None:
    snapshot = _snapshot({"v1": "stable", "v2": "canary"}, {"v2": 100})
    assert route(snapshot, model="m", tenant="t").version.version == "v2"
    decision = route(snapshot, model="m", tenant="t", blocked={"v2"})
    assert (decision.version.version, decision.reason, decision.fallback_from) == ("v1", "fallback", "v2")


def test_pinned_and_explicit_callers_get_503_naming_the_open_version() -> None:
    snapshot = _snapshot({"v1": "stable", "v2": "canary"}, {"v1": 100})
    for kwargs in ({"tenant": "pinned"}, {"tenant": "t", "version": "v2"}):
        with pytest.raises(ServiceUnavailable, match="'v2'") as caught:
            route(snapshot, model="m", blocked={"v2"}, **kwargs)  # type: ignore[arg-type]
        assert caught.value.headers["Retry-After"]


def test_without_a_healthy_stable_version_the_job_stays_where_it_was_routed() -> None:
    snapshot = _snapshot({"v1": "stable", "v2": "canary"}, {"v2": 100})
    assert route(snapshot, model="m", tenant="t", blocked={"v1", "v2"}).version.version == "v2"


def test_a_shadow_version_never_serves_and_samples_its_weight_as_a_percentage() -> None:
    snapshot = _snapshot({"v1": "stable", "v2": "shadow"}, {"v1": 100, "v2": 25})
    for key in ("a", "b", "c", "d"):
        assert route(snapshot, model="m", tenant=key).version.version == "v1"
    stable = snapshot.models["m"].versions["v1"]
    assert shadow_target(snapshot, model="m", primary=stable, point=0.249) == "v2"
    assert shadow_target(snapshot, model="m", primary=stable, point=0.25) is None
    canary = VersionInfo(model="m", version="v3", state="canary", artifact="a", sha256="0" * 64)
    assert shadow_target(snapshot, model="m", primary=canary, point=0.0) is None


def test_quality_proxies_and_agreement() -> None:
    classified = {"label": "billing", "scores": {"billing": 0.7, "refund": 0.3}}
    assert proxies(classified, encoded_size=60) == {"size": 60, "top_p": 0.7, "label": "billing"}
    assert proxies({"embedding": [1.0, 0.0], "dim": 2}, encoded_size=30) == {"size": 30}
    assert agreement({"embedding": [1.0, 0.0]}, {"embedding": [1.0, 1.0]}) == pytest.approx(2 ** -0.5, abs=1e-6)
    assert agreement({"embedding": [1.0, 0.0]}, {"embedding": [-1.0, 0.0]}) == 0.0
    assert agreement({"embedding": [1.0]}, {"embedding": [1.0, 0.0]}) is None
    assert agreement(classified, {"label": "refund", "scores": {}}) == 0.0
    assert agreement({"echo": 1}, {"echo": 1}) == 1.0


def test_quality_summary() -> None:
    summary = summarise_quality([
        {"size": 10, "top_p": 0.9, "label": "a"}, {"size": 20, "top_p": LOW_CONFIDENCE_P - 0.1, "label": "b"},
        {"size": 30, "top_p": 0.8, "label": "a", "agreement": 0.5}, {"size": 40, "agreement": 1.0},
    ])
    assert summary["output_size_mean"] == 25
    assert summary["mean_top_p"] == pytest.approx((0.9 + 0.4 + 0.8) / 3, abs=1e-6)
    assert summary["low_confidence_rate"] == pytest.approx(1 / 3, abs=1e-6)
    assert summary["label_counts"] == {"a": 2, "b": 1}
    assert summary["mean_agreement"] == 0.75 and summary["agreement_n"] == 2
    assert summarise_quality([]) == {}
