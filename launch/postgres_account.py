"""The system account embedded Postgres runs as when `sluice up` runs as root.

Postgres refuses to run as root ("root execution of the PostgreSQL server is not permitted"),
so its data directory is owned by, and the server runs as, a dedicated system account.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import shutil
import stat
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

PG_SYSTEM_USER = "sluice"


def postgres_account() -> tuple[int, int] | None:
    """The (uid, gid) to run Postgres as, or None to run it as ourselves.

    Postgres exits with "root execution of the PostgreSQL server is not permitted", so as root
    we use a dedicated system account, created on first use, with `nobody` as a fallback where
    accounts cannot be created (read-only /etc, no useradd).
    """
    if os.geteuid() != 0:
        return None
    with contextlib.suppress(KeyError):
        entry = pwd.getpwnam(PG_SYSTEM_USER)
        return entry.pw_uid, entry.pw_gid
    useradd = shutil.which("useradd") or "/usr/sbin/useradd"
    why = "no useradd"
    if os.path.exists(useradd):
        result = subprocess.run(
            [
                useradd,
                "--system",
                "--user-group",
                "--no-create-home",
                "--home-dir",
                "/nonexistent",
                "--shell",
                "/usr/sbin/nologin",
                PG_SYSTEM_USER,
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        why = result.stderr.strip()
    try:
        entry = pwd.getpwnam(PG_SYSTEM_USER)
    except KeyError:
        log.warning("cannot create user %r (%s); embedded Postgres runs as nobody", PG_SYSTEM_USER, why)
        entry = pwd.getpwnam("nobody")
    return entry.pw_uid, entry.pw_gid


def grant_traverse(path: Path, account: tuple[int, int]) -> None:
    """Make every ancestor of `path` searchable by `account` (adds o+x where it is missing).

    Needed when the home or the virtualenv lives under a 0700 directory such as /root or
    pytest's /tmp/pytest-of-root. Only the search bit is added: listings stay private.
    """
    uid, gid = account
    for directory in reversed(path.resolve().parents):
        st = directory.stat()
        if st.st_uid == uid:
            needed = stat.S_IXUSR
        elif st.st_gid == gid:
            needed = stat.S_IXGRP
        else:
            needed = stat.S_IXOTH
        if not st.st_mode & needed:
            log.warning("adding o+x to %s so the postgres account can reach its files", directory)
            directory.chmod(stat.S_IMODE(st.st_mode) | stat.S_IXOTH)


def chown_tree(path: Path, account: tuple[int, int]) -> None:
    uid, gid = account
    os.lchown(path, uid, gid)
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            os.lchown(os.path.join(root, name), uid, gid)
