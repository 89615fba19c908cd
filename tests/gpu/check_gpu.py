#!/usr/bin/env python3
"""The connector's data path on a GPU, checked and timed in one short run.

Needs CUDA torch plus this checkout (no vLLM, no install): it starts a master and a
worker from the checkout, builds FlashAttention-layout caches on the GPU (``--layers``
layers of ``(2, num_blocks, 16, 8, 64)`` bf16: 1 MiB per block over 32 layers), and
drives the vLLM connector's worker side (``WorkerSide``, the code vLLM calls) through
its hooks:

1. every cache layout the block mover knows (block-major, K/V split, kernel-split,
   MLA, HND strides, hybrid state views): the CUDA mover's gather and scatter give
   the bytes the host mover gives for a CPU copy of the same cache;
2. saves and loads of ``--blocks`` blocks on the **arena** path (same-host worker:
   loads copied by DMA from pinned arena slots) and the **staging** path (tcp://
   only: pinned rows), bytes checked block by block, with the whole timed section
   under ``torch.cuda.set_sync_debug_mode("error")``: any synchronizing CUDA call in
   the connector raises;
3. GB/s of save (hooks -> D2H -> put) and load (hooks -> get -> H2D -> scatter)
   beside the ceilings of the same bytes: a bare pinned ``copy_`` each way (PCIe)
   and a pageable one.

It writes a JSON (``--out``, default ``bench/results/gpu-check.json``) and prints a
table. ``--dry-run`` runs the same steps with CPU torch on the CPU (host mover,
small sizes) to check the script end to end; its JSON says ``"dry_run": true`` and
holds no GPU figures. Sized to finish well under 5 minutes on one H200.

Python packages a bare CUDA-torch machine lacks travel as wheels (see
``tests/gpu/README.md``); the script names any that are missing and stops.

vLLM itself is not needed: when it is not installed, the base classes the
connector's package imports are stood in by empty classes (the worker side uses none
of their behaviour).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "client"), str(ROOT)]
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT / "client"), str(ROOT), os.environ.get("PYTHONPATH", "")]
)
NEEDED = ["grpc", "grpc_health", "google.protobuf", "lmdb", "xxhash", "numpy", "zmq",
          "msgpack", "click", "yaml", "prometheus_client", "rich", "torch"]  # fmt: skip


def missing_modules() -> list[str]:
    out = []
    for name in NEEDED:
        try:
            importlib.import_module(name)
        except Exception:
            out.append(name)
    return out


def stand_in_for_vllm(force: bool) -> bool:
    """Empty base classes for the connector's metadata when vLLM is absent (or
    ``force``: as on a bare CUDA-torch machine)."""
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


# ---- layouts --------------------------------------------------------------------------


def layouts(torch: Any, nb: int, dev: str) -> dict[str, Any]:
    def rnd(*shape: int, dtype: Any = None) -> Any:
        return torch.randn(shape, device=dev).to(dtype or torch.bfloat16)

    page = rnd(nb, 96, dtype=torch.float32)
    return {
        "flash_attention (2,nb,bs,h,d)": rnd(2, nb, 16, 8, 64),
        "block_major (nb,2,bs,h,d)": rnd(nb, 2, 16, 8, 64),
        "hnd_strides": rnd(nb, 2, 8, 16, 64).permute(0, 1, 3, 2, 4),
        "kernel_split (2,nb*4,kbs,h,d)": rnd(2, nb * 4, 4, 8, 64),
        "kernel_split_block_major (nb*2,...)": rnd(nb * 2, 8, 8, 64),
        "mla (nb,bs,576)": rnd(nb, 16, 576),
        "hybrid_state_view": page[:, :40].view(nb, 5, 8),
    }


def check_layouts(torch: Any, bc: Any, dev: str, mover: Any) -> dict[str, str]:
    nb = 24
    out = {}
    ids = [[17, 3, 0, 22, 9]]
    host = bc.HostMover()
    for name, t in layouts(torch, nb, dev).items():
        layer = bc.describe(t, nb)
        rows = torch.zeros((5, layer.nbytes), dtype=torch.uint8, device=dev)
        if dev == "cpu":
            ticket = mover.gather([layer], ids, rows)
        else:  # after the work queued so far on this (the "forward's") stream
            ticket = mover.gather([layer], ids, rows, after=mover.mark())
        assert ticket.wait(30)
        cpu_t = t.detach().cpu()
        ref = torch.zeros((5, layer.nbytes), dtype=torch.uint8)
        host.gather([bc.describe(cpu_t, nb)], ids, ref)
        same = torch.equal(rows.cpu(), ref)
        # Round trip: scatter the rows into other blocks, compare with the source.
        dst = [[1, 2, 4, 5, 6]]
        back = mover.scatter([layer], dst, rows)
        assert back.wait(30)
        again = torch.zeros_like(ref)
        host.gather([bc.describe(t.detach().cpu(), nb)], dst, again)
        ok = same and torch.equal(again, ref)
        out[name] = "ok" if ok else "MISMATCH"
    return out


# ---- the connector's worker side ----------------------------------------------------


def worker_side(master: str, layers: int, nb: int, dev: str, torch: Any, staging_mb: int,
                zero_copy: bool) -> Any:  # fmt: skip
    from kvstore_client.connectors.config import ConnectorConfig
    from kvstore_client.connectors.naming import ModelIdentity
    from kvstore_client.connectors.stats import Counters
    from kvstore_client.connectors.vllm.common import Setup
    from kvstore_client.connectors.vllm.worker import WorkerSide

    cfg = ConnectorConfig(master=master, staging_mb=staging_mb, zero_copy=zero_copy)
    setup = Setup(cfg, ModelIdentity("gpu-check/fa", None, None), "bfloat16",
                  f"l{layers}-gpucheck-{dev}", 16, [0], [], True, True, True, 1, 1)  # fmt: skip
    names = [f"layer.{i}" for i in range(layers)]
    kcc = types.SimpleNamespace(num_blocks=nb, kv_cache_groups=[types.SimpleNamespace(
        layer_names=names)])  # fmt: skip
    ws = WorkerSide(setup, kcc, Counters(), (0, 1, 0, 1))
    caches = {n: torch.randn((2, nb, 16, 8, 64), device=dev).to(torch.bfloat16) for n in names}
    ws.register_kv_caches(caches)
    if ws._holder.get(wait=30) is None:
        raise SystemExit("the connector could not reach the master")
    return ws, caches


def block_equal(torch: Any, a: dict[str, Any], b: dict[str, Any], src: int, dst: int) -> bool:
    return all(torch.equal(a[n][:, src], b[n][:, dst]) for n in a)


def run_path(path: str, master: str, args: argparse.Namespace, torch: Any, dev: str,
             sync_guard: Any) -> dict[str, Any]:  # fmt: skip
    from kvstore_client import block_hashes
    from kvstore_client.connectors.vllm.common import KVStoreConnectorMetadata, Transfer

    os.environ["KVSTORE_TRANSPORT"] = "auto" if path == "arena" else "tcp"
    n = args.blocks
    nb = 2 * n + 4
    # zero_copy off: on the CPU (dry run) too, blocks take the mover path a CUDA
    # cache takes (a CUDA cache never can be zero copy).
    w, wc = worker_side(master, args.layers, nb, dev, torch, args.staging_mb, False)
    r, rc = worker_side(master, args.layers, nb, dev, torch, args.staging_mb, False)
    assert not w._zero_copy and w.mover.device_rows == (dev == "cuda")
    block = w._block_bytes
    saves, loads, errors = [], [], []
    try:
        for it in range(args.iters + 1):  # the first is a warm-up
            hs = block_hashes(list(range(n * 16)), 16, extra=f"{path}{it}{time.time()}".encode())
            src = list(range(n))
            dst = list(range(n, 2 * n))[::-1]
            idx = list(range(n))
            meta = KVStoreConnectorMetadata(saves=[Transfer(f"s{it}", [src], hs, idx)])
            if dev == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with sync_guard():
                w.start_load_kv(meta)
                for name in wc:
                    w.save_kv_layer(name, meta)
                w.wait_for_save(meta)
                hook_s = time.perf_counter() - t0
                assert w.drain_saves(60)
            t_save = time.perf_counter() - t0
            wm = w.take_meta()
            saved = len(wm.saved.get(f"s{it}", [])) if wm else 0
            lmeta = KVStoreConnectorMetadata(loads=[Transfer(f"l{it}", [dst], hs, idx)])
            t1 = time.perf_counter()
            with sync_guard():
                r.start_load_kv(lmeta)
                while True:
                    done, failed = r.done_loads()
                    if f"l{it}" in done:
                        break
                    if time.perf_counter() - t1 > 60:
                        raise SystemExit("a load did not finish in 60 s")
                    time.sleep(0.0002)
            t_load = time.perf_counter() - t1
            bad = [i for i in range(n) if not block_equal(torch, wc, rc, src[i], dst[i])]
            if saved != n or failed or bad:
                errors.append(f"iteration {it}: saved {saved}/{n}, failed {sorted(failed)}, "
                              f"{len(bad)} blocks differ")  # fmt: skip
            if it:
                saves.append((t_save, hook_s))
                loads.append(t_load)
        gb = n * block / 1e9
        arena = r._interval.peek()["arena_loaded_blocks"]
        return {
            "blocks": n, "block_bytes": block, "layers": args.layers,
            "save_GBps": gb / statistics.median(s for s, _ in saves),
            "save_hook_ms_p50": 1e3 * statistics.median(h for _, h in saves),
            "load_GBps": gb / statistics.median(loads),
            "arena_loaded_blocks": arena, "errors": errors,
        }  # fmt: skip
    finally:
        w.shutdown()
        r.shutdown()


def ceilings(torch: Any, nbytes: int, iters: int) -> dict[str, float]:
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU torch, small sizes, no GPU figures")
    ap.add_argument("--layers", type=int, default=None, help="layers (default 32; dry run 4)")
    ap.add_argument("--blocks", type=int, default=None, help="blocks per transfer (64; 8)")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations (5; 1)")
    ap.add_argument("--staging-mb", type=int, default=256)
    ap.add_argument(
        "--stand-in-vllm",
        action="store_true",
        help="use the empty vLLM base classes even if vLLM is installed",
    )
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu-check.json"))
    args = ap.parse_args()
    dry = args.dry_run
    args.layers = args.layers or (4 if dry else 32)
    args.blocks = args.blocks or (8 if dry else 64)
    args.iters = args.iters or (1 if dry else 5)
    gone = missing_modules()
    if gone:
        print(f"missing Python modules: {', '.join(gone)} (see tests/gpu/README.md)")
        return 2
    import torch

    stood_in = stand_in_for_vllm(args.stand_in_vllm)
    from kvstore.cluster import LocalCluster
    from kvstore_client.connectors import blockcopy as bc

    if not dry and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run to check the script on the CPU")
        return 2
    dev = "cpu" if dry else "cuda"
    t_start = time.perf_counter()
    result: dict[str, Any] = {
        "dry_run": dry, "torch": torch.__version__, "vllm_stood_in": stood_in,
        "device": "cpu (dry run: no GPU figures)" if dry else torch.cuda.get_device_name(),
        "command": " ".join(sys.argv),
    }  # fmt: skip
    mover = bc.mover_for(dev)

    class Guard:
        def __enter__(self) -> None:
            if not dry:
                torch.cuda.set_sync_debug_mode("error")

        def __exit__(self, *exc: object) -> None:
            if not dry:
                torch.cuda.set_sync_debug_mode("default")

    result["layouts"] = check_layouts(torch, bc, dev, mover)
    arena_mb = max(256, 2 * (args.iters + 1) * args.blocks * args.layers * 32 // 1024 + 128)
    with tempfile.TemporaryDirectory() as logs:
        cluster = LocalCluster(workers=1, dram_size=f"{arena_mb}MiB", max_value_size="8MiB",
                               log_dir=logs).start()  # fmt: skip
        try:
            for path in ("arena", "staging"):
                result[path] = run_path(path, cluster.address, args, torch, dev, Guard)
        finally:
            cluster.stop()
    if not dry:
        nbytes = args.blocks * result["arena"]["block_bytes"]
        result["ceilings"] = ceilings(torch, nbytes, args.iters)
        c = result["ceilings"]
        for path in ("arena", "staging"):
            p = result[path]
            p["save_vs_pinned_d2h"] = p["save_GBps"] / c["pinned_d2h_GBps"]
            p["load_vs_pinned_h2d"] = p["load_GBps"] / c["pinned_h2d_GBps"]
    result["seconds"] = time.perf_counter() - t_start
    failed = [k for k, v in result["layouts"].items() if v != "ok"]
    failed += [f"{p}: {e}" for p in ("arena", "staging") for e in result[p]["errors"]]
    result["ok"] = not failed
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    if failed:
        print("FAILED:", *failed, sep="\n  ")
        return 1
    print(f"ok in {result['seconds']:.1f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
