"""The same-host index against real workers: a same-host client's lookups, reads and
pins need no round trip (they work while the worker is stopped), and hostile clients
cannot hurt it: one that scribbles on what it was handed, one killed holding pins,
one whose reads race removals and rewrites."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from kvstore_client import Client, Keys
from kvstore_client.transport.shm import ShmTransfer
from kvstore_client.transport.shmlocal import Local
from tests.conftest import MakeCluster
from tests.helpers import key, value_for
from tests.integration import test_pins

NS = test_pins.NS
SIZE = test_pins.SIZE  # 64 slots per 1 MiB slab; 8 MiB of DRAM = 512 slots


def put_all(c: Client, keys: list[bytes]) -> None:
    test_pins.put_all(c, NS, keys)


def local_of(c: Client) -> Local:
    view = c._view
    assert view is not None
    via = view.workers[0].via
    assert isinstance(via, ShmTransfer)
    loc = via.arena.usable()
    assert loc is not None, "the worker handed over no index"
    return loc


def test_lookups_reads_and_pins_need_no_round_trip(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(workers=1, dram_size="8MiB", max_value_size="1MiB")
    keys = [key(i, "nort") for i in range(100)]
    absent = key(0, "nort-absent")
    with Client(cluster.address, transport="shm") as c:
        put_all(c, keys)
        local_of(c)
        worker = cluster.worker_procs[0]
        worker.signal(signal.SIGSTOP)  # nothing answers on any socket now
        try:
            assert c.match_prefix(NS, [*keys, absent]) == 100
            assert c.match_prefix(NS, Keys([*keys, absent])) == 100  # packed once
            assert c.match_prefix(NS, Keys([*keys[:40], absent, *keys[40:]])) == 40
            assert c.batch_exists(NS, [absent, keys[5]]) == [False, True]
            assert c.batch_exists(NS, Keys([absent, keys[5]])) == [False, True]
            bufs = [bytearray(SIZE) for _ in range(101)]
            hits = c.batch_get_into(NS, [*keys, absent], [memoryview(b) for b in bufs])
            assert hits.result(timeout=5) == [True] * 100 + [False]
            assert [bytes(b) for b in bufs[:100]] == [value_for(k, SIZE) for k in keys]
            with c.pin_local(NS, keys[:10]) as pins:
                assert (
                    [bytes(v) for v in pins.views]
                    == [  # type: ignore[arg-type]
                        value_for(k, SIZE) for k in keys[:10]
                    ]
                )
        finally:
            worker.signal(signal.SIGCONT)
        assert c.batch_get(NS, [keys[0]]) == [value_for(keys[0], SIZE)]


def test_exists_local_answers_from_the_indexes_or_says_it_cannot(
    make_cluster: MakeCluster,
) -> None:
    """The connector's in-step lookup: ``exists_local`` answers from every same-host
    worker's index with no socket (both workers stopped), absent keys are misses, and
    it answers None (ask the workers) for a client that has no index: tcp://."""
    cluster = make_cluster(workers=2, dram_size="8MiB", max_value_size="1MiB")
    keys = [key(i, "exl") for i in range(64)]
    absent = [key(i, "exl-absent") for i in range(3)]
    probe = [absent[0], *keys[:30], absent[1], *keys[30:], absent[2]]
    want = [k in keys for k in probe]
    with Client(cluster.address, transport="shm") as c:
        put_all(c, keys)
        view = c._view
        assert view is not None and len(view.workers) == 2
        for w in cluster.worker_procs:
            w.signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            assert c.exists_local(NS, probe) == (want, False)
            assert c.exists_local(NS, Keys(probe)) == (want, False)
            assert c.where_local(NS, Keys(probe)) == ([int(w) for w in want], False)
            assert c.exists_local(NS, []) == ([], False)
            assert time.monotonic() - t0 < 1.0
        finally:
            for w in cluster.worker_procs:
                w.signal(signal.SIGCONT)
        assert c.batch_exists(NS, probe) == want
    with Client(cluster.address, transport="tcp") as c:
        assert c.exists_local(NS, probe) is None
        assert c.batch_exists(NS, probe) == want
        assert c.batch_exists(NS, Keys.frombytes(b"".join(probe))) == want
        assert c.match_prefix(NS, Keys(probe[1:])) == 30


def test_a_scribbling_client_cannot_write_the_index_or_hurt_others(
    make_cluster: MakeCluster,
) -> None:
    cluster = make_cluster(workers=1, dram_size="8MiB", max_value_size="1MiB")
    keys = [key(i, "scrib") for i in range(100)]
    with Client(cluster.address, transport="shm") as bad, Client(cluster.address) as good:
        put_all(good, keys)
        loc = local_of(bad)
        with pytest.raises((ValueError, TypeError)):
            loc.index.words[:] = 0  # its mapping is read-only
        rng = np.random.default_rng(3)
        loc.hazards.haz[:] = rng.integers(0, 2**63, len(loc.hazards.haz), dtype=np.uint64)
        loc.hazards.ring[:] = rng.integers(0, 2**63, len(loc.hazards.ring), dtype=np.uint64)
        loc.hazards.touched(np.full(4000, 2**63 + 5, dtype=np.uint64))
        # Everyone else goes on, byte-exact, through eviction and removals.
        for r in range(4):
            fresh = [key(i, f"scrib-{r}") for i in range(600)]
            put_all(good, fresh)
            got = good.batch_get(NS, fresh[-50:])
            assert got == [value_for(k, SIZE) for k in fresh[-50:]]
            good.remove(NS, fresh[:100])
        assert cluster.worker_procs[0].proc.poll() is None
        with Client(cluster.address, transport="shm") as other:
            k = key(599, "scrib-3")
            assert other.batch_get(NS, [k]) == [value_for(k, SIZE)]


PINNER = """
import sys, time
from kvstore_client import Client
sys.path.insert(0, "tests")
from helpers import key
c = Client(sys.argv[1], transport="shm")
pins = c.pin_local("{ns}", [key(i, "dead") for i in range(100)])
print(pins.count, flush=True)
time.sleep(600)
"""


def test_a_client_killed_holding_pins_has_them_reclaimed(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(workers=1, dram_size="8MiB", max_value_size="1MiB")
    held = [key(i, "dead") for i in range(100)]
    with Client(cluster.address) as writer:
        put_all(writer, held)
        proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(PINNER.format(ns=NS)), cluster.address],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "100"
            put_all(writer, [key(i, "dead-churn") for i in range(1000)])  # twice the arena
            assert writer.batch_exists(NS, held) == [True] * 100  # pinned: kept
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        deadline = time.monotonic() + 10
        while any(writer.batch_exists(NS, held)):
            assert time.monotonic() < deadline, "a dead client's pins still hold blocks"
            put_all(writer, [key(i, f"dead-churn-{time.monotonic()}") for i in range(600)])


def test_reads_racing_removals_and_rewrites_are_misses_or_the_right_bytes(
    make_cluster: MakeCluster,
) -> None:
    """A writer removes and rewrites keys with new values while a same-host reader
    reads them through the index: every hit is exactly one of the values the key
    ever had, never a torn or foreign block."""
    cluster = make_cluster(workers=1, dram_size="8MiB", max_value_size="1MiB")
    keys = [key(i, "race") for i in range(64)]

    def value(k: bytes, v: int) -> bytes:
        return value_for(k + bytes([v]), SIZE)

    stop = threading.Event()
    errors: list[str] = []
    with Client(cluster.address, transport="shm") as reader, Client(cluster.address) as writer:
        assert all(writer.batch_put(NS, keys, [value(k, 0) for k in keys]))

        def churn() -> None:
            v = 0
            while not stop.is_set():
                v = (v + 1) % 4
                writer.remove(NS, keys[::2])
                writer.batch_put(NS, keys[::2], [value(k, v) for k in keys[::2]])
                put_all(writer, [key(i, f"race-fill-{v}") for i in range(200)])

        t = threading.Thread(target=churn)
        t.start()
        try:
            end = time.monotonic() + 4
            reads = 0
            while time.monotonic() < end:
                bufs = [bytearray(SIZE) for _ in keys]
                hits = reader.batch_get_into(NS, keys, [memoryview(b) for b in bufs]).result(5)
                for k, hit, b in zip(keys, hits, bufs, strict=True):
                    if hit and bytes(b) not in {value(k, v) for v in range(4)}:
                        errors.append(k.hex())
                reads += sum(hits)
        finally:
            stop.set()
            t.join(30)
    assert not errors, f"wrong bytes for {len(errors)} reads"
    assert reads > 0


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="Linux only")
def test_a_client_without_the_index_still_reads_through_the_arena(
    make_cluster: MakeCluster,
) -> None:
    """Clients of the earlier protocol take one descriptor: the worker's extra ones
    are dropped by the kernel and they read over GET_LOC as before."""
    cluster = make_cluster(workers=1, dram_size="8MiB", max_value_size="1MiB")
    keys = [key(i, "old") for i in range(10)]
    with Client(cluster.address, transport="shm") as c:
        put_all(c, keys)
        view = c._view
        assert view is not None
        via = view.workers[0].via
        assert isinstance(via, ShmTransfer)
        via.arena.local = None  # as a client that took the arena alone
        assert c.batch_get(NS, keys) == [value_for(k, SIZE) for k in keys]
        assert c.match_prefix(NS, keys) == 10


def test_many_threads_read_and_look_up_through_the_index_at_once(
    make_cluster: MakeCluster,
) -> None:
    """Found by the transfer bench: the liveness check of the worker's link was a
    poll object, which two threads may not use at once ("concurrent poll()")."""
    cluster = make_cluster(workers=1, dram_size="8MiB", max_value_size="1MiB")
    keys = [key(i, "threads") for i in range(32)]
    errors: list[BaseException] = []
    with Client(cluster.address, transport="shm") as c:
        put_all(c, keys)
        local_of(c)

        def work() -> None:
            try:
                for _ in range(200):
                    assert c.match_prefix(NS, keys) == 32
                    got = c.batch_get(NS, keys[:4])
                    assert got == [value_for(k, SIZE) for k in keys[:4]]
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=work) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not errors, errors[0]


def test_an_arena_closed_under_running_calls_fails_none_of_them(
    make_cluster: MakeCluster,
) -> None:
    """Found by the fault-injection test: a map change closed an arena while another
    thread's put was copying through it ("operation forbidden on released memoryview").
    Calls in flight finish; later ones go over tcp://."""
    cluster = make_cluster(workers=1, dram_size="8MiB", max_value_size="1MiB")
    errors: list[BaseException] = []
    with Client(cluster.address, transport="shm") as c:
        view = c._view
        assert view is not None
        via = view.workers[0].via
        assert isinstance(via, ShmTransfer)
        stop = threading.Event()

        def work(t: int) -> None:
            i = 0
            try:
                while not stop.is_set():
                    ks = [key(i * 8 + j, f"closed-{t}") for j in range(8)]
                    assert all(c.batch_put(NS, ks, [value_for(k, SIZE) for k in ks]))
                    assert c.batch_get(NS, ks[:2]) == [value_for(k, SIZE) for k in ks[:2]]
                    i += 1
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        via.arena.close()  # as the client does when its map drops the mapping
        time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, repr(errors[0])


def test_a_put_whose_inbox_went_away_lands_over_tcp_and_says_so_exactly(
    make_cluster: MakeCluster,
) -> None:
    """Found by the suite under load: the client's mapping closed (so the worker dropped
    its inbox) between the put's check and its frames; the worker answered the frame
    with an error that reached the caller. Now what the worker never took goes over
    tcp://, and every block's status is this put's own (stored, not "present")."""
    from kvstore_client import wire
    from kvstore_client.transport import shminbox

    cluster = make_cluster(workers=1, dram_size="32MiB", max_value_size="1MiB")
    with Client(cluster.address, transport="shm") as c:
        view = c._view
        assert view is not None
        via = view.workers[0].via
        assert isinstance(via, ShmTransfer) and via.arena.inbox is not None
        inbox = via.arena.inbox
        link = via.arena._link
        assert link is not None
        link.shutdown(socket.SHUT_RDWR)  # the worker drops this client's page and inbox
        time.sleep(0.3)
        ks = [key(i, "gone") for i in range(6)]
        vals = [memoryview(value_for(k, SIZE)) for k in ks]
        with pytest.raises(shminbox.PartialPut) as e:
            via.pool.call(5.0, shminbox.put, inbox, via.arena.tag, NS.encode(), ks, vals,
                          [False] * 6)  # fmt: skip
        assert e.value.left == list(range(6))
        # Through the transfer (as Client.batch_put calls it, the arena still looking alive).
        status = via.put(5.0, NS.encode(), ks, vals, [0] * 6)
        assert status == bytes([wire.PUT_STORED] * 6)
        assert c.batch_get(NS, ks) == [bytes(v) for v in vals]


def test_closed_clients_leave_no_descriptors_behind(make_cluster: MakeCluster) -> None:
    """Found by the sustained-load test: each closed same-host client left the
    descriptors its mappings hold (mmap keeps one per mapping) until a GC pass."""
    cluster = make_cluster(workers=1, dram_size="8MiB", max_value_size="1MiB")

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    with Client(cluster.address):  # grpc's process-wide state, before the baseline
        pass
    before = fds()
    for i in range(10):
        with Client(cluster.address, transport="shm") as c:
            put_all(c, [key(i, "fds")])
            local_of(c)
            assert c.match_prefix(NS, [key(i, "fds")]) == 1
    # gRPC closes its channels' sockets from its own threads: give it a moment (the
    # mappings' descriptors, 3 per client, would stay for good).
    deadline = time.monotonic() + 10
    while fds() > before + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert fds() <= before + 2
