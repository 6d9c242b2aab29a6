"""The kubernetes actuator: each version's worker pool is a Deployment, sized through its scale subresource.

`sluice scheduler --actuator kubernetes` hands the autoscaler's decisions to this object instead of
the local `Supervisor`. It has the same four calls the scheduler's loop makes (`live`,
`set_desired`, `reconcile`, `stop_all`), but Kubernetes does the supervising: it starts, restarts
and drains the pods (SIGTERM, then `terminationGracePeriodSeconds`), so this object only reads
`spec.replicas`/`status.replicas` and patches `spec.replicas` when the decision differs.

The Deployments are the operator's (deploy/kubernetes/): the actuator never creates one. A version
without its Deployment is logged once and skipped, so one missing manifest does not stop the
others from scaling. Every error of the API (a refusal, a timeout, no connection) becomes an
`ActuatorError` here, at the boundary, counted in `sluice_actuator_errors_total`. `set_desired`
takes each Deployment on its own: one that fails is logged and tried again on the next tick, and
the others are still scaled.

Two surprises. A Deployment's name ends in a hash of the exact model and version
(`deployment_name`): the readable part alone cannot tell `minilm/v2-int8` from `minilm-v2/int8`,
nor `Intent` from `intent`. And the first call lists the namespace's worker Deployments (by
label): those of versions retired while no scheduler ran, which no decision names any more, are
scaled to zero as well.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from scheduler.supervisor import VersionKey
from sluice.errors import ActuatorError
from sluice.metrics import ACTUATOR_ERRORS

log = logging.getLogger(__name__)

DEFAULT_TEMPLATE = "sluice-worker-{model}-{version}"
# The label every worker Deployment of deploy/kubernetes/ carries, and no other Deployment.
DEFAULT_WORKER_SELECTOR = "app.kubernetes.io/component=worker"
# The client's default for a PATCH is the first JSON type it lists, json-patch, which wants a list
# of operations; a merge patch of {"spec": {"replicas": n}} is what a scale needs.
MERGE_PATCH = "application/merge-patch+json"
# (connect, read) seconds: a hung API server must not hold the scaling loop for more than a tick or two.
REQUEST_TIMEOUT_S = (3.0, 10.0)
# A DNS-1123 label's length (a pod's hostname is cut from its Deployment's name), and the hex
# digits of sha256 that make a name unique: 40 bits, no collision among any registry's versions.
NAME_MAX = 63
DIGEST_CHARS = 10


def dns_label(value: str) -> str:
    """A name as a DNS-1123 label part: `Intent_v1.2` -> `intent-v1-2`; readable, not unique."""
    return re.sub(r"[^a-z0-9-]+", "-", value.lower()).strip("-")


def deployment_name(template: str, model: str, version: str) -> str:
    """The template filled in as a DNS label, cut to fit, then the first hex digits of the sha256 of
    `model/version` exactly (a `/` is in no registry name, so no two versions share the text)."""
    digest = hashlib.sha256(f"{model}/{version}".encode()).hexdigest()[:DIGEST_CHARS]
    readable = dns_label(template.format(model=dns_label(model), version=dns_label(version)))
    readable = readable[:NAME_MAX - DIGEST_CHARS - 1].rstrip("-")
    return f"{readable}-{digest}" if readable else digest


@dataclass(frozen=True, slots=True)
class _Scale:
    at: float
    desired: int | None  # spec.replicas; None when the Deployment does not exist
    live: int  # status.replicas: pods running or starting, which is what the autoscaler counts


class KubernetesActuator:
    def __init__(self, *, apps: Any, namespace: str, template: str = DEFAULT_TEMPLATE,
                 selector: str = DEFAULT_WORKER_SELECTOR, max_age_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`apps` is a `kubernetes.client.AppsV1Api`; `selector` finds every worker Deployment. A scale
        read is reused for `max_age_s`: one tick asks for a version's live replicas twice (deciding,
        publishing) and sets them once."""
        self.apps = apps
        self.namespace = namespace
        self.template = template
        self.selector = selector
        self.max_age_s = max_age_s
        self.clock = clock
        self._scales: dict[str, _Scale] = {}  # by Deployment name
        self._missing: set[str] = set()
        # The Deployments last given replicas, and those found at start: one that leaves the
        # decisions (retired) goes to zero, as the local actuator drains its pool.
        self._managed: set[str] = set()
        self._listed = False

    def deployment(self, key: VersionKey) -> str:
        return deployment_name(self.template, *key)

    def live(self, key: VersionKey) -> int:
        return self._read(self.deployment(key)).live

    def set_desired(self, desired: Mapping[VersionKey, int], *, configs: Mapping[VersionKey, str] | None = None,
                    ready_pids: Collection[int] = ()) -> None:
        """`configs` and `ready_pids` are the local actuator's: a pod template change is rolled by
        the Deployment itself (`kubectl rollout restart`), and readiness is the pods' probes."""
        if not self._listed:
            self._list_workers()
        wanted = {self.deployment(key): replicas for key, replicas in desired.items()}
        targets = {**{name: 0 for name in self._managed - wanted.keys()}, **wanted}
        failed = set()
        for name, replicas in targets.items():
            try:
                scale = self._read(name)
                if scale.desired is not None and scale.desired != replicas:
                    self._patch(name, replicas, was=scale.desired)
            except ActuatorError as exc:
                failed.add(name)
                log.warning("%s; tried again on the next tick", exc)
        # One that could not be taken to zero stays, to be tried again.
        self._managed = set(wanted) | {name for name in failed if name not in wanted}

    def reconcile(self) -> None:
        """Kubernetes keeps every Deployment at its replicas between decisions: nothing to do."""

    def stop_all(self) -> None:
        """The Deployments outlive the scheduler: a restarted one takes them over at their sizes."""

    def _list_workers(self) -> None:
        try:
            listed = self.apps.list_namespaced_deployment(self.namespace, label_selector=self.selector,
                                                          _request_timeout=REQUEST_TIMEOUT_S)
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
            failed = _failed("list", f"deployments {self.namespace}/{self.selector}", exc)
            log.warning("%s; retired versions' deployments are looked for again on the next tick", failed)
            return
        # One already at zero needs nothing.
        running = {item.metadata.name for item in listed.items if item.spec is not None and item.spec.replicas}
        self._managed |= running
        self._listed = True

    def _read(self, name: str) -> _Scale:
        now = self.clock()
        cached = self._scales.get(name)
        if cached is not None and now - cached.at < self.max_age_s:
            return cached
        answer = self._call(name, "read", self.apps.read_namespaced_deployment_scale)
        return self._remember(name, answer, now)

    def _patch(self, name: str, replicas: int, *, was: int) -> None:
        answer = self._call(name, "patch", self.apps.patch_namespaced_deployment_scale,
                            body={"spec": {"replicas": replicas}}, _content_type=MERGE_PATCH)
        if answer is not None:
            log.info("deployment %s/%s scaled from %d to %d replicas", self.namespace, name, was, replicas)
        self._remember(name, answer, self.clock())

    def _remember(self, name: str, answer: Any, now: float) -> _Scale:
        if answer is None:
            if name not in self._missing:
                self._missing.add(name)
                log.warning("no deployment %s/%s: its replicas are not set until it exists", self.namespace, name)
            scale = _Scale(at=now, desired=None, live=0)
        else:
            if name in self._missing:
                self._missing.discard(name)
                log.info("deployment %s/%s found", self.namespace, name)
            spec, status = answer.spec, answer.status
            # The API leaves out a zero spec.replicas.
            scale = _Scale(at=now, desired=int(spec.replicas or 0) if spec is not None else 0,
                           live=int(status.replicas or 0) if status is not None else 0)
        self._scales[name] = scale
        return scale

    def _call(self, name: str, what: str, method: Callable[..., Any], **kwargs: Any) -> Any:
        """The API's answer, None for a Deployment that does not exist, or ActuatorError."""
        target = f"deployment {self.namespace}/{name}'s scale"
        try:
            return method(name=name, namespace=self.namespace, _request_timeout=REQUEST_TIMEOUT_S, **kwargs)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise _failed(what, target, exc) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise _failed(what, target, exc) from exc


def _failed(what: str, target: str, exc: Exception) -> ActuatorError:
    ACTUATOR_ERRORS.labels(what).inc()
    if isinstance(exc, ApiException):
        answered = f"{exc.status} {exc.reason}" if exc.reason else str(exc.status)
        return ActuatorError(f"the Kubernetes API answered {answered} to the {what} of {target}")
    return ActuatorError(f"the Kubernetes API is unreachable ({what} of {target}): {exc}")


def connect(*, namespace: str, template: str = DEFAULT_TEMPLATE,
            selector: str = DEFAULT_WORKER_SELECTOR) -> KubernetesActuator:
    """In a pod (KUBERNETES_SERVICE_HOST set) its service account's token; elsewhere the kubeconfig's
    current context, so an operator can run the scheduler from a workstation."""
    try:
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()  # type: ignore[no-untyped-call]
        else:
            config.load_kube_config()  # type: ignore[no-untyped-call]
    except (ConfigException, OSError) as exc:
        raise ActuatorError(f"no Kubernetes configuration to scale deployments with: {exc}") from exc
    return KubernetesActuator(apps=client.AppsV1Api(), namespace=namespace, template=template, selector=selector)
