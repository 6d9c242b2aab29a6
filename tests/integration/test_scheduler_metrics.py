"""The scheduler's per-version series follow the versions it scales: a version that is retired (or
no longer may have workers) leaves `/metrics` on the next tick instead of exporting its last
numbers until the process ends. Real Redis and Postgres; the scheduler's tick as its loop runs it."""

from __future__ import annotations

from prometheus_client import REGISTRY

from scheduler.main import Scheduler, autoscaler
from sluice.registry import catalog
from sluice.registry.store import Registry
from sluice.settings import Settings
from tests.support import SYNTHETIC_SHA, unique

SERIES = [("sluice_desired_replicas", {}), ("sluice_live_replicas", {}),
          ("sluice_stream_lag", {"lane": "online"}), ("sluice_stream_lag", {"lane": "bulk"})]


def _exported(model: str, version: str) -> dict[tuple[str, str], float | None]:
    return {(name, extra.get("lane", "")): REGISTRY.get_sample_value(name, {"model": model, "version": version,
                                                                          **extra})
            for name, extra in SERIES}


def test_a_retired_versions_series_are_removed(registry: Registry, redis_url: str) -> None:
    model = unique("metrics")
    with registry.session() as session:
        catalog.create_model(session, name=model, kind="synthetic", actor="test")
        for version in ("v1", "v2"):
            catalog.register_version(session, model=model, version=version, artifact="synthetic:?fixed_s=0.001",
                                     sha256=SYNTHETIC_SHA, actor="test", state="stable")
    scheduler = Scheduler(registry=registry, redis_url=redis_url, supervisor=None,
                          autoscaler=autoscaler(Settings(worker_slots=10_000)))
    scheduler.tick()
    assert None not in _exported(model, "v1").values()
    assert _exported(model, "v2")[("sluice_desired_replicas", "")] == 1

    with registry.session() as session:
        catalog.update_version(session, model=model, version="v2", actor="test", reason=None, state="retired")
    scheduler.tick()
    assert set(_exported(model, "v2").values()) == {None}
    assert None not in _exported(model, "v1").values(), "the version still scaled keeps its series"
