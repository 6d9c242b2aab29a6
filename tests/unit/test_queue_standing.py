"""Where a queued job stands (sluice/queue_standing.py): its place from the lane's job numbers, its
estimated start from the jobs in front of it over the workers' backlog rate."""

from __future__ import annotations

import pytest

from sluice.queue_standing import Standing, held_standing, standing


def test_the_next_job_read_stands_first_and_starts_after_one_job_time() -> None:
    assert standing(seq=11, read=10, service_rate=20.0) == Standing(0, 0.05)
    assert standing(seq=50, read=10, service_rate=20.0) == Standing(39, 2.0)


def test_jobs_the_workers_hold_delay_the_start_but_not_the_place() -> None:
    # 40 unread in front, and 160 read into the workers' prefetch and not started: at 20 a second
    # the job starts after 10 s, not the 2 s its place alone would say.
    place = standing(seq=51, read=10, also_ahead=160, service_rate=20.0)
    assert place == Standing(40, round(201 / 20.0, 3))


def test_a_job_whose_number_was_read_stands_nowhere() -> None:
    assert standing(seq=10, read=10, service_rate=20.0) is None  # queued again by its retry policy


def test_no_measured_rate_gives_a_place_without_an_estimate() -> None:
    assert standing(seq=15, read=10, also_ahead=3, service_rate=0.0) == Standing(4, None)


def test_a_held_job_stands_behind_the_unread_the_urgent_and_the_other_tenants_turns() -> None:
    held = {(0, "b"): 5, (1, "a"): 10, (1, "b"): 2, (2, "c"): 50}
    place = held_standing(unread=8, index=3, priority=1, tenant="a", share=1.0, held=held, also_ahead=20,
                          service_rate=10.0)
    # 8 unread + 3 before it in its queue + 5 more urgent + min(2, 4) of b's at its priority; none of c's.
    assert place.queue_position == 18
    assert place.estimated_start_s == pytest.approx((18 + 20 + 1) / 10.0)
