"""The kubernetes actuator: one worker Deployment per placement group, made from the operator's template.

`sluice scheduler --actuator kubernetes` hands the placement plan to this object instead of the
local `Supervisor`. Kubernetes does the supervising (it starts, restarts and drains the pods:
SIGTERM, then `terminationGracePeriodSeconds`); this object only makes the set of group
Deployments match the plan's groups. What each pod serves is the plan's business: the pod's
`sluice worker --group` reads its group's entry itself, so a version joining a group, or changing
its batching, touches no Deployment.

A group's Deployment is a copy of the template Deployment the manifests ship (`sluice-worker`,
no replicas of its own), named `<template>-<group>`, with one replica, the group in its labels,
its selector and `SLUICE_WORKER_GROUP`, and the group's threads in `SLUICE_WORKER_THREADS`: the
operator decides what a worker pod is (image, resources, secrets), the scheduler only how many
there are and what they are called. A group that leaves the plan has its Deployment deleted (its
pod drains).

Every error of the API (a refusal, a timeout, no connection) becomes an `ActuatorError` here, at
the boundary, counted in `sluice_actuator_errors_total{operation}`; `apply` takes each group on its
own, so one that fails is logged and tried again on the next tick while the others go on. The
first `apply`, and one a minute after, lists the Deployments this actuator made (by label): those
of groups the plan no longer has, closed while no scheduler ran, are deleted as well, and one
deleted by hand is made again.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from sluice.errors import ActuatorError
from sluice.metrics import ACTUATOR_ERRORS
from sluice.wire.placements import Group, PlacementPlan

log = logging.getLogger(__name__)

DEFAULT_TEMPLATE = "sluice-worker"
GROUP_LABEL = "sluice.dev/group"
MANAGED_BY = ("app.kubernetes.io/managed-by", "sluice-scheduler")
# The Deployments this actuator made, and no other.
MANAGED_SELECTOR = f"app.kubernetes.io/component=worker,{MANAGED_BY[0]}={MANAGED_BY[1]}"
# (connect, read) seconds: a hung API server must not hold the scheduling loop for more than a tick or two.
REQUEST_TIMEOUT_S = (3.0, 10.0)
# The template is read again after this long: an operator's edit reaches the next group made.
TEMPLATE_MAX_AGE_S = 60.0
# The managed Deployments are listed again after this long: one deleted by hand is made again.
RELIST_S = 60.0


class KubernetesActuator:
    def __init__(self, *, apps: Any, namespace: str, template: str = DEFAULT_TEMPLATE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`apps` is a `kubernetes.client.AppsV1Api`; `template` names the template Deployment."""
        self.apps = apps
        self.namespace = namespace
        self.template = template
        self.clock = clock
        self._existing: set[str] = set()  # the group Deployments made, or found by the last listing
        self._listed = False
        self._listed_at = 0.0
        self._template: tuple[float, dict[str, Any]] | None = None

    def deployment(self, group: str) -> str:
        return f"{self.template}-{group}"

    def apply(self, plan: PlacementPlan) -> None:
        if not self._listed or self.clock() - self._listed_at > RELIST_S:
            self._list_managed()
        wanted = {self.deployment(name): (name, group) for name, group in plan.groups.items()}
        for name, (group_name, group) in sorted(wanted.items()):
            if name in self._existing:
                continue
            try:
                self._create(name, group_name, group)
            except ActuatorError as exc:
                log.warning("%s; tried again on the next tick", exc)
        if not self._listed:
            return  # what else exists is unknown: nothing is deleted on a guess
        for name in sorted(self._existing - wanted.keys()):
            try:
                self._call("delete", name, self.apps.delete_namespaced_deployment, name=name)
                log.info("deployment %s/%s deleted: its group left the plan", self.namespace, name)
                self._existing.discard(name)
            except ActuatorError as exc:
                log.warning("%s; tried again on the next tick", exc)

    def reconcile(self) -> None:
        """Kubernetes keeps every Deployment running between plans: nothing to do."""

    def stop_all(self) -> None:
        """The Deployments outlive the scheduler: a restarted one adopts them (its first `apply`)."""

    def _list_managed(self) -> None:
        try:
            listed = self._call("list", f"deployments {MANAGED_SELECTOR}", self.apps.list_namespaced_deployment,
                                label_selector=MANAGED_SELECTOR)
        except ActuatorError as exc:
            log.warning("%s; the groups' deployments are looked for again on the next tick", exc)
            return
        self._existing = {item.metadata.name for item in listed.items}
        self._listed, self._listed_at = True, self.clock()

    def _create(self, name: str, group_name: str, group: Group) -> None:
        body = group_deployment(self._read_template(), name=name, group=group_name, threads=group.threads)
        try:
            self._call("create", name, self.apps.create_namespaced_deployment, body=body)
        except ActuatorError as exc:
            if not isinstance(exc.__cause__, ApiException) or exc.__cause__.status != 409:
                raise
        self._existing.add(name)
        log.info("deployment %s/%s made for group %s (%d threads)", self.namespace, name, group_name, group.threads)

    def _read_template(self) -> dict[str, Any]:
        now = self.clock()
        if self._template is None or now - self._template[0] > TEMPLATE_MAX_AGE_S:
            found = self._call("read", self.template, self.apps.read_namespaced_deployment, name=self.template)
            self._template = (now, client.ApiClient().sanitize_for_serialization(found))  # type: ignore[no-untyped-call]
        return self._template[1]

    def _call(self, what: str, target: str, method: Callable[..., Any], **kwargs: Any) -> Any:
        try:
            return method(namespace=self.namespace, _request_timeout=REQUEST_TIMEOUT_S, **kwargs)
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
            raise _failed(what, f"{self.namespace}/{target}", exc) from exc


def group_deployment(template: dict[str, Any], *, name: str, group: str, threads: int) -> dict[str, Any]:
    """The template Deployment made into a group's: its name, one replica, the group in labels,
    selector and environment, and the group's threads."""
    body = copy.deepcopy(template)
    labels = {**body.get("metadata", {}).get("labels", {}), GROUP_LABEL: group, MANAGED_BY[0]: MANAGED_BY[1]}
    body["metadata"] = {"name": name, "labels": labels, "annotations": body.get("metadata", {}).get("annotations", {})}
    spec = body.setdefault("spec", {})
    spec["replicas"] = 1
    spec.setdefault("selector", {}).setdefault("matchLabels", {})[GROUP_LABEL] = group
    pod = spec.setdefault("template", {})
    pod.setdefault("metadata", {}).setdefault("labels", {})[GROUP_LABEL] = group
    for container in pod.get("spec", {}).get("containers", []):
        env = [e for e in container.get("env", []) if e.get("name") not in _GROUP_ENV]
        container["env"] = [*env, {"name": "SLUICE_WORKER_GROUP", "value": group},
                            {"name": "SLUICE_WORKER_THREADS", "value": str(threads)},
                            {"name": "OMP_NUM_THREADS", "value": str(threads)},
                            {"name": "MKL_NUM_THREADS", "value": str(threads)}]
    body.pop("status", None)
    return body


_GROUP_ENV = {"SLUICE_WORKER_GROUP", "SLUICE_WORKER_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"}


def _failed(what: str, target: str, exc: Exception) -> ActuatorError:
    ACTUATOR_ERRORS.labels(what).inc()
    if isinstance(exc, ApiException):
        answered = f"{exc.status} {exc.reason}" if exc.reason else str(exc.status)
        return ActuatorError(f"the Kubernetes API answered {answered} to the {what} of {target}")
    return ActuatorError(f"the Kubernetes API is unreachable ({what} of {target}): {exc}")


def connect(*, namespace: str, template: str = DEFAULT_TEMPLATE) -> KubernetesActuator:
    """In a pod (KUBERNETES_SERVICE_HOST set) its service account's token; elsewhere the kubeconfig's
    current context, so an operator can run the scheduler from a workstation."""
    try:
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()  # type: ignore[no-untyped-call]
        else:
            config.load_kube_config()  # type: ignore[no-untyped-call]
    except (ConfigException, OSError) as exc:
        raise ActuatorError(f"no Kubernetes configuration to make worker deployments with: {exc}") from exc
    return KubernetesActuator(apps=client.AppsV1Api(), namespace=namespace, template=template)
