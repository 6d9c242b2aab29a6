"""Who reads the operator views: a version's `/stats`, `/stats/series`, `/quality` and `/mix` are
made of every tenant's jobs (their traffic, errors, label mix and input costs), so they answer an admin key only. A
tenant key gets one 403, the same for a model or version that exists and one that does not, and
for a query that would not validate: the key is refused before anything is looked up."""

from __future__ import annotations

from collections.abc import Callable

import httpx
from typer.testing import CliRunner

from launch.cli import app
from launch.seed import Seeded
from tests.support import ApiServer, unique

VIEWS = ("stats", "stats/series", "quality", "mix")
# Each view's query, valid and not: a refused key must not learn which of the two it sent.
QUERIES = ({}, {"window_s": 60, "step_s": 5, "hours": 1, "days": 1},
           {"window_s": 0, "step_s": 0, "hours": 0, "days": 0})


def test_a_tenant_key_gets_the_same_403_on_every_operator_view(
    demo: httpx.Client, new_tenant: Callable[..., tuple[str, httpx.Client]],
    register_synthetic: Callable[..., str],
) -> None:
    model = register_synthetic("visible")
    _, stranger = new_tenant("stranger")
    targets = [(model, "v1"), (model, "v9"), (unique("no-such-model"), "v1")]
    answers = []
    for client in (demo, stranger):
        for name, version in targets:
            for view in VIEWS:
                for query in QUERIES:
                    response = client.get(f"/v1/models/{name}/versions/{version}/{view}", params=query)
                    assert response.status_code == 403, (name, version, view, query, response.text)
                    answers.append(response.json())
    assert all(answer == answers[0] for answer in answers), answers
    error = answers[0]["error"]
    assert error["code"] == "forbidden" and "admin key" in error["message"], error


def test_an_admin_key_reads_every_operator_view(admin: httpx.Client, register_synthetic: Callable[..., str]) -> None:
    model = register_synthetic("visible-admin")
    for view in VIEWS:
        response = admin.get(f"/v1/models/{model}/versions/v1/{view}")
        assert response.status_code == 200, (view, response.text)
        assert (response.json()["model"], response.json()["version"]) == (model, "v1")
        assert admin.get(f"/v1/models/{model}/versions/v9/{view}").status_code == 404
        assert admin.get(f"/v1/models/{unique('no-such-model')}/versions/v1/{view}").status_code == 404


def test_sluice_stats_with_a_tenant_key_says_it_needs_an_admin_key(
    api: ApiServer, seeded: Seeded, register_synthetic: Callable[..., str],
) -> None:
    model = register_synthetic("visible-cli")
    runner = CliRunner()
    tenant = runner.invoke(app, ["stats", model, "v1", "--url", api.url, "--key", seeded.demo_key])
    assert tenant.exit_code == 1 and "admin key" in tenant.output, tenant.output
    operator = runner.invoke(app, ["stats", model, "v1", "--url", api.url, "--key", seeded.admin_key])
    assert operator.exit_code == 0 and f"{model} v1 over 300 s" in operator.output, operator.output
