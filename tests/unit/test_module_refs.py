"""Module names that the docs and docstrings tell a reader to run or read exist (issue 43:
the engine bench's model writer was documented as a module ``kvstore_bench.engine_models``
after it had moved to ``kvstore_bench.engine.models``, so the command failed as written;
four more docstrings named modules that had moved)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OURS = ("kvstore", "kvstore_client", "kvstore_bench", "tests", "scripts")
RUN = re.compile(r"python3? -m ([A-Za-z_][\w.]*)")
MOD = re.compile(r":mod:`~?([A-Za-z_][\w.]*)`")


def _sources() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "Makefile", *sorted((ROOT / "docs").glob("*.md"))]
    for d in ("kvstore", "client/kvstore_client", "bench/kvstore_bench", "tests", "scripts"):
        files += sorted(p for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".md", ".sh"))
    return files


def _exists(name: str) -> bool:
    for root in (ROOT, ROOT / "client", ROOT / "bench"):
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError as e:  # a parent imports an engine that is not installed here
        return "vllm" in str(e) or "sglang" in str(e) or "torch" in str(e)
    except ValueError:
        return False


def _has(module: str, attr: str) -> bool:
    try:
        return hasattr(importlib.import_module(module), attr)
    except ImportError:  # an engine's module (vLLM, SGLang): not installed here
        return True


def test_documented_modules_exist() -> None:
    missing = []
    for path in _sources():
        text = path.read_text(errors="replace")
        for rx in (RUN, MOD):
            for m in rx.finditer(text):
                name = m.group(1).rstrip(".")
                if name.split(".")[0] not in OURS or _exists(name):
                    continue
                # :mod:`pkg.mod.attr` may name a function or class of a module
                head, _, attr = name.rpartition(".")
                if rx is MOD and head and _exists(head) and _has(head, attr):
                    continue
                line = text.count("\n", 0, m.start()) + 1
                missing.append(f"{path.relative_to(ROOT)}:{line}: {m.group(0)}")
    assert not missing, "these modules do not exist:\n" + "\n".join(missing)
