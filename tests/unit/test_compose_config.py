"""`compose.yaml` as Compose itself reads it: Debian's docker-compose resolves and checks it
without an engine (`docker-compose config`), which .ci/run installs for this test."""

from __future__ import annotations

import os
import shutil
import subprocess

from tests.support import REPO


def _config(**env: str) -> subprocess.CompletedProcess[str]:
    compose = shutil.which("docker-compose")
    assert compose, "this test reads compose.yaml with Compose itself: apt-get install -y docker-compose"
    environment = {k: v for k, v in os.environ.items() if k != "GRAFANA_ADMIN_PASSWORD"} | env
    return subprocess.run([compose, "-f", str(REPO / "compose.yaml"), "config", "-q"], env=environment,
                          capture_output=True, text=True, timeout=60, cwd=REPO)


def test_compose_accepts_the_file_with_its_required_secrets_set() -> None:
    done = _config(GRAFANA_ADMIN_PASSWORD="a-password-for-the-test")
    assert done.returncode == 0, done.stderr


def test_compose_refuses_to_start_grafana_without_an_admin_password() -> None:
    done = _config()
    assert done.returncode != 0 and "set GRAFANA_ADMIN_PASSWORD" in done.stderr, done.stderr
