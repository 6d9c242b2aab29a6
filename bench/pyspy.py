"""Sampling a running process with py-spy (a dev dependency) and saying where its time went.

`recording(pid, path)` samples the process for as long as the block runs and writes py-spy's
collapsed stacks ("frame;frame;... count" per line) to `path`; `summarise(path)` answers, per
function, the share of samples it was on the stack (inclusive) and at the top (self). Frames are
keyed without line numbers, so one function's lines count together.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_FRAME = re.compile(r"^(?P<function>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def _py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(found).exists():
        raise RuntimeError("py-spy is not installed: pip install -e '.[dev]'")
    return found


@contextlib.contextmanager
def recording(pid: int, path: Path, *, rate: int = 1000, extra: tuple[str, ...] = ()) -> Iterator[None]:
    """Sample `pid` while the block runs. Blocking mode (the default): each sample pauses the
    process for a moment, so a profiled run is slower than a measured one and is kept apart."""
    proc = subprocess.Popen(
        [_py_spy(), "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw", *extra, "--output", str(path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if not path.exists():
            raise RuntimeError(f"py-spy wrote no profile: {err.decode(errors='replace')[-500:]}")


def _key(frame: str) -> str:
    match = _FRAME.match(frame.strip())
    return frame.strip() if match is None else f"{match['function']} ({match['file']})"


@dataclass(frozen=True, slots=True)
class Profile:
    samples: int
    inclusive: Counter[str]
    self_: Counter[str]

    def top(self, n: int) -> list[tuple[str, float, float]]:
        """The `n` functions most often on the stack: (function, inclusive share, self share)."""
        total = self.samples or 1
        return [(key, count / total, self.self_[key] / total) for key, count in self.inclusive.most_common(n)]


def summarise(path: Path, *, thread_marker: str = "Runner.run (asyncio/runners.py)") -> Profile:
    """The samples of the thread whose stacks hold `thread_marker` (by default the one running the
    event loop: py-spy counts idle pool threads as busy, and the API's own work runs on the loop)."""
    inclusive: Counter[str] = Counter()
    self_: Counter[str] = Counter()
    samples = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_key(frame) for frame in stack.split(";")]
        if thread_marker not in frames:
            continue
        samples += count
        for key in set(frames):
            inclusive[key] += count
        self_[frames[-1]] += count
    return Profile(samples=samples, inclusive=inclusive, self_=self_)
