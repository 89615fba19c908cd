"""kvstore_client.connectors.sglang against the installed sglang package (0.5.23).

The backend is checked against SGLang's own ``HiCacheStorage`` ABC and made by SGLang's
``StorageBackendFactory`` ("dynamic" backend), against a real kvstore cluster. SGLang's
engine does not run here (its 0.5.23 wheel needs torch 2.14.1 with CUDA kernels, and its
host pool module imports torchvision, which breaks against the CPU torch of this venv),
so the zero-copy page calls are driven through ``HostPool`` below: a stand-in for
SGLang's MHA host pool whose ``get_page_buffer_meta`` follows SGLang's own layouts
(pool_host/mha.py: layer_first = K and V runs per layer, page_first = one K and one V
run per page).
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

sglang_storage = pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage", reason="sglang is not installed in this venv"
)

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvstore_client.connectors.sglang import KVStoreHiCacheStorage  # noqa: E402

pytestmark = pytest.mark.timeout(120)


class HostPool:
    """The host KV pool surface HiCache storage backends use (see module docstring)."""

    def __init__(self, layout: str, size: int = 64, page_size: int = 4, layers: int = 2,
                 heads: int = 2, head_dim: int = 8) -> None:  # fmt: skip
        self.layout, self.size, self.page_size = layout, size, page_size
        self.layer_num, self.head_num, self.head_dim = layers, heads, head_dim
        self.dtype = torch.float32
        first = (layers, size) if layout == "layer_first" else (size, layers)
        self.kv_buffer = torch.zeros((2, *first, heads, head_dim), dtype=self.dtype)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        assert len(indices) % self.page_size == 0
        item = self.dtype.itemsize
        base, idx = self.kv_buffer.data_ptr(), indices.tolist()
        v_off = self.layer_num * self.size * self.head_num * self.head_dim * item
        ptrs: list[int] = []
        for i in range(0, len(idx), self.page_size):
            if self.layout == "layer_first":
                for layer in range(self.layer_num):
                    k = base + (idx[i] + layer * self.size) * self.head_num * self.head_dim * item
                    ptrs += [k, k + v_off]
                size = item * self.page_size * self.head_num * self.head_dim
            else:
                k = base + idx[i] * self.layer_num * self.head_num * self.head_dim * item
                ptrs += [k, k + v_off]
                size = self.layer_num * item * self.page_size * self.head_num * self.head_dim
        return ptrs, [size] * len(ptrs)

    def _page(self, start: int) -> torch.Tensor:
        sl = slice(start, start + self.page_size)
        return self.kv_buffer[:, :, sl] if self.layout == "layer_first" else self.kv_buffer[:, sl]

    def page(self, start: int) -> torch.Tensor:
        """All the pool's values of the page starting at ``start`` (a copy)."""
        return self._page(start).clone()

    def fill(self, start: int, seed: int) -> None:
        v = self._page(start)
        v.copy_(torch.randn(v.shape, generator=torch.Generator().manual_seed(seed)))


def storage_config(master: str, **extra: Any) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name="org/tiny-model",
        extra_config={
            "backend_name": "kvstore",
            "module_path": "kvstore_client.connectors.sglang",
            "class_name": "KVStoreHiCacheStorage",
            "interface_v1": 1,
            "master": master,
            **extra,
        },
    )  # fmt: skip


def make_backend(master: str, pool: HostPool | None = None, **extra: Any) -> HiCacheStorage:
    b = StorageBackendFactory.create_backend("dynamic", storage_config(master, **extra), pool)
    if pool is not None:
        b.register_mem_pool_host(pool)
    return b


def test_implements_the_installed_interface() -> None:
    assert issubclass(KVStoreHiCacheStorage, HiCacheStorage)
    assert not KVStoreHiCacheStorage.__abstractmethods__
    for name in ("get", "batch_get", "set", "batch_set", "exists", "batch_exists",
                 "batch_get_v1", "batch_set_v1", "register_mem_pool_host", "get_stats",
                 "clear", "batch_exists_v2", "batch_get_v2", "batch_set_v2",
                 "register_mem_host_pool_v2"):  # fmt: skip
        ours = list(inspect.signature(getattr(KVStoreHiCacheStorage, name)).parameters)
        theirs = list(inspect.signature(getattr(HiCacheStorage, name)).parameters)
        assert ours == theirs, f"{name}: {ours} != SGLang's {theirs}"


def test_generic_calls_round_trip(make_cluster: Any) -> None:
    c = make_cluster(workers=2)
    a, b = make_backend(c.address), make_backend(c.address)  # two engines, one store
    keys = [f"page-{i:04d}" for i in range(6)]
    vals = [torch.randn(2, 2, 4, 8) for _ in keys]
    assert a.batch_exists(keys) == 0
    assert a.batch_set(keys[:4], vals[:4])
    assert a.batch_set(keys[:4], vals[:4])  # already there: still success
    assert b.exists(keys[0]) and not b.exists(keys[5])
    assert b.batch_exists(keys, HiCacheStorageExtraInfo(prefix_keys=[])) == 4
    dst = [torch.zeros(2 * 2 * 4 * 8) for _ in keys]
    got = b.batch_get(keys, dst)
    for i in range(4):
        assert got[i] is dst[i] and torch.equal(dst[i], vals[i].flatten())
    assert got[4] is None and got[5] is None
    one = b.get(keys[1], torch.zeros(2 * 2 * 4 * 8))
    assert one is not None and torch.equal(one, vals[1].flatten())
    assert b.set(keys[5], vals[5]) and b.batch_exists(keys) == 4  # key 4 still missing


def test_reads_land_in_targets_that_are_not_one_run_of_host_memory(make_cluster: Any) -> None:
    """A target that is a strided view (or on another device) cannot be read into
    directly: the bytes go through a temporary and are copied into the target,
    never left in a copy the caller does not see."""
    c = make_cluster(workers=2)
    b = make_backend(c.address)
    keys = [f"strided-{i}" for i in range(3)]
    vals = [torch.randn(4, 8) for _ in keys]
    assert b.batch_set(keys, vals)
    base = torch.zeros(3, 8, 4)
    dst = [base[i].t() for i in range(3)]  # (4, 8) views, not contiguous
    assert not dst[0].is_contiguous()
    got = b.batch_get(keys, dst)
    for i in range(3):
        assert got[i] is dst[i] and torch.equal(dst[i], vals[i])
    assert torch.equal(base[1].t(), vals[1])  # the caller's memory holds the bytes
    miss = torch.zeros(4, 8).t()
    assert b.batch_get(["absent-key"], [miss]) == [None] and not miss.any()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_zero_copy_page_calls(make_cluster: Any, layout: str) -> None:
    c = make_cluster(workers=2)
    src_pool, dst_pool = HostPool(layout), HostPool(layout)
    writer, reader = make_backend(c.address, src_pool), make_backend(c.address, dst_pool)
    assert writer.namespace == reader.namespace  # type: ignore[attr-defined]
    ps = src_pool.page_size
    keys = [f"{layout}-{i}" for i in range(5)]
    for i in range(len(keys)):
        src_pool.fill(i * ps, seed=i)
    idx = torch.arange(0, len(keys) * ps)
    assert writer.batch_set_v1(keys, idx) == [True] * len(keys)
    assert reader.batch_exists(keys) == len(keys)
    # Read into other slots of another pool.
    off = 8 * ps
    assert reader.batch_get_v1(keys, idx + off) == [True] * len(keys)
    for i in range(len(keys)):
        assert torch.equal(dst_pool.page(off + i * ps), src_pool.page(i * ps)), f"page {i}"
    # A missing page is a miss, the others still land.
    miss = reader.batch_get_v1([keys[0], "absent", keys[2]], torch.arange(0, 3 * ps))
    assert miss == [True, False, True]


def test_unreachable_store_is_a_miss_not_an_error() -> None:
    b = make_backend("127.0.0.1:1", HostPool("page_first"), timeout_s=0.3)
    assert b.batch_exists(["k"]) == 0 and not b.exists("k")
    assert b.batch_get(["k"], [torch.zeros(4)]) == [None]
    assert b.batch_set_v1(["k"], torch.arange(0, 4)) == [False]
    assert b.batch_get_v1(["k"], torch.arange(0, 4)) == [False]


class StatePool:
    """The surface of SGLang's Mamba host pool the v2 calls use (page_size,
    get_data_page, get_dummy_flat_data_page, set_from_flat_data_page)."""

    def __init__(self, size: int = 16, page_size: int = 1, per_page: int = 96) -> None:
        self.page_size, self.size = page_size, size
        self.layout, self.dtype = "mamba", torch.float32
        self.buf = torch.zeros((size, per_page), dtype=torch.float32)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return self.buf[index].view(torch.uint8).flatten().clone()

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.buf.shape[1] * 4, dtype=torch.uint8)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.buf[index].view(torch.uint8).copy_(data_page.view(torch.uint8))


def test_hybrid_pools_v2(make_cluster: Any) -> None:
    """KV pages plus a Mamba state pool through batch_set_v2 / batch_exists_v2 /
    batch_get_v2: the hit needs the state at its end; state bytes round-trip."""
    c = make_cluster(workers=2)
    kv_a, kv_b = HostPool("page_first"), HostPool("page_first")
    st_a, st_b = StatePool(), StatePool()
    a, b = make_backend(c.address, kv_a), make_backend(c.address, kv_b)
    a.register_mem_host_pool_v2(st_a, PoolName.MAMBA)
    b.register_mem_host_pool_v2(st_b, PoolName.MAMBA)
    ps = kv_a.page_size
    keys = [f"hy-{i}" for i in range(6)]
    for i in range(len(keys)):
        kv_a.fill(i * ps, seed=i)
    st_a.buf[3].copy_(torch.randn(96, generator=torch.Generator().manual_seed(7)))
    res = a.batch_set_v2([
        PoolTransfer(name=PoolName.KV, host_indices=torch.arange(0, 6 * ps), keys=keys),
        PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([3]), keys=[keys[3]],
                     hit_policy=PoolHitPolicy.TRAILING_PAGES),
    ])  # fmt: skip
    assert res == {"kv": [True] * 6, "mamba": [True]}
    probe = [PoolTransfer(name=PoolName.MAMBA, keys=[keys[-1]],
                          hit_policy=PoolHitPolicy.TRAILING_PAGES)]  # fmt: skip
    hit = b.batch_exists_v2(keys, probe)
    assert hit.kv_hit_pages == 4  # the state exists at the end of page 3 only
    assert hit.restorable_prefix_pages == [4]
    got = b.batch_get_v2([
        PoolTransfer(name=PoolName.KV, host_indices=torch.arange(0, 4 * ps), keys=keys[:4]),
        PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([9]), keys=[keys[3]],
                     hit_policy=PoolHitPolicy.TRAILING_PAGES),
    ])  # fmt: skip
    assert got == {"kv": [True] * 4, "mamba": [True]}
    assert torch.equal(st_b.buf[9], st_a.buf[3])
    for i in range(4):
        assert torch.equal(kv_b.page(i * ps), kv_a.page(i * ps))
    # KV without state: no hit at all
    assert b.batch_exists_v2(["other-0"], probe).kv_hit_pages == 0
