"""The key layout's slot arithmetic (`sluice.wire.keys`): a job's record lands in its version's slot."""

from __future__ import annotations

import itertools

from redis.crc import key_slot

from sluice.wire import keys


def test_slot_is_redis_clusters_own_arithmetic() -> None:
    for name in ("minilm:v1", "intent:v2", "a", "tenant-7", ""):
        assert keys.slot(name) == key_slot(name.encode())


def test_four_characters_over_0_9a_z_reach_every_slot() -> None:
    seen: set[int] = set()
    for chars in itertools.product("0123456789abcdefghijklmnopqrstuvwxyz", repeat=4):
        seen.add(keys.slot("".join(chars)))
        if len(seen) == keys.SLOTS:
            break
    assert len(seen) == keys.SLOTS


def test_a_job_record_shares_its_versions_slot() -> None:
    for model, version in [("minilm", "v1"), ("intent", "v1"), ("Team.Model-2", "2026-12-01_rc1")]:
        job_id = keys.new_job_id(model, version)
        assert key_slot(keys.job(job_id).encode()) == key_slot(keys.stream(model, version, "online").encode())
        assert key_slot(keys.outbox(model, version).encode()) == key_slot(keys.stream(model, version, "bulk").encode())
        assert keys.job_code(job_id) == keys.version_code(model, version)


def test_a_jobs_event_channel_is_of_its_records_slot() -> None:
    """The scripts SPUBLISH a job's change on a cluster, which refuses a channel of another slot."""
    for job_id in (keys.new_job_id("minilm", "v1"), "job_from_before_codes"):
        for db in (0, 7):
            channel = keys.job_events_channel(db, job_id)
            assert key_slot(channel.encode()) == key_slot(keys.job(job_id).encode())
            assert channel.startswith(keys.events_channel(db) + ":")
    assert keys.job_events_channel(0, "job_a") != keys.job_events_channel(7, "job_a")


def test_ids_from_before_codes_keep_their_own_slot() -> None:
    legacy = "job_AbCdEfGhIjKlMnOpQrStUv"
    assert keys.job_code(legacy) is None
    assert keys.job(legacy) == "sluice:job:{job_AbCdEfGhIjKlMnOpQrStUv}"


def test_a_tenants_admission_records_share_a_slot() -> None:
    tenant = "acme"
    slots = {key_slot(k.encode()) for k in (keys.queued_jobs(tenant), keys.rate_bucket(tenant),
                                             keys.answered_jobs(tenant), keys.idempotency(tenant, "f" * 64))}
    assert len(slots) == 1


def test_webhook_deliveries_share_the_due_sets_slot() -> None:
    assert key_slot(keys.delivery("dlv_x").encode()) == key_slot(keys.WEBHOOK_DUE.encode())
