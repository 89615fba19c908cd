"""ucx:// under faults: a worker SIGKILLed in the middle of transfers costs misses (or
errors of the one exception tree), never a hang and never wrong bytes; the client's
map drops the dead worker and ucx:// keeps working with the survivor. Real worker
processes with `--ucx-port 0`, UCX over loopback (its tcp transport)."""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field

import pytest

from kvstore.cluster import LocalCluster
from kvstore_client import Client
from kvstore_client.errors import KVStoreError
from kvstore_client.transport import ucx
from tests.conftest import MakeCluster
from tests.helpers import key, value_for

if not ucx.available():
    pytest.skip(
        "ucxx is not importable: install the optional extra (pip install 'kvstore-cache[ucx]')",
        allow_module_level=True,
    )

NS = "ucxfault/bf16/b16/tp0of1"
SIZE = 512 * 1024
TIMEOUT = 3.0  # the client's per-call deadline
BOUND = TIMEOUT + 7.0  # a call may also wait out UCX's handshake timeout (5 s), never more


@dataclass
class Outcome:
    calls: int = 0
    wrong: int = 0
    misses: int = 0
    errors: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)  # exceptions outside the error tree
    slowest: float = 0.0


def ucx_cluster(make_cluster: MakeCluster) -> LocalCluster:
    return make_cluster(
        workers=2,
        dram_size="128MiB",
        max_value_size="1MiB",
        worker_ttl="2s",
        extra_worker_args=["--ucx-port", "0"],
    )


def hammer(c: Client, op: str, keys: list[bytes], vals: list[bytes], stop: threading.Event,
           out: Outcome) -> None:  # fmt: skip
    """Repeat one kind of batch call until ``stop``, checking every answer."""
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            if op == "get":
                got = c.batch_get(NS, keys)
                out.misses += sum(g is None for g in got)
                out.wrong += sum(g is not None and g != v for g, v in zip(got, vals, strict=True))
            elif op == "get_into":
                bufs = [memoryview(bytearray(SIZE)) for _ in keys]
                ok = c.batch_get_into(NS, keys, bufs).result(timeout=BOUND)
                for flag, b, v in zip(ok, bufs, vals, strict=True):
                    out.misses += not flag
                    out.wrong += flag and b.tobytes() != v
            else:
                c.batch_put(NS, keys, vals)
        except KVStoreError as e:
            out.errors.append(type(e).__name__)
        except Exception as e:  # reported: anything else is a bug
            out.foreign.append(repr(e))
        out.slowest = max(out.slowest, time.monotonic() - t0)
        out.calls += 1


@pytest.mark.parametrize("op", ["get", "get_into", "put"])
def test_worker_sigkilled_mid_transfer(make_cluster: MakeCluster, op: str) -> None:
    cluster = ucx_cluster(make_cluster)
    keys = [key(i, f"ucx-fault-{op}") for i in range(48)]
    vals = [value_for(k, SIZE) for k in keys]
    with Client(cluster.address, transport="ucx", timeout=TIMEOUT) as c:
        assert all(w.ucx is not None for w in c._view.workers)  # type: ignore[union-attr]
        if op != "put":
            assert all(c.batch_put(NS, keys, vals))
        out = Outcome()
        stop = threading.Event()
        t = threading.Thread(target=hammer, args=(c, op, keys, vals, stop, out), daemon=True)
        t.start()
        deadline = time.monotonic() + 30
        while out.calls < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)  # land inside a call: each moves 24 MiB over UCX
        victim = cluster.worker_procs[0]
        victim.signal(signal.SIGKILL)
        victim.proc.wait(5)
        killed = out.calls
        time.sleep(4)  # past the TTL: the map drops the dead worker
        stop.set()
        t.join(BOUND + 5)
        assert not t.is_alive(), "a call hung after the worker died"
        assert out.foreign == [], out.foreign[:3]
        assert out.wrong == 0, "never wrong bytes"
        assert out.slowest < BOUND, f"a call took {out.slowest:.1f}s"
        assert out.calls > killed, "calls kept completing after the kill"
        assert {e for e in out.errors} <= {"Unavailable", "DeadlineExceeded"}, out.errors
        if op != "put":
            assert out.misses + len(out.errors) > 0, "the dead worker's blocks were missed"
        print(f"\nucx {op}: {out.calls} calls ({killed} before the kill), {out.misses} misses, "
              f"errors {sorted(set(out.errors))}, slowest {out.slowest:.2f}s")  # fmt: skip
        # The survivor still serves over ucx://: its blocks read back byte-exact, and
        # new writes land on it.
        live = {w.id for w in c.workers()}
        assert victim.ready["id"] not in live and len(live) == 1
        got = c.batch_get(NS, keys)
        assert all(g == v for g, v in zip(got, vals, strict=True) if g is not None)
        fresh = [key(i, f"after-{op}") for i in range(8)]
        assert c.batch_put(NS, fresh, [value_for(k, 4096) for k in fresh]) == [True] * 8
        assert c.batch_get(NS, fresh) == [value_for(k, 4096) for k in fresh]
