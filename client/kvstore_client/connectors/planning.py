"""What to load, what to save and when: the connectors' decisions, kept free of
engine types and of I/O so they are unit-tested without an engine or a store.

- :func:`hybrid_hit_blocks`: the hit rule for hybrid models (KV blocks plus the
  recurrent state at a block boundary).
- :class:`LoadPolicy` and :class:`BandwidthMeter`: load a hit or recompute it.
- :class:`RequestTracker`: the scheduler-side bookkeeping of one request — its
  chained block hashes, which blocks the store holds, what is loaded, and the save
  watermark, which moves only when a save is confirmed (a failed save is retried).
- :class:`Lookups`: prefix lookups in flight, several at once, each answered "ask me
  again" until done or past its deadline (the scheduler never waits on the store).
- :class:`StagingBudget`: a cap on the bytes of staging buffers in flight.
- :func:`role_flags`: what ``kv_role`` allows (load, save).
- :func:`classify_groups`: which vLLM KV cache groups hold KV, which hold state,
  or why the connector must stay off for a model.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from ..keys import leading_run
from ..prefix import ROOT, block_hashes

T = TypeVar("T")


def hybrid_hit_blocks(kv_present: Sequence[bool], state_present: Sequence[bool]) -> int:
    """Blocks of a hybrid-model prefix that may be loaded: the largest k such that
    KV blocks 0..k-1 are all present AND the state at boundary k (stored under the
    state namespace with hash k-1) is present. 0 when there is none."""
    k = leading_run(kv_present)
    while k > 0 and not (k - 1 < len(state_present) and state_present[k - 1]):
        k -= 1
    return k


def all_ranks(flags_per_rank: Sequence[Sequence[bool]]) -> list[bool]:
    """Per block: present on every rank (a block is usable only when all shards are)."""
    if not flags_per_rank:
        return []
    n = min(len(f) for f in flags_per_rank)
    return [all(f[i] for f in flags_per_rank) for i in range(n)]


def role_flags(kv_role: str | None) -> tuple[bool, bool]:
    """(may load, may save) for vLLM's ``kv_role``: ``kv_producer`` only saves,
    ``kv_consumer`` only loads, ``kv_both`` (or unset) does both. Raises ValueError
    for anything else."""
    role = kv_role or "kv_both"
    table = {"kv_both": (True, True), "kv_producer": (False, True), "kv_consumer": (True, False)}
    if role not in table:
        raise ValueError(f"kv_role must be one of {sorted(table)}, not {role!r}")
    return table[role]


# ---- load or recompute -----------------------------------------------------------------


class BandwidthMeter:
    """Exponentially weighted load bandwidth (bytes/s) from (bytes, seconds) samples,
    and the time of small loads (``latency_s``).

    Samples under ``min_bytes`` do not count towards the bandwidth (their time is
    all latency); they make ``latency_s``, the time a small load takes."""

    def __init__(self, alpha: float = 0.3, min_bytes: int = 256 << 10) -> None:
        self.alpha = alpha
        self.min_bytes = min_bytes
        self.bytes_per_s: float | None = None
        self.latency_s: float | None = None

    def add(self, nbytes: int, seconds: float) -> None:
        if seconds <= 0:
            return
        if nbytes < self.min_bytes:
            prev = self.latency_s
            self.latency_s = seconds if prev is None else prev + self.alpha * (seconds - prev)
            return
        bw = nbytes / seconds
        prev = self.bytes_per_s
        self.bytes_per_s = bw if prev is None else prev + self.alpha * (bw - prev)

    def load_seconds(self, nbytes: float) -> float | None:
        """The expected time of a load of ``nbytes``: by the bandwidth, at least the
        small loads' time; by the small loads' time alone for a small load; None
        when nothing was measured that covers it."""
        lat = self.latency_s
        if self.bytes_per_s:
            return max(nbytes / self.bytes_per_s, lat or 0.0)
        if lat is not None and nbytes < self.min_bytes:
            return lat
        return None


class StepClock:
    """The engine's step time, measured from the scheduler's steps: the interval
    between two steps is the first one's duration. Exponentially weighted; an
    interval over ``max_gap`` (an idle engine) is skipped."""

    def __init__(self, alpha: float = 0.3, max_gap: float = 5.0):
        self.alpha = alpha
        self.max_gap = max_gap
        self.step_s: float | None = None
        self._last: float | None = None

    def tick(self, now: float) -> None:
        """A step starts at ``now``."""
        last, self._last = self._last, now
        if last is None or not 0 < now - last <= self.max_gap:
            return
        self.step_s = self._avg(self.step_s, now - last)

    def _avg(self, prev: float | None, x: float) -> float:
        return x if prev is None else prev + self.alpha * (x - prev)


def choose_load(
    ext_tokens: int, load_s: float | None, step_s: float | None, prefill_tokens_per_s: float | None
) -> str:
    """``load_mode: auto``: "sync", "async" or "recompute" for a hit of ``ext_tokens``
    whose load is expected to take ``load_s`` (see :meth:`BandwidthMeter.load_seconds`).

    A load inside the step (sync) costs the step its load time; an asynchronous load
    costs the request its load time and at least one more step (it waits for its
    KV, then for the next step); recomputing costs the step the prefill of those
    tokens. The cheapest wins; sync only when the load is shorter than a step (else
    it would hold up every other request of the step). Without a measured load time
    or step time: "async" (the default's behaviour); without a prefill speed the
    recompute cost is unknown and never chosen."""
    if load_s is None or step_s is None:
        return "async"
    recompute_s = ext_tokens / prefill_tokens_per_s if prefill_tokens_per_s else float("inf")
    if load_s < step_s:
        return "sync" if load_s <= recompute_s else "recompute"
    return "async" if load_s + step_s <= recompute_s else "recompute"


@dataclass(slots=True, frozen=True)
class LoadDecision:
    load: bool
    reason: str  # "load", "short_hit" or "slow_load"


@dataclass(slots=True, frozen=True)
class LoadPolicy:
    """When a hit is worth loading.

    ``min_hit_tokens``: hits shorter than this are recomputed (default: one block).
    ``prefill_tokens_per_s``: the engine's prefill speed; with a measured load
    bandwidth, a hit whose load would take longer than recomputing it is skipped.
    None disables that rule (always load)."""

    min_hit_tokens: int
    prefill_tokens_per_s: float | None = None

    def decide(
        self, hit_tokens: int, bytes_per_token: float, load_bytes_per_s: float | None
    ) -> LoadDecision:
        if hit_tokens <= 0 or hit_tokens < self.min_hit_tokens:
            return LoadDecision(False, "short_hit")
        if self.prefill_tokens_per_s and load_bytes_per_s:
            load_s = hit_tokens * bytes_per_token / load_bytes_per_s
            recompute_s = hit_tokens / self.prefill_tokens_per_s
            if load_s > recompute_s:
                return LoadDecision(False, "slow_load")
        return LoadDecision(True, "load")


# ---- scheduler-side request bookkeeping ----------------------------------------------


@dataclass(slots=True)
class BlockRef:
    """One block of a request: its index in the request, the engine's block id, hash."""

    index: int
    block_id: int
    hash: bytes


@dataclass(slots=True)
class RequestTracker:
    """What the scheduler-side connector knows about one request.

    ``hashes`` grows with the request's tokens (only full blocks are hashed);
    ``present`` is the store's answer at lookup time per hash; ``saved_upto`` is the
    watermark: every block below it is known to be in the store (it was there at
    lookup, or its save was confirmed). Blocks being saved are in ``saving``; a
    save reported failed is planned again, up to ``max_save_attempts`` times.
    ``save_known`` True (the connector's ``save_policy: all``) ignores what the
    lookup found: every full block is planned once, present at lookup or not (only
    confirmed saves count as held). Nothing here talks to the store or the engine."""

    req_id: str
    block_tokens: int
    extra: bytes = b""
    hashes: list[bytes] = field(default_factory=list)
    present: list[bool] = field(default_factory=list)
    state_present: list[bool] = field(default_factory=list)
    local_tokens: int = 0
    hit_blocks: int = 0  # the store's leading run from block 0 (the lookup's answer)
    # False for hybrid models (a hit needs the state at its end): else the hit may go on
    # past the engine's own hit when the store lacks blocks the engine holds (a chained
    # key names its whole prefix, so block i of the store fits after the engine's i)
    past_local: bool = True
    run_blocks: int = 0  # the hit plan_hit last planned: blocks from 0, local or stored
    ext_tokens: int = 0
    decision: str = ""
    sync_load: bool = False  # the hit loads inside the step that schedules it
    block_ids: list[int] = field(default_factory=list)
    pending_load: list[BlockRef] = field(default_factory=list)
    saved_upto: int = 0
    saving: set[int] = field(default_factory=set)
    saved: set[int] = field(default_factory=set)
    attempts: dict[int, int] = field(default_factory=dict)
    max_save_attempts: int = 3
    looked_up_tokens: int = -1
    looked_up_at: float = 0.0  # time.monotonic() of the lookup that set ``present``
    save_known: bool = False
    _planned_upto: int = 0  # blocks below were considered for saving once

    def extend_hashes(self, tokens: Sequence[int]) -> None:
        """Hash the full blocks of ``tokens`` not hashed yet (chained from the last)."""
        have = len(self.hashes)
        full = len(tokens) // self.block_tokens
        if full <= have:
            return
        start = have * self.block_tokens
        parent = self.hashes[-1] if self.hashes else ROOT
        self.hashes.extend(
            block_hashes(
                tokens[start : full * self.block_tokens],
                self.block_tokens,
                extra=self.extra,
                parent=parent,
            )
        )

    def plan_hit(
        self,
        num_tokens: int,
        num_computed_tokens: int,
        policy: LoadPolicy,
        bytes_per_token: float,
        load_bytes_per_s: float | None,
    ) -> int:
        """Tokens to load beyond ``num_computed_tokens`` from the lookup's hit.

        A full hit is capped at ``num_tokens - 1`` (the engine must compute one token
        to sample from); the load still covers that last block whole.

        The hit is the store's leading run, or, when the engine's own hit is longer,
        the engine's hit followed by the store's run from there: an engine whose cache
        kept a session's oldest blocks while the store gave them up takes the newer
        ones from the store."""
        self.local_tokens = num_computed_tokens
        run = self.hit_blocks
        first = num_computed_tokens // self.block_tokens
        if self.past_local and first > run:
            run = first + leading_run(self.present[first:])
        self.run_blocks = run
        hit_tokens = min(run * self.block_tokens, num_tokens - 1)
        ext = hit_tokens - num_computed_tokens
        if ext <= 0:
            self.ext_tokens, self.decision = 0, "none"
            return 0
        d = policy.decide(ext, bytes_per_token, load_bytes_per_s)
        self.decision = d.reason
        self.ext_tokens = ext if d.load else 0
        return self.ext_tokens

    def skipped_blocks(self) -> int:
        """Hit blocks not loaded because of the load policy."""
        if self.decision not in ("short_hit", "slow_load"):
            return 0
        first = self.local_tokens // self.block_tokens
        return max(0, self.run_blocks - first)

    def plan_load(self, block_ids: Sequence[int], num_external_tokens: int) -> list[BlockRef]:
        """The blocks to load once the engine allocated ``block_ids`` (index 0 = the
        request's first block): whole blocks from the local hit to the end of the
        external hit (rounded up: a capped last block is loaded whole)."""
        self.block_ids = list(block_ids)
        first = self.local_tokens // self.block_tokens
        last = -(-(self.local_tokens + num_external_tokens) // self.block_tokens)
        last = min(last, len(self.hashes), len(self.block_ids))
        refs = [BlockRef(i, self.block_ids[i], self.hashes[i]) for i in range(first, last)]
        self.pending_load = refs
        return refs

    def mark_missing(self, indices: Iterable[int]) -> None:
        """Blocks that failed to load are not in the store (so they get written), and
        the hit ends before the first of them: vLLM schedules the request again, and
        the lookup's answer is reused for the same tokens, so a hit left as it was
        would load the missing blocks again, fail again, and so on."""
        indices = list(indices)
        if indices:
            self.hit_blocks = min(self.hit_blocks, min(indices))
        for i in indices:
            if i < len(self.present):
                self.present[i] = False
            self.saved.discard(i)
        self.saved_upto = min([self.saved_upto, *indices])

    def _held(self, i: int) -> bool:
        known = not self.save_known and i < len(self.present) and self.present[i]
        return i in self.saved or known

    def blocks_to_save(
        self, computed_tokens: int, tokens: Sequence[int]
    ) -> tuple[list[BlockRef], int]:
        """Full blocks whose KV exists after this step (``computed_tokens``) and whose
        tokens are known, past the watermark, that the store does not hold and that
        are not being saved. Returns them and how many were skipped as present.
        The blocks returned are marked as being saved; the watermark moves only on
        :meth:`save_done`."""
        self.extend_hashes(tokens)
        full = min(computed_tokens, len(tokens)) // self.block_tokens
        full = min(full, len(self.hashes), len(self.block_ids))
        out: list[BlockRef] = []
        skipped = 0
        for i in range(self.saved_upto, full):
            if self._held(i):
                if i >= self._planned_upto:
                    skipped += 1
            elif i not in self.saving and self.attempts.get(i, 0) < self.max_save_attempts:
                out.append(BlockRef(i, self.block_ids[i], self.hashes[i]))
                self.saving.add(i)
                self.attempts[i] = self.attempts.get(i, 0) + 1
        self._planned_upto = max(self._planned_upto, full)
        self._advance()
        return out, skipped

    def save_done(self, indices: Iterable[int], ok: bool) -> None:
        """The worker's report on a save: ``ok`` = the blocks are in the store now.
        Failed blocks are planned again by the next :meth:`blocks_to_save`."""
        for i in indices:
            self.saving.discard(i)
            if ok:
                self.saved.add(i)
        self._advance()

    def _advance(self) -> None:
        while self.saved_upto < len(self.hashes) and self._held(self.saved_upto):
            self.saved_upto += 1


# ---- lookups in flight -----------------------------------------------------------------


@dataclass(slots=True)
class _Asked(Generic[T]):
    future: cf.Future[T]
    started: float


class Lookups(Generic[T]):
    """Prefix lookups running in a small thread pool, several at once.

    ``poll(key, ask)`` starts ``ask()`` the first time a key is seen and waits at
    most ``wait_s`` for it; then, and on every later poll, it answers
    ``("done", result)``, ``("pending", None)`` (the engine asks again later),
    ``("timeout", None)`` once ``deadline_s`` passed since the start, or
    ``("error", exception)``. A finished or timed-out key is forgotten, so a new
    poll starts a new lookup. A slow ``ask`` holds one thread, never the caller."""

    def __init__(self, workers: int, deadline_s: float, wait_s: float = 0.0) -> None:
        self.deadline_s = deadline_s
        self.wait_s = wait_s
        self._pool = cf.ThreadPoolExecutor(max(1, workers), thread_name_prefix="kvstore-lookup")
        self._asked: dict[Hashable, _Asked[T]] = {}
        self._lock = threading.Lock()

    def poll(self, key: Hashable, ask: Callable[[], T]) -> tuple[str, T | BaseException | None]:
        with self._lock:
            a = self._asked.get(key)
            if a is None:
                a = self._asked[key] = _Asked(self._pool.submit(ask), time.monotonic())
        if not a.future.done() and self.wait_s > 0:
            cf.wait([a.future], timeout=self.wait_s)
        if a.future.done():
            self._forget(key)
            exc = a.future.exception()
            return ("error", exc) if exc is not None else ("done", a.future.result())
        if time.monotonic() - a.started >= self.deadline_s:
            self._forget(key)
            a.future.cancel()
            return "timeout", None
        return "pending", None

    def fire(self, ask: Callable[[], object]) -> None:
        """Run ``ask()`` on the pool for its effect on the store; nobody waits for it
        and its result or error is dropped."""
        with contextlib.suppress(RuntimeError):  # shut down
            self._pool.submit(ask)

    def forget(self, key_prefix: Hashable) -> None:
        """Drop every lookup whose key is ``key_prefix`` or a tuple starting with it."""
        with self._lock:
            mine = [
                k
                for k in self._asked
                if k == key_prefix or (isinstance(k, tuple) and k[:1] == (key_prefix,))
            ]
            for k in mine:
                self._asked.pop(k).future.cancel()

    def _forget(self, key: Hashable) -> None:
        with self._lock:
            self._asked.pop(key, None)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._asked)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class StagingBudget:
    """Bytes of staging buffers in flight, capped at ``limit`` bytes.

    ``admit(n)`` is True when ``n`` more fit, or when nothing is in flight (one
    request bigger than the cap still runs, alone); the caller queues otherwise.
    ``release(n)`` returns bytes. Thread-safe."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def admit(self, n: int) -> bool:
        with self._lock:
            if self.used and self.used + n > self.limit:
                return False
            self.used += n
            return True

    def release(self, n: int) -> None:
        with self._lock:
            self.used = max(0, self.used - n)


def pool_hit(
    kv_flags: Sequence[bool], pools: Sequence[tuple[str, bool, int, Sequence[bool]]]
) -> tuple[int, dict[str, int], list[int]]:
    """SGLang's multi-pool hit (``batch_exists_v2``) from existence flags.

    ``kv_flags``: the KV pool's page flags; ``pools``: per extra pool (name,
    all_pages, trailing, flags), where ``all_pages`` pools need every page of the
    prefix and the others only its last ``trailing`` pages (Mamba / SWA state).
    Returns (usable pages, pages found per pool, every usable prefix length): a
    prefix is usable only when the KV pages and every pool allow it, so a state
    missing at the end shrinks the hit to the last boundary that has one."""
    kv = leading_run(kv_flags)
    hits: dict[str, int] = {"kv": kv} if kv else {}
    restorable = list(range(1, kv + 1))
    for name, all_pages, trailing, flags in pools:
        if not restorable:
            break

        def has(i: int, flags: Sequence[bool] = flags) -> bool:
            return i < len(flags) and bool(flags[i])

        if all_pages:
            boundary = next((i for i in range(kv) if not has(i)), kv)
            ok = set(range(1, boundary + 1))
        else:
            t = max(1, trailing)
            ok = {n for n in range(1, kv + 1) if all(has(i) for i in range(max(0, n - t), n))}
            boundary = max(ok, default=0)
        if boundary:
            hits[name] = boundary
        restorable = [n for n in restorable if n in ok]
    return (restorable[-1] if restorable else 0), hits, restorable


def classify_groups(
    specs: list[tuple[str, int, str | None, int]],
) -> tuple[list[int], list[int], str | None]:
    """Split KV cache groups into attention groups (KV blocks) and state groups
    (recurrent state at block boundaries), or say why the connector cannot serve
    them. ``specs``: per group (spec class name, block size, Mamba cache mode or
    None, speculative blocks). Pure: unit-tested without vLLM."""
    attn: list[int] = []
    state: list[int] = []
    for i, (kind, _block, mode, spec_blocks) in enumerate(specs):
        if kind in ("FullAttentionSpec", "MLAAttentionSpec"):
            attn.append(i)
        elif kind == "MambaSpec":
            if mode != "align":
                return (
                    [],
                    [],
                    (
                        f"its recurrent state (group {i}) is not kept at block boundaries "
                        f"(mamba_cache_mode {mode!r}; enable prefix caching: vLLM's 'align' mode)"
                    ),
                )
            if spec_blocks:
                return [], [], "speculative state blocks (MTP / EAGLE) are not supported"
            state.append(i)
        else:
            return [], [], f"KV cache group {i} is a {kind}, which the connector cannot store"
    if not attn:
        return [], [], "it has no full-attention layers (a pure state model)"
    sizes = {specs[i][1] for i in attn + state}
    if len(sizes) != 1:
        return [], [], f"its groups have different block sizes {sorted(sizes)}"
    return attn, state, None
