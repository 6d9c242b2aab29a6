"""A schedule's slots across both daylight-saving changes: each local wall-clock slot runs once."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from sluice.errors import InvalidInput
from sluice.schedule_slots import due_slots, next_slot, wall_clock_instant

PARIS = "Europe/Paris"
# 2026 in Paris: the clock goes from 02:00 CET to 03:00 CEST at 01:00 UTC on 29 March, and from
# 03:00 CEST back to 02:00 CET at 01:00 UTC on 25 October.
SPRING_CHANGE = datetime(2026, 3, 29, 1, 0, tzinfo=UTC)
AUTUMN_CHANGE = datetime(2026, 10, 25, 1, 0, tzinfo=UTC)


def _utc(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def _slots(cron: str, timezone: str, after: datetime, count: int) -> list[datetime]:
    slots = []
    for _ in range(count):
        after = next_slot(cron, timezone, after)
        slots.append(after)
    return slots


def test_a_nightly_slot_runs_once_on_the_night_the_clock_goes_back() -> None:
    slots = _slots("0 2 * * *", PARIS, _utc("2026-10-23T12:00"), 4)
    # 02:00 CEST is 00:00 UTC; 02:00 CET, an hour later, is the same wall-clock slot again.
    assert slots == [_utc("2026-10-24T00:00"), _utc("2026-10-25T00:00"), _utc("2026-10-26T01:00"),
                     _utc("2026-10-27T01:00")]
    local_dates = [slot.astimezone(ZoneInfo(PARIS)).date().isoformat() for slot in slots]
    assert local_dates == ["2026-10-24", "2026-10-25", "2026-10-26", "2026-10-27"]


def test_every_wall_clock_time_of_the_repeated_hour_runs_once() -> None:
    slots = _slots("*/30 * * * *", PARIS, _utc("2026-10-24T23:00"), 6)
    # 01:30, 02:00, 02:30 CEST; then 02:00 and 02:30 CET come again on the clock and are skipped.
    assert slots == [_utc("2026-10-24T23:30"), _utc("2026-10-25T00:00"), _utc("2026-10-25T00:30"),
                     _utc("2026-10-25T02:00"), _utc("2026-10-25T02:30"), _utc("2026-10-25T03:00")]


@pytest.mark.parametrize(("cron", "expected"), [
    ("*/30 * * * *", "2026-10-25T02:00"),   # 03:00 CET: 02:00 and 02:30 CET ran at their first showing
    ("0 2 * * *", "2026-10-26T01:00"),
    ("15 1 * * *", "2026-10-26T00:15"),     # 01:15 CET on the 26th; the 25th's ran before the change
    ("* * * * * */20", "2026-10-25T02:00"),  # seconds: 3 a minute, 180 skipped in the repeated hour
])
def test_after_an_instant_of_the_repeated_hour_the_next_slot_is_a_new_wall_clock_time(
    cron: str, expected: str
) -> None:
    second_showing = AUTUMN_CHANGE + timedelta(minutes=15)  # 02:15 CET, the second 02:15
    assert next_slot(cron, PARIS, second_showing) == _utc(expected)


def test_a_slot_the_clock_skips_runs_at_the_first_instant_after_the_gap() -> None:
    slots = _slots("30 2 * * *", PARIS, _utc("2026-03-27T12:00"), 3)
    # 02:30 CET is 01:30 UTC, 02:30 CEST 00:30 UTC: on the 29th 02:30 never shows; 03:00 CEST does.
    assert slots == [_utc("2026-03-28T01:30"), SPRING_CHANGE, _utc("2026-03-30T00:30")]
    assert wall_clock_instant(datetime(2026, 3, 29, 2, 30), ZoneInfo(PARIS)) == SPRING_CHANGE


def test_the_slots_of_the_gap_and_the_one_after_it_are_one_run() -> None:
    slots = _slots("*/30 * * * *", PARIS, _utc("2026-03-28T23:45"), 4)
    # 01:00 and 01:30 CET, then 02:00, 02:30 and 03:00 (CEST) all at the change, then 03:30 CEST.
    assert slots == [_utc("2026-03-29T00:00"), _utc("2026-03-29T00:30"), SPRING_CHANGE, _utc("2026-03-29T01:30")]


@pytest.mark.parametrize("timezone", ["Europe/Paris", "America/New_York", "Australia/Lord_Howe", "UTC"])
@pytest.mark.parametrize("cron", ["0 * * * *", "*/20 * * * *", "30 2 * * *"])
def test_around_both_changes_slots_are_distinct_wall_clock_times_in_order(timezone: str, cron: str) -> None:
    zone = ZoneInfo(timezone)
    # Lord Howe moves its clock by 30 minutes, in April and October; the others by an hour.
    for start in (_utc("2026-03-01T00:00"), _utc("2026-09-25T00:00")):
        end = start + timedelta(days=45)
        slots = [next_slot(cron, timezone, start)]
        while slots[-1] < end:
            slots.append(next_slot(cron, timezone, slots[-1]))
        walls = [slot.astimezone(zone).replace(tzinfo=None) for slot in slots]
        assert all(a < b for a, b in zip(slots, slots[1:], strict=False))
        assert len(set(walls)) == len(walls), "a wall-clock time ran twice"
        # Every wall-clock time the cron names between the first and last slot and that the clock
        # showed is one of them (the skipped ones are folded into the change).
        hour = walls[0]
        shown = set(walls)
        while hour < walls[-1]:
            hour += timedelta(minutes=10)
            if _matches(cron, hour) and wall_clock_instant(hour, zone).astimezone(zone).replace(tzinfo=None) == hour:
                assert hour in shown, hour


def _matches(cron: str, local: datetime) -> bool:
    minute, hour = cron.split()[:2]
    minutes = {0, 20, 40} if minute == "*/20" else {int(minute)}
    return local.minute in minutes and (hour == "*" or local.hour == int(hour))


def test_due_slots_are_the_slots_up_to_now_and_the_next_one_follows() -> None:
    due = due_slots("0 2 * * *", PARIS, first=_utc("2026-10-24T00:00"), now=_utc("2026-10-26T12:00"))
    assert due.slots == [_utc("2026-10-24T00:00"), _utc("2026-10-25T00:00"), _utc("2026-10-26T01:00")]
    assert due.following == _utc("2026-10-27T01:00")
    nothing = due_slots("0 2 * * *", PARIS, first=due.following, now=_utc("2026-10-26T12:00"))
    assert nothing.slots == [] and nothing.following == due.following


def test_far_behind_the_slots_past_the_limit_are_skipped() -> None:
    first = _utc("2026-01-01T00:00")
    due = due_slots("0 * * * *", "UTC", first=first, now=_utc("2026-01-10T12:30"), limit=5)
    assert due.slots == [first + timedelta(hours=n) for n in range(5)]
    assert due.following == _utc("2026-01-10T13:00")


@pytest.mark.parametrize(("cron", "timezone"), [("every night", "UTC"), ("61 * * * *", "UTC"),
                                                ("0 2 * * *", "Mars/Olympus"), ("0 0 30 2 *", "UTC")])
def test_a_cron_or_zone_croniter_cannot_read_is_invalid_input(cron: str, timezone: str) -> None:
    with pytest.raises(InvalidInput):
        next_slot(cron, timezone, _utc("2026-01-01T00:00"))
