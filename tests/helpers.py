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


def corrupt_arena(pid: int, needle: bytes, at: int = 10) -> bool:
    """Flip the byte ``at`` bytes into the first copy of ``needle`` in the DRAM arena of
    the worker process ``pid``, through /proc/PID/mem: memory gone bad under a stored
    block, which no client can do (the arena is sealed read-only for them; writing
    another process's memory takes ptrace rights, root's here). True if found."""
    with open(f"/proc/{pid}/maps") as f:
        spans = [
            tuple(int(x, 16) for x in line.split()[0].split("-"))
            for line in f
            if "kvstore-arena" in line
        ]
    with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
        for lo, hi in spans:
            step = 8 << 20
            for a in range(lo, hi, step):
                mem.seek(a)
                chunk = mem.read(min(step + len(needle), hi - a))
                i = chunk.find(needle)
                if i >= 0:
                    mem.seek(a + i + at)
                    b = mem.read(1)
                    mem.seek(a + i + at)
                    mem.write(bytes([b[0] ^ 0xFF]))
                    return True
    return False
