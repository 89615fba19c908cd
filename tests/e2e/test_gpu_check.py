"""The prepared GPU check (tests/gpu/check_gpu.py) runs end to end in its dry-run mode
on CPU torch, with vLLM's classes stood in as on a bare CUDA-torch machine: every
layout checks out, both paths move exact bytes through the connector's worker side,
the arena path copies from pinned slots, and the JSON claims no GPU figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests/gpu/check_gpu.py"), "--dry-run", "--stand-in-vllm",
         "--out", str(out)],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["dry_run"] is True and r["ok"] is True and r["vllm_stood_in"] is True
    assert "ceilings" not in r and "GPU" not in r["device"].replace("no GPU", "")
    assert set(r["layouts"].values()) == {"ok"} and len(r["layouts"]) >= 7
    for path in ("arena", "staging"):
        assert r[path]["errors"] == []
    assert r["arena"]["arena_loaded_blocks"] > 0 and r["staging"]["arena_loaded_blocks"] == 0
    assert r["vllm"]["pinned"] and r["vllm"]["used"] == "stand-in"
    speeds = r["layout_speeds"]
    assert set(speeds) == set(r["layouts"])
    for s in speeds.values():
        assert s["save_GBps"] > 0 and s["load_GBps"] > 0 and s["bare_pinned_d2h_GBps"] > 0
        assert 0 < s["save_verify_share"] < 1 and 0 < s["load_verify_share"] < 1
