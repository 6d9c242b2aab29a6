"""Where the queued jobs of an answer stand (`sluice/queue_standing.py`): their place in their
version's lane, from the job numbers the queue script gives and the workers' reading, and when they
may start, from the rate the version's live workers drain a backlog at (the admission's load, read
at most every 0.25 s and shared with it). One Redis round trip for all the jobs of an answer."""

from __future__ import annotations

from collections.abc import Sequence

from api.admission import Load
from api.deps import AppState
from sluice.queue_standing import Standing, held_standing, standing
from sluice.wire.broker import LaneKey
from sluice.wire.jobs import JobRecord, JobStatus, JobView


async def standings(state: AppState, jobs: Sequence[JobView | JobRecord]) -> dict[str, Standing]:
    """Per queued job, its standing; jobs that are not queued (or no longer, when their place is
    read), or were queued before jobs were numbered, have none."""
    queued = [job for job in jobs if job.status is JobStatus.queued and job.seq is not None]
    held = [job for job in jobs if job.status is JobStatus.queued and job.seq is None]
    if not queued and not held:
        return {}
    places, held_counts, held_progress = await state.broker.held_places(held) if held else ({}, {}, {})
    # A held job stands behind its lane's unread entries too.
    lanes: set[LaneKey] = {job.lane_key for job in queued} | {job.lane_key for job in held if job.id in places}
    # A bulk job waits behind its version's online lane too: bulk runs when online has nothing.
    # A held job's own lane was read with its place.
    wanted = {job.lane_key for job in queued} | {(model, version, "online") for model, version, _ in lanes}
    progress, still_queued = await state.broker.lane_progress(sorted(wanted), [job.id for job in queued])
    loads = {(model, version): await state.admission.load(model, version) for model, version, _ in lanes}
    found = {}
    for job in queued:
        if job.id not in still_queued:
            continue  # a worker took it meanwhile: it stands nowhere now
        model, version, lane = job.lane_key
        load = loads[(model, version)]
        place = standing(seq=job.seq or 0, read=progress[job.lane_key][1],
                         also_ahead=_also_ahead(load, lane, progress[(model, version, "online")]),
                         service_rate=load.backlog_rate)
        if place is not None:
            found[job.id] = place
    for job in held:
        if job.id not in places:
            continue  # released meanwhile: the next read numbers it
        model, version, lane = job.lane_key
        load = loads[(model, version)]
        # Read with its place, in one transaction (`Broker.held_places`).
        added, read = held_progress[job.lane_key]
        found[job.id] = held_standing(
            unread=max(0, added - read), index=places[job.id], priority=job.priority, tenant=job.tenant,
            share=job.share, held=held_counts[job.lane_key],
            also_ahead=_also_ahead(load, lane, progress[(model, version, "online")]),
            service_rate=load.backlog_rate)
    return found


def _also_ahead(load: Load, lane: str, online: tuple[int, int]) -> int:
    """The jobs in front of a queued job of `lane` that its position leaves out: those the workers
    hold, read and not finished, of its lane and, for a bulk job, the online lane's, unread too."""
    if lane == "online":
        return load.held_online
    added_online, read_online = online
    return max(0, added_online - read_online) + load.held_online + load.held_bulk
