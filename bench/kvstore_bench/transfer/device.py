"""``kvstore bench transfer --device cuda``: the engine's own data path, measured.

The vLLM connector's worker side (``WorkerSide``, the code vLLM calls) saves and loads
``blocks`` blocks of a FlashAttention-layout cache (``layers`` layers of
``(2, num_blocks, 16, 8, 64)`` bf16: 1 MiB per block over 32 layers) through its
hooks, on two paths:

- **arena**: a same-host worker; loads are copied by DMA straight from the blocks'
  pinned arena slots (``Client.pin_local``), saves through the pinned rows;
- **staging**: tcp:// only; loads and saves through the pinned rows.

Every block is checked byte for byte after its round trip, and the timed section
runs under ``torch.cuda.set_sync_debug_mode("error")`` (a synchronizing CUDA call in
the connector raises). Reported beside the ceilings of the same bytes: a bare
pinned ``copy_`` each way (the PCIe limit) and a pageable one. ``--device cpu``
runs the same path with the host mover on the CPU (no GPU figure).

vLLM itself is not needed: when it is not installed, the base classes the
connector's package imports are stood in by empty classes (the worker side uses
none of their behaviour).
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from rich.table import Table

from kvstore.cluster import LocalCluster
from kvstore.console import make_console


def stand_in_for_vllm(force: bool = False) -> bool:
    """Empty base classes for the connector's package when vLLM is absent (or
    ``force``: as on a bare CUDA-torch machine). True when stood in."""
    if not force:
        try:
            importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.base")
            return False
        except Exception:
            pass
    names = ["vllm", "vllm.distributed", "vllm.distributed.kv_transfer",
             "vllm.distributed.kv_transfer.kv_connector",
             "vllm.distributed.kv_transfer.kv_connector.v1"]  # fmt: skip
    for n in names:
        sys.modules[n] = types.ModuleType(n)
    base = types.ModuleType(names[-1] + ".base")
    metrics = types.ModuleType(names[-1] + ".metrics")
    stood = [(base, "KVConnectorMetadata"), (base, "KVConnectorWorkerMetadata"),
             (base, "KVConnectorBase_V1"), (base, "SupportsHMA"),
             (base, "KVConnectorTransferResults"), (base, "KVConnectorRole"),
             (metrics, "KVConnectorPromMetrics"), (metrics, "KVConnectorStats")]  # fmt: skip
    for mod, cls in stood:
        setattr(mod, cls, type(cls, (), {"SCHEDULER": 0, "WORKER": 1}))
    sys.modules[base.__name__] = base
    sys.modules[metrics.__name__] = metrics
    return True


def worker_side(master: str, layers: int, nb: int, dev: str, staging_mb: int) -> Any:
    """A connector worker side (mover path) over fresh random caches on ``dev``: the
    side, its caches, its counters and the bytes of one block (all layers)."""
    import torch  # type: ignore[import-not-found, unused-ignore]

    from kvstore_client.connectors import blockcopy
    from kvstore_client.connectors.config import ConnectorConfig
    from kvstore_client.connectors.naming import ModelIdentity
    from kvstore_client.connectors.stats import Counters
    from kvstore_client.connectors.vllm.common import Setup
    from kvstore_client.connectors.vllm.worker import WorkerSide

    # zero_copy off: on the CPU too, blocks take the path a CUDA cache takes.
    cfg = ConnectorConfig(master=master, staging_mb=staging_mb, zero_copy=False)
    setup = Setup(cfg, ModelIdentity("bench/device", None, None), "bfloat16",
                  f"l{layers}-bench-{dev}", 16, [0], [], True, True, True, 1, 1)  # fmt: skip
    names = [f"layer.{i}" for i in range(layers)]
    group = types.SimpleNamespace(layer_names=names)
    kcc = types.SimpleNamespace(num_blocks=nb, kv_cache_groups=[group])
    counts = Counters()
    ws = WorkerSide(setup, kcc, counts, (0, 1, 0, 1))
    caches = {n: torch.randn((2, nb, 16, 8, 64), device=dev).to(torch.bfloat16) for n in names}
    ws.register_kv_caches(caches)
    if ws.store_client(30) is None:
        raise RuntimeError("the connector could not reach the master")
    block_bytes = sum(blockcopy.describe(t, nb).nbytes for t in caches.values())
    return ws, caches, counts, block_bytes


Guard = Callable[[], AbstractContextManager[Any]]


def run_path(path: str, master: str, dev: str, layers: int, blocks: int, iters: int,
             staging_mb: int, guard: Guard) -> dict[str, Any]:  # fmt: skip
    """Save then load ``blocks`` blocks ``iters`` times (after a warm-up) between
    two worker sides; GB/s of each, the save hooks' time, and any wrong block."""
    import torch  # type: ignore[import-not-found, unused-ignore]

    from kvstore_client import block_hashes
    from kvstore_client.connectors.vllm.common import KVStoreConnectorMetadata, Transfer

    os.environ["KVSTORE_TRANSPORT"] = "auto" if path == "arena" else "tcp"
    n = blocks
    nb = 2 * n + 4
    w, wc, _, block_bytes = worker_side(master, layers, nb, dev, staging_mb)
    r, rc, r_counts, _ = worker_side(master, layers, nb, dev, staging_mb)
    saves: list[tuple[float, float]] = []
    loads: list[float] = []
    errors: list[str] = []
    try:
        for it in range(iters + 1):  # the first is a warm-up
            hs = block_hashes(list(range(n * 16)), 16, extra=f"{path}{it}{time.time()}".encode())
            src, dst, idx = list(range(n)), list(range(n, 2 * n))[::-1], list(range(n))
            meta = KVStoreConnectorMetadata(saves=[Transfer(f"s{it}", [src], hs, idx)])
            if dev == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with guard():
                w.start_load_kv(meta)
                for name in wc:
                    w.save_kv_layer(name, meta)
                w.wait_for_save(meta)
                hook_s = time.perf_counter() - t0
                drained = w.drain_saves(60)
            t_save = time.perf_counter() - t0
            wm = w.take_meta()
            saved = len(wm.saved.get(f"s{it}", [])) if wm else 0
            lmeta = KVStoreConnectorMetadata(loads=[Transfer(f"l{it}", [dst], hs, idx)])
            t1 = time.perf_counter()
            failed: set[str] = set()
            with guard():
                r.start_load_kv(lmeta)
                while time.perf_counter() - t1 < 60:
                    done, failed = r.done_loads()
                    if f"l{it}" in done:
                        break
                    time.sleep(0.0002)
            t_load = time.perf_counter() - t1
            bad = [i for i in range(n) if not _same(torch, wc, rc, src[i], dst[i])]
            if not drained or saved != n or failed or bad:
                errors.append(f"iteration {it}: saved {saved}/{n}, failed loads "
                              f"{sorted(failed)}, {len(bad)} blocks differ")  # fmt: skip
            if it:
                saves.append((t_save, hook_s))
                loads.append(t_load)
        gb = n * block_bytes / 1e9
        return {
            "blocks": n, "block_bytes": block_bytes, "layers": layers,
            "save_GBps": gb / statistics.median(s for s, _ in saves),
            "save_hook_ms_p50": 1e3 * statistics.median(h for _, h in saves),
            "load_GBps": gb / statistics.median(loads),
            "arena_loaded_blocks": r_counts.peek()["arena_loaded_blocks"],
            "errors": errors,
        }  # fmt: skip
    finally:
        w.shutdown()
        r.shutdown()


def _same(torch: Any, a: dict[str, Any], b: dict[str, Any], i: int, j: int) -> bool:
    return all(torch.equal(a[k][:, i], b[k][:, j]) for k in a)


def copy_ceilings(nbytes: int, iters: int) -> dict[str, float]:
    """GB/s of one ``copy_`` of ``nbytes`` each way, pinned and pageable (CUDA)."""
    import torch  # type: ignore[import-not-found, unused-ignore]

    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    out = {}
    pairs = [("pinned_d2h", pinned, dev), ("pinned_h2d", dev, pinned),
             ("pageable_d2h", pageable, dev), ("pageable_h2d", dev, pageable)]  # fmt: skip
    for name, dst, src in pairs:
        times = []
        for _ in range(iters + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out[name + "_GBps"] = nbytes / 1e9 / statistics.median(times[1:])
    return out


def sync_guard(dev: str) -> Guard:
    """A context that makes any synchronizing CUDA call raise (CUDA only)."""
    if dev != "cuda":
        return nullcontext

    import torch  # type: ignore[import-not-found, unused-ignore]

    class _Guard:
        def __enter__(self) -> None:
            torch.cuda.set_sync_debug_mode("error")

        def __exit__(self, *exc: object) -> None:
            torch.cuda.set_sync_debug_mode("default")

    return _Guard


def measure(dev: str, layers: int, blocks: int, iters: int, staging_mb: int,
            master: str | None = None) -> dict[str, Any]:  # fmt: skip
    """Both paths against a fresh one-worker cluster (or ``master``'s) and, on
    CUDA, the copy ceilings with each path's fraction of them."""
    out: dict[str, Any] = {"device": dev, "layers": layers, "blocks": blocks, "iters": iters}
    guard = sync_guard(dev)
    arena_mb = max(256, 2 * (iters + 1) * blocks * layers * 32 // 1024 + 128)
    with tempfile.TemporaryDirectory() as logs:
        cluster = None
        if master is None:
            cluster = LocalCluster(workers=1, dram_size=f"{arena_mb}MiB", max_value_size="8MiB",
                                   log_dir=logs).start()  # fmt: skip
            master = cluster.address
        try:
            for path in ("arena", "staging"):
                out[path] = run_path(path, master, dev, layers, blocks, iters, staging_mb, guard)
        finally:
            if cluster is not None:
                cluster.stop()
    if dev == "cuda":
        c = copy_ceilings(blocks * out["arena"]["block_bytes"], iters)
        out["ceilings"] = c
        for path in ("arena", "staging"):
            p = out[path]
            p["save_vs_pinned_d2h"] = p["save_GBps"] / c["pinned_d2h_GBps"]
            p["load_vs_pinned_h2d"] = p["load_GBps"] / c["pinned_h2d_GBps"]
    return out


def main(dev: str, layers: int, blocks: int, iters: int, staging_mb: int, out_dir: str,
         master: str | None) -> None:  # fmt: skip
    """``kvstore bench transfer --device``: a table and a JSON file."""
    import torch  # type: ignore[import-not-found, unused-ignore]

    console = make_console()
    if dev == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            f"--device cuda: this torch ({torch.__version__}) sees no CUDA device; "
            "--device cpu runs the same path on the CPU"
        )
    stood_in = stand_in_for_vllm()
    console.print(f"connector data path on {dev}: {layers} layers, {blocks} blocks per transfer")
    res = measure(dev, layers, blocks, iters, staging_mb, master)
    res["vllm_stood_in"] = stood_in
    res["torch"] = torch.__version__
    if dev == "cuda":
        res["gpu"] = torch.cuda.get_device_name()
    t = Table(title=f"connector path, {res['arena']['block_bytes'] >> 10} KiB blocks ({dev})")
    for col in ("path", "save GB/s", "load GB/s", "save hooks ms", "x pinned D2H", "x pinned H2D",
                "arena blocks", "errors"):  # fmt: skip
        t.add_column(col)
    for path in ("arena", "staging"):
        p = res[path]
        xs = [
            f"{p[k]:.2f}" if k in p else "-" for k in ("save_vs_pinned_d2h", "load_vs_pinned_h2d")
        ]
        t.add_row(path, f"{p['save_GBps']:.2f}", f"{p['load_GBps']:.2f}",
                  f"{p['save_hook_ms_p50']:.2f}", *xs, str(p["arena_loaded_blocks"]),
                  str(len(p["errors"])))  # fmt: skip
    console.print(t)
    if "ceilings" in res:
        console.print({k: round(v, 2) for k, v in res["ceilings"].items()})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / f"transfer-device-{dev}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    json_path.write_text(json.dumps(res, indent=1))
    console.print(f"results: {json_path}")
    if any(res[p]["errors"] for p in ("arena", "staging")):
        raise SystemExit("some blocks did not round-trip: see the JSON's errors")
