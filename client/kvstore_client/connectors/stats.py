"""Connector statistics: counters and latency samples per interval (shipped to the
engine's own stats logger), process totals, and Prometheus metrics
(``kvstore_connector_*``). No engine or torch import."""

from __future__ import annotations

import threading
from typing import Any

COUNTER_NAMES = (
    "lookups",
    "lookup_tokens",
    "lookup_timeouts",
    "lookups_local",
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
    "loaded_states",
    "sync_loaded_blocks",
    "arena_loaded_blocks",
    "arena_stored_blocks",
    "stored_states",
    "session_hints",
    "session_hints_dropped",
    "session_hints_bad",
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
            "lookups_local": Counter(
                "kvstore_connector_lookups_local_total",
                "Lookups answered from same-host workers' shared indexes in the scheduler's "
                "own thread (no I/O)",
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
            "loaded_states": Counter(
                "kvstore_connector_loaded_states_total",
                "Hybrid-model boundary states loaded",
                lab,
            ),
            "sync_loaded_blocks": Counter(
                "kvstore_connector_sync_loaded_blocks_total",
                "Blocks loaded synchronously (load_mode sync: before the forward)",
                lab,
            ),
            "arena_loaded_blocks": Counter(
                "kvstore_connector_arena_loaded_blocks_total",
                "Blocks copied into the KV cache straight from a same-host worker's arena slot",
                lab,
            ),
            "arena_stored_blocks": Counter(
                "kvstore_connector_arena_stored_blocks_total",
                "Blocks copied from the KV cache straight into a same-host worker's arena slot",
                lab,
            ),
            "stored_states": Counter(
                "kvstore_connector_stored_states_total",
                "Hybrid-model boundary states written",
                lab,
            ),
            "store_failed_blocks": Counter(
                "kvstore_connector_store_failed_blocks_total",
                "Blocks not written (already there by another writer, or worker down)",
                lab,
            ),
            "session_hints": Counter(
                "kvstore_connector_session_hints_total", "Session hints sent to the store", lab
            ),
            "session_hints_dropped": Counter(
                "kvstore_connector_session_hints_dropped_total",
                "Session hints dropped (queue full, or the store refused them)",
                lab,
            ),
            "session_hints_bad": Counter(
                "kvstore_connector_session_hints_bad_total",
                "Requests whose session hint was malformed (ignored)",
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
