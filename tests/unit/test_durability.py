"""Reading WAITAOF's reply: only a confirmed local fsync lets durable accept answer 202."""

from __future__ import annotations

import pytest
from redis.exceptions import ResponseError

from sluice.wire.durability import fsynced


@pytest.mark.parametrize(
    ("reply", "confirmed"),
    [
        ([1, 0], True),
        ([b"1", b"0"], True),
        ([0, 0], False),  # the timeout passed before the fsync
        (ResponseError("ERR WAITAOF cannot be used when numlocal is set but appendonly is disabled."), False),
        (ResponseError("ERR unknown command 'waitaof'"), False),
        ([], False),
        (None, False),
    ],
)
def test_only_a_confirmed_local_fsync_counts(reply: object, confirmed: bool) -> None:
    assert fsynced(reply) is confirmed
