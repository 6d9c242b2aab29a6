"""Where a queued job stands: how many jobs are ahead of it in its version's lane, and when it may
start. Pure: the numbers come from the queue script's job numbers (`sluice.wire.keys.queue_added`,
`queue_read`) and the version's measured service rate, so the simulator can use it unchanged.

Both figures are estimates, and the API documents them so: a job ahead that is cancelled or
expires before a worker reads it still counts until the reading passes it, and the start is the
jobs ahead over the rate the live workers measure.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Standing:
    queue_position: int  # jobs ahead of it in its version and lane; 0: the next one read
    estimated_start_s: float | None  # None while no live worker has measured its rate


def standing(*, seq: int, read: int, ahead_elsewhere: int = 0, service_rate: float) -> Standing | None:
    """A job numbered `seq` in a lane whose workers have read up to number `read`; the jobs of
    lanes served before it (`ahead_elsewhere`: the online lane's, for a bulk job) wait in front
    too. Starting takes the jobs in front, and the job itself, at `service_rate` jobs a second.
    None for a queued job whose number was read already: one its retry policy queued again under
    its first number, whose place the numbers no longer tell."""
    if seq <= read:
        return None
    position = seq - read - 1
    if service_rate <= 0:
        return Standing(position, None)
    return Standing(position, round((position + max(0, ahead_elsewhere) + 1) / service_rate, 3))
