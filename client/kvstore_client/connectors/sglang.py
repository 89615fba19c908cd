"""SGLang HiCache storage backend (L3) on a kvstore cluster: ``HiCacheStorage``.

Load it as a dynamic backend::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
        "module_path": "kvstore_client.connectors.sglang",
        "class_name": "KVStoreHiCacheStorage", "interface_v1": 1,
        "master": "HOST:PORT"}'

``interface_v1: 1`` makes HiCache use the zero-copy page calls (``batch_get_v1`` /
``batch_set_v1``): pages move between the host KV pool and the store with no copy
in Python, a page given to the multi-part calls as its runs in the pool (one run,
or 2 x layers runs in layer-first layouts), so the stored bytes are the same either way.
Without it HiCache calls the generic ``batch_get`` / ``batch_set`` with tensors.

Keys: SGLang hands over its own page hash strings (chained over the prefix, equal
in every SGLang process); each becomes a 16-byte kvstore hash (xxh3-128 of the
string) in a namespace of the model, KV dtype, pool layout, page size and rank.
Misses, an unreachable store or a full store are "not found" / "not stored",
never exceptions into the engine.

Hybrid models (v2 calls: a KV pool plus Mamba / SWA / ... pools): each pool has its
own namespace (``.../<pool name>``) keyed by the same page hashes;
``batch_exists_v2`` applies each pool's hit policy (all pages, or the trailing
pages: the state at the prefix's end), so a prefix whose state is missing shrinks
to the last boundary that has one, never KV without state.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch  # type: ignore[import-not-found, unused-ignore]
import xxhash
from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found, unused-ignore]
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolTransfer,
    PoolTransferResult,
)

from ..keys import leading_run
from .base import StoreConnector
from .config import SGLANG_OWN_KEYS, ConnectorConfig
from .holder import ClientHolder
from .naming import namespace, sglang_shard
from .planning import pool_hit
from .stats import Counters, record

log = logging.getLogger(__name__)
NAME = "sglang"


def key_hash(key: str) -> bytes:
    """The 16-byte kvstore hash of an SGLang page key."""
    return xxhash.xxh3_128_digest(key.encode())


def _view(ptr: int, size: int) -> memoryview:
    """A writable memoryview of ``size`` bytes of host memory at ``ptr``."""
    return memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")


def _direct(t: Any) -> bool:
    """True when ``t`` is one run of host memory, readable and writable in place."""
    return bool(t.device.type == "cpu" and t.is_contiguous())


def _tensor_bytes(t: Any) -> memoryview:
    """A memoryview of a tensor's bytes to write from: the tensor itself when it is
    one run of host memory, else a host copy of it (another device, or strided)."""
    t = t.detach()
    if not _direct(t):
        t = t.to("cpu").contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _read_targets(targets: list[Any]) -> tuple[list[memoryview], list[tuple[int, Any, Any]]]:
    """Byte views to read into, one per target: the target itself when it is one
    run of host memory, else a host temporary (pinned for a CUDA target) that
    :func:`_land` copies into the target once read. Returns (views, temporaries as
    (index, target, temporary))."""
    views: list[memoryview] = []
    temps: list[tuple[int, Any, Any]] = []
    for i, t in enumerate(targets):
        if _direct(t):
            views.append(memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()))
            continue
        pin = bool(t.device.type == "cuda")
        tmp = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
        views.append(memoryview(tmp.reshape(-1).view(torch.uint8).numpy()))
        temps.append((i, t, tmp))
    return views, temps


def _land(temps: list[tuple[int, Any, Any]], hits: list[bool]) -> None:
    """Copy each read temporary into its target (hits only; a miss leaves the
    target as it was)."""
    for i, target, tmp in temps:
        if hits[i]:
            target.copy_(tmp)


class KVStoreHiCacheStorage(StoreConnector, HiCacheStorage):  # type: ignore[misc]
    """See the module docstring. Built by SGLang's StorageBackendFactory as
    ``KVStoreHiCacheStorage(storage_config, kwargs)``; thread-safe."""

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None
    ) -> None:
        extra = dict(storage_config.extra_config or {})
        self._cfg = ConnectorConfig.from_dict(extra, ignore=SGLANG_OWN_KEYS)
        if self._cfg.ablations():  # never silently ignored
            raise ValueError(
                f"kvstore connector: {self._cfg.ablations()} are settings of the vLLM "
                "connector only; SGLang's storage backend does not have them"
            )
        self._sc = storage_config
        self.attach(ClientHolder(self._cfg.master, self._cfg.timeout_s))
        self._interval = Counters()
        self.mem_pool_host: Any = None
        self.registered_pools: dict[str, Any] = {}
        self._shard = sglang_shard(
            is_mla=bool(storage_config.is_mla_model),
            tp_rank=storage_config.tp_rank,
            tp_size=storage_config.tp_size,
            dcp_rank=getattr(storage_config, "dcp_rank", 0),
            dcp_size=getattr(storage_config, "dcp_size", 1),
            attn_cp_size=getattr(storage_config, "attn_cp_size", 1),
        )
        self._ns = self._namespace(None)
        self._pool_ns: dict[str, str] = {}

    # ---- set-up ----------------------------------------------------------------

    def _namespace(self, pool: Any, kind: str = "kv") -> str:
        sc = self._sc
        model = self._cfg.model_id or sc.model_name or "model"
        # MLA KV is the same on every TP rank: one shared copy (one per DCP rank).
        tag, tp, tps = self._shard
        if pool is None:
            dtype, layout, page = "unknown", "sglang", 1
        else:
            dtype = str(getattr(pool, "dtype", "unknown"))
            parts = [f"sglang-{getattr(pool, 'layout', 'unknown')}"]
            for attr, tag in (("layer_num", "l"), ("head_num", "kvh"), ("head_dim", "hd")):
                v = getattr(pool, attr, None)
                if v is not None:
                    parts.append(f"{tag}{v}")
            if sc.is_mla_model:
                parts.append("mla")
            if tag != "tp":
                parts.append(tag)
            layout = "-".join(parts)
            page = int(getattr(pool, "page_size", 1) or 1)
        return namespace(
            model, dtype, layout, page, tp_rank=tp, tp_size=tps, pp_rank=sc.pp_rank,
            pp_size=sc.pp_size, kind=kind,
        )  # fmt: skip

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang, once: the host KV pool the v1 calls address by index."""
        super().register_mem_pool_host(mem_pool_host)
        self._ns = self._namespace(mem_pool_host)
        log.info("kvstore HiCache backend: namespace %s, master %s", self._ns, self._cfg.master)

    @property
    def namespace(self) -> str:
        return self._ns

    # ---- generic calls (tensors) ---------------------------------------------------

    def exists(self, key: str) -> bool:
        client = self.store_client(self._cfg.timeout_s)
        return bool(client and client.batch_exists(self._ns, [key_hash(key)])[0])

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many leading keys are present (one batched call)."""
        client = self.store_client(self._cfg.timeout_s)
        if client is None or not keys:
            return 0
        t0 = time.perf_counter()
        try:
            flags = client.batch_exists(self._ns, [key_hash(k) for k in keys])
        except Exception as e:
            log.warning("kvstore exists failed: %s", e)
            return 0
        record(NAME, self._interval, "lookups", 1)
        record(NAME, self._interval, "lookup_seconds", time.perf_counter() - t0)
        return leading_run(flags)

    def get(
        self, key: str, target_location: Any | None = None, target_sizes: Any | None = None
    ) -> Any | None:
        out = self.batch_get([key], [target_location] if target_location is not None else None)
        return out[0] if isinstance(out, list) else None

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> list[Any | None]:
        """Fill ``target_locations`` (flat page tensors) and return them, None for
        misses; without targets, return new uint8 tensors."""
        client = self.store_client(self._cfg.timeout_s)
        if client is None or not keys:
            return [None] * len(keys)
        hashes = [key_hash(k) for k in keys]
        t0 = time.perf_counter()
        if target_locations is None:
            vals = client.batch_get(self._ns, hashes)
            self._count_load(sum(v is not None for v in vals), sum(len(v or b"") for v in vals), t0)
            return [None if v is None else torch.frombuffer(bytearray(v), dtype=torch.uint8)
                    for v in vals]  # fmt: skip
        views, temps = _read_targets(list(target_locations))
        hits = client.batch_get_into(self._ns, hashes, views).result()
        _land(temps, hits)
        self._count_load(
            sum(hits), sum(v.nbytes for v, h in zip(views, hits, strict=True) if h), t0
        )
        return [t if h else None for t, h in zip(target_locations, hits, strict=True)]

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Store the tensors; True when every key is in the store afterwards."""
        if values is None or len(values) != len(keys):
            return False
        return all(self._put([key_hash(k) for k in keys], [_tensor_bytes(v) for v in values]))

    # ---- zero-copy page calls (host pool indices) ------------------------------------

    def _page_views(self, host_indices: Any, n_keys: int) -> list[list[memoryview]]:
        """Per key, the host-pool runs of its page (from the pool's buffer meta)."""
        pool = self.mem_pool_host
        ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        if n_keys == 0 or len(ptrs) % n_keys:
            raise ValueError(f"{len(ptrs)} buffer runs for {n_keys} pages")
        per = len(ptrs) // n_keys
        return [
            [_view(int(ptrs[i * per + j]), int(sizes[i * per + j])) for j in range(per)]
            for i in range(n_keys)
        ]

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: Any,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Read pages straight into the host pool at ``host_indices``; per key, hit."""
        client = self.store_client(self._cfg.timeout_s)
        if client is None or not keys:
            return [False] * len(keys)
        pages = self._page_views(host_indices, len(keys))
        hashes = [key_hash(k) for k in keys]
        t0 = time.perf_counter()
        # Each page as its runs in the host pool (one, or one per layer / K and V):
        # read straight into them, no copy.
        hits = client.batch_get_into_parts(self._ns, hashes, pages).result()
        nbytes = sum(sum(v.nbytes for v in p) for p, h in zip(pages, hits, strict=True) if h)
        self._count_load(sum(hits), nbytes, t0)
        return list(hits)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: Any,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Write pages straight from the host pool; per key, True if it is in the store."""
        if not keys:
            return []
        pages = self._page_views(host_indices, len(keys))
        return self._put([key_hash(k) for k in keys], pages, parts=True)

    # ---- hybrid pools (v2: KV plus Mamba / SWA / ... pools) -------------------------

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """SGLang, per pool of a hybrid model: each pool gets its own namespace (the
        pool's layout and name), keyed by the same page hashes as the KV pool."""
        name = str(host_pool_name)
        self.registered_pools[name] = host_pool
        self._pool_ns[name] = self._namespace(host_pool, kind=name)

    def _ns_of(self, name: str) -> str:
        if name == "kv":
            return self._ns
        ns = self._pool_ns.get(name)
        if ns is None:
            raise ValueError(f"kvstore HiCache backend: pool {name!r} was never registered")
        return ns

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The usable prefix: KV pages present, and per extra pool its pages as its
        hit policy asks (all pages, or the trailing ones: a state at the prefix's
        end). One batched query per pool; an unreachable store is no hit."""
        client = self.store_client(self._cfg.timeout_s)
        if client is None or not keys:
            return PoolTransferResult(0, {}, [])
        hashes = [key_hash(k) for k in keys]
        t0 = time.perf_counter()
        try:
            kv = client.batch_exists(self._ns, hashes)
            pools = []
            for t in pool_transfers or []:
                name = str(t.name)
                if t.hit_policy not in (PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES):
                    log.warning("kvstore HiCache backend: hit policy %s of pool %s is not "
                                "supported: no hit", t.hit_policy, name)  # fmt: skip
                    return PoolTransferResult(0, {}, [])
                flags = client.batch_exists(self._ns_of(name), hashes)
                all_pages = t.hit_policy == PoolHitPolicy.ALL_PAGES
                pools.append((name, all_pages, len(t.keys or []) or 1, flags))
        except Exception as e:
            log.warning("kvstore exists failed: %s", e)
            return PoolTransferResult(0, {}, [])
        record(NAME, self._interval, "lookups", 1)
        record(NAME, self._interval, "lookup_seconds", time.perf_counter() - t0)
        final, hits, restorable = pool_hit(kv, pools)
        return PoolTransferResult(final, hits, restorable)

    def _pool_pages(self, t: PoolTransfer) -> tuple[Any, list[int]] | None:
        """The host pool of a transfer and the page offset of each of its keys."""
        pool = self.registered_pools.get(str(t.name))
        if pool is None and str(t.name) == "kv":
            pool = self.mem_pool_host
        keys = t.keys or []
        page = int(getattr(pool, "page_size", 1) or 1)
        idx = t.host_indices
        if pool is None or idx is None or idx.numel() != len(keys) * page:
            log.warning("kvstore HiCache backend: pool %s: %s host indices for %d keys",
                        t.name, None if idx is None else idx.numel(), len(keys))  # fmt: skip
            return None
        return pool, [int(idx[i * page].item()) for i in range(len(keys))]

    def batch_get_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """Per pool, read its pages into the host pool; per key, hit. KV pages go
        through the v1 page path, so v1 and v2 engines share one KV page format."""
        client = self.store_client(self._cfg.timeout_s)
        out: dict[str, list[bool]] = {}
        for t in transfers:
            keys = t.keys or []
            if str(t.name) == "kv" and t.host_indices is not None:  # one KV page format
                out["kv"] = self.batch_get_v1(keys, t.host_indices, extra_info)
                continue
            pages = self._pool_pages(t) if client is not None and keys else None
            if pages is None or client is None:
                out[str(t.name)] = [False] * len(keys)
                continue
            pool, offsets = pages
            bufs = [pool.get_dummy_flat_data_page() for _ in keys]
            t0 = time.perf_counter()
            views, temps = _read_targets(bufs)
            hits = client.batch_get_into(
                self._ns_of(str(t.name)), [key_hash(k) for k in keys], views
            ).result()
            _land(temps, hits)
            for off, buf, hit in zip(offsets, bufs, hits, strict=True):
                if hit:
                    pool.set_from_flat_data_page(off, buf)
            nbytes = sum(b.numel() * b.element_size() for b, h in zip(bufs, hits, strict=True) if h)
            self._count_load(sum(hits), nbytes, t0)
            out[str(t.name)] = list(hits)
        return out

    def batch_set_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """Per pool, write its pages from the host pool; per key, in the store."""
        out: dict[str, list[bool]] = {}
        for t in transfers:
            keys = t.keys or []
            if str(t.name) == "kv" and t.host_indices is not None:  # one KV page format
                out["kv"] = self.batch_set_v1(keys, t.host_indices, extra_info)
                continue
            pages = self._pool_pages(t) if keys else None
            if pages is None:
                out[str(t.name)] = [False] * len(keys)
                continue
            pool, offsets = pages
            values = [_tensor_bytes(pool.get_data_page(off, flat=True)) for off in offsets]
            ns = self._ns_of(str(t.name))
            out[str(t.name)] = self._put([key_hash(k) for k in keys], values, ns)
        return out

    # ---- shared --------------------------------------------------------------------

    def _put(self, hashes: list[bytes], values: Sequence[Any], ns: str | None = None,
             parts: bool = False) -> list[bool]:  # fmt: skip
        """One batched write of ``values`` (``parts``: each a list of buffers, sent
        without joining them); True per key in the store afterwards."""
        ns = ns or self._ns
        client = self.store_client(self._cfg.timeout_s)
        if client is None:
            return [False] * len(hashes)
        t0 = time.perf_counter()
        try:
            w = self.write(client, ns, hashes, values, parts)
        except Exception as e:  # full store: the pages are simply not cached
            log.warning("kvstore put of %d pages failed: %s", len(hashes), e)
            return [False] * len(hashes)
        stored = w.stored
        n = sum(stored)
        record(NAME, self._interval, "stored_blocks", n)
        sizes = [sum(memoryview(p).nbytes for p in v) if parts else memoryview(v).nbytes
                 for v in values]  # fmt: skip
        record(NAME, self._interval, "stored_bytes",
               sum(n for n, s in zip(sizes, stored, strict=True) if s))  # fmt: skip
        record(NAME, self._interval, "store_seconds", time.perf_counter() - t0)
        if n < len(stored):  # a key already in the store counts
            record(NAME, self._interval, "skipped_present_blocks", w.present)
        return w.held

    def _count_load(self, blocks: int, nbytes: int, t0: float) -> None:
        record(NAME, self._interval, "loaded_blocks", blocks)
        record(NAME, self._interval, "loaded_bytes", nbytes)
        record(NAME, self._interval, "load_seconds", time.perf_counter() - t0)

    def get_stats(self) -> None:
        """Statistics go to Prometheus (``kvstore_connector_*{connector="sglang"}``)."""
        return None

    def clear(self) -> None:
        """Not supported: a shared store is not cleared by one engine."""
        return None

    def close(self) -> None:
        self.close_store()
