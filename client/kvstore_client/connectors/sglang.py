"""SGLang HiCache storage backend (L3) on a kvstore cluster: ``HiCacheStorage``.

Load it as a dynamic backend::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
        "module_path": "kvstore_client.connectors.sglang",
        "class_name": "KVStoreHiCacheStorage", "interface_v1": 1,
        "master": "HOST:PORT"}'

``interface_v1: 1`` makes HiCache use the zero-copy page calls (``batch_get_v1`` /
``batch_set_v1``): pages move between the host KV pool and the store with no copy
in Python when a page is one contiguous run of the pool, and with one gather /
scatter per page otherwise (layer-first layouts hold a page as 2 x layers runs).
Without it HiCache calls the generic ``batch_get`` / ``batch_set`` with tensors.

Keys: SGLang hands over its own page hash strings (chained over the prefix, equal
in every SGLang process); each becomes a 16-byte kvstore hash (xxh3-128 of the
string) in a namespace of the model, KV dtype, pool layout, page size and rank.
Misses, an unreachable store or a full store are "not found" / "not stored",
never exceptions into the engine. The v2 (multi-pool) calls are not implemented:
HiCache falls back to v1 for models with a single KV pool.
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
)

from ..keys import leading_run
from .config import SGLANG_OWN_KEYS, ConnectorConfig
from .holder import ClientHolder
from .naming import namespace
from .stats import Counters, record

log = logging.getLogger(__name__)
NAME = "sglang"


def key_hash(key: str) -> bytes:
    """The 16-byte kvstore hash of an SGLang page key."""
    return xxhash.xxh3_128_digest(key.encode())


def _view(ptr: int, size: int) -> memoryview:
    """A writable memoryview of ``size`` bytes of host memory at ``ptr``."""
    return memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")


def _tensor_bytes(t: Any) -> memoryview:
    """A memoryview of a CPU tensor's bytes (made contiguous if it is not)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())


class KVStoreHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """See the module docstring. Built by SGLang's StorageBackendFactory as
    ``KVStoreHiCacheStorage(storage_config, kwargs)``; thread-safe."""

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None
    ) -> None:
        extra = dict(storage_config.extra_config or {})
        self._cfg = ConnectorConfig.from_dict(extra, ignore=SGLANG_OWN_KEYS)
        self._sc = storage_config
        self._holder = ClientHolder(self._cfg.master, self._cfg.timeout_s)
        self._holder.start()
        self._interval = Counters()
        self.mem_pool_host: Any = None
        self._ns = self._namespace(None)

    # ---- set-up ----------------------------------------------------------------

    def _namespace(self, pool: Any) -> str:
        sc = self._sc
        model = self._cfg.model_id or sc.model_name or "model"
        # MLA KV is the same on every TP rank: one shared copy.
        tp, tps = (0, 1) if sc.is_mla_model else (sc.tp_rank, sc.tp_size)
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
            layout = "-".join(parts)
            page = int(getattr(pool, "page_size", 1) or 1)
        return namespace(
            model, dtype, layout, page, tp_rank=tp, tp_size=tps, pp_rank=sc.pp_rank,
            pp_size=sc.pp_size,
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
        client = self._holder.get(wait=self._cfg.timeout_s)
        return bool(client and client.batch_exists(self._ns, [key_hash(key)])[0])

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many leading keys are present (one batched call)."""
        client = self._holder.get(wait=self._cfg.timeout_s)
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
        client = self._holder.get(wait=self._cfg.timeout_s)
        if client is None or not keys:
            return [None] * len(keys)
        hashes = [key_hash(k) for k in keys]
        t0 = time.perf_counter()
        if target_locations is None:
            vals = client.batch_get(self._ns, hashes)
            self._count_load(sum(v is not None for v in vals), sum(len(v or b"") for v in vals), t0)
            return [None if v is None else torch.frombuffer(bytearray(v), dtype=torch.uint8)
                    for v in vals]  # fmt: skip
        views = [_tensor_bytes(t) for t in target_locations]
        hits = client.batch_get_into(self._ns, hashes, views).result()
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
        client = self._holder.get(wait=self._cfg.timeout_s)
        if client is None or not keys:
            return [False] * len(keys)
        pages = self._page_views(host_indices, len(keys))
        hashes = [key_hash(k) for k in keys]
        t0 = time.perf_counter()
        if all(len(p) == 1 for p in pages):  # one run per page: no copy at all
            hits = client.batch_get_into(self._ns, hashes, [p[0] for p in pages]).result()
        else:
            staging = [bytearray(sum(v.nbytes for v in p)) for p in pages]
            hits = client.batch_get_into(
                self._ns, hashes, [memoryview(s) for s in staging]
            ).result()
            for p, s, hit in zip(pages, staging, hits, strict=True):
                if hit:
                    off = 0
                    for v in p:
                        v[:] = s[off : off + v.nbytes]
                        off += v.nbytes
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
        values: list[Any] = [p[0] if len(p) == 1 else b"".join(p) for p in pages]
        return self._put([key_hash(k) for k in keys], values)

    # ---- shared --------------------------------------------------------------------

    def _put(self, hashes: list[bytes], values: Sequence[Any]) -> list[bool]:
        client = self._holder.get(wait=self._cfg.timeout_s)
        if client is None:
            return [False] * len(hashes)
        t0 = time.perf_counter()
        try:
            stored = client.batch_put(self._ns, hashes, values)
        except Exception as e:  # full store: the pages are simply not cached
            log.warning("kvstore put of %d pages failed: %s", len(hashes), e)
            return [False] * len(hashes)
        n = sum(stored)
        record(NAME, self._interval, "stored_blocks", n)
        record(NAME, self._interval, "stored_bytes", sum(
            memoryview(v).nbytes for v, s in zip(values, stored, strict=True) if s))  # fmt: skip
        record(NAME, self._interval, "store_seconds", time.perf_counter() - t0)
        if n == len(stored):
            return stored
        # False means "already there" or "worker down": a key in the store counts.
        rest = [i for i, s in enumerate(stored) if not s]
        there = client.batch_exists(self._ns, [hashes[i] for i in rest])
        record(NAME, self._interval, "skipped_present_blocks", sum(there))
        out = list(stored)
        for i, t in zip(rest, there, strict=True):
            out[i] = t
        return out

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
        self._holder.close()
