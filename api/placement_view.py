"""What this API replica knows of the placement: the versions no worker can serve now.

The scheduler publishes them in the placement plan's `not_served` (sluice/wire/placements.py);
this view reads the plan once a second, so a submission routed to such a version is refused at
once with 503 `not_served` and the reason, instead of a 202 for a job no worker will ever take
(docs/ARCHITECTURE.md, "Placement"). No plan yet, or Redis away: every version counts as served,
as before the scheduler first spoke.
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis

from sluice.errors import BrokerError
from sluice.wire import placements

log = logging.getLogger(__name__)


class PlacementView:
    def __init__(self, *, redis: aioredis.Redis, refresh_s: float = 1.0) -> None:
        self.redis = redis
        self.refresh_s = refresh_s
        self._not_served: dict[str, str] = {}

    def not_served(self, model: str, version: str) -> str | None:
        """Why the version cannot be served now, or None."""
        return self._not_served.get(f"{model}/{version}")

    async def refresh(self) -> None:
        plan = await placements.read_async(self.redis)
        self._not_served = dict(plan.not_served) if plan is not None else {}

    async def run_forever(self) -> None:
        while True:
            try:
                await self.refresh()
            except BrokerError as exc:
                log.debug("placement plan not refreshed: %s", exc)
            await asyncio.sleep(self.refresh_s)
