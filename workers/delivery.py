"""Webhook delivery: one attempt at one delivery, recorded in the delivery's hash, and the sweep
that finds attempts overdue. No Celery here: workers/tasks.py calls this from its tasks, and tests
drive it directly.

Each attempt is counted in Redis (sluice/wire/lua/delivery_begin.lua) before the request is made
and its outcome recorded (delivery_end.lua) after, under a lease, so duplicate messages and dead
workers never add attempts beyond `max_attempts` and a delivered webhook is never sent again.

No receiver can hold the pool: an attempt ends by its deadline whatever the receiver sends
(workers/deadline.py), a tenant's attempts in flight are at most its share of the pool and pass
its own rate (the same script counts both), and an attempt over either is deferred, uncounted,
without waiting in a thread.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import random
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import httpx
import redis as redis_sync

from sluice.errors import SluiceError
from sluice.metrics import WEBHOOK_ATTEMPTS
from sluice.redact import scrub
from sluice.registry import tenants
from sluice.registry.batches import batch_resource
from sluice.registry.store import Registry
from sluice.registry.tables import Batch
from sluice.settings import Settings
from sluice.webhooks import (
    DELIVERY_HEADER,
    SIGNATURE_HEADER,
    STANDARD_ID_HEADER,
    STANDARD_SIGNATURE_HEADER,
    STANDARD_TIMESTAMP_HEADER,
    CallbackRefused,
    IPAddress,
    IPNetwork,
    WebhookSecrets,
    allowed_networks,
    literal_address,
    parse_callback,
    pin_address,
    retry_after_s,
    retry_delay,
    should_retry,
    signature,
    standard_signature,
)
from sluice.wire import keys, scripts
from sluice.wire.connections import connect_sync, translate_redis_errors
from sluice.wire.jobs import JobRecord
from workers.deadline import DeadlineTransport, deadline

log = logging.getLogger(__name__)

USER_AGENT = "Sluice-Webhooks/1"
# A retry message may run this much before its due time (clocks of two hosts) and still count.
EARLY_SLACK_S = 2.0

Resolver = Callable[[str, int], list[IPAddress]]


def resolve(host: str, port: int) -> list[IPAddress]:
    """Every address `host` resolves to, in the resolver's order, without repeats."""
    literal = literal_address(host)
    if literal is not None:
        return [literal]
    found: list[IPAddress] = []
    for _, _, _, _, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        address = ipaddress.ip_address(sockaddr[0])
        if address not in found:
            found.append(address)
    return found


@dataclass(frozen=True, slots=True)
class Attempt:
    """What one run of the task did: `delivered`, `retry` (after retry_in_s), `deferred` (not
    attempted, nor counted: its tenant is over its share or rate; again after retry_in_s),
    `failed`, or `skipped` (detail says why: done already, running elsewhere, or not due yet)."""

    outcome: str
    number: int = 0
    retry_in_s: float = 0.0
    detail: str = ""


class _Undeliverable(SluiceError):
    """The delivery can never succeed (its job record or tenant is gone)."""


@dataclass(frozen=True, slots=True)
class _Subject:
    """What a delivery reports: the tenant it belongs to, where it goes, and the resource sent."""

    tenant: str
    callback_url: str
    resource: dict[str, object]


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """A tenant's attempts in flight at once (over every delivery worker) and its rate."""

    in_flight: int
    rate_per_s: float
    burst: int


class Deliverer:
    """Makes one attempt at a delivery and records it in the delivery's hash (`keys.delivery`)."""

    def __init__(
        self,
        *,
        redis: redis_sync.Redis,
        registry: Registry,
        http: httpx.Client,
        allowed: tuple[IPNetwork, ...],
        max_attempts: int,
        backoff_base_s: float,
        backoff_cap_s: float,
        attempt_deadline_s: float,
        tenant_limits: TenantLimits,
        ttl_s: int,
        secret_cache_s: float = 60.0,
        resolver: Resolver = resolve,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        self.redis = redis
        self.registry = registry
        self.http = http
        self.allowed = allowed
        self.max_attempts = max_attempts
        self.backoff_base_s = backoff_base_s
        self.backoff_cap_s = backoff_cap_s
        self.attempt_deadline_s = attempt_deadline_s
        # The lease, and a tenant's place in its share, outlive the attempt's deadline: a worker
        # that died mid-attempt gives both back by then.
        self.lease_s = attempt_deadline_s + 5.0
        self.tenant_limits = tenant_limits
        self.ttl_s = ttl_s
        self.secret_cache_s = secret_cache_s
        self.resolver = resolver
        self.clock = clock
        self.rng = rng or random.Random()
        self._begin = redis.register_script(scripts.DELIVERY_BEGIN)
        self._end = redis.register_script(scripts.DELIVERY_END)
        self._secrets: dict[str, tuple[WebhookSecrets, float]] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: Settings) -> Deliverer:
        return cls(
            redis=connect_sync(settings.require_redis_url(), health_check_interval=15),
            registry=Registry.serving(settings, pool_size=2),
            http=delivery_client(timeout_s=settings.webhook_timeout_s),
            allowed=allowed_networks(settings.webhook_allowed_networks),
            max_attempts=settings.webhook_max_attempts,
            backoff_base_s=settings.webhook_backoff_base_s,
            backoff_cap_s=settings.webhook_backoff_cap_s,
            attempt_deadline_s=settings.webhook_attempt_deadline_s,
            tenant_limits=TenantLimits(
                in_flight=max(1, int(settings.webhook_tenant_share * settings.webhook_concurrency)),
                rate_per_s=settings.webhook_rate_per_tenant_s, burst=settings.webhook_rate_burst,
            ),
            ttl_s=settings.result_ttl_s,
        )

    def close(self) -> None:
        self.http.close()
        self.registry.dispose()
        self.redis.close()

    # --- one attempt ------------------------------------------------------------------------------

    def attempt(self, delivery_id: str, job_id: str) -> Attempt:
        # The deadline runs from here: resolving the host and reading the subject count too.
        until = time.monotonic() + self.attempt_deadline_s
        token = secrets.token_hex(8)
        gone: _Undeliverable | None = None
        try:
            subject: _Subject | None = self._subject(job_id)
        except _Undeliverable as exc:
            subject, gone = None, exc
        # What is gone is recorded failed at once, outside any tenant's share.
        tenant = subject.tenant if subject is not None else ""
        limits = self.tenant_limits
        with translate_redis_errors():
            reply = self._begin(keys=[keys.delivery(delivery_id), keys.WEBHOOK_DUE, keys.webhook_tenant_slots(tenant),
                                      keys.webhook_tenant_rate(tenant)], args=[
                repr(self.clock()), job_id, token, self.lease_s, self.max_attempts, self.ttl_s, delivery_id,
                EARLY_SLACK_S, limits.in_flight if subject is not None else 0, limits.rate_per_s, limits.burst,
                # A place in the share frees within a deadline; spread the deferred over it.
                self.rng.uniform(0.1, 1.0) * self.attempt_deadline_s,
            ])
        verdict = _text(reply[0])
        if verdict == "deferred":
            WEBHOOK_ATTEMPTS.labels("deferred").inc()
            return Attempt("deferred", retry_in_s=float(_text(reply[1])), detail="over the tenant's share or rate")
        if verdict != "go":
            return Attempt("skipped", detail=verdict)
        number = int(reply[1])
        release = keys.webhook_tenant_slots(tenant)
        if gone is not None or subject is None:
            return self._record(delivery_id, token, release, number, "failed", error=str(gone))
        try:
            with deadline(until):
                status, retry_after = self._send(delivery_id, subject)
        except CallbackRefused as exc:
            return self._record(delivery_id, token, release, number, "failed", error=str(exc), counted_as="refused")
        except _Undeliverable as exc:
            return self._record(delivery_id, token, release, number, "failed", error=str(exc))
        except (httpx.TransportError, OSError, SluiceError) as exc:
            return self._retry_or_fail(delivery_id, token, release, number,
                                       error=f"{type(exc).__name__}: {scrub(str(exc))}")
        if 200 <= status < 300:
            return self._record(delivery_id, token, release, number, "delivered", status=status)
        if should_retry(status):
            return self._retry_or_fail(delivery_id, token, release, number, status=status, retry_after=retry_after)
        return self._record(delivery_id, token, release, number, "failed", status=status)

    def _send(self, delivery_id: str, subject: _Subject) -> tuple[int, float | None]:
        tenant_secrets = self._secrets_of(subject.tenant)
        if tenant_secrets is None:
            raise _Undeliverable("the tenant no longer exists")
        target = parse_callback(subject.callback_url)
        address = pin_address(target, self.resolver(target.host, target.port), self.allowed)
        url = httpx.URL(subject.callback_url)
        body = json.dumps(subject.resource, separators=(",", ":")).encode()
        now = self.clock()
        active, timestamp = tenant_secrets.active(now), int(now)
        headers = {
            "Host": url.netloc.decode("ascii"),
            "Content-Type": "application/json",
            "User-Agent": USER_AGENT,
            DELIVERY_HEADER: delivery_id,
            SIGNATURE_HEADER: signature(active, body, timestamp=timestamp),
            # The delivery id is the message id: the same on every attempt, so receivers dedupe on it.
            STANDARD_ID_HEADER: delivery_id,
            STANDARD_TIMESTAMP_HEADER: str(timestamp),
            STANDARD_SIGNATURE_HEADER: standard_signature(active, delivery_id, body, timestamp=timestamp),
        }
        # Connect to the address just checked, never to what a second lookup might answer; TLS
        # still verifies the certificate against the host name (SNI).
        extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
        with self.http.stream("POST", url.copy_with(host=str(address)), content=body, headers=headers,
                              extensions=extensions) as response:
            # The answer's body is never read: a receiver cannot make us hold a large one.
            return response.status_code, retry_after_s(response.headers.get("Retry-After"), now=self.clock())

    def _subject(self, subject_id: str) -> _Subject:
        """The tenant, callback URL and resource of what the delivery reports: a job, or a batch
        (its callback fires once, when it is final)."""
        if subject_id.startswith("bat_"):
            with self.registry.session() as session:
                batch = session.get(Batch, subject_id)
                if batch is None or not batch.callback_url:
                    raise _Undeliverable("the batch no longer exists or has no callback_url")
                return _Subject(batch.tenant_id, batch.callback_url, batch_resource(batch))
        with translate_redis_errors():
            raw = self.redis.hgetall(keys.job(subject_id))
        if not raw:
            raise _Undeliverable("the job record no longer exists (past result_ttl_s)")
        record = JobRecord.from_redis(raw)
        if not record.callback_url:
            raise _Undeliverable("the job has no callback_url")
        return _Subject(record.tenant, record.callback_url, record.resource())

    def _secrets_of(self, tenant: str) -> WebhookSecrets | None:
        """The tenant's signing secrets, from the registry, cached for secret_cache_s per process
        (a rotation reaches every delivery worker within that time; which of them are active is
        decided at each attempt)."""
        now = self.clock()
        with self._lock:
            cached = self._secrets.get(tenant)
        if cached is not None and cached[1] > now:
            return cached[0]
        with self.registry.session() as session:
            found = tenants.webhook_secrets(session, tenant)
        if found is not None:
            with self._lock:
                self._secrets[tenant] = (found, now + self.secret_cache_s)
        return found

    def _retry_or_fail(self, delivery_id: str, token: str, release: str, number: int, *, status: int | None = None,
                       error: str = "", retry_after: float | None = None) -> Attempt:
        if number >= self.max_attempts:
            return self._record(delivery_id, token, release, number, "failed", status=status,
                                error=f"gave up after {number} attempts; last: {error or f'answered {status}'}")
        delay = retry_delay(number, base_s=self.backoff_base_s, cap_s=self.backoff_cap_s, retry_after=retry_after,
                            rng=self.rng)
        return self._record(delivery_id, token, release, number, "retrying", status=status, error=error, delay=delay)

    def _record(self, delivery_id: str, token: str, release: str, number: int, outcome: str, *,
                status: int | None = None, error: str = "", delay: float = 0.0,
                counted_as: str | None = None) -> Attempt:
        """Record the attempt's outcome and give back its place in the tenant's share (`release`)."""
        now = self.clock()
        with translate_redis_errors():
            self._end(keys=[keys.delivery(delivery_id), keys.WEBHOOK_DUE, release], args=[
                token, outcome, repr(now), repr(now + delay) if outcome == "retrying" else "",
                "" if status is None else str(status), error[:500], delivery_id,
            ])
        WEBHOOK_ATTEMPTS.labels(counted_as or outcome).inc()
        detail = error or (f"answered {status}" if status is not None else "")
        log.info("webhook %s attempt %d: %s %s", delivery_id, number, outcome, detail)
        return Attempt("retry" if outcome == "retrying" else outcome, number, delay, detail)

    # --- the sweep --------------------------------------------------------------------------------

    def overdue(self, *, grace_s: float, limit: int = 500) -> list[tuple[str, str]]:
        """(delivery id, job id) of deliveries whose attempt is overdue by more than grace_s,
        each pushed back by grace_s so that the next sweep does not send it again at once."""
        now = self.clock()
        with translate_redis_errors():
            # Without scores redis-py answers members only; its stubs cover both shapes.
            members = cast(list[bytes | str], self.redis.zrangebyscore(keys.WEBHOOK_DUE, "-inf", now - grace_s,
                                                                        start=0, num=limit))
            due = [_text(d) for d in members]
            pipe = self.redis.pipeline(transaction=False)
            for delivery_id in due:
                pipe.hget(keys.delivery(delivery_id), "job")
            jobs = pipe.execute()
            pipe = self.redis.pipeline(transaction=False)
            found = []
            for delivery_id, job in zip(due, jobs, strict=True):
                if job is None:
                    pipe.zrem(keys.WEBHOOK_DUE, delivery_id)
                else:
                    pipe.zadd(keys.WEBHOOK_DUE, {delivery_id: now + grace_s}, xx=True)
                    found.append((delivery_id, _text(job)))
            pipe.execute()
        return found


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def delivery_client(*, timeout_s: float) -> httpx.Client:
    """The HTTP client deliveries share: `timeout_s` per network operation, and each attempt's
    deadline over all of them (workers/deadline.py).

    No keep-alive: connections are made to a pinned address, and one verified for one host name
    must not carry a request for another name that resolves there too (and each request opens its
    own connection, in its own thread, under its own deadline). No redirects (a 3xx could point
    anywhere) and no proxy from the environment."""
    limits = httpx.Limits(max_keepalive_connections=0)
    return httpx.Client(timeout=httpx.Timeout(timeout_s), follow_redirects=False, trust_env=False,
                        transport=DeadlineTransport(limits=limits))
