"""The CLI as a new user meets it: every mistake is one line on stderr and a non-zero
exit, with no traceback, no arena file and no process left behind (issue 12, and the
CLI items of issue 11).

Commands run as a user runs them (``python -m kvstore ...`` in a subprocess, real ports).
Workers put their arenas in a private directory under /dev/shm (KVSTORE_WORKER_SHM_DIR),
so "nothing left behind" is exact even while other tests use /dev/shm.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.cluster import free_port
from kvstore.config import WorkerConfig

KV = [sys.executable, "-m", "kvstore"]


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    d = Path("/dev/shm") / f"kvstore-test-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    yield d
    left = list(d.iterdir())
    for f in left:
        f.unlink()
    d.rmdir()
    assert not left, f"arena files left behind: {left}"


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port something else listens on."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        yield s.getsockname()[1]


def _processes_with(marker: str) -> list[int]:
    """Pids whose environment holds ``marker`` (our private shm dir)."""
    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            if marker.encode() in (p / "environ").read_bytes():
                pids.append(int(p.name))
        except OSError:
            continue
    return pids


def fails(shm: Path, *args: str, env: dict[str, str] | None = None, code: int | None = None) -> str:
    """Run ``kvstore ARGS``; assert a one-line error and a clean exit; return the line."""
    full_env = {**os.environ, "KVSTORE_WORKER_SHM_DIR": str(shm), **(env or {})}
    out = subprocess.run([*KV, *args], capture_output=True, text=True, timeout=90, env=full_env)
    err = out.stderr.strip()
    assert out.returncode != 0, f"kvstore {' '.join(args)} succeeded: {out.stdout}"
    if code is not None:
        assert out.returncode == code, err
    assert "Traceback" not in err, err
    assert len(err.splitlines()) == 1, f"want one line, got:\n{err}"
    assert err.startswith("Error: "), err
    assert not list(shm.iterdir()), f"arena left behind: {list(shm.iterdir())}"
    assert not _processes_with(str(shm)), "a daemon outlived the failed command"
    return err


# ---- issue 12, item 1: a port in use ------------------------------------------------


def test_port_in_use_names_port_and_flag(shm_dir: Path, taken_port: int) -> None:
    p = str(taken_port)
    for args, flag in [
        (("master", "--port", p), "--port"),
        (("worker", "--grpc-port", p, "--dram-size", "64MiB"), "--grpc-port"),
        (("worker", "--tcp-port", p, "--dram-size", "64MiB"), "--tcp-port"),
        (("worker", "--metrics-port", p, "--dram-size", "64MiB"), "--metrics-port"),
        (("up", "--master-port", p, "--dram-size", "64MiB"), "--master-port"),
    ]:
        err = fails(shm_dir, *args)
        assert f"port {p} " in err and "in use" in err and flag in err, err


def test_worker_failing_after_its_arena_exists_removes_it(tmp_path: Path) -> None:
    """The worker itself (not the CLI's port check) cleans up when a bind fails late."""
    from kvstore.worker.server import Worker

    with socket.create_server(("127.0.0.1", 0)) as s:
        cfg = WorkerConfig(
            dram_size=4 << 20,
            max_value_size=1 << 20,
            shm_dir=str(tmp_path),
            tcp_port=s.getsockname()[1],
        )
        with pytest.raises(OSError):
            Worker(cfg)
    assert not list(tmp_path.iterdir()), "the arena file was left behind"


# ---- item 2: `kvstore up` reports the child's own error ---------------------------------


def test_up_reports_the_workers_real_error(shm_dir: Path, tmp_path: Path) -> None:
    # (Worker ports from the environment no longer make `up` fail: it picks each
    # worker's ports itself since issue 25. A bad SSD path still fails the worker.)
    not_a_dir = tmp_path / "ssd-file"
    not_a_dir.write_text("x")
    err = fails(
        shm_dir,
        "up", "--workers", "1", "--master-port", "0", "--dram-size", "64MiB",
        "--max-value-size", "1MiB",
        env={"KVSTORE_WORKER_SSD_PATH": str(not_a_dir)},
    )  # fmt: skip
    assert "kvstore worker failed to start" in err and str(not_a_dir) in err, err
    assert "no ready line" not in err


def test_up_bad_size_and_usage_line(shm_dir: Path) -> None:
    err = fails(shm_dir, "up", "--dram-size", "10XB", code=2)
    assert "--dram-size" in err and "10XB" in err
    out = subprocess.run([*KV, "worker", "--bogus"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Usage: kvstore worker" in out.stderr, out.stderr


# ---- item 4: status / check -------------------------------------------------------------


def test_status_and_check_errors_are_one_line(shm_dir: Path) -> None:
    dead = f"127.0.0.1:{free_port()}"  # a port nobody listens on
    err = fails(shm_dir, "status", "--master", "127.0.0.1")
    assert "host:port" in err
    err = fails(shm_dir, "status", "--master", dead, "--timeout", "1")
    assert "UNAVAILABLE" in err and "_InactiveRpcError" not in err
    err = fails(shm_dir, "check", "--master", dead)
    assert "no master answered" in err and "_InactiveRpcError" not in err
    err = fails(shm_dir, "check", "--size", "10XB", code=2)
    assert "--size" in err


# ---- issue 11, items 11 and 12: strict config, one-line start errors -------------------


def test_bad_settings_are_one_line_naming_the_key(shm_dir: Path, tmp_path: Path) -> None:
    cases: list[tuple[tuple[str, ...], dict[str, str], str]] = [
        (("master", "--worker-ttl", "0"), {}, "master.worker_ttl"),
        (("worker", "--tcp-port", "-5"), {}, "worker.tcp_port"),
        (("worker", "--grpc-port", "99999"), {}, "worker.grpc_port"),
        (("master", "--port", "65536"), {}, "master.port"),
        (("worker", "--shm-dir", str(tmp_path / "missing")), {}, "worker.shm_dir"),
        (("worker", "--ssd-path", "/etc/hostname"), {}, "worker.ssd_path"),
        (("worker",), {"KVSTORE_WORKER_TLS_CLIENT_AUTH": "enabled"}, "worker.tls_client_auth"),
        (("worker",), {"KVSTORE_WORKER_TLS_CLIENT_AUTH": "y"}, "worker.tls_client_auth"),
        (("worker",), {"KVSTORE_WORKER_UCX_PORT": "-2"}, "worker.ucx_port"),
    ]
    for args, env, key in cases:
        err = fails(shm_dir, *args, env=env, code=2)
        assert key in err, err
    cfg = tmp_path / "kv.yaml"
    cfg.write_text("worker:\n  grpc_port: true\n")
    err = fails(shm_dir, "--config", str(cfg), "worker", code=2)
    assert "worker.grpc_port" in err


def test_invalid_tls_certificate_is_named(shm_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate\n")
    for role in ("master", "worker"):
        err = fails(shm_dir, role, "--tls-cert", str(bad), "--tls-key", str(bad), code=2)
        assert "tls_cert" in err and "Failed to bind" not in err, err
    err = fails(shm_dir, "worker", "--tls-cert", str(tmp_path / "none.pem"), "--tls-key", "x")
    assert "no such file" in err


# ---- item 11: the bench group is loaded lazily -----------------------------------------


def test_cli_starts_without_the_bench_package() -> None:
    code = (
        "import sys; sys.modules['kvstore_bench'] = None\n"
        "from kvstore.cli import main\n"
        "main(['version'], prog_name='kvstore')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("kvstore "), out.stderr
    code = code.replace("['version']", "['bench', 'replay']")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 1 and "not installed" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
