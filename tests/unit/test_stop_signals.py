"""Daemons wait for SIGTERM / SIGINT through kvstore.procs.StopSignals.

A CI run once saw a worker (master unreachable) not exit within 15 s of SIGTERM. The
worker's handler set a threading.Event that its main loop waited on: when the signal
lands while the main thread holds that Event's lock (inside its own ``wait``), the
handler blocks on the lock its own thread holds, and every later SIGTERM does the same.
The first test reproduces that hang deterministically; the second shows that
StopSignals, which takes no lock in its handler, stops at that instant and under a storm
of signals.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

OLD = """
import os, signal, threading
ev = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: ev.set())
with ev._cond:  # where Event.wait holds its lock between two waits
    os.kill(os.getpid(), signal.SIGTERM)
    x = 1  # the handler runs at this bytecode boundary and waits for ev._cond
print("stopped", flush=True)
"""

NEW = """
import os, signal, threading, time
from kvstore.procs import StopSignals
stop = StopSignals()
def storm():
    for _ in range(200):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.0005)
t = threading.Thread(target=storm)
t.start()
t0 = time.monotonic()
while not stop.wait(0.5):
    assert time.monotonic() - t0 < 10
assert stop.signum == signal.SIGTERM
t.join()
os.kill(os.getpid(), signal.SIGINT)  # the storm is over: the last signal is the one kept
assert stop.wait(0.5) and stop.signum == signal.SIGINT
print("stopped", flush=True)
"""


def _run(code: str, timeout: float) -> subprocess.CompletedProcess[str] | None:
    p = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()  # SIGKILL: the hung handler ignores every SIGTERM
        p.communicate()
        return None
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def test_an_event_set_from_a_signal_handler_can_hang_the_daemon() -> None:
    assert _run(OLD, timeout=3) is None, "the old pattern is expected to hang"


def test_stop_signals_stop_the_loop_whenever_the_signal_lands() -> None:
    for _ in range(3):
        r = _run(NEW, timeout=30)
        assert r is not None, "StopSignals hung"
        assert r.returncode == 0 and r.stdout.strip() == "stopped", r.stderr
