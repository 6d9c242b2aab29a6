"""A Worker's side of fair sharing between tenants (sluice/fair_share.py): the turns its batcher
gives tenants on the model, the contention that shortens a heavy tenant's batches, and the turns
in which it releases held jobs into the stream (docs/ARCHITECTURE.md, "Priority and fair sharing").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from sluice.batcher import Batch
from sluice.fair_share import Contention, DeficitRoundRobin, HeldQueue, batch_limit, model_quantum, plan_release
from sluice.vocabulary import LANES, Lane

# A tenant's turn in the release of held jobs, at share 1, in tokens (`Item.cost`): one token, so
# tenants alternate job by job, each job's tokens charged to its tenant.
RELEASE_QUANTUM_TOKENS = 1


class TenantTurns:
    """`slice_s`: a heavy tenant's batch while tenants contend, in model seconds (the version's
    batching window); `ageing_s`: the wait after which a job counts as the most urgent priority.
    `fair` False (`SLUICE_FAIR_SHARE=false`): no turns on the model and no short batches; jobs held
    by an API that shares fairly are still released, by priority and in turns."""

    def __init__(self, *, slice_s: float, ageing_s: float, fair: bool = True) -> None:
        self.fair = fair
        self.slice_s = slice_s
        self.ageing_s = ageing_s
        self.model = DeficitRoundRobin[str](quantum=model_quantum(slice_s))
        self.contention = Contention(share=self.model.share)
        self._release = {lane: DeficitRoundRobin[str](quantum=RELEASE_QUANTUM_TOKENS) for lane in LANES}

    def saw(self, tenant: str, share: float, now: float) -> None:
        """A job of `tenant`'s was read, carrying its share."""
        self.model.note_share(tenant, share)
        self.contention.saw(tenant, now)

    def charge(self, batch: Batch[Any], model_s: float, now: float) -> None:
        """A batch's model time, to its tenant, or to each tenant of a mixed batch by its tokens."""
        if batch.tenant is not None:
            charges = {batch.tenant: model_s}
        else:
            tokens = sum(max(1, item.cost) for item in batch.items)
            charges = {}
            for item in batch.items:
                charges[item.tenant] = charges.get(item.tenant, 0.0) + model_s * max(1, item.cost) / tokens
        for tenant, seconds in charges.items():
            self.model.charge(tenant, seconds)
            self.contention.used(tenant, seconds, now)

    def limit(self, now: float, *, items_per_s: float) -> Callable[[str], int | None] | None:
        """The batcher's `limit` now (`MicroBatcher.take`)."""
        if not self.fair:
            return None
        return batch_limit(self.contention, items_per_s=items_per_s, slice_s=self.slice_s, now=now)

    def release(self, lane: Lane, queues: Sequence[HeldQueue], *, want: int,
                now: float) -> list[tuple[HeldQueue, int]]:
        """Which held jobs of `lane` to release now, `want` at most."""
        return plan_release(queues, want=want, now=now, turns=self._release[lane], ageing_s=self.ageing_s)
