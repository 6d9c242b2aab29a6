"""The kubernetes actuator: each version's worker pool is a Deployment, sized through its scale subresource.

`sluice scheduler --actuator kubernetes` hands the autoscaler's decisions to this object instead of
the local `Supervisor`. It has the same four calls the scheduler's loop makes (`live`,
`set_desired`, `reconcile`, `stop_all`), but Kubernetes does the supervising: it starts, restarts
and drains the pods (SIGTERM, then `terminationGracePeriodSeconds`), so this object only reads
`spec.replicas`/`status.replicas` and patches `spec.replicas` when the decision differs.

The Deployments are the operator's (deploy/kubernetes/): the actuator never creates one. A version
without its Deployment is logged once and skipped, so one missing manifest does not stop the
others from scaling. Every error of the API (a refusal, a timeout, no connection) becomes an
`ActuatorError` here, at the boundary; the loop logs it and tries again on its next tick.
"""

from __future__ import annotations

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

log = logging.getLogger(__name__)

DEFAULT_TEMPLATE = "sluice-worker-{model}-{version}"
# The client's default for a PATCH is the first JSON type it lists, json-patch, which wants a list
# of operations; a merge patch of {"spec": {"replicas": n}} is what a scale needs.
MERGE_PATCH = "application/merge-patch+json"
# (connect, read) seconds: a hung API server must not hold the scaling loop for more than a tick or two.
REQUEST_TIMEOUT_S = (3.0, 10.0)


def dns_label(value: str) -> str:
    """A registry name (`[A-Za-z0-9][A-Za-z0-9._-]*`) as a DNS-1123 label part: `Intent_v1.2` -> `intent-v1-2`."""
    return re.sub(r"[^a-z0-9-]+", "-", value.lower()).strip("-")


def deployment_name(template: str, model: str, version: str) -> str:
    return template.format(model=dns_label(model), version=dns_label(version))


@dataclass(frozen=True, slots=True)
class _Scale:
    at: float
    desired: int | None  # spec.replicas; None when the Deployment does not exist
    live: int  # status.replicas: pods running or starting, which is what the autoscaler counts


class KubernetesActuator:
    def __init__(self, *, apps: Any, namespace: str, template: str = DEFAULT_TEMPLATE,
                 max_age_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        """`apps` is a `kubernetes.client.AppsV1Api`. A scale read is reused for `max_age_s`: one
        tick asks for a version's live replicas twice (deciding, publishing) and sets them once."""
        self.apps = apps
        self.namespace = namespace
        self.template = template
        self.max_age_s = max_age_s
        self.clock = clock
        self._scales: dict[VersionKey, _Scale] = {}
        self._missing: set[VersionKey] = set()
        # The versions last given replicas: one that leaves the decisions (retired) goes to zero,
        # as the local actuator drains its pool.
        self._managed: set[VersionKey] = set()

    def deployment(self, key: VersionKey) -> str:
        return deployment_name(self.template, *key)

    def live(self, key: VersionKey) -> int:
        return self._read(key).live

    def set_desired(self, desired: Mapping[VersionKey, int], *, configs: Mapping[VersionKey, str] | None = None,
                    ready_pids: Collection[int] = ()) -> None:
        """`configs` and `ready_pids` are the local actuator's: a pod template change is rolled by
        the Deployment itself (`kubectl rollout restart`), and readiness is the pods' probes."""
        targets = dict(desired)
        targets.update({key: 0 for key in self._managed - desired.keys()})
        for key, replicas in targets.items():
            scale = self._read(key)
            if scale.desired is not None and scale.desired != replicas:
                self._patch(key, replicas, was=scale.desired)
        self._managed = set(desired)

    def reconcile(self) -> None:
        """Kubernetes keeps every Deployment at its replicas between decisions: nothing to do."""

    def stop_all(self) -> None:
        """The Deployments outlive the scheduler: a restarted one takes them over at their sizes."""

    def _read(self, key: VersionKey) -> _Scale:
        now = self.clock()
        cached = self._scales.get(key)
        if cached is not None and now - cached.at < self.max_age_s:
            return cached
        answer = self._call(key, "read", self.apps.read_namespaced_deployment_scale)
        return self._remember(key, answer, now)

    def _patch(self, key: VersionKey, replicas: int, *, was: int) -> None:
        answer = self._call(key, "patch", self.apps.patch_namespaced_deployment_scale,
                            body={"spec": {"replicas": replicas}}, _content_type=MERGE_PATCH)
        if answer is not None:
            log.info("deployment %s/%s scaled from %d to %d replicas (%s/%s)", self.namespace,
                     self.deployment(key), was, replicas, *key)
        self._remember(key, answer, self.clock())

    def _remember(self, key: VersionKey, answer: Any, now: float) -> _Scale:
        if answer is None:
            if key not in self._missing:
                self._missing.add(key)
                log.warning("no deployment %s/%s for %s/%s: its replicas are not set until it exists",
                            self.namespace, self.deployment(key), *key)
            scale = _Scale(at=now, desired=None, live=0)
        else:
            if key in self._missing:
                self._missing.discard(key)
                log.info("deployment %s/%s for %s/%s found", self.namespace, self.deployment(key), *key)
            spec, status = answer.spec, answer.status
            # The API leaves out a zero spec.replicas.
            scale = _Scale(at=now, desired=int(spec.replicas or 0) if spec is not None else 0,
                           live=int(status.replicas or 0) if status is not None else 0)
        self._scales[key] = scale
        return scale

    def _call(self, key: VersionKey, what: str, method: Callable[..., Any], **kwargs: Any) -> Any:
        """The API's answer, None for a Deployment that does not exist, or ActuatorError."""
        name = self.deployment(key)
        try:
            return method(name=name, namespace=self.namespace, _request_timeout=REQUEST_TIMEOUT_S, **kwargs)
        except ApiException as exc:
            if exc.status == 404:
                return None
            answered = f"{exc.status} {exc.reason}" if exc.reason else str(exc.status)
            raise ActuatorError(f"the Kubernetes API answered {answered} to the {what} of deployment "
                                f"{self.namespace}/{name}'s scale") from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise ActuatorError(f"the Kubernetes API is unreachable ({what} of deployment "
                                f"{self.namespace}/{name}'s scale): {exc}") from exc


def connect(*, namespace: str, template: str = DEFAULT_TEMPLATE) -> KubernetesActuator:
    """In a pod (KUBERNETES_SERVICE_HOST set) its service account's token; elsewhere the kubeconfig's
    current context, so an operator can run the scheduler from a workstation."""
    try:
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()  # type: ignore[no-untyped-call]
        else:
            config.load_kube_config()  # type: ignore[no-untyped-call]
    except (ConfigException, OSError) as exc:
        raise ActuatorError(f"no Kubernetes configuration to scale deployments with: {exc}") from exc
    return KubernetesActuator(apps=client.AppsV1Api(), namespace=namespace, template=template)
