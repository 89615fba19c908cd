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
          "msgpack", "click", "yaml", "prometheus_client", "rich", "torch"]  # fmt: skip


def missing_modules() -> list[str]:
    out = []
    for name in NEEDED:
        try:
            importlib.import_module(name)
        except Exception:
            out.append(name)
    return out


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

    stood_in = device.stand_in_for_vllm(args.stand_in_vllm)
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
    result["layouts"] = check_layouts(torch, bc, dev, bc.mover_for(dev))
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
