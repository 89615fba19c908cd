"""Settings reach the daemons the way the README says (issue 25): `kvstore up` reads the
config file (`--config` before or after the subcommand), `kvstore worker` takes
KVSTORE_MASTER, flags beat the file; and the CLI's small promises: --version, a bad
--log-level refused, `status` with no workers says what to do and shows the SSD tier, the
port-in-use hint for --metrics-port, and no hand-over noise in a worker's log when
another worker starts."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvstore.cluster import LocalCluster, spawn
from tests.conftest import MakeCluster, arena_files

KV = [sys.executable, "-m", "kvstore"]
MiB = 1 << 20


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KV, *args], capture_output=True, text=True, timeout=60, env=env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                status = (d / "status").read_text()
            except OSError:
                continue
            if f"\nPPid:\t{pid}\n" in status:
                out.append(int(d.name))
    return out


def status_json(addr: str) -> dict[str, object]:
    out = run("status", "--master", addr, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def run_up(args: list[str], cwd: Path) -> tuple[str, dict[str, object]]:
    """Start `kvstore ...up...`, wait for its banner, read the status, stop it with
    Ctrl-C (SIGINT to its pid only) and check that it leaves nothing behind."""
    p = subprocess.Popen([*KV, *args], cwd=cwd, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert p.stdout is not None
        banner = p.stdout.readline()
        assert banner.startswith("kvstore cluster up: master "), banner + p.stderr.read()  # type: ignore[union-attr]
        addr = banner.split()[4].rstrip(",")
        daemons = children(p.pid)
        assert len(daemons) >= 2
        deadline = time.monotonic() + 20
        st = status_json(addr)
        while time.monotonic() < deadline and not all(
            w["ssd_capacity_bytes"] or w["keys"] == 0
            for w in st["workers"]  # type: ignore[attr-defined, index]
        ):
            time.sleep(0.2)
            st = status_json(addr)
        p.send_signal(signal.SIGINT)
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    for pid in daemons:
        assert (
            not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
        ), f"daemon {pid} of kvstore up still runs"
        assert not arena_files(pid)
    return banner, st


def test_up_reads_the_config_file_before_or_after_the_subcommand(tmp_path: Path) -> None:
    port = free_port()
    (tmp_path / "kv.yaml").write_text(
        f"master:\n  port: {port}\nworker:\n  dram_size: 48MiB\n  max_value_size: 1MiB\n"
        "  grpc_port: 7999\n"  # a fixed worker port in the file: up picks per worker
    )
    for args in (["--config", "kv.yaml", "up", "--workers", "2"],
                 ["up", "--config", "kv.yaml", "--workers", "2"]):  # fmt: skip
        banner, st = run_up(args, tmp_path)
        assert f"master 127.0.0.1:{port}, 2 workers of 48.0MiB" in banner, banner
        caps = [w["capacity_bytes"] for w in st["workers"]]  # type: ignore[attr-defined, index]
        assert caps == [48 * MiB, 48 * MiB], caps
    # Flags beat the file.
    banner, st = run_up(["--config", "kv.yaml", "up", "--workers", "1", "--dram-size", "32MiB",
                         "--master-port", "0"], tmp_path)  # fmt: skip
    assert f":{port}," not in banner and "1 workers of 32.0MiB" in banner, banner
    assert [w["capacity_bytes"] for w in st["workers"]] == [32 * MiB]  # type: ignore[attr-defined, index]


def test_worker_takes_kvstore_master_from_the_environment(cluster: LocalCluster) -> None:
    env = {**os.environ, "KVSTORE_MASTER": cluster.address}
    d = spawn("worker", ["--dram-size", "32MiB", "--max-value-size", "1MiB"], env=env)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(cluster.live_worker_ids()) < 3:
            time.sleep(0.1)
        assert len(cluster.live_worker_ids()) == 3, "the worker did not join KVSTORE_MASTER"
    finally:
        assert d.stop() == 0
    assert not arena_files(d.pid)


def test_config_after_the_subcommand_is_read(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("worker:\n  dram_sise: 1GiB\n")
    for args in (["worker", "--config", str(bad)], ["--config", str(bad), "worker"],
                 ["master", "--config", str(tmp_path / "missing.yaml")]):  # fmt: skip
        out = run(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert "No such option" not in out.stderr
        assert "dram_sise" in out.stderr or "cannot read config file" in out.stderr, out.stderr


def test_version_and_log_levels() -> None:
    out = run("--version")
    assert out.returncode == 0 and out.stdout.strip().startswith("kvstore 0."), out.stdout
    out = run("--log-level", "verbose", "version")
    assert out.returncode == 2 and "'verbose' is not one of" in out.stderr, out.stderr
    out = run("--log-level", "WARNING", "version")
    assert out.returncode == 0, out.stderr


def test_status_without_workers_says_what_to_do() -> None:
    m = spawn("master", ["--port", "0"])
    try:
        out = run("status", "--master", m.address)
    finally:
        m.stop()
    assert out.returncode == 0, out.stderr
    assert "no workers" in out.stdout and f"kvstore worker --master {m.address}" in out.stdout


def test_status_shows_the_ssd_tier(make_cluster: MakeCluster, tmp_path: Path) -> None:
    c = make_cluster(workers=1, dram_size="32MiB", max_value_size="1MiB",
                     extra_worker_args=["--ssd-path", str(tmp_path / "ssd"),
                                        "--ssd-size", "256MiB"])  # fmt: skip
    deadline = time.monotonic() + 15
    st = status_json(c.address)
    while time.monotonic() < deadline and not st["workers"][0]["ssd_capacity_bytes"]:  # type: ignore[index]
        time.sleep(0.2)
        st = status_json(c.address)
    (w,) = st["workers"]  # type: ignore[misc]
    assert w["capacity_bytes"] == 32 * MiB and w["ssd_capacity_bytes"] == 256 * MiB
    table = run("status", "--master", c.address)
    assert "DRAM 0 B of 32.0 MiB used · SSD 0 B of 256.0 MiB" in " ".join(table.stdout.split())
    assert "DRAM, SSD: used / capacity" in table.stdout, table.stdout
    assert "0 B / 256.0" in " ".join(table.stdout.split()), table.stdout


def test_metrics_port_in_use_hint_matches_its_help(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = run("worker", "--metrics-port", str(port), "--shm-dir", str(tmp_path))
    assert out.returncode == 1
    assert "choose another with --metrics-port (0 turns it off)" in out.stderr, out.stderr


def test_a_starting_worker_leaves_no_noise_in_the_others_logs(
    make_cluster: MakeCluster, tmp_path: Path
) -> None:
    make_cluster(workers=3, dram_size="16MiB", max_value_size="1MiB")
    time.sleep(0.5)
    for i in range(3):
        log = (tmp_path / f"worker{i}.log").read_text()
        assert "hand-over failed" not in log, log
