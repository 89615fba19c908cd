"""Helpers for tests: deterministic block contents and running code in another process."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from typing import Any


def key(i: int, salt: str = "") -> bytes:
    return hashlib.blake2b(f"{salt}{i}".encode(), digest_size=16).digest()


def value_for(k: bytes, size: int) -> bytes:
    """Bytes derived from the key, so a wrong block is always caught."""
    seed = hashlib.blake2b(k, digest_size=64).digest()
    return (seed * (size // 64 + 1))[:size]


def run_client_process(code: str, timeout: float = 120.0, **params: Any) -> Any:
    """Run ``code`` in a fresh Python process; it sees PARAMS and sets RESULT (JSON)."""
    prog = (
        "import json, sys\n"
        "sys.path.insert(0, 'tests')\n"
        f"PARAMS = json.loads({json.dumps(json.dumps(params))})\n"
        + textwrap.dedent(code)
        + "\nprint('RESULT=' + json.dumps(RESULT))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", prog], capture_output=True, text=True, timeout=timeout
    )
    if out.returncode != 0:
        raise AssertionError(f"client process failed:\n{out.stderr[-4000:]}")
    for line in out.stdout.splitlines():
        if line.startswith("RESULT="):
            return json.loads(line[len("RESULT=") :])
    raise AssertionError(f"client process printed no result:\n{out.stdout[-2000:]}")
