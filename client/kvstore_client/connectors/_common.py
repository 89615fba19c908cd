"""Pieces shared by the engine connectors; no engine (vLLM, SGLang) or torch import here.

- :func:`namespace` and :func:`extra_keys`: what a key is made of, so every engine
  instance of one model layout and rank agrees on it (see DESIGN.md, "Key").
- :func:`hybrid_hit_blocks`: the hit rule for hybrid models (KV blocks plus the
  recurrent state at a block boundary).
- :class:`LoadPolicy` and :class:`BandwidthMeter`: load a hit or recompute it.
- :class:`Counters` and :func:`record`: connector statistics, exported both to the
  engine (per interval) and to Prometheus (``kvstore_connector_*``, process totals).
- :class:`RequestTracker`: the scheduler-side bookkeeping of one request — its
  chained block hashes, which blocks the store holds, what is loaded and what is
  saved — kept free of engine types so it is unit-tested without an engine.
- :class:`ClientHolder`: a client made lazily and re-made after failures, so an
  unreachable store turns into misses, never into a failed engine start.
"""

from __future__ import annotations

import logging
import re
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from ..client import Client
from ..keys import MAX_NAMESPACE_LEN, check_namespace, leading_run
from ..prefix import ROOT, block_hashes

log = logging.getLogger(__name__)

STATE_KIND = "state"

# ---- keys --------------------------------------------------------------------------

_BAD = re.compile(r"[^A-Za-z0-9._:+=@-]")


def _segment(text: str, limit: int = 64) -> str:
    """One namespace segment from free text: bad characters become '_', a leading
    '.' is dropped, and a long text keeps its head plus a short hash of the whole."""
    seg = _BAD.sub("_", text).lstrip(".") or "_"
    if not seg[0].isalnum() and seg[0] != "_":
        seg = "_" + seg
    if len(seg) > limit:
        seg = f"{seg[: limit - 17]}-{xxhash.xxh3_64_hexdigest(text.encode())}"
    return seg


def model_segment(model: str) -> str:
    """A model name as one segment: "org/name" -> "org--name"; a local path keeps
    its last component (engines on other hosts may keep the model elsewhere)."""
    name = model.rstrip("/")
    if name.startswith(("/", "./", "../", "~")):
        name = name.rsplit("/", 1)[-1]
    return _segment(name.replace("/", "--"))


def namespace(
    model: str,
    dtype: str,
    layout: str,
    block_tokens: int,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    kind: str = "kv",
) -> str:
    """The namespace of one model layout and rank, e.g.
    ``tiny-llama/float32/l2-kvh2-hd64-nhd/b32/tp0of1/pp0of1``; ``kind="state"``
    names the namespace of hybrid-model state blocks (same hashes, separate keys).

    Everything that changes the bytes of a block is in it: the model, the KV dtype,
    the layout (layers, KV heads, head size, memory order), the block size and the
    rank's shard. Raises ValueError for a non-positive block size or a bad rank."""
    if block_tokens <= 0:
        raise ValueError("block_tokens must be positive")
    if not (0 <= tp_rank < tp_size and 0 <= pp_rank < pp_size):
        raise ValueError(f"bad rank tp{tp_rank}of{tp_size} pp{pp_rank}of{pp_size}")
    segs = [
        model_segment(model),
        _segment(dtype.removeprefix("torch.")),
        _segment(layout),
        f"b{block_tokens}",
        f"tp{tp_rank}of{tp_size}",
        f"pp{pp_rank}of{pp_size}",
    ]
    if kind != "kv":
        segs.append(_segment(kind))
    ns = "/".join(segs)
    if len(ns) > MAX_NAMESPACE_LEN:  # only with absurd inputs: keep it valid
        ns = f"{segs[0][:40]}/{xxhash.xxh3_64_hexdigest(ns.encode())}"
    return check_namespace(ns)


def extra_keys(
    *,
    lora: str | None = None,
    cache_salt: str | None = None,
    mm_hashes: Sequence[str] = (),
) -> bytes:
    """The ``extra`` bytes mixed into every block hash of a request.

    Empty when the request has none of them, so plain prompts hash the same in
    every engine. Each part is tagged and length-prefixed, so ("ab", "") and
    ("a", "b") never collide. Multimodal hashes are mixed into every block of the
    request (coarser than per-placeholder, never wrong)."""
    out = bytearray()

    def put(tag: bytes, text: str) -> None:
        raw = text.encode()
        out.extend(tag + struct.pack("<I", len(raw)) + raw)

    if lora:
        put(b"L", lora)
    if cache_salt:
        put(b"S", cache_salt)
    for h in mm_hashes:
        put(b"M", h)
    return b"kvx1" + bytes(out) if out else b""


def hybrid_hit_blocks(kv_present: Sequence[bool], state_present: Sequence[bool]) -> int:
    """Blocks of a hybrid-model prefix that may be loaded: the largest k such that
    KV blocks 0..k-1 are all present AND the state at boundary k (stored under the
    state namespace with hash k-1) is present. 0 when there is none."""
    k = leading_run(kv_present)
    while k > 0 and not (k - 1 < len(state_present) and state_present[k - 1]):
        k -= 1
    return k


# ---- load or recompute -----------------------------------------------------------------


class BandwidthMeter:
    """Exponentially weighted load bandwidth (bytes/s) from (bytes, seconds) samples.

    Samples under ``min_bytes`` are ignored (their time is all latency)."""

    def __init__(self, alpha: float = 0.3, min_bytes: int = 256 << 10) -> None:
        self.alpha = alpha
        self.min_bytes = min_bytes
        self.bytes_per_s: float | None = None

    def add(self, nbytes: int, seconds: float) -> None:
        if nbytes < self.min_bytes or seconds <= 0:
            return
        bw = nbytes / seconds
        prev = self.bytes_per_s
        self.bytes_per_s = bw if prev is None else prev + self.alpha * (bw - prev)


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


# ---- statistics --------------------------------------------------------------------

COUNTER_NAMES = (
    "lookups",
    "lookup_tokens",
    "lookup_timeouts",
    "hit_tokens",
    "loaded_blocks",
    "loaded_bytes",
    "load_failed_blocks",
    "stored_blocks",
    "stored_bytes",
    "store_failed_blocks",
    "skipped_present_blocks",
    "skipped_short_blocks",
    "skipped_slow_blocks",
    "dropped_save_blocks",
)
TIMER_NAMES = ("lookup_seconds", "load_seconds", "store_seconds")

_PROM: dict[str, Any] = {}
_PROM_LOCK = threading.Lock()
_SKIP_REASON = {
    "skipped_present_blocks": "present",
    "skipped_short_blocks": "short_hit",
    "skipped_slow_blocks": "slow_load",
    "dropped_save_blocks": "backpressure",
}


def _prom() -> dict[str, Any]:
    """Create the Prometheus metrics once per process (default registry)."""
    with _PROM_LOCK:
        if _PROM:
            return _PROM
        from prometheus_client import Counter, Histogram

        lab = ["connector"]
        m: dict[str, Any] = {
            "lookups": Counter("kvstore_connector_lookups_total", "Prefix lookups", lab),
            "lookup_tokens": Counter(
                "kvstore_connector_lookup_tokens_total", "Prompt tokens looked up", lab
            ),
            "lookup_timeouts": Counter(
                "kvstore_connector_lookup_timeouts_total",
                "Lookups that missed their deadline (taken as no hit)",
                lab,
            ),
            "hit_tokens": Counter(
                "kvstore_connector_hit_tokens_total", "Tokens loaded from the store", lab
            ),
            "loaded_blocks": Counter("kvstore_connector_loaded_blocks_total", "Blocks loaded", lab),
            "loaded_bytes": Counter("kvstore_connector_loaded_bytes_total", "Bytes loaded", lab),
            "load_failed_blocks": Counter(
                "kvstore_connector_load_failed_blocks_total",
                "Blocks that were hits at lookup but missing at load (recomputed)",
                lab,
            ),
            "stored_blocks": Counter(
                "kvstore_connector_stored_blocks_total", "Blocks written", lab
            ),
            "stored_bytes": Counter("kvstore_connector_stored_bytes_total", "Bytes written", lab),
            "store_failed_blocks": Counter(
                "kvstore_connector_store_failed_blocks_total",
                "Blocks not written (already there by another writer, or worker down)",
                lab,
            ),
            "skipped": Counter(
                "kvstore_connector_skipped_blocks_total",
                "Blocks neither loaded nor written, by reason",
                [*lab, "reason"],
            ),
        }
        for t in TIMER_NAMES:
            m[t] = Histogram(
                f"kvstore_connector_{t}",
                f"Connector {t.split('_')[0]} latency",
                lab,
                buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            )
        _PROM.update(m)
        return _PROM


class Counters:
    """Thread-safe counters and latency samples of one interval.

    ``take()`` returns a plain, serialisable dict and starts a new interval; that
    dict is what the engine ships from its workers to its stats logger."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = self._empty()

    @staticmethod
    def _empty() -> dict[str, Any]:
        d: dict[str, Any] = dict.fromkeys(COUNTER_NAMES, 0)
        for t in TIMER_NAMES:
            d[t] = []
        return d

    def add(self, name: str, n: int) -> None:
        with self._lock:
            self._data[name] += n

    def observe(self, name: str, seconds: float) -> None:
        with self._lock:
            self._data[name].append(seconds)

    def take(self) -> dict[str, Any]:
        with self._lock:
            d, self._data = self._data, self._empty()
        return d

    def peek(self) -> dict[str, Any]:
        with self._lock:
            return {k: (list(v) if isinstance(v, list) else v) for k, v in self._data.items()}


def merge_stats(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Sum two stats dicts (counters add, samples concatenate)."""
    out = dict(a)
    for k, v in b.items():
        if isinstance(v, list):
            out[k] = [*out.get(k, []), *v]
        else:
            out[k] = out.get(k, 0) + v
    return out


def reduce_stats(d: dict[str, Any]) -> dict[str, float]:
    """Counters as they are, latency samples as count / mean / max in ms."""
    out: dict[str, float] = {}
    for k, v in d.items():
        if isinstance(v, list):
            if v:
                out[f"{k[:-8]}_count"] = len(v)
                out[f"{k[:-8]}_mean_ms"] = round(1000 * sum(v) / len(v), 3)
                out[f"{k[:-8]}_max_ms"] = round(1000 * max(v), 3)
        elif v:
            out[k] = v
    return out


def stats_empty(d: dict[str, Any]) -> bool:
    return not any(d.values())


# Process totals since start (never reset): what tests and `kvstore` tooling read.
TOTALS = Counters()


def record(connector: str, interval: Counters | None, name: str, value: float) -> None:
    """Count ``value`` under ``name`` in the interval, the process totals and Prometheus."""
    prom = _prom()
    if name in TIMER_NAMES:
        if interval is not None:
            interval.observe(name, value)
        TOTALS.observe(name, value)
        prom[name].labels(connector).observe(value)
        return
    n = int(value)
    if n == 0:
        return
    if interval is not None:
        interval.add(name, n)
    TOTALS.add(name, n)
    if name in _SKIP_REASON:
        prom["skipped"].labels(connector, _SKIP_REASON[name]).inc(n)
    else:
        prom[name].labels(connector).inc(n)


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
    watermark: blocks below it were written, or were known to be in the store, or
    are being loaded. Nothing here talks to the store or the engine."""

    req_id: str
    block_tokens: int
    extra: bytes = b""
    hashes: list[bytes] = field(default_factory=list)
    present: list[bool] = field(default_factory=list)
    state_present: list[bool] = field(default_factory=list)
    local_tokens: int = 0
    hit_blocks: int = 0
    ext_tokens: int = 0
    decision: str = ""
    block_ids: list[int] = field(default_factory=list)
    pending_load: list[BlockRef] = field(default_factory=list)
    saved_upto: int = 0
    looked_up_tokens: int = -1

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
        to sample from); the load still covers that last block whole."""
        self.local_tokens = num_computed_tokens
        hit_tokens = min(self.hit_blocks * self.block_tokens, num_tokens - 1)
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
        return max(0, self.hit_blocks - first)

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

    def mark_missing(self, indices: Sequence[int]) -> None:
        """Blocks that failed to load are not in the store (so they get written)."""
        for i in indices:
            if i < len(self.present):
                self.present[i] = False

    def blocks_to_save(
        self, computed_tokens: int, tokens: Sequence[int]
    ) -> tuple[list[BlockRef], int]:
        """Full blocks whose KV exists after this step (``computed_tokens``) and whose
        tokens are known, past the watermark, that the store does not hold.

        Returns them and how many past the watermark were skipped as present; moves
        the watermark."""
        self.extend_hashes(tokens)
        full = min(computed_tokens, len(tokens)) // self.block_tokens
        full = min(full, len(self.hashes), len(self.block_ids))
        out: list[BlockRef] = []
        skipped = 0
        for i in range(self.saved_upto, full):
            if i < len(self.present) and self.present[i]:
                skipped += 1
            else:
                out.append(BlockRef(i, self.block_ids[i], self.hashes[i]))
        self.saved_upto = max(self.saved_upto, full)
        return out, skipped


# ---- the store client -----------------------------------------------------------------


class ClientHolder:
    """A :class:`Client` made in a background thread, so no caller ever waits for an
    unreachable master longer than it asked to: ``get(wait)`` returns the client, or
    None when it is not there within ``wait`` seconds (callers treat that as a miss).
    A failed attempt is retried at most every ``retry_s`` seconds. Thread-safe."""

    def __init__(
        self,
        master: str,
        timeout: float,
        retry_s: float = 5.0,
        factory: Callable[..., Client] = Client,
    ) -> None:
        self.master = master
        self.timeout = timeout
        self.retry_s = retry_s
        self._factory = factory
        self._client: Client | None = None
        self._next_try = 0.0
        self._lock = threading.Lock()
        self._attempt: threading.Event | None = None  # set when the running attempt ends
        self._closed = False

    def start(self) -> None:
        """Begin connecting now (idempotent)."""
        self._kick()

    def _kick(self) -> threading.Event | None:
        with self._lock:
            if self._client is not None or self._closed:
                return None
            if self._attempt is not None:
                return self._attempt
            if time.monotonic() < self._next_try:
                return None
            done = self._attempt = threading.Event()
        threading.Thread(target=self._connect, args=(done,), name="kvstore-connect",
                         daemon=True).start()  # fmt: skip
        return done

    def _connect(self, done: threading.Event) -> None:
        client: Client | None = None
        try:
            client = self._factory(self.master, timeout=self.timeout)
        except Exception as e:
            log.warning("kvstore at %s unreachable (%s); lookups are misses meanwhile",
                        self.master, e)  # fmt: skip
        with self._lock:
            if client is not None and self._closed:
                client.close()
                client = None
            self._client = client
            if client is None:
                self._next_try = time.monotonic() + self.retry_s
            self._attempt = None
        done.set()

    def get(self, wait: float = 0.0) -> Client | None:
        c = self._client
        if c is not None:
            return c
        done = self._kick()
        if done is not None and wait > 0:
            done.wait(wait)
        return self._client

    def close(self) -> None:
        with self._lock:
            self._closed = True
            c, self._client = self._client, None
        if c is not None:
            c.close()


def parse_bool(v: object) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "yes", "on")
    return bool(v)


@dataclass(slots=True, frozen=True)
class ConnectorConfig:
    """The connector's settings (vLLM: ``kv_connector_extra_config``; SGLang:
    ``--hicache-storage-backend-extra-config``). Unknown keys are ignored.

    master               "host:port[,host:port]" of the kvstore master (required)
    timeout_s            deadline of data calls (get, put), default 5
    lookup_timeout_s     deadline of the scheduler's prefix lookup, default 0.05;
                         a lookup past it is a miss, never a stalled scheduler
    min_hit_tokens       hits shorter than this are recomputed; default one block
    prefill_tokens_per_s the engine's prefill speed, for the load-or-recompute
                         rule; unset = always load
    model_id             overrides the model name in the namespace
    max_pending_save_mb  unwritten save bytes allowed before new saves are dropped
    load_failure_policy  "recompute" (default: blocks missing at load are recomputed)
                         or "fail" (vLLM fails the request)
    test_fault_file      fault injection for tests only: while this file exists and
                         holds {"remove_from_block": k}, each load first removes its
                         blocks from k on from the store, so they really miss
    """

    master: str
    timeout_s: float = 5.0
    lookup_timeout_s: float = 0.05
    min_hit_tokens: int | None = None
    prefill_tokens_per_s: float | None = None
    model_id: str | None = None
    max_pending_save_mb: int = 1024
    test_fault_file: str | None = None
    load_failure_policy: str = "recompute"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ConnectorConfig:
        master = d.get("master") or d.get("kvstore_master")
        if not master:
            raise ValueError('the kvstore connector needs "master": "HOST:PORT" in its config')

        def opt_float(k: str) -> float | None:
            v = d.get(k)
            return None if v in (None, "") else float(v)

        mht = d.get("min_hit_tokens")
        policy = str(d.get("load_failure_policy", "recompute"))
        if policy not in ("recompute", "fail"):
            raise ValueError(f'load_failure_policy must be "recompute" or "fail", not {policy!r}')
        return cls(
            master=str(master),
            timeout_s=float(d.get("timeout_s", 5.0)),
            lookup_timeout_s=float(d.get("lookup_timeout_s", 0.05)),
            min_hit_tokens=None if mht in (None, "") else int(mht),
            prefill_tokens_per_s=opt_float("prefill_tokens_per_s"),
            model_id=d.get("model_id") or None,
            max_pending_save_mb=int(d.get("max_pending_save_mb", 1024)),
            test_fault_file=d.get("test_fault_file") or None,
            load_failure_policy=policy,
        )
