"""The facts the client (`sluice_client`, its own distribution) and the server each hold, written
twice on purpose so that neither imports the other: the webhook signatures, the `Retry-After`
reading, the final job states and how many jobs one wait may name. Each is checked here from both
sides, so the two copies cannot drift."""

from __future__ import annotations

import base64
import time

import pytest

import sluice_client.batches
import sluice_client.jobs
from sluice import webhooks
from sluice.vocabulary import FINAL_BATCH_STATES
from sluice.wire import jobs
from sluice_client import verify
from sluice_client.webhooks import retry_after_s, signing_key
from tests.unit import standard_webhooks_vectors as vector

BODY = b'{"id":"job_x","status":"succeeded"}'
NEW = "whsec_" + base64.b64encode(b"n" * 32).decode()
OLD = "a-plain-secret-made-before-whsec"


def signed_headers(secrets: list[str], *, timestamp: int, body: bytes = BODY) -> dict[str, str]:
    """The headers a delivery carries, as the server signs them (names in the receiver's case)."""
    return {
        "Sluice-Signature": webhooks.signature(secrets, body, timestamp=timestamp),
        "webhook-id": "dlv_x",
        "webhook-timestamp": str(timestamp),
        "webhook-signature": webhooks.standard_signature(secrets, "dlv_x", body, timestamp=timestamp),
    }


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


def test_the_client_checks_every_signature_header_the_server_sends() -> None:
    now = int(time.time())
    headers = signed_headers([NEW], timestamp=now)
    assert verify(NEW, headers, BODY)
    assert verify(NEW, {name.upper(): value for name, value in headers.items()}, BODY)
    assert not verify(NEW, headers, BODY.replace(b"succeeded", b"failed"))
    assert not verify(OLD, headers, BODY)


@pytest.mark.parametrize("spoiled", ["Sluice-Signature", "webhook-signature", "webhook-id", "webhook-timestamp"])
def test_each_form_present_must_verify(spoiled: str) -> None:
    """A receiver handed every header refuses the delivery if any one of them is wrong, or if a
    Standard Webhooks header is missing while the others are there."""
    now = int(time.time())
    headers = signed_headers([NEW], timestamp=now)
    other = "whsec_" + base64.b64encode(b"x" * 32).decode()
    wrong = dict(headers)
    wrong[spoiled] = {
        "Sluice-Signature": webhooks.signature(other, BODY, timestamp=now),
        "webhook-signature": webhooks.standard_signature(other, "dlv_x", BODY, timestamp=now),
        "webhook-id": "dlv_other",
        "webhook-timestamp": str(now - 1),
    }[spoiled]
    assert not verify(NEW, wrong, BODY)
    if spoiled != "Sluice-Signature":
        assert not verify(NEW, {k: v for k, v in headers.items() if k != spoiled}, BODY)


def test_either_form_alone_verifies_and_no_form_does_not() -> None:
    headers = signed_headers([NEW], timestamp=int(time.time()))
    assert verify(NEW, {"sluice-signature": headers["Sluice-Signature"]}, BODY)
    assert verify(NEW, {k: v for k, v in headers.items() if k != "Sluice-Signature"}, BODY)
    assert not verify(NEW, {"content-type": "application/json"}, BODY)


def test_during_a_rotation_either_secret_verifies_both_forms() -> None:
    headers = signed_headers([NEW, OLD], timestamp=int(time.time()))
    assert verify(NEW, headers, BODY) and verify(OLD, headers, BODY)
    assert verify(["whsec_" + base64.b64encode(b"z" * 32).decode(), NEW], headers, BODY)  # a receiver holding two
    assert not verify("whsec_" + base64.b64encode(b"z" * 32).decode(), headers, BODY)


def test_the_client_refuses_a_stale_standard_signature_as_the_server_does() -> None:
    headers = signed_headers([NEW], timestamp=1_000)
    del headers["Sluice-Signature"]
    for now in (1_299.0, 1_301.0, 700.0, 699.0):
        server = webhooks.verify_standard(NEW, msg_id="dlv_x", timestamp="1000", header=headers["webhook-signature"],
                                          body=BODY, now=now)
        assert verify(NEW, headers, BODY, now=now) == server
    assert verify(NEW, headers, BODY, now=1_299.0) and not verify(NEW, headers, BODY, now=1_301.0)


@pytest.mark.parametrize(("header", "now", "verifies"), [
    (vector.SIGNATURE, vector.TIMESTAMP, True),
    (vector.BAD_SIGNATURE, vector.TIMESTAMP, False),
    (vector.MULTI_SIGNATURE, vector.TIMESTAMP, True),
    (vector.SIGNATURE, vector.TIMESTAMP + vector.TOLERANCE_S + 1, False),
    (vector.SIGNATURE, vector.TIMESTAMP - vector.TOLERANCE_S - 1, False),
])
def test_the_client_passes_the_published_vectors(header: str, now: int, verifies: bool) -> None:
    headers = {"webhook-id": vector.MSG_ID, "webhook-timestamp": str(vector.TIMESTAMP), "webhook-signature": header}
    assert verify(vector.SECRET, headers, vector.PAYLOAD, tolerance_s=vector.TOLERANCE_S, now=now) is verifies


@pytest.mark.parametrize("secret", [vector.SECRET, "whsec_dGVzdA", OLD, NEW, "whsec_cnJy"])
def test_the_client_keys_a_secret_as_the_server_does(secret: str) -> None:
    assert signing_key(secret) == webhooks.signing_key(secret)


@pytest.mark.parametrize("value", [None, "", "5", " 12 ", "-1", "soon", "Wed, 21 Oct 2015 07:28:00 GMT"])
def test_retry_after_reads_alike(value: str | None) -> None:
    assert retry_after_s(value, now=1_445_412_400.0) == webhooks.retry_after_s(value, now=1_445_412_400.0)


def test_the_client_knows_the_servers_final_states_and_wait_limit() -> None:
    assert {str(state) for state in jobs.FINAL_STATES} == sluice_client.jobs.FINAL
    assert sluice_client.jobs.MAX_WAIT_IDS == jobs.MAX_WAIT_IDS


def test_the_client_knows_the_servers_final_batch_states() -> None:
    assert {str(state) for state in FINAL_BATCH_STATES} == sluice_client.batches.BATCH_FINAL
