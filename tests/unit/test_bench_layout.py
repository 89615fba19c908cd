"""The benchmarks use the public API only: no module under bench/ imports the tests or
the worker's internals, and the constants the bench mirrors match the worker's."""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "kvstore_bench"


def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                names.append(arg.value)
    return names


def test_no_bench_module_imports_tests_or_worker_internals() -> None:
    bad = [
        f"{p.relative_to(BENCH)}: {name}"
        for p in sorted(BENCH.rglob("*.py"))
        for name in _imports(p)
        if name.split(".")[0] == "tests" or name.startswith("kvstore.worker")
    ]
    assert not bad, bad
    texts = "\n".join(p.read_text() for p in BENCH.rglob("*.py"))
    assert "tests.e2e" not in texts and "kvstore.worker.tiers" not in texts


def test_bench_is_grouped_by_benchmark() -> None:
    for pkg in ("engine", "replay", "transfer", "scale", "peers"):
        assert (BENCH / pkg / "__init__.py").is_file(), pkg
    flat = sorted(p.name for p in BENCH.glob("*.py"))
    assert not [n for n in flat if n.startswith("engine")], flat


def test_ssd_footprint_matches_the_worker_record_layout() -> None:
    from kvstore.worker.tiers import ssd
    from kvstore_bench.peers.kvstore import SSD_PAGE_HEADER, SSD_RECORD_HEADER

    assert SSD_RECORD_HEADER == ssd.HEADER_LEN
    assert SSD_PAGE_HEADER == ssd.PAGE_HEADER


def test_the_hybrid_preset_is_the_e2e_tests_model() -> None:
    from kvstore_bench.engine.models import SEED, model_config
    from tests.e2e import tiny_model

    assert model_config("lfm2") == tiny_model.lfm2_config()
    assert SEED == tiny_model.SEED
