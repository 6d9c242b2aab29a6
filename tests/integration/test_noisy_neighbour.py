"""Two versions in one worker process (bench/noisy_neighbour.py's setup, smaller): a flood on one,
in the bulk lane or in the online lane beside the other's, holds the other's single jobs back by
no more than its `max_wait_ms` plus one of the flood's batches (and scheduling slack)."""

from __future__ import annotations

import pytest

from bench.noisy_neighbour import measure

pytestmark = pytest.mark.soak

# The event loop's own delays on a busy 2-core runner, on top of the promised bound.
SLACK_MS = 60.0


@pytest.mark.parametrize("flood_lane", ["bulk", "online"])
async def test_a_flood_holds_a_neighbours_jobs_back_by_at_most_one_batch(redis_url: str, flood_lane: str) -> None:
    run = await measure(redis_url, flood=1500, quiet_jobs=60, flood_lane=flood_lane)
    assert run.p99_ms <= run.bound_ms + SLACK_MS, run
