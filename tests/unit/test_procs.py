"""kvstore.procs: the one helper that waits for ready lines and stops children by pid."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

from kvstore import procs


def _child(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL
    )


def test_ready_line_is_found_among_other_lines() -> None:
    p = _child(
        "import json, time\n"
        "print('starting up', flush=True)\n"
        "print('[1, 2]', flush=True)\n"
        "print(json.dumps({'event': 'ready', 'grpc': 'x:1'}), flush=True)\n"
        "time.sleep(30)\n"
    )
    try:
        got = procs.read_ready(p, 20)
        assert got.msg == {"event": "ready", "grpc": "x:1"}
    finally:
        assert procs.stop(p, 5) == -signal.SIGTERM
        assert p.stdout is not None
        p.stdout.close()


def test_exit_without_ready_line_returns_none_and_what_it_said() -> None:
    p = _child("print('Error: port taken', flush=True); raise SystemExit(3)")
    t0 = time.monotonic()
    got = procs.read_ready(p, 20)
    assert got.msg is None and b"Error: port taken" in got.tail
    assert time.monotonic() - t0 < 10  # did not wait for the timeout
    assert procs.stop(p) == 3  # already gone: just its exit code
    assert p.stdout is not None
    p.stdout.close()


def test_silent_child_times_out_and_is_not_killed_by_read() -> None:
    p = _child("import time; time.sleep(30)")
    try:
        assert procs.read_ready(p, 0.3).msg is None
        assert p.poll() is None
    finally:
        procs.kill(p)
        assert p.returncode == -signal.SIGKILL
        assert p.stdout is not None
        p.stdout.close()


def test_stop_escalates_to_sigkill_when_sigterm_is_ignored() -> None:
    p = _child(
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        'print(\'{"event": "ready"}\', flush=True)\n'
        "time.sleep(30)\n"
    )
    assert procs.read_ready(p, 20).msg is not None  # the handler is installed
    assert procs.stop(p, 0.3) == -signal.SIGKILL
    assert procs.stop(p, 0.3) == -signal.SIGKILL  # twice is fine
    assert p.stdout is not None
    p.stdout.close()


def test_wait_listening() -> None:
    p = _child("import time; time.sleep(30)")
    try:
        with socket.socket() as srv:
            srv.bind(("127.0.0.1", 0))
            srv.listen()
            assert procs.wait_listening(p, "127.0.0.1", srv.getsockname()[1], 5) is None
        port = procs.free_port()
        assert procs.wait_listening(p, "127.0.0.1", port, 0.2) == "did not listen"
    finally:
        procs.stop(p)
        assert p.stdout is not None
        p.stdout.close()
    assert procs.wait_listening(p, "127.0.0.1", port, 5) == f"exited with code {p.returncode}"
