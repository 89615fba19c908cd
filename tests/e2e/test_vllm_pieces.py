"""Pieces of the vLLM connector that need torch and vLLM's classes but no engine:
the vectorised block copy, the per-step worker metadata across ranks, and the
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
from kvstore_client.connectors.vllm.worker import _ids, describe_layer  # noqa: E402


@pytest.mark.parametrize("split", [False, True])
def test_one_index_copy_per_layer_moves_the_same_bytes_as_a_loop(split: bool) -> None:
    nb = 8
    shape = (2, nb, 4, 3) if split else (nb, 2, 4, 3)
    a = torch.randn(shape)
    b = torch.randn((nb, 5), dtype=torch.float64)  # a second layer, other dtype
    la = describe_layer(a, nb, 0)
    lb = describe_layer(b, nb, la.nbytes)
    assert la.kv_split == split and la.nbytes == 2 * 4 * 3 * 4 and lb.nbytes == 40
    src = [5, 2, 7]
    staging = torch.empty((3, la.nbytes + lb.nbytes), dtype=torch.uint8)
    for layer in (la, lb):
        layer.gather(_ids([src]), staging)
    # Row bytes: each layer's block in order (K then V for split layouts), as before.
    for row, blk in enumerate(src):
        parts = [a[0, blk], a[1, blk]] if split else [a[blk]]
        want = b"".join(p.contiguous().numpy().tobytes() for p in parts)
        want += b[blk].numpy().tobytes()
        assert staging[row].numpy().tobytes() == want
    a2, b2 = torch.zeros_like(a), torch.zeros_like(b)
    la2, lb2 = describe_layer(a2, nb, 0), describe_layer(b2, nb, la.nbytes)
    dst = [1, 6, 0]
    for layer in (la2, lb2):
        layer.scatter(_ids([dst]), staging)
    for s, d in zip(src, dst, strict=True):
        if split:
            assert torch.equal(a2[:, d], a[:, s])
        else:
            assert torch.equal(a2[d], a[s])
        assert torch.equal(b2[d], b[s])
    untouched = [i for i in range(nb) if i not in dst]
    assert not b2[untouched].any()
    with pytest.raises(ValueError, match="unknown KV cache layout"):
        describe_layer(torch.zeros((3, 4)), nb, 0)


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
