"""The facts the client (`sluice_client`, its own distribution) and the server each hold, written
twice on purpose so that neither imports the other: the webhook signature, the `Retry-After`
reading, the final job states and how many jobs one wait may name. Each is checked here from both
sides, so the two copies cannot drift."""

from __future__ import annotations

import time

import pytest

import sluice_client.batches
import sluice_client.jobs
from sluice import webhooks
from sluice.vocabulary import FINAL_BATCH_STATES
from sluice.wire import jobs
from sluice_client import verify
from sluice_client.webhooks import retry_after_s

BODY = b'{"id":"job_x","status":"succeeded"}'


def test_the_client_verifies_what_the_server_signs() -> None:
    header = webhooks.signature("whsec_test", BODY, timestamp=int(time.time()))
    assert verify("whsec_test", header, BODY)
    assert not verify("whsec_test", header, BODY.replace(b"succeeded", b"failed"))
    assert not verify("whsec_other", header, BODY)


def test_the_client_refuses_a_stale_signature_as_the_server_does() -> None:
    header = webhooks.signature("whsec_test", BODY, timestamp=1_000)
    for now in (1_000 + 299.0, 1_000 + 301.0, 1_000 - 301.0):
        assert verify("whsec_test", header, BODY, now=now) == webhooks.verify("whsec_test", header, BODY, now=now)
    assert verify("whsec_test", header, BODY, now=1_299.0)
    assert not verify("whsec_test", header, BODY, now=1_301.0)


@pytest.mark.parametrize("header", ["t=x,v1=00", "v1=00", "", "t=1000", "t=1000,v1=00,v1=11"])
def test_a_malformed_signature_is_refused_alike(header: str) -> None:
    assert verify("whsec_test", header, BODY, now=1_000) == webhooks.verify("whsec_test", header, BODY, now=1_000)


@pytest.mark.parametrize("value", [None, "", "5", " 12 ", "-1", "soon", "Wed, 21 Oct 2015 07:28:00 GMT"])
def test_retry_after_reads_alike(value: str | None) -> None:
    assert retry_after_s(value, now=1_445_412_400.0) == webhooks.retry_after_s(value, now=1_445_412_400.0)


def test_the_client_knows_the_servers_final_states_and_wait_limit() -> None:
    assert {str(state) for state in jobs.FINAL_STATES} == sluice_client.jobs.FINAL
    assert sluice_client.jobs.MAX_WAIT_IDS == jobs.MAX_WAIT_IDS


def test_the_client_knows_the_servers_final_batch_states() -> None:
    assert {str(state) for state in FINAL_BATCH_STATES} == sluice_client.batches.BATCH_FINAL
