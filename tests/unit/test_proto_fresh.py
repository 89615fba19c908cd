"""The committed protobuf stubs match proto/ (run `make proto` when this fails)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts/gen_proto.py"), str(tmp_path)],
        check=True,
        capture_output=True,
    )
    committed = ROOT / "client/kvstore_client/proto"
    fresh = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    assert fresh == sorted(p.name for p in committed.iterdir() if p.is_file())
    stale = [n for n in fresh if (tmp_path / n).read_text() != (committed / n).read_text()]
    assert not stale, f"stale generated files {stale}: run `make proto` and commit"
