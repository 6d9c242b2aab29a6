"""Which failures end a job and which leave it for another delivery (workers/execution.py), and how
much a worker may hold (workers/holdings.held_limit): pure, no Redis."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from sluice.errors import InferenceError
from sluice.kinds import ModelKind
from workers.execution import fault_message, run_isolating
from workers.holdings import held_limit, releasable
from workers.models.protocol import ModelHandler


class Raising(ModelHandler):
    """Echoes, except that a batch holding `bad` raises `error`."""

    kind = ModelKind.synthetic

    def __init__(self, bad: str, error: Exception) -> None:
        self.bad = bad
        self.error = error

    def warmup(self) -> None:
        """Nothing to warm."""

    def run(self, inputs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        if any(item["text"] == self.bad for item in inputs):
            raise self.error
        return [{"echo": dict(item)} for item in inputs]


class Short(ModelHandler):
    """Breaks the handler contract: one output too few."""

    kind = ModelKind.synthetic

    def warmup(self) -> None:
        """Nothing to warm."""

    def run(self, inputs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        return [{"echo": dict(item)} for item in inputs][1:]


INPUTS = [{"text": f"text number {i}"} for i in range(6)]


def test_an_input_the_model_refuses_fails_alone_for_good() -> None:
    outcomes, _ = run_isolating(Raising("text number 3", InferenceError("cannot embed this")), INPUTS)
    assert [o.error is not None for o in outcomes] == [False, False, False, True, False, False]
    assert outcomes[3].error == {"code": "inference_error", "message": "InferenceError: cannot embed this"}
    assert all(o.fault is None for o in outcomes)


def test_a_worker_side_failure_is_a_fault_not_the_input_s_final_error() -> None:
    outcomes, _ = run_isolating(Raising("text number 3", RuntimeError("CUDA error: device lost")), INPUTS)
    assert [o.fault is not None for o in outcomes] == [False, False, False, True, False, False]
    assert outcomes[3].error is None and outcomes[3].output is None
    assert outcomes[3].fault == "RuntimeError: CUDA error: device lost"
    assert [o.output for o in outcomes if o.output is not None] == [{"echo": i} for j, i in enumerate(INPUTS) if j != 3]


def test_a_handler_that_breaks_its_contract_faults_every_input_instead_of_raising() -> None:
    outcomes, _ = run_isolating(Short(), INPUTS[:3])
    assert [o.fault for o in outcomes] == ["RuntimeError: handler answered 0 outputs for 1 inputs"] * 3


def test_a_fault_message_leaves_the_input_out() -> None:
    item = {"text": "my secret diagnosis, reach me at someone@example.com", "extra": ["abc", "nested words"]}
    message = fault_message(KeyError(f"{item['text']} / nested words / abc"), item)
    assert message == "KeyError: '[input] / [input] / abc'"


@pytest.mark.parametrize(
    ("items_per_s", "expected"),
    [
        (0.0, 128),  # nothing measured yet: the configured prefetch
        (10.0, 64),  # a batch of 32 takes 3.2 s: still two batches, one running and one formed
        (100.0, 100),  # 100 items start within half of the 2 s threshold
        (10_000.0, 128),  # never above the configured prefetch
    ],
)
def test_a_worker_holds_what_it_can_start_within_half_the_claim_threshold(items_per_s: float, expected: int) -> None:
    assert held_limit(prefetch=128, max_batch_size=32, items_per_s=items_per_s, claim_after_s=2.0) == expected


@pytest.mark.parametrize(
    ("room", "reserve", "expected"),
    [
        (32, 8, 24),  # the reserve is kept for jobs written to the stream directly
        (1, 1, 1),  # a version whose batches hold one job: its one place still releases a job
        (3, 8, 1),
        (0, 1, 0),  # no room, no release
        (-2, 1, -2),
    ],
)
def test_a_lane_releases_its_room_less_the_reserve_but_one_job_at_least(room: int, reserve: int,
                                                                          expected: int) -> None:
    assert releasable(room, reserve) == expected
