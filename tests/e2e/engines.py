"""Start and drive engine processes (tests/e2e/engine_proc.py) from the tests."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


class EngineError(RuntimeError):
    pass


class Engine:
    """One engine process. ``start()`` returns at once; ``wait_ready()`` waits for it,
    so several engines can start side by side."""

    def __init__(
        self,
        name: str,
        model: str,
        log_dir: Path,
        master: str | None = None,
        extra: dict[str, Any] | None = None,
        warmup_seed: int = 99,
        kv_role: str = "kv_both",
        engine: dict[str, Any] | None = None,
        fault_file: Path | None = None,
    ) -> None:
        self.name = name
        self.cfg = {
            "model": model,
            "master": master,
            "extra": extra or {},
            "warmup_seed": warmup_seed,
            "kv_role": kv_role,
            "engine": engine or {},
        }
        # With a fault file, the engine runs the tests' fault-injecting connector.
        self.fault_file = fault_file
        if fault_file is not None:
            self.cfg["connector_module"] = "tests.e2e.faults"
        self.log_path = log_dir / f"engine-{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.namespace: str | None = None  # the connector's, once ready
        self.block_size = 0  # tokens per block the engine resolved, once ready
        self._buf = b""

    def start(self) -> Engine:
        env = dict(os.environ)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
        if self.fault_file is not None:
            env["KVSTORE_TEST_FAULT_FILE"] = str(self.fault_file)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.e2e.engine_proc", json.dumps(self.cfg)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                cwd=ROOT,
                env=env,
            )
        return self

    def _read_line(self, timeout: float) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EngineError(
                        f"engine {self.name}: no answer in {timeout:.0f}s (log: {self.log_path})"
                    )
                if not sel.select(min(left, 1.0)):
                    if self.proc.poll() is not None:
                        break
                    continue
                chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
                if not chunk:
                    break
                self._buf += chunk
        if b"\n" not in self._buf:
            raise EngineError(
                f"engine {self.name} exited with {self.proc.poll()} "
                f"(log: {self.log_path}):\n{self.tail()}"
            )
        line, self._buf = self._buf.split(b"\n", 1)
        msg: dict[str, Any] = json.loads(line)
        return msg

    def wait_ready(self, timeout: float = 300.0) -> Engine:
        msg = self._read_line(timeout)
        if msg.get("event") != "ready":
            raise EngineError(f"engine {self.name}: unexpected {msg}")
        self.namespace = msg.get("namespace")
        self.block_size = int(msg.get("block_size") or 0)
        return self

    def generate(
        self,
        prompt: list[int],
        max_tokens: int = 8,
        timeout: float = 300.0,
        top: int = 0,
        params: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One request; ``params``: its ``kv_transfer_params`` (session hints)."""
        assert self.proc is not None and self.proc.stdin is not None
        req: dict[str, Any] = {"op": "generate", "prompt": prompt, "max_tokens": max_tokens}
        req["top"] = top
        if params is not None:
            req["params"] = params
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        ans = self._read_line(timeout)
        if "error" in ans:
            raise EngineError(f"engine {self.name}: {ans['error']}\n{self.tail()}")
        return ans

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        try:
            assert p.stdin is not None
            p.stdin.write(b'{"op": "exit"}\n')
            p.stdin.flush()
            p.wait(20)
        except (OSError, subprocess.TimeoutExpired):
            p.kill()
            p.wait(10)
        finally:
            for f in (p.stdin, p.stdout):
                if f is not None:
                    f.close()


@contextmanager
def running(engines: dict[str, Engine]) -> Iterator[dict[str, Engine]]:
    """Start the engines side by side, wait until each is ready, and stop them all on
    the way out (even when one failed to start)."""
    try:
        for e in engines.values():
            e.start()
        for e in engines.values():
            e.wait_ready()
        yield engines
    finally:
        for e in engines.values():
            e.stop()
