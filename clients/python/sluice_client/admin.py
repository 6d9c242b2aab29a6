"""The registry and operator calls of the Python clients, as mixins of `SluiceClient` and
`AsyncClient`: models and versions, routing, rollback, rollouts, tenants, keys, webhook secrets,
pins, and the per-version stats, quality windows and audit log.

Most of them need an admin key; a tenant's key gets 403 (`AuthError`). Each answers the API's
resource as a plain dict, except `models` and `audit`, which answer the list the resource wraps.
An option left at None is not sent, so the API's default applies.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any


def _present(**fields: Any) -> dict[str, Any]:
    return {name: value for name, value in fields.items() if value is not None}


def _rollout_body(canary: str, stable: str | None, steps: Sequence[float] | None, soak_s: float | None,
                  min_samples: int | None, reason: str | None) -> dict[str, Any]:
    return _present(canary=canary, stable=stable, steps=list(steps) if steps is not None else None, soak_s=soak_s,
                    min_samples=min_samples, reason=reason)


class AdminCalls(ABC):
    @abstractmethod
    def _call(self, method: str, path: str, **kwargs: Any) -> Any: ...

    def model(self, name: str) -> dict[str, Any]:
        return dict(self._call("GET", f"/v1/models/{name}"))

    def models(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/v1/models")["models"])

    def create_model(self, name: str, kind: str, *, tier: str | None = None) -> dict[str, Any]:
        return dict(self._call("POST", "/v1/models", json=_present(name=name, kind=kind, tier=tier)))

    def create_version(self, model: str, version: str, *, artifact: str, sha256: str,
                       **options: Any) -> dict[str, Any]:
        """Register a version; `options` are the body's other fields (state, batching, min_replicas...)."""
        return dict(self._call("POST", f"/v1/models/{model}/versions",
                               json={"version": version, "artifact": artifact, "sha256": sha256, **options}))

    def update_version(self, model: str, version: str, **changes: Any) -> dict[str, Any]:
        """Change a version's state, batching, replicas or the model's tier (with an optional `reason`)."""
        return dict(self._call("PATCH", f"/v1/models/{model}/versions/{version}", json=changes))

    def set_routing(self, model: str, weights: dict[str, float], reason: str | None = None) -> dict[str, Any]:
        return dict(self._call("PUT", f"/v1/models/{model}/routing", json={"weights": weights, "reason": reason}))

    def rollback(self, model: str, *, reason: str | None = None) -> dict[str, Any]:
        return dict(self._call("POST", f"/v1/models/{model}/rollback", json=_present(reason=reason)))

    def start_rollout(self, model: str, canary: str, *, stable: str | None = None,
                      steps: Sequence[float] | None = None, soak_s: float | None = None,
                      min_samples: int | None = None, reason: str | None = None) -> dict[str, Any]:
        return dict(self._call("POST", f"/v1/models/{model}/rollouts",
                               json=_rollout_body(canary, stable, steps, soak_s, min_samples, reason)))

    def rollout(self, model: str, *, decisions: int = 20) -> dict[str, Any]:
        """The running rollout, else the latest finished one, with its latest `decisions`."""
        return dict(self._call("GET", f"/v1/models/{model}/rollouts/current", params={"decisions": decisions}))

    def abort_rollout(self, model: str, *, reason: str | None = None) -> dict[str, Any]:
        return dict(self._call("DELETE", f"/v1/models/{model}/rollouts/current", params=_present(reason=reason)))

    def create_tenant(self, tenant: str, **options: Any) -> dict[str, Any]:
        """Create a tenant (`options`: admin, rate_limit_per_s, max_queued, share); the answer holds
        its first key's secret, shown once."""
        return dict(self._call("POST", "/v1/tenants", json={"id": tenant, **options}))

    def set_share(self, tenant: str, share: float, *, reason: str | None = None) -> dict[str, Any]:
        """The tenant's weight when tenants share a version's workers (1 by default); audited."""
        return dict(self._call("PATCH", f"/v1/tenants/{tenant}", json=_present(share=share, reason=reason)))

    def issue_key(self, tenant: str, *, admin: bool = False) -> dict[str, Any]:
        return dict(self._call("POST", f"/v1/tenants/{tenant}/keys", json={"admin": admin}))

    def revoke_key(self, key_id: str) -> dict[str, Any]:
        return dict(self._call("DELETE", f"/v1/keys/{key_id}"))

    def rotate_webhook_secret(self, tenant: str, *, secret: str | None = None, overlap_s: int | None = None,
                              reason: str | None = None) -> dict[str, Any]:
        """Make `secret` (a fresh `whsec_` one when None) the tenant's webhook secret; the old one
        signs too for `overlap_s` (the API's default: a day). The answer holds the new secret."""
        return dict(self._call("POST", f"/v1/tenants/{tenant}/webhook-secret:rotate",
                               json=_present(secret=secret, overlap_s=overlap_s, reason=reason)))

    def pin(self, tenant: str, model: str, version: str) -> dict[str, Any]:
        return dict(self._call("PUT", f"/v1/tenants/{tenant}/pins/{model}", json={"version": version}))

    def unpin(self, tenant: str, model: str) -> dict[str, Any]:
        return dict(self._call("DELETE", f"/v1/tenants/{tenant}/pins/{model}"))

    def stats(self, model: str, version: str, *, window_s: float | None = None) -> dict[str, Any]:
        return dict(self._call("GET", f"/v1/models/{model}/versions/{version}/stats",
                               params=_present(window_s=window_s)))

    def quality(self, model: str, version: str, *, hours: float | None = None) -> dict[str, Any]:
        return dict(self._call("GET", f"/v1/models/{model}/versions/{version}/quality",
                               params=_present(hours=hours)))

    def mix(self, model: str, version: str, *, days: int | None = None) -> dict[str, Any]:
        """The version's served mix: inputs per cost bucket, per UTC day and lane."""
        return dict(self._call("GET", f"/v1/models/{model}/versions/{version}/mix", params=_present(days=days)))

    def audit(self, model: str, *, limit: int | None = None, before: int | None = None) -> list[dict[str, Any]]:
        """The model's audit entries, newest first; the next page is `before=` the last one's id."""
        return list(self._call("GET", f"/v1/models/{model}/audit",
                               params=_present(limit=limit, before=before))["entries"])


class AsyncAdminCalls(ABC):
    @abstractmethod
    async def _call(self, method: str, path: str, **kwargs: Any) -> Any: ...

    async def model(self, name: str) -> dict[str, Any]:
        return dict(await self._call("GET", f"/v1/models/{name}"))

    async def models(self) -> list[dict[str, Any]]:
        return list((await self._call("GET", "/v1/models"))["models"])

    async def create_model(self, name: str, kind: str, *, tier: str | None = None) -> dict[str, Any]:
        return dict(await self._call("POST", "/v1/models", json=_present(name=name, kind=kind, tier=tier)))

    async def create_version(self, model: str, version: str, *, artifact: str, sha256: str,
                             **options: Any) -> dict[str, Any]:
        """Register a version; `options` are the body's other fields (state, batching, min_replicas...)."""
        return dict(await self._call("POST", f"/v1/models/{model}/versions",
                                     json={"version": version, "artifact": artifact, "sha256": sha256, **options}))

    async def update_version(self, model: str, version: str, **changes: Any) -> dict[str, Any]:
        """Change a version's state, batching, replicas or the model's tier (with an optional `reason`)."""
        return dict(await self._call("PATCH", f"/v1/models/{model}/versions/{version}", json=changes))

    async def set_routing(self, model: str, weights: dict[str, float], reason: str | None = None) -> dict[str, Any]:
        return dict(await self._call("PUT", f"/v1/models/{model}/routing",
                                     json={"weights": weights, "reason": reason}))

    async def rollback(self, model: str, *, reason: str | None = None) -> dict[str, Any]:
        return dict(await self._call("POST", f"/v1/models/{model}/rollback", json=_present(reason=reason)))

    async def start_rollout(self, model: str, canary: str, *, stable: str | None = None,
                            steps: Sequence[float] | None = None, soak_s: float | None = None,
                            min_samples: int | None = None, reason: str | None = None) -> dict[str, Any]:
        return dict(await self._call("POST", f"/v1/models/{model}/rollouts",
                                     json=_rollout_body(canary, stable, steps, soak_s, min_samples, reason)))

    async def rollout(self, model: str, *, decisions: int = 20) -> dict[str, Any]:
        """The running rollout, else the latest finished one, with its latest `decisions`."""
        return dict(await self._call("GET", f"/v1/models/{model}/rollouts/current",
                                     params={"decisions": decisions}))

    async def abort_rollout(self, model: str, *, reason: str | None = None) -> dict[str, Any]:
        return dict(await self._call("DELETE", f"/v1/models/{model}/rollouts/current",
                                     params=_present(reason=reason)))

    async def create_tenant(self, tenant: str, **options: Any) -> dict[str, Any]:
        """Create a tenant (`options`: admin, rate_limit_per_s, max_queued, share); the answer holds
        its first key's secret, shown once."""
        return dict(await self._call("POST", "/v1/tenants", json={"id": tenant, **options}))

    async def set_share(self, tenant: str, share: float, *, reason: str | None = None) -> dict[str, Any]:
        """The tenant's weight when tenants share a version's workers (1 by default); audited."""
        return dict(await self._call("PATCH", f"/v1/tenants/{tenant}", json=_present(share=share, reason=reason)))

    async def issue_key(self, tenant: str, *, admin: bool = False) -> dict[str, Any]:
        return dict(await self._call("POST", f"/v1/tenants/{tenant}/keys", json={"admin": admin}))

    async def revoke_key(self, key_id: str) -> dict[str, Any]:
        return dict(await self._call("DELETE", f"/v1/keys/{key_id}"))

    async def rotate_webhook_secret(self, tenant: str, *, secret: str | None = None, overlap_s: int | None = None,
                                    reason: str | None = None) -> dict[str, Any]:
        """Make `secret` (a fresh `whsec_` one when None) the tenant's webhook secret; the old one
        signs too for `overlap_s` (the API's default: a day). The answer holds the new secret."""
        return dict(await self._call("POST", f"/v1/tenants/{tenant}/webhook-secret:rotate",
                                     json=_present(secret=secret, overlap_s=overlap_s, reason=reason)))

    async def pin(self, tenant: str, model: str, version: str) -> dict[str, Any]:
        return dict(await self._call("PUT", f"/v1/tenants/{tenant}/pins/{model}", json={"version": version}))

    async def unpin(self, tenant: str, model: str) -> dict[str, Any]:
        return dict(await self._call("DELETE", f"/v1/tenants/{tenant}/pins/{model}"))

    async def stats(self, model: str, version: str, *, window_s: float | None = None) -> dict[str, Any]:
        return dict(await self._call("GET", f"/v1/models/{model}/versions/{version}/stats",
                                     params=_present(window_s=window_s)))

    async def quality(self, model: str, version: str, *, hours: float | None = None) -> dict[str, Any]:
        return dict(await self._call("GET", f"/v1/models/{model}/versions/{version}/quality",
                                     params=_present(hours=hours)))

    async def mix(self, model: str, version: str, *, days: int | None = None) -> dict[str, Any]:
        """The version's served mix: inputs per cost bucket, per UTC day and lane."""
        return dict(await self._call("GET", f"/v1/models/{model}/versions/{version}/mix",
                                     params=_present(days=days)))

    async def audit(self, model: str, *, limit: int | None = None,
                    before: int | None = None) -> list[dict[str, Any]]:
        """The model's audit entries, newest first; the next page is `before=` the last one's id."""
        return list((await self._call("GET", f"/v1/models/{model}/audit",
                                      params=_present(limit=limit, before=before)))["entries"])
