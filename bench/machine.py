"""The machine a benchmark runs on: CPU accounting from /proc, a wait for a quiet machine, and
what the machine is (cores, CPU, versions), recorded with every result."""

from __future__ import annotations

import contextlib
import math
import os
import platform as py_platform
import time
from pathlib import Path
from typing import Any

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# The CPU features the model's kernels choose between (fp32, int8 with VNNI, bf16, AMX tiles).
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


def cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of one process (and its reaped children); nan if gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    # After the comm field: state is fields[0]; utime, stime are fields 11, 12.
    return (int(fields[11]) + int(fields[12])) / _TICKS


def system_cpu_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds over all cores, from /proc/stat."""
    parts = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    total = sum(parts[:8])
    return (total - idle) / _TICKS, total / _TICKS


class CpuWindow:
    """System-wide busy CPU over a window, and how much of it was not ours.

    `ours` is the caller's accounting of its own processes' CPU seconds over the same window;
    `foreign_cores` is what everything else on the machine (other users' jobs, Postgres, the
    kernel) kept busy, in cores, so a run disturbed by a neighbour can be recognised.
    """

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.busy0 = system_cpu_seconds()[0]
        self.elapsed = math.nan
        self.busy = math.nan

    def stop(self) -> CpuWindow:
        self.elapsed = time.perf_counter() - self.t0
        self.busy = system_cpu_seconds()[0] - self.busy0
        return self

    def foreign_cores(self, ours_cpu_s: float) -> float:
        return max(0.0, self.busy - ours_cpu_s) / self.elapsed


def wait_quiet(max_wait_s: float = 30.0, threshold_cores: float = 0.25, window_s: float = 1.0) -> float:
    """Wait (up to max_wait_s) for a window in which the machine is nearly idle; answer the
    busy cores of the last window (the caller's own idle process included)."""
    deadline = time.monotonic() + max_wait_s
    while True:
        window = CpuWindow()
        time.sleep(window_s)
        busy = window.stop().busy / window.elapsed
        if busy <= threshold_cores or time.monotonic() >= deadline:
            return busy


def machine_info() -> dict[str, Any]:
    import torch

    cpu_model, flags = "", set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not cpu_model:
                cpu_model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    return {
        "cores": os.cpu_count(), "cpu": cpu_model, "cpu_flags": [f for f in KERNEL_FLAGS if f in flags],
        "python": py_platform.python_version(),
        "torch": torch.__version__, "loadavg_at_start": os.getloadavg(),
    }
