"""A job's own retry policy (sluice/retry.py): which finished attempts go back to the queue."""

from __future__ import annotations

import pytest

from sluice.retry import RETRY_ON, RetryPolicy


@pytest.mark.parametrize("code, attempts, expected", [
    ("run_timeout", 1, True),
    ("run_timeout", 2, True),
    ("run_timeout", 3, False),  # the third start was the last
    ("handler_timeout", 1, False),  # `timeout` is not listed
    ("inference_error", 1, False),  # the input's own failure: never retried
    ("worker_error", 1, False),  # no outcome to store: the claim script's to count
    (None, 1, False),
])
def test_a_listed_failure_requeues_while_attempts_are_left(code: str | None, attempts: int, expected: bool) -> None:
    policy = RetryPolicy(max_attempts=3, on=("run_timeout", "worker_error"))
    assert policy.requeues(error_code=code, attempts=attempts) is expected


def test_timeout_names_the_per_batch_timeout() -> None:
    policy = RetryPolicy(max_attempts=2, on=("timeout",))
    assert policy.requeues(error_code="handler_timeout", attempts=1)
    assert not policy.requeues(error_code="run_timeout", attempts=1)


def test_a_policy_round_trips_through_its_encoding() -> None:
    policy = RetryPolicy(max_attempts=4, on=RETRY_ON)
    assert policy.encode() == "4:worker_error,timeout,run_timeout"
    assert RetryPolicy.parse(policy.encode()) == policy
    assert RetryPolicy.parse(None) is None and RetryPolicy.parse("") is None


@pytest.mark.parametrize("max_attempts, on", [(0, ("timeout",)), (2, ("sometimes",))])
def test_a_policy_refuses_what_it_cannot_mean(max_attempts: int, on: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="max_attempts|unknown"):
        RetryPolicy(max_attempts=max_attempts, on=on)  # type: ignore[arg-type]
