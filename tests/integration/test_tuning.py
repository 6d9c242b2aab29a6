"""The served mix, recorded (workers' tallies → Redis → daily rows and the drift gauge), and the
re-tune job that plans on it, proposes, and applies through the audited PATCH."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, date, datetime
from typing import Any

import httpx
import pytest
import redis
from typer.testing import CliRunner

from launch.cli import app
from launch.seed import Seeded
from scheduler.mix import MixAggregator
from scheduler.planning.capacity_sim import CostModel
from scheduler.planning.retune import Grid
from scheduler.retune import Outcome, retune_all
from sluice.metrics import MIX_DRIFT
from sluice.mix import Mix
from sluice.registry import mix as mix_rows
from sluice.registry.store import Registry
from sluice.wire import connections, keys
from sluice.wire import mix as wire_mix
from sluice.wire.mix import Pass, Tally
from sluice_client import SluiceClient
from tests.support import ApiServer, wait_until

DAY = 1_900_022_400.0  # 2030-03-18 00:00 UTC
NOW = DAY + 10 * 3600.0
COST = CostModel(fixed_s=0.008, per_item_s=0.0002, per_token_s=0.00003, cold_start_s=0.0)
GRID = Grid(batch_sizes=(2, 8, 32), waits_ms=(0.0, 20.0), fractions=(0.5, 0.8, 0.95), phase_s=5.0)
SHORT = [12] * 80 + [24] * 20
LONG = [12] * 20 + [300] * 80


def _flush(redis_url: str, model: str, tally: Tally) -> None:
    async def run() -> None:
        client = connections.connect(redis_url)
        try:
            await tally.flush(client, model, "v1")
        finally:
            await client.aclose()

    asyncio.run(run())


def _served(redis_url: str, model: str, *, at: float, costs: list[int], lane: str = "online",
            passes: bool = True) -> None:
    """What a worker's tally flushes after serving `costs`, with passes timed at `COST`."""
    tally = Tally()
    tally.served(at=at, lane=lane, costs=costs)  # type: ignore[arg-type]
    if passes:
        for size in (1, 2, 4, 8, 16, 32):
            for longest in (16, 32, 64, 300):
                tally.passed(Pass(size=size, longest=longest, seconds=COST.batch_s(size, longest)))
    _flush(redis_url, model, tally)


def test_a_tally_folds_into_one_row_per_day_and_lane_and_the_same_row_again(
    registry: Registry, rds: redis.Redis, redis_url: str, register_synthetic: Callable[..., str],
    admin: httpx.Client, api: ApiServer, seeded: Seeded,
) -> None:
    model = register_synthetic("mix")
    _served(redis_url, model, at=NOW - 20 * 3600, costs=[3, 3, 40], passes=False)  # the day before
    _served(redis_url, model, at=NOW, costs=[3, 600], passes=False)
    _served(redis_url, model, at=NOW, costs=[5], lane="bulk", passes=False)
    _served(redis_url, model, at=NOW - 60 * 3600, costs=[7], passes=False)  # past the hours kept
    assert rds.hget(keys.mix(model, "v1"), f"{wire_mix.hour_of(NOW)}:online:4") == "1"

    async def flush_twice() -> tuple[int, int]:
        client = connections.connect(redis_url)
        try:
            aggregator = MixAggregator(registry=registry, redis=client, clock=lambda: NOW)
            return await aggregator.flush(), await aggregator.flush()
        finally:
            await client.aclose()

    first, second = asyncio.run(flush_twice())
    assert first == second == 3
    with registry.session() as session:
        rows = mix_rows.days(session, model=model, version="v1", since=date(2030, 1, 1))
    assert rows == [
        (date(2030, 3, 17), "online", Mix.of_costs([3, 3, 40])),
        (date(2030, 3, 18), "bulk", Mix.of_costs([5])),
        (date(2030, 3, 18), "online", Mix.of_costs([3, 600])),
    ]
    response = admin.get(f"/v1/models/{model}/versions/v1/mix", params={"days": 30})
    assert response.status_code == 200, response.text
    assert response.json()["days"] == [
        {"day": "2030-03-17", "lane": "online", "total": 3, "counts": {"4": 2, "64": 1}},
        {"day": "2030-03-18", "lane": "bulk", "total": 1, "counts": {"8": 1}},
        {"day": "2030-03-18", "lane": "online", "total": 2, "counts": {"4": 1, "1024": 1}},
    ]
    assert response.json()["buckets"][-1] == "inf"
    with SluiceClient(base_url=api.url, api_key=seeded.admin_key) as sluice:
        assert sluice.mix(model, "v1", days=30) == response.json()
    # The hour past the 48 kept is forgotten; the others stay for the open day's next fold.
    fields: list[str] = rds.hkeys(keys.mix(model, "v1"))  # type: ignore[assignment]
    assert fields and not any(f.startswith(f"{wire_mix.hour_of(NOW - 60 * 3600)}:") for f in fields)


def _budget(admin: httpx.Client, model: str, **tuning: object) -> dict[str, object]:
    response = admin.patch(f"/v1/models/{model}/versions/v1", json={"tuning": tuning, "reason": "test"})
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def _retune(registry: Registry, redis_url: str, *, at: float, min_gain: float = 0.05) -> list[Outcome]:
    async def run() -> list[Outcome]:
        client = connections.connect(redis_url)
        try:
            return list(await retune_all(registry=registry, redis=client, min_gain=min_gain, batch_timeout_s=120.0,
                                         clock=lambda: at, grid=GRID))
        finally:
            await client.aclose()

    return asyncio.run(run())


def _version(admin: httpx.Client, model: str) -> dict[str, object]:
    response = admin.get(f"/v1/models/{model}/versions/v1")
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def test_a_version_tuned_on_short_texts_gets_another_proposal_when_its_mix_turns_long(
    registry: Registry, redis_url: str, admin: httpx.Client, register_synthetic: Callable[..., str],
) -> None:
    model = register_synthetic("retune", max_batch_size=8, max_wait_ms=0.0)
    assert _version(admin, model)["batching"]["p99_budget_ms"] is None  # type: ignore[index]
    # No budget: not re-tuned.
    assert not [o for o in _retune(registry, redis_url, at=NOW) if o.model == model]
    _budget(admin, model, p99_budget_ms=150.0)
    _served(redis_url, model, at=NOW, costs=SHORT)
    outcome, = [o for o in _retune(registry, redis_url, at=NOW) if o.model == model]
    assert outcome.action == "proposed", outcome
    batching = _version(admin, model)["batching"]
    proposal = batching["proposal"]  # type: ignore[index]
    assert proposal["on"]["mix"] == Mix.of_costs(SHORT).to_mapping()
    assert batching["tuned_at"] is None  # type: ignore[index]

    applied = admin.patch(f"/v1/models/{model}/versions/v1", json={"apply_proposal": True, "reason": "tuned"})
    assert applied.status_code == 200, applied.text
    body = applied.json()
    short_setting = (proposal["max_batch_size"], proposal["max_wait_ms"])
    assert (body["batching"]["max_batch_size"], body["batching"]["max_wait_ms"]) == short_setting
    assert body["batching"]["tuned_on"] == proposal["on"]
    assert body["batching"]["tuned_at"] is not None
    assert body["audit"]["action"] == "version.update"

    # Two days later the mix has turned long: one run proposes another setting.
    later = NOW + 2 * 86_400
    _served(redis_url, model, at=later, costs=LONG)
    _retune(registry, redis_url, at=later)
    resource = _version(admin, model)
    moved = resource["batching"]["proposal"]  # type: ignore[index]
    assert (moved["max_batch_size"], moved["max_wait_ms"]) != short_setting
    assert moved["on"]["mix"] == Mix.of_costs(LONG).to_mapping()
    assert moved["gain"] is None or moved["gain"] > 0
    # Not auto_tune: proposed, not applied.
    assert (resource["batching"]["max_batch_size"], resource["batching"]["max_wait_ms"]) == short_setting  # type: ignore[index]


def test_auto_tune_applies_a_proposal_through_the_audited_patch_and_dates_it(
    registry: Registry, redis_url: str, admin: httpx.Client, register_synthetic: Callable[..., str],
    api: ApiServer, seeded: Seeded,
) -> None:
    model = register_synthetic("autotune", max_batch_size=2, max_wait_ms=0.0)
    _budget(admin, model, p99_budget_ms=150.0, auto_tune=True)
    _served(redis_url, model, at=NOW, costs=SHORT)
    outcome, = [o for o in _retune(registry, redis_url, at=NOW) if o.model == model]
    assert outcome.action == "applied", outcome
    batching = _version(admin, model)["batching"]
    proposal = batching["proposal"]  # type: ignore[index]
    assert (batching["max_batch_size"], batching["max_wait_ms"]) == (  # type: ignore[index]
        proposal["max_batch_size"], proposal["max_wait_ms"])
    assert batching["tuned_at"] == datetime.fromtimestamp(NOW, tz=UTC).isoformat()  # type: ignore[index]
    assert batching["drift"] == {"online": 0.0}  # type: ignore[index]
    audit = admin.get(f"/v1/models/{model}/audit").json()
    entries = audit["entries"] if isinstance(audit, dict) else audit
    assert any(e["actor"] == "scheduler:retune" and e["action"] == "version.update" for e in entries)

    listed = CliRunner().invoke(app, ["tune", "status", "--url", api.url, "--key", seeded.admin_key])
    assert listed.exit_code == 0, listed.output
    assert f"{model} v1: batch {proposal['max_batch_size']}, " in listed.output
    assert "p99 budget 150 ms, auto_tune on" in listed.output

    # The drift gauge once the aggregator has seen the tuned version's mix turn long.
    _served(redis_url, model, at=NOW + 3600, costs=LONG * 9, passes=False)

    async def fold() -> None:
        client = connections.connect(redis_url)
        try:
            await MixAggregator(registry=registry, redis=client, clock=lambda: NOW + 3600).flush()
        finally:
            await client.aclose()

    asyncio.run(fold())
    drift = MIX_DRIFT.labels(model, "v1", "online")._value.get()
    assert 0.5 < drift <= 1.0


def test_applying_without_a_proposal_is_a_conflict(admin: httpx.Client,
                                                   register_synthetic: Callable[..., str]) -> None:
    model = register_synthetic("noproposal")
    response = admin.patch(f"/v1/models/{model}/versions/v1", json={"apply_proposal": True})
    assert response.status_code == 409, response.text
    response = admin.patch(f"/v1/models/{model}/versions/v1", json={"tuning": {"p99_budget_ms": 0}})
    assert response.status_code == 422


@pytest.mark.parametrize("body", [{"apply_proposal": True}, {"tuning": {"p99_budget_ms": 100.0}}])
def test_a_tenant_key_may_not_tune_and_learns_nothing_of_a_version_that_is_not_there(
    client_for: Callable[[str], httpx.Client], seeded: Seeded, admin: httpx.Client,
    register_synthetic: Callable[..., str], body: dict[str, object],
) -> None:
    model = register_synthetic("tenanttune")
    tenant = client_for(seeded.demo_key)
    there = tenant.patch(f"/v1/models/{model}/versions/v1", json=body)
    missing = tenant.patch(f"/v1/models/{model}/versions/v9", json=body)
    assert there.status_code == missing.status_code == 403
    assert there.json() == missing.json()


@pytest.mark.slow
def test_a_worker_counts_what_it_ran_by_cost_and_records_its_passes(
    demo: httpx.Client, register_synthetic: Callable[..., str], start_worker: Callable[..., Any],
    wait_jobs: Callable[..., list[dict[str, Any]]], rds: redis.Redis,
) -> None:
    model = register_synthetic("counted", max_batch_size=8, max_wait_ms=20)
    texts = ["short text"] * 30 + [" ".join(["word"] * 200)] * 10
    response = demo.post(f"/v1/models/{model}/jobs:bulk", json={"inputs": [{"text": t} for t in texts]})
    assert response.status_code == 202, response.text
    start_worker(model)
    jobs = wait_jobs(demo, response.json()["ids"])
    assert {job["status"] for job in jobs} == {"succeeded"}

    def counted() -> int:
        return sum(int(v) for v in rds.hvals(keys.mix(model, "v1")))  # type: ignore[union-attr]

    wait_until(lambda: counted() == len(texts), timeout_s=15.0, what="every input counted")
    fields: dict[str, str] = rds.hgetall(keys.mix(model, "v1"))  # type: ignore[assignment]
    assert {field.split(":")[1] for field in fields} == {"bulk"}
    # Two costs far apart: the short texts and the long ones land in different buckets.
    assert len(fields) == 2 and sorted(int(v) for v in fields.values()) == [10, 30]
    assert 0 < rds.ttl(keys.mix(model, "v1")) <= wire_mix.KEEP_HOURS * wire_mix.HOUR_S  # type: ignore[operator]
    passes = rds.xrange(keys.passes(model, "v1"))
    assert sum(int(entry["n"]) for _, entry in passes) == len(texts)  # type: ignore[index]
    assert all(1 <= int(entry["n"]) <= 8 and float(entry["s"]) > 0 for _, entry in passes)  # type: ignore[index]
