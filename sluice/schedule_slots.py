"""The slots of a cron schedule: each local wall-clock time the cron expression names is one slot,
run once, at an instant in UTC. Pure: it takes times and answers times.

The surprising parts, both at daylight-saving changes (ARCHITECTURE, "Schedules"):

* When the clock is set back, the wall-clock times of the repeated hour come twice. A slot among
  them runs once, at its first instant: croniter, given local time, answers both (`0 2 * * *` in
  Europe/Paris on the autumn change: 02:00 CEST and 02:00 CET), and both runs would render the same
  `{date}` into their output paths.
* When the clock is set forward, the wall-clock times of the gap never show. A slot among them runs
  at the first instant after the gap (02:30 on the spring change in Paris runs at 03:00 CEST), and
  every slot of the gap, with a slot at that instant, is that one run: a slot is its instant.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadCronError, CroniterBadDateError, croniter

from sluice.errors import InvalidInput

# The most missed slots one dispatch catches up per schedule (after beat was down for a long time).
MAX_CATCH_UP = 100


def zone_of(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise InvalidInput(f"unknown time zone '{name}'") from exc


def wall_clock_instant(local: datetime, zone: ZoneInfo) -> datetime:
    """The instant a naive wall-clock time in `zone` names: its first one when the clock showed it
    twice, the end of the gap when the clock skipped it."""
    instant = local.replace(tzinfo=zone, fold=0).astimezone(UTC)
    if instant.astimezone(zone).replace(tzinfo=None) == local:
        return instant
    # In a gap, fold=1 reads the time with the offset from after the change and lands before it;
    # fold=0 with the offset from before and lands after it. The change is between, on a second.
    before = local.replace(tzinfo=zone, fold=1).astimezone(UTC)
    offset = instant.astimezone(zone).utcoffset()
    low, high = 0, int((instant - before).total_seconds())
    while low < high:
        middle = (low + high) // 2
        if (before + timedelta(seconds=middle)).astimezone(zone).utcoffset() == offset:
            high = middle
        else:
            low = middle + 1
    return before + timedelta(seconds=low)


def next_slot(cron: str, timezone: str, after: datetime) -> datetime:
    """The first slot of `cron` in `timezone` strictly after the instant `after`, in UTC."""
    zone = zone_of(timezone)
    local_after = after.astimezone(zone).replace(tzinfo=None)
    try:
        times = croniter(cron, local_after)
        while True:
            # Naive local times: croniter steps the wall clock, which never goes back.
            instant = wall_clock_instant(times.get_next(datetime), zone)
            # Past `after` on the wall clock but not in time: the second showing of a repeated
            # hour, whose times ran at their first instant already.
            if instant > after:
                return instant
    except (CroniterBadCronError, CroniterBadDateError, ValueError, KeyError) as exc:
        raise InvalidInput(f"'{cron}' is not a cron expression croniter reads: {exc}") from exc


@dataclass(frozen=True, slots=True)
class Due:
    """The slots due by a moment, oldest first, and the schedule's next slot after them."""

    slots: list[datetime]
    following: datetime


def due_slots(cron: str, timezone: str, *, first: datetime, now: datetime,
              limit: int = MAX_CATCH_UP) -> Due:
    """The slots from `first` (the schedule's earliest slot not run) up to `now`, at most `limit`
    of them; further behind than that, the slots in between are skipped, not run late one after
    another."""
    slots: list[datetime] = []
    slot = first
    while slot <= now:
        if len(slots) == limit:
            return Due(slots=slots, following=next_slot(cron, timezone, now))
        slots.append(slot)
        slot = next_slot(cron, timezone, slot)
    return Due(slots=slots, following=slot)
