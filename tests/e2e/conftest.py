"""End-to-end tests: real vLLM engines on the CPU against a real kvstore cluster.

They need the e2e environment (``scripts/e2e.sh`` makes ``.venv-e2e`` with vLLM and
runs them). Where vLLM (and torch) cannot be imported, as in the main ``.venv`` of
``make test``, every test here is skipped with the reason. Nothing here imports vLLM
itself: engines run in their own processes (tests/e2e/engine_proc.py).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent


def _missing() -> str | None:
    for mod in ("torch", "vllm", "transformers"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not importable here; run scripts/e2e.sh (it makes .venv-e2e)"
    return None


MISSING = _missing()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if MISSING is None:
        return
    skip = pytest.mark.skip(reason=f"e2e: {MISSING}")
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(skip)


# Numbers the tests measured, printed at the end of the run (hit rates, TTFT, ...).
REPORT: list[str] = []


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if REPORT:
        terminalreporter.section("kvstore e2e measurements")
        for line in REPORT:
            terminalreporter.write_line(line)
        path = os.environ.get("KVSTORE_E2E_REPORT")
        if path:
            Path(path).write_text("\n".join(REPORT) + "\n")


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """The tiny Llama written once per cache directory (KVSTORE_E2E_CACHE)."""
    from .tiny_model import write_tiny_llama

    cache = Path(os.environ.get("KVSTORE_E2E_CACHE", Path.home() / ".cache" / "kvstore-e2e"))
    return str(write_tiny_llama(cache / "tiny-llama"))
