"""The published schema describes what the API answers (api/response_models.py).

`/openapi.json` names a response model for every resource route, and real bodies from the
running API (a queued, a cancelled, a succeeded and a failed job, a model, a version, stats)
validate against the published schema: every required key present, none undocumented.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import jsonschema_rs
import pytest

pytestmark = pytest.mark.slow

# (method, path, status) -> the component schema the response names.
RESOURCE_ROUTES = {
    ("post", "/v1/models/{model}/jobs", "202"): "JobResource",
    ("post", "/v1/models/{model}/jobs:bulk", "202"): "BulkAccepted",
    ("get", "/v1/jobs/{job_id}", "200"): "JobResource",
    ("delete", "/v1/jobs/{job_id}", "200"): "JobResource",
    ("get", "/v1/jobs", "200"): "JobSet",
    ("get", "/v1/models", "200"): "ModelList",
    ("post", "/v1/models", "201"): "ModelResource",
    ("get", "/v1/models/{model}", "200"): "ModelResource",
    ("post", "/v1/models/{model}/versions", "201"): "VersionResource",
    ("get", "/v1/models/{model}/versions/{version}", "200"): "VersionResource",
    ("patch", "/v1/models/{model}/versions/{version}", "200"): "VersionChange",
    ("put", "/v1/models/{model}/routing", "200"): "RoutingChange",
    ("post", "/v1/models/{model}/rollback", "200"): "RoutingChange",
    ("get", "/v1/models/{model}/versions/{version}/stats", "200"): "StatsResource",
    ("post", "/v1/models/{model}/rollouts", "201"): "RolloutResource",
    ("get", "/v1/models/{model}/rollouts", "200"): "RolloutList",
    ("get", "/v1/models/{model}/rollouts/current", "200"): "RolloutResource",
    ("delete", "/v1/models/{model}/rollouts/current", "200"): "RolloutResource",
    ("post", "/v1/tenants/{tenant}/webhook-secret:rotate", "200"): "WebhookSecretRotation",
    ("patch", "/v1/tenants/{tenant}", "200"): "TenantShare",
}


@pytest.fixture(scope="module")
def spec(anon: httpx.Client) -> dict[str, Any]:
    response = anon.get("/openapi.json")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def conforms(spec: dict[str, Any], name: str, body: Any) -> None:
    """`body` validates against component `name`, and every object in it has only documented keys."""
    schemas = spec["components"]["schemas"]
    validator = jsonschema_rs.Draft202012Validator(
        {"$ref": f"#/components/schemas/{name}", "components": spec["components"]})
    errors = [f"{e.instance_path}: {e.message}" for e in validator.iter_errors(body)]
    assert not errors, errors

    def documented(schema: dict[str, Any], value: Any, where: str) -> None:
        if "$ref" in schema:
            schema = schemas[schema["$ref"].rsplit("/", 1)[1]]
        if "properties" in schema and isinstance(value, dict):
            assert set(schema.get("required", [])) <= set(value), (where, schema.get("required"), list(value))
            undocumented = set(value) - set(schema["properties"])
            assert not undocumented, f"{where}: {sorted(undocumented)} not in the schema of {schema.get('title')}"
            for key, item in value.items():
                documented(schema["properties"][key], item, f"{where}.{key}")
        if schema.get("type") == "array" and isinstance(value, list):
            for i, item in enumerate(value):
                documented(schema["items"], item, f"{where}[{i}]")
        for option in schema.get("anyOf", []):
            if ("$ref" in option or "properties" in option) and value is not None:
                documented(option, value, where)

    documented({"$ref": f"#/components/schemas/{name}"}, body, "$")


def test_the_schema_names_a_model_for_every_resource_route(spec: dict[str, Any]) -> None:
    for (method, path, status), name in RESOURCE_ROUTES.items():
        responses = spec["paths"][path][method]["responses"]
        assert status in responses, (method, path, sorted(responses))
        schema = responses[status]["content"]["application/json"]["schema"]
        assert schema == {"$ref": f"#/components/schemas/{name}"}, (method, path, schema)
    job = spec["components"]["schemas"]["JobResource"]
    assert set(job["required"]) == {"id", "status", "model", "version", "lane", "cache_hit", "attempts",
                                    "timings", "batch"}
    assert {"output", "error", "metadata"} <= set(job["properties"])
    timings = spec["components"]["schemas"]["Timings"]
    # Every timing is present, null until known, but the cold start of a job that woke its version.
    assert set(timings["required"]) == set(timings["properties"]) - {"cold_start_ms"}, timings["required"]
    assert timings["properties"]["cold_start_ms"]["type"] == "number"


def test_real_job_resources_validate_against_the_published_schema(
    spec: dict[str, Any], demo: httpx.Client, admin: httpx.Client, register_synthetic: Callable[..., str],
    start_worker: Callable[..., Any], wait_jobs: Callable[..., list[dict[str, Any]]],
) -> None:
    model = register_synthetic("schema")
    submitted = demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": "hello"}, "metadata": {"n": 1}})
    assert submitted.status_code == 202, submitted.text
    assert submitted.headers["Location"] == f"/v1/jobs/{submitted.json()['id']}"
    conforms(spec, "JobResource", submitted.json())

    to_cancel = demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": "bye"}}).json()["id"]
    queued = demo.get(f"/v1/jobs/{to_cancel}").json()
    conforms(spec, "JobResource", queued)
    assert queued["timings"]["started_at"] is None and "output" not in queued and "metadata" not in queued
    cancelled = demo.delete(f"/v1/jobs/{to_cancel}")
    assert cancelled.status_code == 200, cancelled.text
    conforms(spec, "JobResource", cancelled.json())

    bulk = demo.post(f"/v1/models/{model}/jobs:bulk", json={"inputs": [{"text": "a"}, {"text": "__poison__"}]})
    assert bulk.status_code == 202, bulk.text
    conforms(spec, "BulkAccepted", bulk.json())

    start_worker(model)
    done, ok, poisoned = wait_jobs(demo, [submitted.json()["id"], *bulk.json()["ids"]])
    assert (done["status"], ok["status"], poisoned["status"]) == ("succeeded", "succeeded", "failed")
    assert done["metadata"] == {"n": 1} and "output" in done and "error" in poisoned
    for job in (done, ok, poisoned):
        conforms(spec, "JobResource", job)
    listed = [done["id"], ok["id"], poisoned["id"], to_cancel, "job_unknown"]
    sorted_out = demo.get("/v1/jobs", params={"ids": ",".join(listed)})
    assert sorted_out.status_code == 200, sorted_out.text
    assert len(sorted_out.json()["jobs"]) == 4 and sorted_out.json()["not_found"] == ["job_unknown"]
    conforms(spec, "JobSet", sorted_out.json())

    stats = admin.get(f"/v1/models/{model}/versions/v1/stats")
    assert stats.status_code == 200, stats.text
    conforms(spec, "StatsResource", stats.json())
    conforms(spec, "ModelResource", demo.get(f"/v1/models/{model}").json())
    conforms(spec, "VersionResource", demo.get(f"/v1/models/{model}/versions/v1").json())
    conforms(spec, "ModelList", demo.get("/v1/models").json())
