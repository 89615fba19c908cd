"""Connector keys: namespaces (model identity, ranks) and the extra bytes of a request.

Pure logic, no engine: these run in ``make test``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kvstore_client import block_hashes
from kvstore_client.connectors.naming import (
    STATE_KIND,
    ModelIdentity,
    embeds_digest,
    extra_keys,
    namespace,
    rank_namespaces,
    resolve_ranks,
    sglang_shard,
)
from kvstore_client.keys import check_namespace

_HASH_SCRIPT = """
import json, sys
from kvstore_client import block_hashes
from kvstore_client.connectors.naming import extra_keys, namespace
x = extra_keys(lora="adapter-a", cache_salt="s1", mm_hashes=["img0"])
print(json.dumps({
    "ns": namespace("meta-llama/Llama-3-8B", "torch.bfloat16", "attn32x8x128-cuda", 16,
                    tp_rank=1, tp_size=2),
    "h": [h.hex() for h in block_hashes(list(range(100)), 16, extra=x)],
}))
"""


def test_keys_equal_across_processes_and_hash_seeds() -> None:
    outs = []
    for seed in ("0", "1", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        r = subprocess.run([sys.executable, "-c", _HASH_SCRIPT], env=env, capture_output=True,
                           text=True, check=True)  # fmt: skip
        outs.append(json.loads(r.stdout))
    assert all(o == outs[0] for o in outs)
    ns = outs[0]["ns"]
    assert ns.startswith("meta-llama--Llama-3-8B@")
    assert ns.endswith("/bfloat16/attn32x8x128-cuda/b16/tp1of2/pp0of1")
    assert len(outs[0]["h"]) == 6  # only full blocks


def test_namespace_segments() -> None:
    ns = namespace("/models/tiny llama/", "float32", "l2", 32)
    assert ns.startswith("tiny_llama@") and ns.endswith("/float32/l2/b32/tp0of1/pp0of1")
    assert namespace("m", "f", "l", 16, kind=STATE_KIND).endswith("/state")
    long = namespace("x" * 300, "f", "l" * 300, 16)
    assert check_namespace(long) == long and len(long) <= 255
    with pytest.raises(ValueError):
        namespace("m", "f", "l", 16, tp_rank=2, tp_size=2)


def test_model_identity_is_complete() -> None:
    """Bug (old code): only the last path component was kept, so two checkpoints
    named alike collided; revision and quantization were not in the namespace."""

    def ns(m: str | ModelIdentity) -> str:
        return namespace(m, "bfloat16", "l2", 16)

    variants = [
        ns("/ckpt/a/final"),
        ns("/ckpt/b/final"),
        ns("org/model"),
        ns(ModelIdentity("org/model", revision="abc123")),
        ns(ModelIdentity("org/model", revision="def456")),
        ns(ModelIdentity("org/model", quantization="fp8")),
        ns(ModelIdentity("org/model", revision="abc123", quantization="awq")),
    ]
    assert len(set(variants)) == len(variants)
    assert ns("org/model") == ns(ModelIdentity("org/model"))  # stable
    assert ns("/ckpt/a/final/") == ns("/ckpt/a/final")


def test_extra_keys_change_every_hash_and_are_unambiguous() -> None:
    toks = list(range(64))
    plain = block_hashes(toks, 16, extra=extra_keys())
    assert plain == block_hashes(toks, 16)
    variants = [
        extra_keys(lora="a"),
        extra_keys(lora="a", lora_path="/adapters/1"),
        extra_keys(lora="a", lora_path="/adapters/2"),
        extra_keys(cache_salt="a"),
        extra_keys(mm_hashes=["a"]),
        extra_keys(lora="ab"),
        extra_keys(lora="a", cache_salt="b"),
        extra_keys(embeds_digest=b"\x01" * 16),
        extra_keys(embeds_digest=b"\x02" * 16),
    ]
    assert len(set(variants)) == len(variants)
    for x in variants:
        hs = block_hashes(toks, 16, extra=x)
        assert all(a != b for a, b in zip(hs, plain, strict=True))


def test_prompt_embeddings_never_share_keys() -> None:
    """Bug (old code): embedding prompts carry all-zero token ids, so two different
    embedding prompts of one length had equal keys and loaded each other's KV."""
    rng = np.random.default_rng(0)
    e1 = rng.standard_normal((64, 8)).astype(np.float32)
    e2 = e1.copy()
    e2[40, 3] += 1e-3  # differs only in block 2
    zeros = [0] * 64
    k1 = block_hashes(zeros, 16, extra=extra_keys(embeds_digest=embeds_digest(
        e1.tobytes(), e1.shape, "float32")))  # fmt: skip
    k2 = block_hashes(zeros, 16, extra=extra_keys(embeds_digest=embeds_digest(
        e2.tobytes(), e2.shape, "float32")))  # fmt: skip
    assert not set(k1) & set(k2)
    # the same embeddings give the same keys (another engine finds them)
    assert embeds_digest(e1.tobytes(), e1.shape, "float32") == embeds_digest(
        e1.copy().tobytes(), (64, 8), "float32"
    )
    # the shape and dtype are part of the digest
    assert embeds_digest(e1.tobytes(), (8, 64), "float32") != embeds_digest(
        e1.tobytes(), (64, 8), "float32"
    )


def test_rank_namespaces_cover_every_rank() -> None:
    nss = rank_namespaces("m", "f", "l", 16, tp_size=2, pp_size=2)
    assert [n.split("/")[-2:] for n in nss] == [
        ["tp0of2", "pp0of2"], ["tp1of2", "pp0of2"], ["tp0of2", "pp1of2"], ["tp1of2", "pp1of2"],
    ]  # fmt: skip
    assert rank_namespaces("m", "f", "l", 16, 1, 1) == [namespace("m", "f", "l", 16)]


def test_unknown_rank_raises() -> None:
    """Bug (old code): a worker whose process groups were not readable became
    tp0of1 silently, so TP ranks overwrote each other's shards under one key."""
    assert resolve_ranks(None, 1, 1) == (0, 1, 0, 1)
    with pytest.raises(ValueError, match="cannot tell this worker's rank"):
        resolve_ranks(None, 2, 1)
    with pytest.raises(ValueError, match="does not match"):
        resolve_ranks((0, 1, 0, 1), 2, 1)
    with pytest.raises(ValueError):
        resolve_ranks((2, 2, 0, 1), 2, 1)
    assert resolve_ranks((1, 2, 0, 1), 2, 1) == (1, 2, 0, 1)


def test_sglang_shards() -> None:
    """MLA KV is one shared copy (tp0of1) unless decode-context parallelism splits a
    page's tokens across ranks: then one copy per DCP rank. Attention context
    parallelism is refused clearly."""
    assert sglang_shard(is_mla=False, tp_rank=1, tp_size=2) == ("tp", 1, 2)
    assert sglang_shard(is_mla=True, tp_rank=1, tp_size=2) == ("tp", 0, 1)
    assert sglang_shard(is_mla=True, tp_rank=3, tp_size=4, dcp_rank=1, dcp_size=2) == ("dcp", 1, 2)
    with pytest.raises(ValueError, match="context parallelism"):
        sglang_shard(is_mla=False, tp_rank=0, tp_size=1, attn_cp_size=2)
    with pytest.raises(ValueError, match="MLA"):
        sglang_shard(is_mla=False, tp_rank=0, tp_size=2, dcp_rank=0, dcp_size=2)
