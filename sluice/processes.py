"""Child processes that die with the process that started them.

A supervisor killed with SIGKILL runs no cleanup, so its children would outlive it, holding their
ports and the GPU. On Linux the kernel can signal a child when its parent dies (PR_SET_PDEATHSIG);
the signal chosen is the child's ordinary stop signal, so it still drains.

The surprise: the kernel sends it when the *thread* that forked the child exits, not the process.
Start such children from a thread that lives as long as they should, the main thread in practice.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` for `subprocess.Popen` that has the child receive `sig` when this process
    dies; None where the platform has no such thing (the child then simply outlives it)."""
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()
    # Loaded here, before the fork: the child should run as little as possible before exec.
    libc = ctypes.CDLL(None, use_errno=True)

    def arm() -> None:
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        # The parent may have died between the fork and the prctl: nobody would signal us then.
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return arm
