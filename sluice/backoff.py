"""Capped exponential backoff for a loop that retries after its store failed (Redis reconnects in
the worker, the webhook relay and the API's event hub): the first delay is `base_s`, each failure
doubles it up to `cap_s`, and a success starts again from `base_s`.

Pure: it never sleeps or reads a clock; the caller sleeps what `failed` answers. With `jitter` j
each delay is drawn between (1 - j) and all of it, from the random source given, so processes cut
off together do not retry in step.
"""

from __future__ import annotations

import random


class Backoff:
    """The delays of one retry loop; `failures` counts those since the last success."""

    def __init__(self, *, base_s: float, cap_s: float, jitter: float = 0.0, rng: random.Random | None = None) -> None:
        if not 0.0 <= jitter <= 1.0:
            raise ValueError(f"jitter is a fraction of the delay, from 0 to 1: {jitter}")
        self.base_s = base_s
        self.cap_s = cap_s
        self.jitter = jitter
        self.rng = rng or random.Random()
        self.failures = 0
        self._delay_s = base_s

    def failed(self) -> float:
        """Count a failure; answer how long to wait before the next try."""
        delay = self._delay_s
        self._delay_s = min(delay * 2, self.cap_s)
        self.failures += 1
        if self.jitter:
            return delay * self.rng.uniform(1.0 - self.jitter, 1.0)
        return delay

    def succeeded(self) -> None:
        """The next failure waits `base_s` again."""
        self.failures = 0
        self._delay_s = self.base_s
