"""The README's "Rolling out a new version" runs as printed after a plain `sluice up`.

Its shell block is read from the README itself, cut into commands (a line ending in a backslash
goes on), and run in order in one shell, so its variables carry from command to command, with
only what `sluice up` itself is given (the home, the API port, the bootstrap admin key): no
database or Redis URL, which the embedded stores of `sluice up` do not have at a known port.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import REPO

from ._up import ADMIN_KEY, Up, start_up

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.soak]

SECTION = "## Rolling out a new version"
MARK = "@@sluice-readme-rc"


def readme_section(readme: str, title: str) -> str:
    return readme.split(f"\n{title}\n", 1)[1].split("\n## ", 1)[0]


def readme_commands(readme: str, title: str = SECTION) -> list[str]:
    """The commands of the section's ```sh / ```bash blocks, each joined onto one line."""
    section = readme_section(readme, title)
    commands: list[str] = []
    for block in re.findall(r"^```(?:sh|bash)\n(.*?)^```", section, flags=re.MULTILINE | re.DOTALL):
        pending = ""
        for line in block.splitlines():
            if not pending and (not line.strip() or line.lstrip().startswith("#")):
                continue
            pending += line
            if line.endswith("\\"):
                pending = pending[:-1] + " "
                continue
            commands.append(pending)
            pending = ""
        assert not pending, f"a command runs past its block: {pending}"
    return commands


@pytest.fixture
def platform(tmp_path: Path) -> Iterator[Up]:
    up = start_up(tmp_path)
    try:
        yield up
    finally:
        up.terminate()


def run_in_one_shell(commands: list[str], *, env: dict[str, str], cwd: Path,
                     timeout_s: float = 120) -> list[tuple[str, int, str]]:
    """Each command with its exit status and its output, run one after another in one bash."""
    script = "".join(f"{command}\nprintf '\\n{MARK} {i} %d\\n' $?\n" for i, command in enumerate(commands))
    done = subprocess.run(["bash", "-c", script], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout_s)
    results, output = [], done.stdout
    for i, command in enumerate(commands):
        before, found, output = output.partition(f"\n{MARK} {i} ")
        assert found, f"the block stopped at command {i}: {command}\nstderr: {done.stderr}"
        status, _, output = output.partition("\n")
        results.append((command, int(status), before.strip()))
    return results


def readme_env(platform: Up) -> dict[str, str]:
    """What a reader's shell has after `sluice up`: the platform's own variables, nothing more."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env.update(SLUICE_HOME=str(platform.home), SLUICE_API_PORT=str(platform.api_port),
               SLUICE_BOOTSTRAP_ADMIN_KEY=ADMIN_KEY, PYTHONPATH=str(REPO),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    return env


def test_the_rollout_section_of_the_readme_runs_as_printed(platform: Up, tmp_path: Path) -> None:
    commands = readme_commands((REPO / "README.md").read_text())
    assert any(c.startswith("sluice rollout start ") for c in commands), commands
    env = readme_env(platform)

    results = run_in_one_shell(commands, env=env, cwd=tmp_path)
    failed = [(command, status, output) for command, status, output in results if status != 0]
    assert not failed, failed
    for command, _, output in results:
        if command.startswith("curl") and output.startswith("{"):
            assert "error" not in json.loads(output), (command, output)
    said = {command.split("#")[0].strip(): output for command, _, output in results}
    assert "against 'v1', starting at the shadow phase" in said[
        "sluice rollout start minilm v2 --steps 1,5,25,100 --soak-s 600 --min-samples 500"]
    assert "running" in said["sluice rollout status minilm"]
    assert "aborted; weights restored to {'v1': 100.0, 'v2': 20.0}" in said["sluice rollout abort minilm"]
    assert "minilm v2 over 300 s" in said["sluice stats minilm v2 --window-s 300"]

    with httpx.Client(base_url=platform.api_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as admin:
        rollout = admin.get("/v1/models/minilm/rollouts/current").json()
        assert (rollout["canary"], rollout["stable"], rollout["state"]) == ("v2", "v1", "aborted")
        assert [d["action"] for d in rollout["decisions"]][0] == "start"
        assert rollout["decisions"][-1]["action"] == "abort"
        assert rollout["policy"]["steps"] == [1.0, 5.0, 25.0, 100.0] and rollout["policy"]["soak_s"] == 600
        model = admin.get("/v1/models/minilm").json()
    assert model["routing"] == {"v1": 100.0, "v2": 20.0}, "the abort and the rollback keep the shadow's copies"
    assert {v["version"]: v["state"] for v in model["versions"]} == {"v1": "stable", "v2": "shadow"}


def test_the_own_model_section_of_the_readme_runs_as_printed(tmp_path: Path) -> None:
    """From `save_pretrained` to a served, canaried and rolled-back version, as a new user follows
    the README: `sluice up` as it says for this 2-core machine, its Python block saved as the file
    it names, its shell block run in order."""
    readme = (REPO / "README.md").read_text()
    assert "SLUICE_WORKER_SLOTS=4 sluice up" in readme_section(readme, "## Serving your own model")
    platform = start_up(tmp_path, env_extra={"SLUICE_WORKER_SLOTS": "4"})
    try:
        _follow_the_own_model_section(readme, platform, tmp_path)
    finally:
        platform.terminate()


def _follow_the_own_model_section(readme: str, platform: Up, tmp_path: Path) -> None:
    section = readme_section(readme, "## Serving your own model")
    script = re.search(r"save this as `(\S+)`.*?```python\n(.*?)^```", section, flags=re.DOTALL | re.MULTILINE)
    assert script, "the section names no script to save"
    (tmp_path / script.group(1)).write_text(script.group(2))
    commands = readme_commands(readme, "## Serving your own model")

    results = run_in_one_shell(commands, env=readme_env(platform), cwd=tmp_path, timeout_s=240)
    failed = [(command, status, output) for command, status, output in results if status != 0]
    assert not failed, failed
    said = {command.split("#")[0].strip(): output for command, _, output in results}
    answered = json.loads(next(output for command, output in said.items() if "jobs?wait=" in command))
    assert answered["status"] == "succeeded", answered
    assert answered["output"]["dim"] == 384 and answered["version"] == "v1"
    registered = said["sluice models register support-encoder v2 --kind hf-embedding --path my-encoder-v2"]
    assert "registered support-encoder v2 (staged)" in registered, registered
    assert "starting at 10 %" in said["sluice rollout start support-encoder v2 --steps 10,50,100 --soak-s 600 "
                                      "--min-samples 500"]
    assert "aborted; weights restored to {'v1': 100.0}" in said["sluice rollout abort support-encoder"]

    with httpx.Client(base_url=platform.api_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as admin:
        model = admin.get("/v1/models/support-encoder").json()
    assert model["kind"] == "hf-embedding" and model["routing"] == {"v1": 100.0}
    versions = {v["version"]: v for v in model["versions"]}
    assert versions["v1"]["state"] == "stable" and versions["v2"]["state"] == "staged"
    # Published content-addressed under the platform's home, by the hash of every file.
    assert versions["v1"]["artifact"].startswith((platform.home / "artifacts").resolve().as_uri())
    assert versions["v1"]["sha256"] == versions["v2"]["sha256"]
