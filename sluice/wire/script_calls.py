"""The KEYS and ARGV of the stream protocol's transition scripts (sluice/wire/lua/: queue, claim,
finish), built from what the worker and the broker hold, and the claim script's verdicts.

Each call names the keys of one version's slot only, so the scripts run unchanged on a Redis
Cluster (see ARCHITECTURE, "Every script touches one slot")."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.redact import scrub
from sluice.references import InputRef, OutputRef
from sluice.vocabulary import LANES, ClaimVerdict, Lane
from sluice.wire import keys, samples
from sluice.wire.entries import Delivered, StreamEntry
from sluice.wire.jobs import JobRecord

DEAD_LETTER_MAXLEN = 100_000


@dataclass(frozen=True, slots=True)
class Claim:
    """The claim script's verdict on one entry: `run` (with the job's input, attempt number and
    references), `expired`, `dead` (with the last error), `missing`, or the final state the job
    already has."""

    verdict: str
    input: dict[str, Any] = field(default_factory=dict)
    attempts: int = 0
    last_error: str = ""
    input_ref: InputRef | None = None
    output_ref: OutputRef | None = None


@dataclass(frozen=True, slots=True)
class Finished:
    """One job's outcome as finish.lua stores it: `output` and `error` are JSON, or empty. Status
    `queued` is a retry: the job goes back to its queue with `error` noted as this attempt's."""

    job_id: str
    lane: Lane
    entry_id: str
    status: str
    output: bytes | str
    error: bytes | str
    sample: samples.Sample
    announce: bool = True  # publish the final state (a shadow copy's is nobody's to wait for)
    copy: JobRecord | None = None  # a shadow copy, queued (`queue_copies`) only if this write wins
    written: str = ""  # the facts of an output written to the job's output_uri (sluice.references.Written)
    cold_start_ms: float | None = None  # how long it waited for the worker its version woke from zero to start


def _flat(fields: Mapping[str, str]) -> list[str]:
    return [str(len(fields)), *(part for pair in fields.items() for part in pair)]


def _shared(rows: Sequence[Mapping[str, str]]) -> tuple[dict[str, str], list[dict[str, str]]]:
    """The fields all rows have with one value (never `id`, which names a row, so that each row
    keeps one of its own), and each row's other fields."""
    first, others = rows[0], rows[1:]
    shared = {name: value for name, value in first.items()
              if name != "id" and all(row.get(name) == value for row in others)}
    return shared, [{name: value for name, value in row.items() if name not in shared} for row in rows]


def queue_call(records: Sequence[JobRecord], *, result_ttl_s: int, window: int = 0) -> tuple[list[str], list[str]]:
    """KEYS and ARGV of queue.lua for one submission: one tenant's jobs, for one lane of one
    version (so the stream and the outbox are the same for all), those answered from the response
    cache (`cache_hit`) among them. `window`: hold jobs while that many entries wait unread (0:
    never; see queue.lua)."""
    first = records[0]
    if any((r.tenant, r.model, r.version, r.lane) != (first.tenant, first.model, first.version, first.lane)
           for r in records):
        raise ValueError("one submission queues one tenant's jobs on one lane of one version")
    queued = [record for record in records if not record.cache_hit]
    hits = [record for record in records if record.cache_hit]
    script_keys = [keys.stream(first.model, first.version, first.lane),  # type: ignore[arg-type]
                   keys.outbox(first.model, first.version), keys.deadlines(first.model, first.version),
                   keys.queue_added(first.model, first.version),
                   keys.held_index(first.model, first.version, first.lane)]  # type: ignore[arg-type]
    args = [str(result_ttl_s), str(len(queued)), str(window),
            keys.held_queue_prefix(first.model, first.version, first.lane)]  # type: ignore[arg-type]
    if queued:
        shared_record, own_records = _shared([record.to_redis() for record in queued])
        shared_entry, own_entries = _shared([StreamEntry.of(record).to_fields() for record in queued])
        args += [*_flat(shared_record), *_flat(shared_entry)]
        for record, own_record, own_entry in zip(queued, own_records, own_entries, strict=True):
            script_keys.append(keys.job(record.id))
            args += [*_flat(own_record), *_flat(own_entry)]
    else:
        args += ["0", "0"]
    for hit in hits:
        script_keys.append(keys.job(hit.id))
        args += _flat(hit.to_redis())
    return script_keys, args


def _lane_streams(model: str, version: str) -> list[str]:
    return [keys.stream(model, version, lane) for lane in LANES]


def _lane_number(lane: Lane) -> str:
    """How the claim and finish scripts name a lane: its place in `LANES`, from 1."""
    return str(LANES.index(lane) + 1)


def claim_call(model: str, version: str, delivered: Sequence[Delivered], *, now: float, worker: str,
               max_deliveries: int, channel: str) -> tuple[list[str], list[str]]:
    """KEYS and ARGV of claim.lua for entries of one version."""
    script_keys = [keys.outbox(model, version), keys.dead_stream(model, version), *_lane_streams(model, version)]
    args = [repr(now), worker, str(max_deliveries), channel, keys.GROUP, str(DEAD_LETTER_MAXLEN)]
    for item in delivered:
        script_keys.append(keys.job(item.entry.job_id))
        args += [_lane_number(item.lane), item.entry_id, item.entry.job_id]
    return script_keys, args


def parse_claims(reply: list[Any]) -> list[Claim]:
    claims = []
    for verdict, *rest in reply:
        name = verdict.decode()
        if name == ClaimVerdict.run:
            refs = [value or b"" for value in rest[2:4]] + [b"", b""]
            claims.append(Claim(name, input=json.loads(rest[0]), attempts=int(rest[1]),
                                input_ref=InputRef.parse(refs[0]), output_ref=OutputRef.parse(refs[1])))
        elif name == ClaimVerdict.dead:
            claims.append(Claim(name, last_error=rest[0].decode() if rest else ""))
        else:
            claims.append(Claim(name))
    return claims


def finish_call(model: str, version: str, jobs: Sequence[Finished], *, faults: Sequence[tuple[str, str]] = (),
                channel: str, result_ttl_s: int, started: float, finished: float, model_ms: float, batch_size: int,
                close_reason: str) -> tuple[list[str], list[bytes | str]]:
    """KEYS and ARGV of finish.lua for one batch of one version; `faults` are (job id, message)
    of the jobs whose run faulted."""
    script_keys = [keys.outbox(model, version), keys.stats(model, version), *_lane_streams(model, version),
                   keys.deadlines(model, version)]
    args: list[bytes | str] = [
        str(result_ttl_s), channel, keys.GROUP, str(samples.SAMPLES_MAXLEN), repr(started), repr(finished),
        repr(model_ms), str(batch_size), close_reason, str(len(jobs)),
    ]
    for job in jobs:
        script_keys.append(keys.job(job.job_id))
        args += [job.job_id, _lane_number(job.lane), job.entry_id, job.status, job.output, job.error,
                 "1" if job.announce else "", job.written, "" if job.cold_start_ms is None else repr(job.cold_start_ms),
                 *_flat(job.sample.to_fields())]
    for job_id, message in faults:
        script_keys.append(keys.job(job_id))
        args.append(scrub(message)[:500])
    return script_keys, args
