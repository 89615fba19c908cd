"""ucx:// (UCX through ucxx, the optional extra kvstore-cache[ucx]) moves the same bytes as
tcp://: byte-exact round trips, misses are misses, and garbage or a vanished client
never takes the server down. Real UCX endpoints over loopback (UCX's tcp transport);
the server runs in its own process, except where its stop() is the point."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash

from kvstore_client import wire
from kvstore_client.errors import (
    InvalidArgument,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from kvstore_client.keys import HASH_LEN
from kvstore_client.transport import ucx
from tests.conftest import MakeCluster
from tests.helpers import key, run_client_process, value_for

if not ucx.available():
    pytest.skip(
        "ucxx is not importable: install the optional extra (pip install 'kvstore-cache[ucx]')",
        allow_module_level=True,
    )

NS = b"m/bf16/b16/tp0of1"
MIB = 1 << 20
T = 10.0  # per-call deadline
ROOT = Path(__file__).resolve().parents[2]

SERVER = """
import json, sys
from kvstore.auth import Tenants
from kvstore.worker.transfer.tcp import TcpTransferServer
from kvstore.worker.transfer.ucx import UcxTransferServer
from kvstore.worker.arena import Arena
from kvstore.worker.store import BlockStore

arena = Arena(32 << 20, "/dev/shm")
try:
    store = BlockStore(arena, 1 << 20)
    tenants = Tenants.load(sys.argv[1]) if len(sys.argv) > 1 else None
    tcp = TcpTransferServer(store, "127.0.0.1", 0, tenants=tenants)
    srv = UcxTransferServer(store, "127.0.0.1", 0, frame_timeout=3.0, tenants=tenants)
    tcp.start()
    srv.start()
    print(json.dumps({"ucx": srv.port, "tcp": tcp.port}), flush=True)
    for line in sys.stdin:
        stats = {
            "bad_frames": store.counters.bad_frames,
            "checksum_errors": store.counters.checksum_errors,
            "keys": store.tier.keys,
        }
        print(json.dumps(stats), flush=True)
    srv.stop(1.0)
    tcp.stop(1.0)
finally:
    arena.close()
"""


class Server:
    """A BlockStore served over ucx:// (and tcp://) by a child process."""

    def __init__(self, tenants_file: str = "") -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "client"), str(ROOT / "bench")])
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                textwrap.dedent(SERVER),
                *([tenants_file] if tenants_file else []),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            cwd=ROOT,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.stop()
            raise AssertionError("the ucx server process exited before it was ready")
        ports = json.loads(line)
        self.port: int = ports["ucx"]
        self.tcp_port: int = ports["tcp"]

    def stats(self) -> dict[str, int]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        out: dict[str, int] = json.loads(self.proc.stdout.readline())
        return out

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            for f in glob.glob(f"/dev/shm/kvstore-{self.proc.pid}-*"):
                os.unlink(f)  # a killed server cannot remove its arena
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server()
    try:
        yield s
    finally:
        s.stop()
    assert s.proc.returncode == 0, f"the server exited with {s.proc.returncode}"


@pytest.fixture(scope="module")
def pool(server: Server) -> Iterator[ucx.UcxPool]:
    p = ucx.UcxPool("127.0.0.1", server.port)
    yield p
    p.close()


def _sums(values: list[bytes]) -> list[int]:
    return [xxhash.xxh3_64_intdigest(v) for v in values]


@pytest.mark.parametrize("size", [100, 64 * 1024, MIB])
def test_round_trip_is_byte_exact(pool: ucx.UcxPool, size: int) -> None:
    keys = [key(i, f"rt{size}") for i in range(6)]
    vals = [value_for(k, size) for k in keys]
    assert pool.put(T, NS, keys, vals, _sums(vals)) == bytes([wire.PUT_STORED] * 6)
    again = pool.put(T, NS, keys[:2], vals[:2], _sums(vals[:2]))
    assert again == bytes([wire.PUT_PRESENT] * 2), "first writer wins"

    absent = key(0, "absent")
    got = pool.get(T, NS, [*keys, absent], None)
    assert got.found == [True] * 6 + [False]
    assert [bytes(v) if v is not None else None for v in got.values] == [*vals, None]
    assert got.bytes_received == 6 * size

    bufs = [memoryview(bytearray(size)) for _ in keys]
    into = pool.get(T, NS, keys, bufs)
    assert into.found == [True] * 6 and all(
        b.tobytes() == v for b, v in zip(bufs, vals, strict=True)
    )

    assert pool.exists(T, NS, [*keys, absent]) == [True] * 6 + [False]
    assert pool.remove(T, NS, [*keys[:3], absent]) == 3
    assert pool.get(T, NS, keys, None).found == [False] * 3 + [True] * 3


def test_misses_are_misses(pool: ucx.UcxPool) -> None:
    keys = [key(i, "never-stored") for i in range(5)]
    res = pool.get(T, NS, keys, None)
    assert res.found == [False] * 5 and res.values == [None] * 5 and res.bytes_received == 0
    assert pool.exists(T, NS, keys) == [False] * 5
    assert pool.remove(T, NS, keys) == 0
    other_ns = pool.get(T, b"other/ns/b16/tp0of1", keys, None)
    assert other_ns.found == [False] * 5


def test_size_mismatch_and_bad_checksum_are_misses(pool: ucx.UcxPool, server: Server) -> None:
    keys = [key(i, "mismatch") for i in range(3)]
    vals = [value_for(k, 4096) for k in keys]
    sums = _sums(vals)
    sums[2] ^= 1  # the client claims a checksum the bytes do not have
    status = pool.put(T, NS, keys, vals, sums)
    assert status == bytes([wire.PUT_STORED, wire.PUT_STORED, wire.PUT_CORRUPT])
    assert server.stats()["checksum_errors"] >= 1
    bufs = [memoryview(bytearray(4096)), memoryview(bytearray(100)), memoryview(bytearray(4096))]
    res = pool.get(T, NS, keys, bufs)
    assert res.found == [True, False, False], "wrong-size buffer and corrupt block miss"
    assert bufs[0].tobytes() == vals[0]


def _raw(port: int) -> Any:
    rt = ucx.UcxRuntime.get()
    return rt.run(ucx.UcxConnection.open(rt, "127.0.0.1", port, T), T + 5)


def _send(conn: Any, parts: list[bytes]) -> None:
    ucx.UcxRuntime.get().run(ucx.send_all(conn.ep, parts), T)


def _recv(conn: Any, n: int, timeout: float = T) -> bytes:
    async def go() -> bytes:
        buf = bytearray(n)
        await ucx.recv_all(conn.ep, [buf])
        return bytes(buf)

    return ucx.UcxRuntime.get().run(go(), timeout)


def _closed_by_server(conn: Any) -> bool:
    """True when the next receive fails: the server closed (or reset) the endpoint."""
    try:
        _recv(conn, wire.HEADER_LEN, timeout=8.0)
    except Exception:
        return True
    return False


def test_garbage_closes_only_that_endpoint(pool: ucx.UcxPool, server: Server) -> None:
    bad_before = server.stats()["bad_frames"]
    keys = [key(i, "survivor") for i in range(2)]
    vals = [value_for(k, 1000) for k in keys]
    pool.put(T, NS, keys, vals, _sums(vals))

    conn = _raw(server.port)  # bad magic
    _send(conn, [b"GARBAGE!" * 3])
    assert _closed_by_server(conn)
    conn.abort()

    conn = _raw(server.port)  # a shm:// op is not served over ucx://: error answer, close
    _send(conn, [wire.HEADER.pack(wire.REQ_MAGIC, wire.OP_GET_LOC, 0, len(NS), 1, 7)])
    head = wire.decode_header(_recv(conn, wire.HEADER_LEN), wire.ANS_MAGIC)
    assert head.req_id == 7 and head.flags_or_code == InvalidArgument.code
    assert b"not served" in _recv(conn, head.count)
    assert _closed_by_server(conn)
    conn.abort()

    big = [b"x" * (MIB + 64)]
    with pytest.raises(InvalidArgument, match="exceeds the limit"):  # answered, then closed
        pool.put(T, NS, [key(0, "big")], big, _sums(big))

    conn = _raw(server.port)  # a body longer than its header says: UCX truncation, close
    _send(conn, [wire.HEADER.pack(wire.REQ_MAGIC, wire.OP_GET, 0, len(NS), 1, 8), b"x" * 4096])
    assert _closed_by_server(conn)
    conn.abort()

    assert server.alive()
    assert server.stats()["bad_frames"] >= bad_before + 3
    got = pool.get(T, NS, keys, None)
    assert [bytes(v) if v is not None else None for v in got.values] == vals


def _hdr(op: int, count: int, flags: int = 0, ns: bytes = NS, req: int = 3) -> bytes:
    return wire.HEADER.pack(wire.REQ_MAGIC, op, flags, len(ns), count, req)


# Hostile frames as UCX messages (a header, then the namespace and body as one); tcp://
# gets the same bytes as one stream. Both transports run one frame core.
HOSTILE = {
    "unknown EXISTS flags": [_hdr(wire.OP_EXISTS, 1, 0x82)],
    "GET with an unknown flag (4)": [_hdr(wire.OP_GET, 1, 4)],
    "REMOVE with PREFIX": [_hdr(wire.OP_REMOVE, 1, wire.FLAG_PREFIX)],
    "batch over the limit": [_hdr(wire.OP_GET, wire.MAX_BATCH + 1)],
    "bad namespace": [_hdr(wire.OP_GET, 1, ns=b"../../etc"), b"../../etc" + b"k" * HASH_LEN],
    "value over the limit": [
        _hdr(wire.OP_PUT, 1),
        NS + wire.PUT_ENTRY.pack(b"k" * HASH_LEN, MIB + 1, 0),
    ],
    "namespace length 0": [_hdr(wire.OP_GET, 1, ns=b"")],
    # ucx:// reads the body and refuses it; tcp:// does not know the flag at all.
    "packed PUT over its bound": [
        _hdr(wire.OP_PUT, wire.MAX_PACKED // MIB + 1, wire.FLAG_PACKED),
        NS
        + b"".join(
            wire.PUT_ENTRY.pack(i.to_bytes(HASH_LEN, "little"), MIB, 0)
            for i in range(wire.MAX_PACKED // MIB + 1)
        ),
    ],
}


def _tcp_outcome(port: int, parts: list[bytes]) -> tuple[int | None, bool]:
    """(error code answered or None, closed by the server) for a frame sent over tcp://."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=T) as s:
        s.sendall(b"".join(parts))
        data = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
    code = (
        wire.decode_header(data[: wire.HEADER_LEN], wire.ANS_MAGIC).flags_or_code if data else None
    )
    return code, True


def _ucx_outcome(port: int, parts: list[bytes]) -> tuple[int | None, bool]:
    conn = _raw(port)
    try:
        _send(conn, parts)
        try:
            h = wire.decode_header(_recv(conn, wire.HEADER_LEN, timeout=8.0), wire.ANS_MAGIC)
        except Exception:
            return None, True  # closed without an answer
        _recv(conn, h.count)
        return h.flags_or_code, _closed_by_server(conn)
    finally:
        conn.abort()


def test_tcp_and_ucx_answer_hostile_frames_alike(server: Server) -> None:
    """The same hostile frame gets the same answer (code, or none) and the same close
    over tcp:// and ucx://, and each is counted as a bad frame."""
    for name, parts in HOSTILE.items():
        bad = server.stats()["bad_frames"]
        over_tcp = _tcp_outcome(server.tcp_port, parts)
        over_ucx = _ucx_outcome(server.port, parts)
        assert over_tcp == over_ucx, f"{name}: tcp {over_tcp}, ucx {over_ucx}"
        want = None if name == "namespace length 0" else InvalidArgument.code
        assert over_tcp == (want, True), name
        assert server.stats()["bad_frames"] == bad + 2, name
    assert server.alive()


def test_ucx_answers_a_prefix_exists_like_tcp(pool: ucx.UcxPool, server: Server) -> None:
    keys = [key(i, "prefix") for i in range(4)]
    vals = [value_for(k, 100) for k in keys[:2]]
    pool.put(T, NS, keys[:2], vals, _sums(vals))
    conn = _raw(server.port)
    try:
        _send(conn, [_hdr(wire.OP_EXISTS, 4, wire.FLAG_PREFIX), NS + b"".join(keys)])
        h = wire.decode_header(_recv(conn, wire.HEADER_LEN), wire.ANS_MAGIC)
        assert (h.flags_or_code, h.ns_len, h.count) == (0, wire.TAG_RUN, 2)
    finally:
        conn.abort()


def test_client_vanishing_mid_put_leaves_nothing_reserved(
    pool: ucx.UcxPool, server: Server
) -> None:
    keys = [key(i, "vanish") for i in range(3)]
    vals = [value_for(k, 64 * 1024) for k in keys]
    sums = _sums(vals)
    entries = b"".join(
        wire.PUT_ENTRY.pack(k, len(v), c) for k, v, c in zip(keys, vals, sums, strict=True)
    )
    conn = _raw(server.port)
    head = wire.HEADER.pack(wire.REQ_MAGIC, wire.OP_PUT, 0, len(NS), 3, 1)
    _send(conn, [head, NS + entries, vals[0]])  # two payloads never come
    time.sleep(0.3)
    conn.abort()
    deadline = time.monotonic() + 8.0  # the server notices at once, or at its frame timeout
    while pool.exists(T, NS, keys) != [False] * 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pool.exists(T, NS, keys) == [False] * 3, "a half-sent PUT never becomes visible"
    status = b""
    while time.monotonic() < deadline:  # the aborted reservations are free again
        status = pool.put(T, NS, keys, vals, sums)
        if status == bytes([wire.PUT_STORED] * 3):
            break
        pool.remove(T, NS, keys)
        time.sleep(0.2)
    assert status == bytes([wire.PUT_STORED] * 3)
    assert server.alive()


def test_unreachable_port_is_unavailable() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = ucx.UcxPool("127.0.0.1", port)
    t0 = time.monotonic()
    with pytest.raises(Unavailable):
        p.get(2.0, NS, [key(0)], None)
    with pytest.raises(Unavailable, match="a moment ago"):
        p.get(2.0, NS, [key(0)], None)  # fails fast right after a failed connect
    assert time.monotonic() - t0 < 6.0
    p.close()


TENANTS = """
tenants:
  - {name: a, token: tok-a, namespaces: [team-a]}
  - {name: b, token: tok-b, namespaces: [team-b]}
"""


def test_tenants_authenticate_every_endpoint(tmp_path: Path) -> None:
    f = tmp_path / "tenants.yaml"
    f.write_text(TENANTS)
    s = Server(str(f))
    try:
        ns_a = b"team-a/m/b16/tp0of1"
        v = [b"a" * 5000]
        good = ucx.UcxPool("127.0.0.1", s.port, token="tok-a")
        assert good.put(T, ns_a, [key(1, "ten")], v, _sums(v)) == bytes([wire.PUT_STORED])
        assert good.get(T, ns_a, [key(1, "ten")], None).values == [bytearray(v[0])]
        with pytest.raises(PermissionDenied):
            good.exists(T, b"team-b/m/b16/tp0of1", [key(1, "ten")])
        good.close()
        for token in ("", "wrong"):
            bad = ucx.UcxPool("127.0.0.1", s.port, token=token)
            with pytest.raises(Unauthenticated):
                bad.exists(T, ns_a, [key(1, "ten")])
            bad.close()
        assert s.alive()
    finally:
        s.stop()


IN_PROCESS = """
import xxhash
from kvstore_client import wire
from kvstore_client.errors import Unavailable
from kvstore_client.transport import ucx
from kvstore.worker.transfer.ucx import UcxTransferServer
from kvstore.worker.arena import Arena
from kvstore.worker.store import BlockStore

arena = Arena(8 << 20, "/dev/shm")
try:
    store = BlockStore(arena, 1 << 20)
    srv = UcxTransferServer(store, "127.0.0.1", 0)
    srv.start()
    p = ucx.UcxPool("127.0.0.1", srv.port)
    k, v = b"k" * 16, b"v" * 3000
    RESULT = {"mode": ucx.UcxRuntime.get().mode}
    RESULT["put"] = list(p.put(10.0, b"a/b", [k], [v], [xxhash.xxh3_64_intdigest(v)]))
    RESULT["stored"] = store.get_bytes("a/b", [k]) == [v]
    srv.stop(1.0)
    try:
        p.exists(2.0, b"a/b", [k])
        RESULT["after_stop"] = "answered"
    except Unavailable:
        RESULT["after_stop"] = "unavailable"
    p.close()
    srv.stop(1.0)
finally:
    arena.close()
"""


def test_server_in_a_client_process_stops_cleanly() -> None:
    """Worker-like process: the server starts the runtime (blocking mode), a client
    shares it, stop() closes the listener at once, and the process exits cleanly."""
    out = run_client_process(IN_PROCESS, timeout=60.0)
    assert out == {
        "mode": "blocking",
        "put": [wire.PUT_STORED],
        "stored": True,
        "after_stop": "unavailable",
    }


def test_client_over_ucx_with_a_real_worker(make_cluster: MakeCluster) -> None:
    """Client(transport="ucx") against `kvstore worker --ucx-port 0` processes."""
    from kvstore.config import WorkerConfig

    if "ucx_port" not in WorkerConfig.__dataclass_fields__:
        pytest.skip("this tree's worker has no --ucx-port yet")
    from kvstore_client import Client

    cluster = make_cluster(
        workers=2, dram_size="64MiB", max_value_size="1MiB", extra_worker_args=["--ucx-port", "0"]
    )
    keys = [key(i, "cluster") for i in range(24)]
    vals = [value_for(k, 64 * 1024) for k in keys]
    with Client(cluster.address, transport="ucx") as c:
        assert all(ucx.find_ucx_url(w.endpoints) for w in c.workers())
        assert all(w.ucx is not None and w.arena is None for w in c._view.workers)  # type: ignore[union-attr, attr-defined]
        assert c.batch_put(NS.decode(), keys, vals) == [True] * 24
        assert c.batch_get(NS.decode(), [*keys, key(0, "absent")]) == [*vals, None]
        bufs = [memoryview(bytearray(64 * 1024)) for _ in keys]
        assert c.batch_get_into(NS.decode(), keys, bufs).result() == [True] * 24
        assert [b.tobytes() for b in bufs] == vals
        assert c.remove(NS.decode(), keys[:4]) == 4
        assert c.batch_exists(NS.decode(), keys[:6]) == [False] * 4 + [True] * 2
    with Client(cluster.address, transport="tcp") as c:
        assert c.batch_get(NS.decode(), keys[4:]) == vals[4:], "tcp:// sees the same blocks"


def test_urls() -> None:
    assert ucx.parse_ucx_url("ucx://10.0.0.1:7703") == ("10.0.0.1", 7703)
    assert ucx.parse_ucx_url(ucx.ucx_url("::1", 7703)) == ("::1", 7703)
    assert ucx.find_ucx_url(["tcp://h:1", "ucx://h:2"]) == "ucx://h:2"
    assert ucx.find_ucx_url(["tcp://h:1"]) == ""
    with pytest.raises(ValueError):
        ucx.parse_ucx_url("tcp://h:1")
    assert HASH_LEN == 16


UCX_CONFIG = """
import json, sys
from kvstore_client.transport import ucx
ucx.UcxRuntime.get()
import ucxx
print(json.dumps(ucxx.get_config()))
"""


@pytest.mark.parametrize(
    ("env", "want"), [({}, "put_zcopy"), ({"UCX_RNDV_SCHEME": "auto"}, "auto")]
)
def test_runtime_uses_put_zcopy_unless_the_environment_says(env: dict[str, str], want: str) -> None:
    """kvstore's UCP context writes big messages straight into the receiver's buffer
    (the rendezvous that made ucx:// as fast as tcp:// here); a UCX_* variable wins,
    and the option is the context's, not the process environment's."""
    base = {k: v for k, v in os.environ.items() if k != "UCX_RNDV_SCHEME"}
    out = subprocess.run(
        [sys.executable, "-c", UCX_CONFIG],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    config = json.loads(out.stdout.strip().splitlines()[-1])
    assert config["RNDV_SCHEME"] == want


def test_packed_frames_round_trip_exactly(pool: ucx.UcxPool) -> None:
    """Many small blocks (and parts) go packed into one message each way: bytes come
    back exactly, misses and wrong-size buffers are misses, empty values are values."""
    keys = [key(i, "packed") for i in range(40)]
    vals = [value_for(k, 1 + 997 * i) for i, k in enumerate(keys)]
    vals[7] = b""
    assert ucx.packs([memoryview(v) for v in vals])
    assert pool.put(T, NS, keys, vals, _sums(vals)) == bytes([wire.PUT_STORED] * 40)
    absent = key(0, "packed-absent")
    bufs: list[memoryview | list[memoryview]] = [memoryview(bytearray(len(v))) for v in vals]
    bufs[3] = memoryview(bytearray(len(vals[3]) + 1))  # wrong size: a miss
    whole = bytearray(len(vals[5]))
    bufs[5] = [memoryview(whole)[:10], memoryview(whole)[10:]]  # parts
    got = pool.get(T, NS, [*keys, absent], [*bufs, memoryview(bytearray(8))])
    want = [True] * 40 + [False]
    want[3] = False
    assert got.found == want
    for i, (b, v) in enumerate(zip(bufs, vals, strict=True)):
        if i == 5:
            assert bytes(whole) == v
        elif i != 3:
            assert isinstance(b, memoryview) and b.tobytes() == v, i
    # Parts of one block, written packed and read back whole.
    pk = key(0, "packed-parts")
    value = value_for(pk, 64 * 1024)
    parts = [memoryview(value)[j : j + 1024] for j in range(0, len(value), 1024)]
    assert pool.put(T, NS, [pk], [parts], [xxhash.xxh3_64_intdigest(value)]) == bytes([0])
    assert [bytes(v or b"") for v in pool.get(T, NS, [pk], None).values] == [value]
