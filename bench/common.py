"""Shared pieces of the benchmarks: the skewed length mix, batch planners, exact percentiles,
an open-loop load generator, process CPU accounting, and a launcher for the real platform.

Nothing here asserts on absolute times: benchmarks report ratios measured in one run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import platform as py_platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"

# --------------------------------------------------------------------------------------------
# The skewed length mix (DESIGN §9): 80 % of texts have 8-24 words, 20 % have 100-200 words.
# --------------------------------------------------------------------------------------------

_DETERMINERS = ("the", "a", "every", "this", "that", "our", "your", "my", "their", "some")
_ADJECTIVES = (
    "new", "old", "small", "large", "quick", "late", "early", "simple", "broken", "recent", "missing",
    "monthly", "online", "local", "careful", "strange", "annual", "final", "second", "public", "private",
    "blue", "heavy", "quiet", "busy", "useful", "expensive", "cheap", "direct", "open",
)
_NOUNS = (
    "customer", "order", "account", "payment", "card", "report", "team", "manager", "driver", "package",
    "invoice", "meeting", "server", "password", "office", "ticket", "delivery", "schedule", "store", "bank",
    "phone", "email", "city", "window", "student", "teacher", "doctor", "garden", "kitchen", "river",
    "market", "project", "budget", "contract", "question", "answer", "problem", "train", "flight", "hotel",
    "weekend", "morning", "company", "network", "device", "screen", "battery", "letter", "address", "price",
)
_VERBS = (
    "checked", "sent", "lost", "found", "opened", "closed", "moved", "needed", "wanted", "asked for",
    "cancelled", "updated", "reviewed", "approved", "delivered", "repaired", "signed", "paid", "booked",
    "changed", "returned", "ordered", "printed", "blocked", "replaced", "visited", "described", "shared",
)
_ADVERBS = ("yesterday", "today", "again", "quickly", "twice", "carefully", "early", "late", "finally",
            "already", "soon", "together")
_PREPOSITIONS = ("in", "at", "near", "for", "with", "from", "after", "before", "during", "without", "about")
_CONNECTIVES = ("and", "but", "because", "so", "while", "although")


def _phrase(rng: random.Random) -> list[str]:
    words = [rng.choice(_DETERMINERS)]
    if rng.random() < 0.6:
        words.append(rng.choice(_ADJECTIVES))
    words.append(rng.choice(_NOUNS))
    return words


def _clause(rng: random.Random) -> list[str]:
    words = _phrase(rng) + rng.choice(_VERBS).split() + _phrase(rng)
    if rng.random() < 0.5:
        words += [rng.choice(_PREPOSITIONS)] + _phrase(rng)
    if rng.random() < 0.3:
        words.append(rng.choice(_ADVERBS))
    return words


def sentence_text(rng: random.Random, n_words: int) -> str:
    """Exactly `n_words` English-like words, made of sentences of clauses."""
    out: list[str] = []
    while len(out) < n_words:
        sentence = _clause(rng)
        while rng.random() < 0.35:
            sentence += [rng.choice(_CONNECTIVES)] + _clause(rng)
        sentence[0] = sentence[0].capitalize()
        sentence[-1] += rng.choice((".", ".", ".", "?", "!"))
        out += sentence
    out = out[:n_words]
    if out[-1][-1] not in ".?!":
        out[-1] += "."
    return " ".join(out)


@dataclass(frozen=True, slots=True)
class LengthMix:
    long_fraction: float = 0.2
    short_words: tuple[int, int] = (8, 24)
    long_words: tuple[int, int] = (100, 200)

    def describe(self) -> str:
        return (f"{100 - self.long_fraction * 100:.0f}% of {self.short_words[0]}-{self.short_words[1]} words, "
                f"{self.long_fraction * 100:.0f}% of {self.long_words[0]}-{self.long_words[1]} words")


SKEWED = LengthMix()


def skewed_texts(n: int, seed: int = 0, mix: LengthMix = SKEWED) -> list[str]:
    """`n` texts in a deterministic order; exactly round(n * long_fraction) of them are long,
    at positions drawn by the seed (so arrival order mixes short and long texts)."""
    rng = random.Random(seed)
    n_long = round(n * mix.long_fraction)
    is_long = [True] * n_long + [False] * (n - n_long)
    rng.shuffle(is_long)
    texts = []
    for long in is_long:
        lo, hi = mix.long_words if long else mix.short_words
        texts.append(sentence_text(rng, rng.randint(lo, hi)))
    return texts


def token_lengths(texts: Sequence[str]) -> list[int]:
    """Real MiniLM token counts ([CLS]/[SEP] included, truncated like the encoder), without torch."""
    from tokenizers import Tokenizer

    from sluice.artifacts import MINILM_URI, resolve_artifact

    model_dir = resolve_artifact(MINILM_URI)
    limit = 256
    with contextlib.suppress(OSError, ValueError, KeyError):
        limit = int(json.loads((model_dir / "sentence_bert_config.json").read_text())["max_seq_length"])
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=limit)
    return [len(e.ids) for e in tokenizer.encode_batch(list(texts))]


class PassThroughHandler:
    """A model handler that hands everything to `inner`; a bench subclasses it to measure `run`.
    One place passes the whole handler surface through: a wrapper that forgot `passes` once left
    the worker's runner dead on its first batch of two (bench.worker_cost)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.kind = inner.kind
        self.length_buckets = inner.length_buckets

    def warmup(self) -> None:
        self.inner.warmup()

    def passes(self, inputs: Sequence[Any]) -> list[list[int]]:
        return self.inner.passes(inputs)  # type: ignore[no-any-return]

    def run(self, inputs: Sequence[Any]) -> list[dict[str, Any]]:
        return self.inner.run(inputs)  # type: ignore[no-any-return]


# --------------------------------------------------------------------------------------------
# Batch planners: index lists into the text list.
# --------------------------------------------------------------------------------------------


def arrival_batches(n: int, size: int) -> list[list[int]]:
    return [list(range(i, min(n, i + size))) for i in range(0, n, size)]


def sorted_batches(lengths: Sequence[int], size: int) -> list[list[int]]:
    """Sort by token length (stable), then chunk: the least padding any batch size-`size` plan gets."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[i : i + size] for i in range(0, len(order), size)]


def bucketed_batches(costs: Sequence[int], size: int, *, max_wait_ms: float = 10.0) -> list[list[int]]:
    """The platform's own policy: sluice.batcher.MicroBatcher's default length buckets, top-up
    off (as the worker builds it), every item present at once (arrival order = index order),
    batches taken one at a time as the worker's runner does."""
    from sluice.batcher import Item, MicroBatcher

    batcher = MicroBatcher(max_batch_size=size, max_wait_ms=max_wait_ms, isolate_tenants=False, top_up=False)
    for i, cost in enumerate(costs):
        batcher.add(Item(id=str(i), tenant="t", cost=int(cost), enqueued_at=i * 1e-6))
    batches = []
    while (batch := batcher.take(math.inf)) is not None:
        batches.append([int(item.id) for item in batch.items])
    return batches


def padding_ratio(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> float:
    """Padded tokens / real tokens: each batch is padded to its longest member."""
    padded = sum(max(lengths[i] for i in b) * len(b) for b in batches)
    real = sum(lengths[i] for b in batches for i in b)
    return padded / real


# --------------------------------------------------------------------------------------------
# Exact percentiles.
# --------------------------------------------------------------------------------------------

PERCENTILE_METHOD = ("exact over all samples: numpy.percentile(method='linear'), i.e. Hyndman-Fan type 7 "
                     "(linear interpolation between closest ranks)")
MIN_SAMPLES_P99 = 300


def percentiles(samples: Sequence[float], qs: Sequence[float] = (50, 95, 99)) -> dict[str, float | None]:
    """Exact percentiles (type 7). A p99 (or higher) from fewer than MIN_SAMPLES_P99 samples is None."""
    import numpy as np

    out: dict[str, float | None] = {}
    data = np.asarray(samples, dtype=float)
    for q in qs:
        key = f"p{q:g}"
        if len(data) == 0 or (q >= 99 and len(data) < MIN_SAMPLES_P99):
            out[key] = None
        else:
            out[key] = float(np.percentile(data, q, method="linear"))
    out["n"] = float(len(data))
    return out


# --------------------------------------------------------------------------------------------
# Open-loop load generation.
# --------------------------------------------------------------------------------------------


def poisson_timetable(rate_per_s: float, n: int, seed: int = 0) -> list[float]:
    """Offsets (s from start) of `n` Poisson arrivals at `rate_per_s`, fixed in advance."""
    rng = random.Random(seed)
    t = 0.0
    out = []
    for _ in range(n):
        t += rng.expovariate(rate_per_s)
        out.append(t)
    return out


def uniform_timetable(rate_per_s: float, n: int) -> list[float]:
    return [(i + 1) / rate_per_s for i in range(n)]


@dataclass(slots=True)
class Sent:
    index: int
    scheduled_at: float  # epoch seconds: when this request was due
    sent_at: float = math.nan  # epoch seconds: when the request actually left
    answered_at: float = math.nan  # epoch seconds: when the submit call returned
    result: Any = None
    error: str | None = None


async def open_loop(offsets: Sequence[float], send: Callable[[int], Awaitable[Any]]) -> list[Sent]:
    """Call `send(i)` at start + offsets[i], whether or not earlier calls have answered.

    The timetable is fixed before the run, so a slow system cannot slow the arrivals down
    (no coordinated omission): latency must be measured from `scheduled_at`, not `sent_at`.
    """
    loop = asyncio.get_running_loop()
    start_mono = loop.time() + 0.05
    start_epoch = time.time() + 0.05
    records = [Sent(index=i, scheduled_at=start_epoch + off) for i, off in enumerate(offsets)]

    async def one(record: Sent) -> None:
        record.sent_at = time.time()
        try:
            record.result = await send(record.index)
        except Exception as exc:  # recorded, the run goes on
            record.error = f"{type(exc).__name__}: {exc}"
        record.answered_at = time.time()

    tasks: list[asyncio.Task[None]] = []
    for record, off in zip(records, offsets, strict=True):
        delay = start_mono + off - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(record)))
    await asyncio.gather(*tasks)
    return records


# --------------------------------------------------------------------------------------------
# CPU accounting from /proc.
# --------------------------------------------------------------------------------------------

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


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

    cpu_model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    return {
        "cores": os.cpu_count(), "cpu": cpu_model, "python": py_platform.python_version(),
        "torch": torch.__version__, "loadavg_at_start": os.getloadavg(),
    }


# --------------------------------------------------------------------------------------------
# Output helpers.
# --------------------------------------------------------------------------------------------


def fmt(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _is_number(text: str) -> bool:
    try:
        float(text.rstrip("x%"))
    except ValueError:
        return False
    return True


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], max_width: int = 110) -> str:
    """A plain-text table: numbers right-aligned, text left-aligned, long cells cut."""
    cells = [[str(h) for h in headers]] + [[fmt(c) for c in row] for row in rows]
    cells = [[c if len(c) <= max_width else c[: max_width - 3] + "..." for c in row] for row in cells]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    out = [line, "| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths, strict=True)) + " |", line]
    for row in cells[1:]:
        out.append("| " + " | ".join(c.rjust(w) if _is_number(c) else c.ljust(w)
                                     for c, w in zip(row, widths, strict=True)) + " |")
    out.append(line)
    return "\n".join(out)


def write_json(name: str, data: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / name
    path.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    return path


def command_line(module: str) -> str:
    """The command that reproduces this run (from the repository root, venv active)."""
    import shlex

    return f"python -m {module}" + (" " + shlex.join(sys.argv[1:]) if sys.argv[1:] else "")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_processes(procs: Sequence[subprocess.Popen[bytes]], grace_s: float = 40.0) -> None:
    """SIGTERM each (so it drains), then SIGKILL whatever is left when the shared grace runs out."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()


@contextlib.contextmanager
def sluice_api(*, env: dict[str, str], log: Path, timeout_s: float = 60.0) -> Iterator[tuple[int, int]]:
    """`sluice api` on a free port with `env` over the environment: answers (pid, port) once
    /readyz says 200, and stops it (`stop_processes`) on the way out."""
    import httpx

    port = free_port()
    with log.open("ab") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "launch.cli", "api", "--port", str(port)],
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **env}, cwd=REPO,
                                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the API did not start; see {log}")
            time.sleep(0.2)
        yield proc.pid, port
    finally:
        stop_processes([proc])


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Let SIGTERM unwind like Ctrl-C, so `finally` blocks clean up."""

    def handler(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def private_redis() -> Iterator[tuple[str, int]]:
    """A redis-server of the bench's own (no persistence): nobody else publishes on its channels."""
    import redis

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="sluice-bench-redis-") as directory:
        proc = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1",
             "--dir", directory, "--save", "", "--appendonly", "no", "--daemonize", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            client = redis.Redis(port=port, socket_connect_timeout=0.5)
            deadline = time.monotonic() + 20
            while True:
                with contextlib.suppress(redis.RedisError):
                    if client.ping():
                        break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {port} did not start")
                time.sleep(0.05)
            client.close()
            yield f"redis://127.0.0.1:{port}", 0
        finally:
            proc.terminate()
            proc.wait(timeout=20)


# --------------------------------------------------------------------------------------------
# The real platform as subprocesses, against the system Redis and Postgres.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ExtraVersion:
    """A second version of an existing model (same artifact) with its own batching."""

    model: str
    version: str
    artifact: str
    max_batch_size: int
    max_wait_ms: float


@dataclass
class BenchPlatform:
    """Fresh database + dedicated Redis DB index + API + workers; `close()` undoes all of it.

    Use as a context manager. Children run in their own sessions (Ctrl-C reaches only the
    bench, which then stops them in order) and log to `home/logs`.
    """

    pg_admin_url: str = "postgresql://postgres@127.0.0.1:5432/test"
    redis_base: str = "redis://127.0.0.1:6379"
    redis_db: int = 13
    extra_versions: Sequence[ExtraVersion] = ()
    keep_home: bool = False
    home: Path = field(init=False)
    db_name: str = field(init=False, default="")
    database_url: str = field(init=False, default="")
    redis_url: str = field(init=False, default="")
    api_port: int = field(init=False, default=0)
    demo_key: str = field(init=False, default="")
    api: subprocess.Popen[bytes] | None = field(init=False, default=None)
    workers: dict[str, list[subprocess.Popen[bytes]]] = field(init=False, default_factory=dict)
    _db_created: bool = field(init=False, default=False)

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def __enter__(self) -> BenchPlatform:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is not None and exc_type is not KeyboardInterrupt:
            # Keep the children's logs for a post-mortem.
            self.keep_home = True
            print(f"platform logs kept in {self.home / 'logs'}", file=sys.stderr)
        self.close()

    def _env(self) -> dict[str, str]:
        return dict(os.environ, SLUICE_REDIS_URL=self.redis_url, SLUICE_DATABASE_URL=self.database_url,
                    SLUICE_HOME=str(self.home), PYTHONUNBUFFERED="1")

    def _admin(self, sql: str) -> None:
        import sqlalchemy as sa

        engine = sa.create_engine(self.pg_admin_url.replace("postgresql://", "postgresql+psycopg://", 1),
                                  isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                conn.execute(sa.text(sql))
        finally:
            engine.dispose()

    def redis(self) -> Any:
        import redis as redis_sync

        return redis_sync.Redis.from_url(self.redis_url)

    def start(self) -> None:
        from launch.seed import seed
        from sluice.artifacts import artifact_sha256, resolve_artifact
        from sluice.migrate import upgrade
        from sluice.registry import catalog
        from sluice.registry.store import Registry
        from sluice.registry.tables import ModelVersion

        self.home = Path(tempfile.mkdtemp(prefix="sluice-bench-"))
        self.db_name = f"sluice_bench_{os.urandom(4).hex()}"
        self._admin(f'CREATE DATABASE "{self.db_name}"')
        self._db_created = True
        self.database_url = self.pg_admin_url.rsplit("/", 1)[0] + "/" + self.db_name
        self.redis_url = f"{self.redis_base}/{self.redis_db}"
        client = self.redis()
        try:
            client.flushdb()
        finally:
            client.close()
        upgrade(self.database_url)
        registry = Registry(url=self.database_url, pool_size=1)
        try:
            self.demo_key = seed(registry, home=self.home).demo_key
            # Registered before the API starts, so its first routing snapshot already has them.
            with registry.session() as session:
                for extra in self.extra_versions:
                    if session.get(ModelVersion, (extra.model, extra.version)) is None:
                        catalog.register_version(
                            session, model=extra.model, version=extra.version, artifact=extra.artifact,
                            sha256=artifact_sha256(resolve_artifact(extra.artifact)), actor="bench",
                            state="staged", max_batch_size=extra.max_batch_size, max_wait_ms=extra.max_wait_ms,
                        )
        finally:
            registry.dispose()
        self.api_port = free_port()
        self.api = self._spawn("api", ["api", "--port", str(self.api_port)])

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        logs = self.home / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with (logs / f"{name}.log").open("ab") as sink:
            return subprocess.Popen([sys.executable, "-m", "launch.cli", *args], env=self._env(), cwd=REPO,
                                    stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)

    def start_workers(self, model: str, version: str, n: int, threads: int = 1) -> list[subprocess.Popen[bytes]]:
        procs = [self._spawn(f"worker-{model}-{version}-{i}",
                             ["worker", "--model", model, "--version", version, "--threads", str(threads),
                              "--device", "cpu"])
                 for i in range(n)]
        self.workers.setdefault(f"{model}/{version}", []).extend(procs)
        return procs

    def wait_ready(self, model: str, version: str, n: int, timeout_s: float = 180.0) -> None:
        from sluice.wire import keys

        client = self.redis()
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                self.check_alive()
                ready = sum(1 for k in client.scan_iter(keys.heartbeat_pattern(model, version))
                            if client.hget(k, "state") == b"ready")
                if ready >= n and self._api_ready():
                    return
                time.sleep(0.25)
        finally:
            client.close()
        raise TimeoutError(f"{n} workers of {model}/{version} and the API were not ready in {timeout_s}s; "
                           f"see {self.home / 'logs'}")

    def _api_ready(self) -> bool:
        import httpx

        try:
            return httpx.get(f"{self.api_url}/readyz", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def check_alive(self) -> None:
        for name, procs in [("api", [self.api] if self.api else []), *self.workers.items()]:
            for proc in procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} (pid {proc.pid}) exited with {proc.returncode}; "
                                       f"see {self.home / 'logs'}")

    def pids(self) -> dict[str, int]:
        out = {"api": self.api.pid} if self.api else {}
        for name, procs in self.workers.items():
            for i, proc in enumerate(procs):
                if proc.poll() is None:
                    out[f"worker {name} #{i}"] = proc.pid
        return out

    def stop_workers(self, model: str, version: str) -> None:
        stop_processes(self.workers.pop(f"{model}/{version}", []))

    def close(self) -> None:
        # Every step runs even if an earlier one fails, and a second Ctrl-C cannot skip them.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            for name in list(self.workers):
                with contextlib.suppress(Exception):
                    stop_processes(self.workers.pop(name))
            if self.api is not None:
                with contextlib.suppress(Exception):
                    stop_processes([self.api])
                self.api = None
            if self.redis_url:
                with contextlib.suppress(Exception):
                    client = self.redis()
                    client.flushdb()
                    client.close()
            if self._db_created:
                with contextlib.suppress(Exception):
                    self._admin(f'DROP DATABASE IF EXISTS "{self.db_name}" WITH (FORCE)')
                    self._db_created = False
            if not self.keep_home and getattr(self, "home", None) is not None and self.home.exists():
                import shutil

                shutil.rmtree(self.home, ignore_errors=True)
        finally:
            signal.signal(signal.SIGINT, previous)
