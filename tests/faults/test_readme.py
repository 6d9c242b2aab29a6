"""The README runs as printed, top to bottom, after a plain `sluice up` (less its demo run).

Every ```sh block of the README is either run here or marked, on the line just above its fence,
`<!-- readme-test: skip (why) -->` or `<!-- readme-test: long-running (what) -->`: a block that is
neither fails the test, so skipping one is a visible, deliberate edit of the README. The blocks
that run are cut into commands (a line ending in a backslash goes on) and run in order in one
bash, as a reader's second terminal runs them: the venv's bin first on PATH, variables carried
from section to section, with only what `sluice up` itself was given (its home, its API port, the
bootstrap admin key) and no database or Redis URL. The working directory holds what a clone has
there: `.venv`, `examples/` and `.sluice` (the platform's home). The own-model section's Python
block is saved as the file the section names.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support import REPO

from ._up import ADMIN_KEY, Up, start_up

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.soak]

MARK = "@@sluice-readme-rc"
MARKER = re.compile(r"^<!-- readme-test: (skip|long-running) \((.+)\) -->$")
# Every version that is not retired holds a worker slot; after the sections above it, the own-model
# section's third model makes six versions (see the README's note at "Serving your own model").
# As on the 2-core machine the README is written for, whatever this one has: every version of
# every section must be served there.
CORES = "2"


@dataclass(frozen=True)
class Block:
    section: str
    marker: str | None  # "skip" or "long-running"; None: the block runs
    commands: tuple[str, ...]


def quote_left_open(command: str) -> bool:
    try:
        shlex.split(command, comments=True)
    except ValueError:  # "No closing quotation"
        return True
    return False


def commands_of(body: str) -> list[str]:
    """A block's commands, blank lines and comment lines left out. A line ending in a backslash
    goes on (joined onto one line), and so does one that leaves a single quote open (a JSON body
    over several lines: the newlines are kept, inside the quotes)."""
    commands: list[str] = []
    pending = ""
    for line in body.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line
        if line.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        if quote_left_open(pending):
            pending += "\n"
            continue
        commands.append(pending)
        pending = ""
    assert not pending, f"a command runs past its block: {pending}"
    return commands


def readme_blocks(readme: str) -> list[Block]:
    """Every ```sh / ```bash block, in order, with its section and its marker."""
    blocks: list[Block] = []
    section = ""
    lines = readme.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            section = line[3:]
        if re.fullmatch(r"```(sh|bash)", line):
            end = lines.index("```", i + 1)
            found = MARKER.match(lines[i - 1]) if i else None
            assert found or not lines[i - 1].startswith("<!-- readme-test"), f"a malformed marker: {lines[i - 1]}"
            blocks.append(Block(section=section, marker=found.group(1) if found else None,
                                commands=tuple(commands_of("\n".join(lines[i + 1 : end])))))
            i = end
        i += 1
    return blocks


def readme_section(readme: str, title: str) -> str:
    return readme.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def run_in_one_shell(commands: list[str], *, env: dict[str, str], cwd: Path,
                     timeout_s: float) -> list[tuple[str, int, str]]:
    """Each command with its exit status and its output, run one after another in one bash."""
    script = "".join(f"{command}\nprintf '\\n{MARK} {i} %d\\n' $?\n" for i, command in enumerate(commands))
    done = subprocess.run(["bash", "-c", script], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout_s)
    results, output = [], done.stdout
    for i, command in enumerate(commands):
        before, found, output = output.partition(f"\n{MARK} {i} ")
        assert found, f"the shell stopped at command {i}: {command}\nstderr: {done.stderr}"
        status, _, output = output.partition("\n")
        results.append((command, int(status), before.strip()))
    return results


def reader_env(platform: Up) -> dict[str, str]:
    """What a reader's second terminal has after `sluice up`: the venv activated, the platform's
    own variables, nothing more."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env.update(SLUICE_HOME=str(platform.home), SLUICE_API_PORT=str(platform.api_port),
               SLUICE_BOOTSTRAP_ADMIN_KEY=ADMIN_KEY, PYTHONPATH=str(REPO),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    return env


def a_clone(tmp_path: Path, platform: Up, readme: str) -> Path:
    """A working directory laid out like the clone the README is read in."""
    here = tmp_path / "clone"
    here.mkdir()
    (here / ".venv").symlink_to(Path(sys.executable).parent.parent)
    (here / "examples").symlink_to(REPO / "examples")
    (here / ".sluice").symlink_to(platform.home)
    section = readme_section(readme, "Serving your own model")
    script = re.search(r"save this as `(\S+)`.*?```python\n(.*?)^```", section, flags=re.DOTALL | re.MULTILINE)
    assert script, "the own-model section names no script to save"
    (here / script.group(1)).write_text(script.group(2))
    return here


def test_every_shell_block_of_the_readme_is_run_or_marked() -> None:
    blocks = readme_blocks((REPO / "README.md").read_text())
    assert len(blocks) > 10, blocks
    for block in blocks:
        assert block.commands, f"an empty block in {block.section!r}"
    assert {b.section for b in blocks if b.marker is None} >= {
        "A session with curl", "Rolling out a new version", "Serving your own model", "Batch scoring and schedules"}


def test_the_readme_runs_as_printed(tmp_path: Path) -> None:
    readme = (REPO / "README.md").read_text()
    platform = start_up(tmp_path, env_extra={"SLUICE_CPU_CORES": CORES})
    try:
        here = a_clone(tmp_path, platform, readme)
        commands = [c for b in readme_blocks(readme) if b.marker is None for c in b.commands]
        results = run_in_one_shell(commands, env=reader_env(platform), cwd=here, timeout_s=420)
        failed = [(command, status, output) for command, status, output in results if status != 0]
        assert not failed, failed
        said = {command.split("  #")[0].strip(): output for command, _, output in results}
        check_the_curl_session(said)
        check_the_rollout(said, platform)
        check_the_own_model(said, platform)
        check_batch_scoring(said, here)
        assert "order-42-try-1" in next(output for command, output in said.items()
                                         if command.startswith("sleep 1; grep -h order-42-try-1"))
        check_every_version_is_served(platform)
    finally:
        platform.terminate()


def said_by(said: dict[str, str], start: str) -> str:
    """The output of the one command that starts with `start`."""
    found = [output for command, output in said.items() if command.startswith(start)]
    assert len(found) == 1, (start, list(said))
    return found[0]


def check_the_curl_session(said: dict[str, str]) -> None:
    waited = json.loads(said_by(said, 'curl -s "$API/v1/jobs/$JOB?wait=10"'))
    assert waited["status"] == "succeeded" and waited["output"]["label"] == "card_lost", waited
    events = said_by(said, 'curl -sN "$API/v1/jobs/$JOB/events"')
    assert "event: succeeded" in events, events
    many = json.loads(said_by(said, 'curl -s "$API/v1/jobs?ids=$JOB,'))
    assert [job["id"] for job in many["jobs"]] == [waited["id"]] and many["pending"] == [], many
    assert many["not_found"] == ["job_a", "job_b"], many
    registered = json.loads(said_by(said, "curl -s -XPOST $API/v1/models/intent/versions "))
    assert (registered["version"], registered["state"]) == ("v2", "canary"), registered
    routed = json.loads(said_by(said, "curl -s -XPUT $API/v1/models/intent/routing "))
    assert "error" not in routed, routed


def check_the_rollout(said: dict[str, str], platform: Up) -> None:
    assert "against 'v1', starting at the shadow phase" in said[
        "sluice rollout start minilm v2 --steps 1,5,25,100 --soak-s 600 --min-samples 500"]
    assert "running" in said["sluice rollout status minilm"]
    assert "aborted; weights restored to {'v1': 100.0, 'v2': 20.0}" in said["sluice rollout abort minilm"]
    assert "minilm v2 over 300 s" in said["sluice stats minilm v2 --window-s 300"]
    for command in ("curl -s -XPOST $API/v1/models/minilm/versions ", "curl -s -XPATCH $API/v1/models/minilm/",
                    "curl -s -XPUT $API/v1/models/minilm/routing "):
        assert "error" not in json.loads(said_by(said, command)), command
    # The operator views answer the admin key the section passes them (a tenant's would get 403).
    stats = json.loads(said_by(said, 'curl -s "$API/v1/models/minilm/versions/v2/stats?'))
    assert (stats.get("model"), stats.get("version")) == ("minilm", "v2"), stats
    quality = json.loads(said_by(said, 'curl -s "$API/v1/models/minilm/versions/v2/quality?'))
    assert "windows" in quality, quality

    with httpx.Client(base_url=platform.api_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as admin:
        rollout = admin.get("/v1/models/minilm/rollouts/current").json()
        model = admin.get("/v1/models/minilm").json()
    assert (rollout["canary"], rollout["stable"], rollout["state"]) == ("v2", "v1", "aborted")
    assert [d["action"] for d in rollout["decisions"]][0] == "start"
    assert rollout["decisions"][-1]["action"] == "abort"
    assert rollout["policy"]["steps"] == [1.0, 5.0, 25.0, 100.0] and rollout["policy"]["soak_s"] == 600
    assert model["routing"] == {"v1": 100.0, "v2": 20.0}, "the abort and the rollback keep the shadow's copies"
    assert {v["version"]: v["state"] for v in model["versions"]} == {"v1": "stable", "v2": "shadow"}


def check_every_version_is_served(platform: Up) -> None:
    """After every section, on two cores: no version that is not retired has lost its workers."""
    with httpx.Client(base_url=platform.api_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as admin:
        models = admin.get("/v1/models").json()["models"]
    unserved = {f"{m['name']}/{v['version']}": v.get("replicas") for m in models for v in m["versions"]
                if v["state"] != "retired" and v["min_replicas"] >= 1
                and not (v.get("replicas") and v["replicas"]["live"] >= 1 and not v["replicas"]["not_served"])}
    assert not unserved, unserved


def check_the_own_model(said: dict[str, str], platform: Up) -> None:
    answered = json.loads(said_by(said, 'curl -s "$API/v1/models/support-encoder/jobs?wait=60"'))
    assert answered["status"] == "succeeded", answered
    assert answered["output"]["dim"] == 384 and answered["version"] == "v1"
    registered = said["sluice models register support-encoder v2 --kind hf-embedding --path my-encoder-v2"]
    assert "registered support-encoder v2 (staged)" in registered, registered
    assert "starting at 10 %" in said["sluice rollout start support-encoder v2 --steps 10,50,100 --soak-s 600 "
                                      "--min-samples 500"]
    assert "aborted; weights restored to {'v1': 100.0}" in said_by(said, "sluice rollout abort support-encoder")

    with httpx.Client(base_url=platform.api_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as admin:
        model = admin.get("/v1/models/support-encoder").json()
    assert model["kind"] == "hf-embedding" and model["routing"] == {"v1": 100.0}
    versions = {v["version"]: v for v in model["versions"]}
    assert versions["v1"]["state"] == "stable" and versions["v2"]["state"] == "staged"
    # Published content-addressed under the platform's home, by the hash of every file.
    assert versions["v1"]["artifact"].startswith((platform.home / "artifacts").resolve().as_uri())
    assert versions["v1"]["sha256"] == versions["v2"]["sha256"]


def check_batch_scoring(said: dict[str, str], here: Path) -> None:
    followed = said_by(said, "sluice batch submit calls.parquet ")
    assert "succeeded, 50 done, 0 failed of 50" in followed, followed
    with (here / "scores.csv").open(newline="") as scores:
        rows = list(csv.DictReader(scores))
    numbers = [int(row["row"]) for row in rows]
    assert len(rows) == 50 and numbers == sorted(numbers), rows[:3]
    assert {row["status"] for row in rows} == {"succeeded"}
    scheduled = json.loads(said_by(said, "curl -s -XPOST $API/v1/schedules "))
    assert scheduled["id"].startswith("sch_"), scheduled
    runs = json.loads(said_by(said, 'curl -s "$API/v1/batches?schedule_id=$SCHEDULE"'))
    assert "error" not in runs, runs
