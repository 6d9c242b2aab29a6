"""deploy/kubernetes/ checked without a cluster: every object parses into the official client's
models with nothing dropped (a misspelled field would be), the kustomizations point at what
exists, and the parts the platform relies on (probes, drain, requests, scrape annotations, the
scheduler's rights, the worker template and its group copies) are there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
BASE = DEPLOY / "base"
OVERLAY = DEPLOY / "overlays" / "production"
MODELS = {"Deployment": "V1Deployment", "Service": "V1Service", "ConfigMap": "V1ConfigMap", "Secret": "V1Secret",
          "Job": "V1Job", "PersistentVolumeClaim": "V1PersistentVolumeClaim", "ServiceAccount": "V1ServiceAccount",
          "Role": "V1Role", "RoleBinding": "V1RoleBinding"}
SCRAPED = {"api", "worker", "scheduler", "celery", "flower"}


def _docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _kustomization(folder: Path) -> dict[str, Any]:
    return _docs(folder / "kustomization.yaml")[0]


def _base_objects() -> list[dict[str, Any]]:
    """The objects of the base's own files (a folder it includes is a kustomization of its own)."""
    return [doc for entry in _kustomization(BASE)["resources"] if (BASE / entry).is_file()
            for doc in _docs(BASE / entry)]


def _by_component(kind: str = "Deployment") -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for doc in _base_objects():
        if doc["kind"] == kind:
            found.setdefault(doc["metadata"]["labels"]["app.kubernetes.io/component"], []).append(doc)
    return found


def _pod_specs() -> list[tuple[str, dict[str, Any]]]:
    return [(doc["metadata"]["name"], doc["spec"]["template"]) for doc in _base_objects()
            if doc["kind"] in {"Deployment", "Job"}]


def _config() -> dict[str, str]:
    return next(doc["data"] for doc in _base_objects() if doc["kind"] == "ConfigMap")


@pytest.mark.parametrize("path", sorted(DEPLOY.rglob("*.yaml")), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_document_parses(path: Path) -> None:
    assert _docs(path)


def _full_objects() -> list[dict[str, Any]]:
    return _base_objects() + _docs(BASE / "secret.example.yaml")


@pytest.mark.parametrize("doc", _full_objects(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_every_object_is_the_client_model_with_no_field_dropped(doc: dict[str, Any]) -> None:
    api = client.ApiClient()
    model = getattr(client, MODELS[doc["kind"]]).from_dict(doc)
    assert api.sanitize_for_serialization(model) == doc


def test_the_kustomizations_name_files_that_exist_and_patch_objects_of_the_base() -> None:
    base = _kustomization(BASE)
    assert all((BASE / entry).is_file() or (BASE / entry / "kustomization.yaml").is_file()
               for entry in base["resources"])
    overlay = _kustomization(OVERLAY)
    assert [(OVERLAY / entry).resolve() for entry in overlay["resources"]] == [BASE.resolve()]
    objects = _base_objects()
    for patch in overlay["patches"]:
        target = _docs(OVERLAY / patch["path"])[0]
        selector = patch.get("target", {}).get("labelSelector")
        if selector:
            label, value = selector.split("=")
            matched = [o for o in objects if o["kind"] == target["kind"]
                       and o["metadata"].get("labels", {}).get(label) == value]
        else:
            matched = [o for o in objects if (o["kind"], o["metadata"]["name"]) ==
                       (target["kind"], target["metadata"]["name"])]
        assert matched, patch
        containers = {c["name"] for o in matched for c in o["spec"]["template"]["spec"]["containers"]}
        assert {c["name"] for c in target["spec"]["template"]["spec"]["containers"]} <= containers
    names = {o["metadata"]["name"] for o in objects}
    assert {entry["name"] for entry in overlay["replicas"]} <= names
    images = {c["image"] for _, pod in _pod_specs() for c in pod["spec"]["containers"]}
    assert images == {entry["name"] for entry in overlay["images"]}


def test_the_api_drains_before_it_is_killed() -> None:
    (api,) = _by_component()["api"]
    pod = api["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    port = container["ports"][0]["name"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port}
    sleep = container["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] > int(sleep[1]) + float(_config()["SLUICE_SHUTDOWN_GRACE_S"])


def test_every_pod_that_stops_gracefully_outlasts_the_drain() -> None:
    grace = float(_config()["SLUICE_SHUTDOWN_GRACE_S"])
    for component in ("worker", "scheduler", "celery"):
        for deployment in _by_component()[component]:
            assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > grace


@pytest.mark.parametrize("name,pod", _pod_specs(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_container_requests_cpu_and_memory(name: str, pod: dict[str, Any]) -> None:
    spec = pod["spec"]
    for container in [*spec.get("initContainers", []), *spec["containers"]]:
        assert {"cpu", "memory"} <= container["resources"]["requests"].keys(), (name, container["name"])


def test_every_metrics_serving_pod_is_annotated_for_prometheus() -> None:
    config = _config()
    assert (config["SLUICE_METRICS_HOST"], config["SLUICE_METRICS_PORT"]) == ("0.0.0.0", "9100")
    deployments = _by_component()
    assert deployments.keys() >= SCRAPED
    for component in SCRAPED:
        for deployment in deployments[component]:
            pod = deployment["spec"]["template"]
            annotations = pod["metadata"]["annotations"]
            ports = {p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
            assert annotations["prometheus.io/scrape"] == "true"
            assert annotations["prometheus.io/path"] == "/metrics"
            assert int(annotations["prometheus.io/port"]) in ports
            if component in {"worker", "scheduler", "celery"}:
                assert annotations["prometheus.io/port"] == config["SLUICE_METRICS_PORT"]


def test_the_scheduler_scales_with_its_own_rights() -> None:
    (scheduler,) = _by_component()["scheduler"]
    pod = scheduler["spec"]["template"]["spec"]
    assert pod["containers"][0]["args"] == ["sluice", "scheduler", "--actuator", "kubernetes"]
    objects = {(o["kind"], o["metadata"]["name"]): o for o in _base_objects()}
    account = pod["serviceAccountName"]
    assert ("ServiceAccount", account) in objects
    binding = next(o for o in objects.values() if o["kind"] == "RoleBinding"
                   and {"kind": "ServiceAccount", "name": account} in o["subjects"])
    role = objects[("Role", binding["roleRef"]["name"])]
    granted = {(resource, verb) for rule in role["rules"] if "apps" in rule["apiGroups"]
               for resource in rule["resources"] for verb in rule["verbs"]}
    # It copies the template and deletes its copies; it never edits a Deployment's pods.
    assert {("deployments", verb) for verb in ("get", "list", "create", "delete")} <= granted
    assert not {verb for _, verb in granted} & {"patch", "update", "*"}


def test_the_worker_template_runs_no_pod_and_its_copies_serve_their_group() -> None:
    from scheduler.kubernetes import DEFAULT_TEMPLATE, group_deployment

    (template,) = _by_component()["worker"]
    assert template["metadata"]["name"] == DEFAULT_TEMPLATE and template["spec"]["replicas"] == 0
    copy = group_deployment(template, name=f"{DEFAULT_TEMPLATE}-g7", group="g7", threads=2)
    assert copy["spec"]["replicas"] == 1 and copy["metadata"]["name"] == "sluice-worker-g7"
    assert copy["spec"]["selector"]["matchLabels"]["sluice.dev/group"] == "g7"
    assert copy["spec"]["template"]["metadata"]["labels"]["sluice.dev/group"] == "g7"
    # The template's selector matches none of a group's pods: two Deployments never fight over one.
    assert template["spec"]["selector"]["matchLabels"]["sluice.dev/group"] == "template"
    container = copy["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["sluice", "worker", "--group", "$(SLUICE_WORKER_GROUP)", "--threads",
                                 "$(SLUICE_WORKER_THREADS)"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["SLUICE_WORKER_GROUP"] == "g7" and env["SLUICE_WORKER_THREADS"] == env["OMP_NUM_THREADS"] == "2"
    # The client's model holds it whole: nothing the API server would drop.
    assert client.ApiClient().sanitize_for_serialization(client.V1Deployment.from_dict(copy)) == copy


def test_the_jobs_migrate_and_seed() -> None:
    jobs = {doc["metadata"]["name"]: doc for doc in _base_objects() if doc["kind"] == "Job"}
    commands = {tuple(job["spec"]["template"]["spec"]["containers"][0]["args"]) for job in jobs.values()}
    assert commands == {("sluice", "migrate"), ("sluice", "seed")}


def test_flower_asks_for_basic_auth_from_the_secret() -> None:
    (flower,) = _by_component()["flower"]
    env = flower["spec"]["template"]["spec"]["containers"][0]["env"]
    auth = next(e for e in env if e["name"] == "FLOWER_BASIC_AUTH")
    (secret,) = _docs(BASE / "secret.example.yaml")
    assert auth["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"], "key": "FLOWER_BASIC_AUTH"}
    assert {"SLUICE_REDIS_URL", "SLUICE_DATABASE_URL", "SLUICE_BOOTSTRAP_ADMIN_KEY",
            "FLOWER_BASIC_AUTH"} <= secret["stringData"].keys()
    assert all("CHANGE-ME" in value for value in secret["stringData"].values())


def test_the_base_ships_the_alert_rules_as_a_config_map_generated_from_the_rules_file() -> None:
    """The rules have one source, deploy/prometheus/sluice.rules.yml: the base includes its folder,
    whose kustomization makes the ConfigMap from that file under a fixed name a Prometheus mounts."""
    rules = DEPLOY.parent / "prometheus"
    assert (BASE / "../../prometheus").resolve() == rules.resolve()
    assert "../../prometheus" in _kustomization(BASE)["resources"]
    folder = _kustomization(rules)
    assert folder["generatorOptions"] == {"disableNameSuffixHash": True}
    (generator,) = folder["configMapGenerator"]
    assert generator["name"] == "sluice-prometheus-rules"
    assert generator["files"] == ["sluice.rules.yml"] and (rules / "sluice.rules.yml").is_file()
