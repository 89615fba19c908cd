"""Pieces of the vLLM connector that need torch and vLLM's classes but no engine:
the per-step worker metadata across ranks, and the
statistics on vLLM's own Prometheus metrics (``build_prom_metrics``)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

from kvstore_client.connectors.vllm import KVStoreConnector  # noqa: E402
from kvstore_client.connectors.vllm.common import KVStoreWorkerMetadata  # noqa: E402


def test_worker_metadata_across_ranks() -> None:
    """A load failed if any rank lost it; a save counts only when no rank failed it."""
    r0 = KVStoreWorkerMetadata(failed={"a": [3]}, saved={"a": [0, 1, 2]}, load_samples=[(1, 1.0)])
    r1 = KVStoreWorkerMetadata(failed={"a": [4]}, saved={"a": [0, 2]}, save_failed={"a": [1]})
    m = r0.aggregate(r1)
    assert isinstance(m, KVStoreWorkerMetadata)
    assert m.failed == {"a": [3, 4]} and m.saved == {"a": [0, 2]} and m.save_failed == {"a": [1]}
    assert m.load_samples == [(1, 1.0)] and not m.empty() and KVStoreWorkerMetadata().empty()


def test_stats_reach_vllms_prometheus_metrics() -> None:
    reg = CollectorRegistry()
    types = {t: functools.partial(t, registry=reg) for t in (Gauge, Counter, Histogram)}
    cfg = SimpleNamespace(kv_transfer_config=None)
    prom = KVStoreConnector.build_prom_metrics(
        cfg, types, ["model_name", "engine"], {0: ["m", "0"]}
    )
    prom.observe({"stored_blocks": 3, "loaded_states": 1, "store_seconds": [0.01, 0.02]}, 0)
    labels = {"model_name": "m", "engine": "0"}
    assert reg.get_sample_value("vllm:kvstore_stored_blocks_total", labels) == 3
    assert reg.get_sample_value("vllm:kvstore_loaded_states_total", labels) == 1
    assert reg.get_sample_value("vllm:kvstore_store_seconds_count", labels) == 2


def test_a_prefix_cache_reset_leaves_the_shared_store_alone() -> None:
    """vLLM's reset_prefix_cache asks the connector; the store is shared by every
    engine of the model identity, so it reports success and drops nothing."""
    assert KVStoreConnector.reset_cache(object.__new__(KVStoreConnector)) is True
