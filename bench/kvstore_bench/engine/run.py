"""Run one configuration of the engine bench: start engines, play the scripts, collect.

:class:`EngineProc` is one engine process (:mod:`kvstore_bench.engine.proc` run by the
engine venv's python) with a reader thread that hands each finished request to the
thread waiting for it. :func:`run_config` starts a configuration's backing
(:mod:`kvstore_bench.engine.peers`) and ``engines`` fresh engines, plays every script
on its own thread (turns in order, pauses between them, sub-agents after their fork
turn), and returns one :class:`Result` per turn. Everything it started is stopped by pid
before it returns, also on failure.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import selectors
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..peers import stop_process
from .peers import Backing, Context, NotRunnable, engine_env, make_backing
from .saturate import Admission, PauseClock, goes_idle
from .workload import Script, Turn

__all__ = ["ConfigRun", "EngineError", "EngineProc", "EngineSpec", "Result", "run_config"]

ROOT = Path(__file__).resolve().parents[3]


class EngineError(RuntimeError):
    """An engine failed to start or to answer; the message carries its log's tail."""


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """How every engine of a run is built."""

    python: Path
    model: str
    block_size: int | None = 32  # None: vLLM resolves it (hybrid models)
    expect_block_size: int = 32  # what the engine must report resolved (the ideal's unit)
    max_len: int = 4096
    kv_cache_bytes: int = 256 << 20
    block_bytes: int = 0  # bytes of one KV block (0: the allocation is not checked)
    dtype: str = "float32"
    start_timeout_s: float = 600.0
    request_timeout_s: float = 600.0


@dataclass(slots=True)
class Result:
    """One turn as it ran (times in seconds since the configuration's run started)."""

    script: str
    turn: int
    engine: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    e2e_s: float
    start: float
    end: float
    tokens: list[int]
    logprobs: list[float]
    error: str = ""
    steps: int = 0  # engine steps from arrival to the first token (inclusive)
    wait_s: float = 0.0  # TTFT before the step that produced the first token
    step_s: float = 0.0  # that step's duration
    # of cached_tokens: from the engine's own prefix cache and from the connector
    # (vLLM's prefill stats; -1: not known)
    local_cached_tokens: int = -1
    external_cached_tokens: int = -1


@dataclass(slots=True)
class ConfigRun:
    """A configuration's outcome: its results, or why it did not run."""

    name: str
    ran: bool
    why_not: str = ""
    note: str = ""
    wall_s: float = 0.0
    results: list[Result] = field(default_factory=list)
    min_bytes: int = 0  # when it did not run for want of memory: the least it accepts
    # loads that failed (blocks the connector reported missing), as vLLM logged them:
    # requests rescheduled and tokens recomputed (:func:`load_failures`)
    load_failed_requests: int = 0
    load_failed_tokens: int = 0
    # the KV cache each engine allocated, as it said when ready: blocks, and tokens
    engine_kv_blocks: list[int] = field(default_factory=list)
    engine_kv_tokens: list[int] = field(default_factory=list)


def expected_kv_blocks(spec: EngineSpec) -> int:
    """The blocks an engine of ``spec`` should allocate: its KV bytes over a block's
    (0 when the block's bytes are unknown)."""
    return spec.kv_cache_bytes // spec.block_bytes if spec.block_bytes > 0 else 0


def check_kv_blocks(name: str, spec: EngineSpec, got: int | None) -> None:
    """EngineError unless the engine allocated the KV cache the bench asked for (within
    1% or one block: vLLM rounds to whole blocks)."""
    want = expected_kv_blocks(spec)
    if not want or got is None:
        return
    if abs(int(got) - want) > max(1, want // 100):
        raise EngineError(
            f"engine {name} allocated {int(got):,} KV blocks, the bench asked for {want:,} "
            f"({spec.kv_cache_bytes:,} B): something else sized its cache "
            "(VLLM_CPU_KVCACHE_SPACE?)"
        )


# vLLM's scheduler, when a connector reports blocks it could not load
_RECOVERED = re.compile(
    r"Recovered from KV load failure: (\d+) request\(s\) rescheduled \((\d+) tokens affected\)"
)


def load_failures(texts: Sequence[str]) -> tuple[int, int]:
    """(requests rescheduled, tokens recomputed) over engines' logs, from vLLM's
    "Recovered from KV load failure" lines (0, 0 where vLLM logs none)."""
    n = tokens = 0
    for text in texts:
        for m in _RECOVERED.finditer(text):
            n += int(m.group(1))
            tokens += int(m.group(2))
    return n, tokens


class EngineProc:
    """One engine process; ``submit`` may be called from many threads."""

    def __init__(self, name: str, spec: EngineSpec, backing: Backing, work_dir: Path) -> None:
        self.name = name
        self.spec = spec
        self.log_path = work_dir / f"engine-{name}.log"
        cfg = {
            "model": spec.model,
            "block_size": spec.block_size,
            "max_len": spec.max_len,
            "kv_cache_bytes": spec.kv_cache_bytes,
            "dtype": spec.dtype,
            "kv_transfer_config": backing.kv_transfer_config,
            "warmup_seed": 1000 + sum(name.encode()),
        }
        # its own temp dir (IPC sockets, TMPDIR) and port: nothing shared with another
        # engine on this host; short, as a unix socket's path is (108 bytes at most)
        self.scratch = Path(tempfile.mkdtemp(prefix=f"kvb{name}-"))
        self.kv_blocks: int | None = None
        self.kv_block_tokens = 0
        env = engine_env(
            backing, [str(ROOT / "client"), str(ROOT / "bench"), str(ROOT)], self.scratch
        )
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [str(spec.python), "-m", "kvstore_bench.engine.proc", json.dumps(cfg)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                cwd=ROOT,
                env=env,
            )
        self._lock = threading.Lock()
        self._waiting: dict[str, tuple[threading.Event, list[dict[str, Any]]]] = {}
        self._buf = b""
        self._reader: threading.Thread | None = None
        self._dead = ""

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self) -> None:
        """Block until the engine printed its ready line; EngineError if it exits first."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + self.spec.start_timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                if time.monotonic() > deadline:
                    raise EngineError(f"engine {self.name}: not ready in time\n{self.tail()}")
                if not sel.select(1.0):
                    if self.proc.poll() is not None:
                        break
                    continue
                chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
                if not chunk:
                    break
                self._buf += chunk
        if b"\n" not in self._buf:
            raise EngineError(f"engine {self.name} exited with {self.proc.poll()}:\n{self.tail()}")
        line, self._buf = self._buf.split(b"\n", 1)
        ready = json.loads(line)
        if ready.get("event") != "ready":
            raise EngineError(f"engine {self.name}: unexpected {line!r}")
        got = ready.get("block_size")
        if got is not None and int(got) != self.spec.expect_block_size:
            raise EngineError(
                f"engine {self.name} resolved {got}-token blocks, the bench counts hits in "
                f"{self.spec.expect_block_size}-token blocks (engine.models.BLOCK_SIZES)"
            )
        blocks = ready.get("kv_blocks")
        self.kv_blocks = None if blocks is None else int(blocks)
        self.kv_block_tokens = int(got) if got is not None else self.spec.expect_block_size
        check_kv_blocks(self.name, self.spec, self.kv_blocks)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while True:
            try:
                chunk = os.read(fd, 1 << 20)
            except OSError:
                chunk = b""
            if not chunk:
                break
            self._buf += chunk
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                with self._lock:
                    slot = self._waiting.pop(str(msg.get("id")), None)
                if slot is not None:
                    slot[1].append(msg)
                    slot[0].set()
        with self._lock:
            self._dead = f"engine {self.name} exited with {self.proc.poll()}"
            for ev, _ in self._waiting.values():
                ev.set()
            self._waiting.clear()

    def submit(
        self,
        rid: str,
        prompt: Sequence[int],
        max_tokens: int,
        params: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Send one request and wait for its answer (a "done" or "error" message);
        ``params``: its ``kv_transfer_params``."""
        assert self.proc.stdin is not None
        ev = threading.Event()
        box: list[dict[str, Any]] = []
        with self._lock:
            if self._dead:
                raise EngineError(self._dead)
            self._waiting[rid] = (ev, box)
            line: dict[str, Any] = {
                "op": "add",
                "id": rid,
                "prompt": list(prompt),
                "max_tokens": max_tokens,
            }
            if params:
                line["params"] = params
            self.proc.stdin.write((json.dumps(line) + "\n").encode())
            self.proc.stdin.flush()
        if not ev.wait(self.spec.request_timeout_s) or not box:
            raise EngineError(self._dead or f"engine {self.name}: no answer for {rid}")
        return box[0]

    def stop(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write(b'{"op": "exit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(15)
            except (OSError, subprocess.TimeoutExpired):
                pass
        stop_process(self.proc)
        shutil.rmtree(self.scratch, ignore_errors=True)


def _play(
    scripts: Sequence[Script],
    engines: Sequence[EngineProc],
    t0: float,
    on_done: Callable[[Result], None],
    hints: bool = False,
    saturate: int = 0,
) -> list[Result]:
    """Play every script: on the traces' clock, or (``saturate`` > 0) with that many
    sessions busy at once (:class:`~kvstore_bench.engine.saturate.Admission`)."""
    results: list[Result] = []
    cond = threading.Condition()
    fork_events = {(s.id, t.index): threading.Event() for s in scripts for t in s.turns}
    errors: list[BaseException] = []
    adm = Admission(scripts, saturate) if saturate > 0 else None
    # saturated: pauses on a clock that skips the time no engine would have work
    clock = PauseClock(len(engines)) if saturate > 0 else None

    def run_turn(t: Turn) -> Result:
        start = time.perf_counter() - t0
        params = {"session_id": t.script, "session_state": t.session_state} if hints else None
        try:
            ans = engines[t.engine].submit(f"{t.script}#{t.index}", t.prompt, t.max_tokens, params)
        except EngineError as e:
            ans = {"event": "error", "error": str(e)}
        end = time.perf_counter() - t0
        ok = ans.get("event") == "done"
        return Result(
            script=t.script,
            turn=t.index,
            engine=t.engine,
            prompt_tokens=len(t.prompt),
            cached_tokens=int(ans.get("num_cached_tokens", 0)) if ok else 0,
            ttft_s=float(ans.get("ttft_s", end - start)) if ok else float("nan"),
            e2e_s=float(ans.get("e2e_s", end - start)) if ok else float("nan"),
            start=start,
            end=end,
            tokens=list(ans.get("tokens", [])),
            logprobs=[float(x) for x in ans.get("logprobs", [])],
            error="" if ok else str(ans.get("error", "?")),
            steps=int(ans.get("steps", 0)) if ok else 0,
            wait_s=float(ans.get("wait_s", 0.0)) if ok else 0.0,
            step_s=float(ans.get("step_s", 0.0)) if ok else 0.0,
            local_cached_tokens=int(ans.get("local_cached_tokens", -1)) if ok else -1,
            external_cached_tokens=int(ans.get("external_cached_tokens", -1)) if ok else -1,
        )

    def play(s: Script, admitted: bool = False) -> None:
        try:
            if s.parent is not None and s.after_turn >= 0:
                fork_events[(s.parent, s.after_turn)].wait()
            delay = s.start_s - (time.perf_counter() - t0)
            if adm is None and delay > 0:
                time.sleep(delay)
            for k, t in enumerate(s.turns):
                if t.pause_s > 0 and k and clock is None:
                    time.sleep(t.pause_s)
                elif t.pause_s > 0 and k and clock is not None:
                    with cond:  # the controller skips idle time and wakes us
                        clock.pause(s.id, time.perf_counter(), t.pause_s)
                        cond.notify_all()
                        while not clock.due(s.id, time.perf_counter()):
                            cond.wait(0.05)
                        clock.resume(s.id)
                # a sub-agent's first turn, or a turn after a pause, takes a place again
                if adm is not None and ((k == 0 and not admitted) or (k and t.pause_s > 0)):
                    with cond:
                        adm.turn_ready()
                try:
                    r = run_turn(t)
                finally:
                    if adm is not None:
                        with cond:
                            adm.turn_done(goes_idle(s, k))
                            cond.notify_all()
                with cond:
                    results.append(r)
                on_done(r)
                fork_events[(s.id, t.index)].set()
        except BaseException as e:  # keep other scripts going; report after
            errors.append(e)
        finally:
            for t in s.turns:  # children of a failed script still run
                fork_events[(s.id, t.index)].set()

    def spawn(s: Script, admitted: bool = False) -> threading.Thread:
        th = threading.Thread(target=play, args=(s, admitted), daemon=True)
        th.start()
        return th

    if adm is None:
        threads = [spawn(s) for s in scripts]
    else:  # sub-agents wait for their fork; top-level scripts start when admitted
        assert clock is not None
        threads = [spawn(s) for s in scripts if s.parent is not None]
        with cond:
            while adm.waiting or any(th.is_alive() for th in threads):
                threads += [spawn(s, True) for s in adm.admit()]
                if not adm.waiting and clock.skip(time.perf_counter(), adm.busy) > 0:
                    cond.notify_all()
                cond.wait(0.05)
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return results


def run_config(
    name: str,
    ctx: Context,
    spec: EngineSpec,
    scripts: Sequence[Script],
    engines: int,
    on_event: Callable[[str], None] = lambda _: None,
    on_done: Callable[[Result], None] = lambda _: None,
) -> ConfigRun:
    """Play ``scripts`` on ``engines`` fresh engines of configuration ``name``
    (``ctx.saturate``: sessions kept busy at once, 0 = on the traces' clock).

    Returns ``ConfigRun(ran=False, why_not=...)`` when the configuration's backing or its
    engines cannot start; requests that fail are kept as results with ``error`` set.
    """
    cdir = ctx.work_dir / name
    cdir.mkdir(parents=True, exist_ok=True)
    cctx = dataclasses.replace(ctx, work_dir=cdir)
    procs: list[EngineProc] = []
    backing: Backing | None = None
    try:
        on_event(f"{name}: starting backing")
        try:
            backing = make_backing(name, cctx)
        except NotRunnable as e:
            return ConfigRun(name, False, why_not=str(e), min_bytes=e.min_bytes)
        except Exception as e:
            return ConfigRun(name, False, why_not=f"backing did not start: {e}")
        on_event(f"{name}: starting {engines} engines")
        procs = [EngineProc(f"{i}", spec, backing, cdir) for i in range(engines)]
        try:
            for p in procs:
                p.wait_ready()
        except EngineError as e:
            return ConfigRun(name, False, why_not=_why(str(e)))
        on_event(f"{name}: running")
        t0 = time.perf_counter()
        try:
            hints = ctx.session_hints and name.startswith("kvstore")
            results = _play(scripts, procs, t0, on_done, hints, ctx.saturate)
        except Exception as e:  # a bench bug or a lost engine: report, run the others
            return ConfigRun(name, False, why_not=f"run failed: {type(e).__name__}: {e}")
        wall = time.perf_counter() - t0
        for p in procs:  # their logs are complete once they exited
            p.stop()
        failed = load_failures([p.log_path.read_text(errors="replace") for p in procs])
        return ConfigRun(
            name,
            True,
            note=backing.note,
            wall_s=wall,
            results=results,
            load_failed_requests=failed[0],
            load_failed_tokens=failed[1],
            engine_kv_blocks=[p.kv_blocks or 0 for p in procs],
            engine_kv_tokens=[(p.kv_blocks or 0) * p.kv_block_tokens for p in procs],
        )
    finally:
        for p in procs:
            p.stop()
        if backing is not None:
            backing.stop()


def _why(text: str) -> str:
    """The most telling line of an engine's failure: the last exception line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "error" in ln or "Exception" in ln:
            return ln[:400]
    return (lines[-1] if lines else text)[:400]
