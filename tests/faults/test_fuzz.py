"""Fuzzing every route of the OpenAPI schema with schemathesis: zero 5xx.

Two passes, each over every operation, in positive (schema-valid) and negative (schema-invalid)
generation modes:
- with the demo tenant's key, against the session's live API (as a tenant sees it);
- with an admin key, against an API of this test's own (a scratch database and a private Redis),
  so that the registry writes it fuzzes (models, versions, routing, tenants, keys, pins) cannot
  disturb the rest of the session.
Path parameters are sometimes drawn at random and sometimes pinned to things that exist (a
synthetic model and its version, a finished job, the demo tenant), so the handlers behind the
404s are reached too. Failures are collected rather than raised, so Hypothesis does not spend the
time budget shrinking them; the assertion lists every one with a curl line to reproduce it.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error

from launch.seed import seed
from sluice.registry.store import Registry
from sluice.settings import Settings
from tests.support import ApiServer, http_client, make_settings, register_synthetic_model

from ._support import RedisServer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("batches_ended_after"), pytest.mark.soak]

MODES = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)


@dataclass
class FuzzReport:
    cases: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    by_operation: dict[str, int] = field(default_factory=dict)

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)


def fuzz(base_url: str, key: str, known: dict[str, str], *, examples_per_operation: int,
         report: FuzzReport) -> None:
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", timeout=10)
    operations = []
    for result in schema.get_all_operations():
        operations.append(result.ok())  # an Err here is a broken schema: let it raise
    assert len(operations) >= 15, [op.label for op in operations]
    headers = {"Authorization": f"Bearer {key}"}
    with requests.Session() as session:
        for operation in operations:
            _fuzz_operation(operation, base_url=base_url, session=session, headers=headers, known=known,
                            examples=examples_per_operation, report=report)


def _fuzz_operation(operation: Any, *, base_url: str, session: requests.Session, headers: dict[str, str],
                    known: dict[str, str], examples: int, report: FuzzReport) -> None:
    names = [p.name for p in operation.path_parameters]
    pinned = {name: known[name] for name in names if name in known}
    strategies = [operation.as_strategy(generation_mode=mode) for mode in MODES]
    if pinned:
        strategies += [operation.as_strategy(generation_mode=mode, path_parameters=pinned) for mode in MODES]

    @given(case=st.one_of(strategies))
    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    def run(case: schemathesis.Case) -> None:
        try:
            response = case.call(base_url=base_url, session=session, headers=headers, timeout=15)
        except requests.RequestException as exc:
            report.failures.append(f"{operation.label}: transport error {exc!r}: "
                                   f"{case.as_curl_command(headers=headers)}")
            return
        report.cases += 1
        report.statuses[response.status_code] = report.statuses.get(response.status_code, 0) + 1
        report.by_operation[operation.label] = report.by_operation.get(operation.label, 0) + 1
        try:
            case.validate_response(response, checks=[not_a_server_error])
        except Exception as exc:  # collected, reported all together below
            report.failures.append(f"{operation.label}: {response.status_code} {response.text[:200]!r} "
                                   f"({type(exc).__name__}) {case.as_curl_command(headers=headers)}")

    run()


def fuzz_and_judge(base_url: str, key: str, known: dict[str, str], *, examples_per_operation: int,
                   figure: Callable[[str, object], None]) -> None:
    """Fuzz, record the figures, then fail listing every failure (at least 200 cases, no 5xx)."""
    report = FuzzReport()
    started = time.monotonic()
    fuzz(base_url, key, known, examples_per_operation=examples_per_operation, report=report)
    figure("cases", report.cases)
    figure("statuses", dict(sorted(report.statuses.items())))
    figure("operations", len(report.by_operation))
    figure("seconds", round(time.monotonic() - started, 1))
    assert report.cases >= 200, report
    assert not report.failures, f"{len(report.failures)} failures in {report.cases} cases:\n" + "\n".join(
        report.failures[:20])
    assert report.server_errors == 0, report.statuses


def _finished_job(api: httpx.Client, model: str) -> str:
    """A job in a final state (cancelled), so long-polls and SSE on it answer at once."""
    response = api.post(f"/v1/models/{model}/jobs", json={"input": {"text": "fuzz target"}})
    assert response.status_code == 202, response.text
    job_id: str = response.json()["id"]
    assert api.delete(f"/v1/jobs/{job_id}").status_code == 200
    return job_id


def test_fuzz_every_route_as_a_tenant_gets_no_5xx(
    api: ApiServer, demo: httpx.Client, register_synthetic: Callable[..., str],
    figure: Callable[[str, object], None],
) -> None:
    model = register_synthetic("fuzz")  # no worker: whatever the fuzzer queues stays queued
    known = {"model": model, "version": "v1", "job_id": _finished_job(demo, model), "tenant": "demo"}
    fuzz_and_judge(api.url, demo.headers["Authorization"].removeprefix("Bearer "), known,
                   examples_per_operation=25, figure=figure)


def test_fuzz_every_route_as_an_admin_gets_no_5xx(
    scratch_database: str, private_redis: RedisServer, tmp_path: Path,
    start_api: Callable[[Settings], ApiServer], figure: Callable[[str, object], None],
) -> None:
    registry = Registry(url=scratch_database, pool_size=1)
    try:
        seeded = seed(registry, home=tmp_path, versions=(),
                      bootstrap_admin_key=f"sk_admin_fuzz_{secrets.token_urlsafe(16)}")
    finally:
        registry.dispose()
    api = start_api(make_settings(redis_url=private_redis.url, database_url=scratch_database, home=tmp_path))
    with http_client(api.url, seeded.admin_key) as admin:
        model = register_synthetic_model(admin, "fz", cost="fixed_s=0.001")
        known = {"model": model, "version": "v1", "job_id": _finished_job(admin, model), "tenant": "demo"}
    fuzz_and_judge(api.url, seeded.admin_key, known, examples_per_operation=20, figure=figure)
