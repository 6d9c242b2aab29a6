"""Weights loaded once per process: the models of a worker process that serves several versions.

Versions whose artifact, sha256, kind, handler class, device and pickle opt-in are equal run the
same model, so they get the same handler object, loaded once and counted: the last `release`
drops it. Below handlers, the MiniLM encoder is shared too (`EncoderCache`): the intent classifier
is a head over the very encoder the embedding model holds, and a canary clone of a file costs no
second copy.

The artifact's integrity check runs before anything is shared: the identity holds the sha256 the
version declares, so a version naming a loaded file with another hash is a new identity, verified
(and refused) on its own. `resident_bytes` is what a load grew the process's resident memory by,
measured around it (0 for a version that shared a loaded model); the heartbeat reports it and
the placement budgets memory with it (docs/ARCHITECTURE.md, "Weights loaded once per process").
"""

from __future__ import annotations

import gc
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from workers.models.loading import Sources, load_handler
from workers.models.precision import PrecisionChoice, PrecisionPolicy
from workers.models.protocol import ModelHandler

if TYPE_CHECKING:
    from workers.models.calibration import Selected
    from workers.models.minilm import MiniLMEncoder

_PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    """This process's resident memory now."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * _PAGE


@dataclass(frozen=True, slots=True)
class Loaded:
    handler: ModelHandler
    weights: str  # the identity: equal identities share this handler
    resident_bytes: int  # what loading it added to the process; 0 when it was shared
    shared: bool


@dataclass
class _Entry:
    handler: ModelHandler | None = None
    error: BaseException | None = None
    holders: int = 0
    done: threading.Event | None = None


class EncoderCache:
    """The process's MiniLM encoders by what their weights depend on, held while a handler holds
    them (weak references: the last handler dropped lets its encoder go)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, ...], tuple[weakref.ref[Any], PrecisionChoice, Any]] = {}

    def shared(self, key: tuple[str, ...],
               build: Callable[[], Selected[MiniLMEncoder]]) -> Selected[MiniLMEncoder]:
        from workers.models.calibration import Selected

        # Built under the lock: two versions over one encoder loading at once build it once.
        with self._lock:
            found = self._entries.get(key)
            encoder = found[0]() if found else None
            if encoder is not None and found is not None:
                return Selected(encoder, found[1], found[2])
            selected = build()
            self._entries[key] = (weakref.ref(selected.model), selected.choice, selected.reference)
            return selected


class LoadedModels:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        # One load at a time: the resident growth measured around a load is that load's alone,
        # and two versions arriving together do not both peak in memory at once.
        self._loading = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self.encoders = EncoderCache()

    def acquire(self, *, kind: str, artifact: str, sha256: str | None, device: str, threads: int | None,
                precision: PrecisionPolicy, sources: Sources) -> Loaded:
        """The version's handler, loaded now or shared; raises what `load_handler` raises, and a
        second caller waiting on the same load gets the same error."""
        identity = "|".join((kind, artifact, sha256 or "", sources.handler or "", device,
                             f"pickle={sources.allow_pickle}", precision.key()))
        with self._lock:
            entry = self._entries.setdefault(identity, _Entry())
            entry.holders += 1
            loading = entry.done is None
            if loading:
                entry.done = threading.Event()
            done = entry.done
        assert done is not None
        if not loading:
            done.wait()
            if entry.error is not None:
                self._drop(identity, entry)
                raise entry.error
            assert entry.handler is not None
            return Loaded(handler=entry.handler, weights=identity, resident_bytes=0, shared=True)
        try:
            with self._loading:
                before = resident_bytes()
                entry.handler = load_handler(kind=kind, artifact=artifact, sha256=sha256, device=device,
                                             threads=threads, precision=precision,
                                             sources=replace(sources, encoders=self.encoders))
                grown = max(0, resident_bytes() - before)
        except BaseException as exc:
            entry.error = exc
            with self._lock:
                # A failed load is not kept: the next acquirer tries again (an operator may fix it).
                if self._entries.get(identity) is entry:
                    del self._entries[identity]
            self._drop(identity, entry)
            raise
        finally:
            done.set()
        return Loaded(handler=entry.handler, weights=identity, resident_bytes=grown, shared=False)

    def release(self, loaded: Loaded) -> None:
        with self._lock:
            entry = self._entries.get(loaded.weights)
            if entry is None or entry.handler is not loaded.handler:
                return
        self._drop(loaded.weights, entry)

    def holders(self, loaded: Loaded) -> int:
        entry = self._entries.get(loaded.weights)
        return entry.holders if entry is not None and entry.handler is loaded.handler else 0

    def _drop(self, identity: str, entry: _Entry) -> None:
        with self._lock:
            entry.holders -= 1
            last = entry.holders <= 0
            if last and self._entries.get(identity) is entry:
                del self._entries[identity]
        if last:
            entry.handler = None
            gc.collect()  # the model's tensors go now, not at some later collection
