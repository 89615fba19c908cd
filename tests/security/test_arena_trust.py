"""The same-host arena as a trust boundary (docs/SECURITY.md, "Shared memory"): real
workers, attacked by same-user processes the way issue 41 found them.

Each test names its finding. The attackers never use the worker's internals: they
connect to the hand-over socket like any process of the user could, and try every way
to write what they were handed (a writable mapping of the descriptor, a read-write
reopen through /proc, write(2)).
"""

from __future__ import annotations

import glob
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from unittest import mock

import numpy as np
import xxhash

from kvstore.cluster import LocalCluster
from kvstore_client import Client
from tests.conftest import MakeCluster
from tests.helpers import key, value_for

NS = "m/bf16/b16/tp0of1"
MiB = 1 << 20

# The attackers' toolbox, run in their own processes (source text: it must not import
# anything of the project but the wire codec, which any attacker can read).
TOOLS = textwrap.dedent(
    """
    import json, mmap, os, socket, struct, sys, time

    SPEAKS = []  # learned once: does the worker wait for the client to speak first?

    def steal(path, identity=None):
        '''Every descriptor the worker's hand-over socket gives a process that asks
        (speaking the current protocol; an older worker sends without being asked).'''
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        if not SPEAKS:
            s.settimeout(0.5)
            try:  # a worker of the first protocol sends at once (any byte is a bye to it)
                msg, fds, _, _ = socket.recv_fds(s, 64, 8)
                SPEAKS.append(False)
                return s, fds
            except TimeoutError:
                SPEAKS.append(True)
            except OSError:
                return s, []
        elif not SPEAKS[0]:
            s.settimeout(3)
            try:
                msg, fds, _, _ = socket.recv_fds(s, 64, 8)
            except OSError:
                return s, []
            return s, fds
        s.settimeout(3)
        ident = identity or os.urandom(16)
        try:
            s.sendall(struct.pack("<4sHH16s", b"KVSR", 2, 0, ident))
            msg, fds, _, _ = socket.recv_fds(s, 64, 8)
        except OSError:
            return s, []
        return s, fds

    def writable(fd, size):
        '''A writable shared mapping of the memory behind fd, by any means, or None.'''
        for how in ("fd", "reopen"):
            try:
                f = fd if how == "fd" else os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
            except OSError:
                continue
            try:
                return mmap.mmap(f, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError:
                pass
            try:
                os.pwrite(f, b"", 0)
                if os.pwrite(f, bytes(1), 0) == 1:
                    return "pwrite"
            except OSError:
                pass
        return None
    """
)


def attacker(code: str, **params: object) -> subprocess.Popen[str]:
    prog = (
        TOOLS + f"PARAMS = json.loads({json.dumps(json.dumps(params))})\n" + textwrap.dedent(code)
    )
    return subprocess.Popen(
        [sys.executable, "-c", prog], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def result(p: subprocess.Popen[str], timeout: float = 120) -> dict[str, object]:
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, f"attacker failed:\n{err[-3000:]}"
    line = next(x for x in out.splitlines() if x.startswith("RESULT="))
    got: dict[str, object] = json.loads(line[len("RESULT=") :])
    return got


def sockets_of(c: LocalCluster) -> list[str]:
    """Every hand-over socket the cluster's workers made (whatever the map says)."""
    return [p for w in c.worker_procs for p in glob.glob(f"/dev/shm/kvstore-{w.pid}-*.sock")]


# ---- finding 1: tenants share one arena ----------------------------------------------

TENANTS = """
tenants:
  - name: team-a
    token: token-a
    namespaces: [team-a]
  - name: team-b
    token: token-b
    namespaces: [team-b]
  - name: ops
    token: token-ops
    admin: true
"""


def test_no_process_maps_a_tenant_workers_arena(make_cluster: MakeCluster, tmp_path: Path) -> None:
    """Finding 1: with tenants the worker handed its arena to any process of its user
    (a client of tenant B, or one with no token at all) and tenant A's blocks were in
    it. Now nothing is handed over with tenants: no shm:// endpoint, no socket, and
    same-host clients read through the worker, which checks the token."""
    f = tmp_path / "tenants.yaml"
    f.write_text(TENANTS)
    c = make_cluster(
        workers=1,
        dram_size="64MiB",
        max_value_size="1MiB",
        extra_worker_args=["--tenants-file", str(f), "--token", "token-ops"],
    )
    secret = value_for(key(0, "tenant-a"), 256 << 10)
    with Client(c.address, token="token-a") as a:
        assert a.batch_put("team-a/m", [key(0, "tenant-a")], [secret]) == [True]
    with Client(c.address, token="token-b") as b:
        assert all(w.arena is None for w in b._view.workers)  # type: ignore[union-attr]
        assert not any(u.startswith("shm://") for w in b.workers() for u in w.endpoints)
    for path in sockets_of(c):
        p = attacker(
            """
            s, fds = steal(PARAMS["path"])
            found = False
            for fd in fds:
                size = os.fstat(fd).st_size
                if size:
                    m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
                    found |= m.find(bytes.fromhex(PARAMS["needle"])) >= 0
            print("RESULT=" + json.dumps({"fds": len(fds), "found": found}))
            """,
            path=path,
            needle=secret[:4096].hex(),
        )
        got = result(p)
        assert got == {"fds": 0, "found": False}, f"a tokenless process got {got}"
    assert not sockets_of(c), "a worker with tenants keeps no hand-over socket"


# ---- findings 2 and 3: nobody but the worker writes a published block ---------------


def test_a_scribbler_cannot_change_pinned_or_published_blocks(make_cluster: MakeCluster) -> None:
    """Findings 2 and 3: a same-user process that got the arena wrote into pinned slots
    under an engine's DMA (~200 wrong reads of pin_local views in 6 s), and into slots
    between a reserve_local write and its commit, whose late checksum then verified
    its bytes (78 of 80 blocks published wrong under matching checksums). Now the arena
    is sealed: no writable mapping of it exists outside the worker, the engine's
    writes go through its private inbox, and the worker publishes only what it
    verified itself. Every view and every block read back is exact."""
    c = make_cluster(workers=1, dram_size="128MiB", max_value_size="1MiB")
    size = 256 << 10
    pinned_keys = [key(i, "pinned") for i in range(16)]
    with Client(c.address, transport="shm") as cl:
        assert all(cl.batch_put(NS, pinned_keys, [value_for(k, size) for k in pinned_keys]))
        [path] = sockets_of(c)
        scribbler = attacker(
            """
            s, fds = steal(PARAMS["path"])
            maps = []
            arena = False  # the first descriptor is the arena (its own page, inbox follow)
            for i, fd in enumerate(fds):
                size = os.fstat(fd).st_size
                m = writable(fd, size) if size else None
                arena |= i == 0 and m is not None
                if m is not None and m != "pwrite":
                    maps.append(m)
            sweeps = 0
            deadline = time.monotonic() + PARAMS["seconds"]
            junk = os.urandom(1 << 20)
            while maps and time.monotonic() < deadline:
                for m in maps:  # every byte of everything it could write, again and again
                    for at in range(0, len(m), 1 << 20):
                        n = min(1 << 20, len(m) - at)
                        m[at : at + n] = junk[:n]
                sweeps += 1
            if not maps:
                time.sleep(PARAMS["seconds"])
            print("RESULT=" + json.dumps({"arena": arena, "sweeps": sweeps}))
            """,
            path=path,
            seconds=6,
        )
        try:
            wrong_views = 0
            written: list[bytes] = []
            vals: list[bytes] = []
            t0 = time.monotonic()
            i = 0
            while time.monotonic() - t0 < 5:
                # An engine's load: pin, read the views (its DMA), release.
                pins = cl.pin_local(NS, pinned_keys)
                try:
                    for k, v in zip(pinned_keys, pins.views, strict=True):
                        if v is not None and bytes(v) != value_for(k, size):
                            wrong_views += 1
                finally:
                    pins.release()
                # An engine's save: reserve, write (its DMA), commit.
                if i < 80:
                    ks = [key(i, "saved")]
                    slots = cl.reserve_local(NS, ks, [size])
                    if slots.views[0] is not None:
                        slots.views[0][:] = value_for(ks[0], size)
                        if slots.commit([True]) == [True]:
                            written.append(ks[0])
                    else:
                        slots.abort()
                    i += 1
        finally:
            got = result(scribbler)
        assert got["arena"] is False, f"a same-user process wrote the arena: {got}"
        assert wrong_views == 0
        assert len(written) >= 40, "saves went through"
        vals = [value_for(k, size) for k in written]
    with Client(c.address, transport="tcp") as t:
        assert t.batch_get(NS, written) == vals, "a published block is not what was saved"


# ---- finding 4: a mismatched checksum aborts the put, never poisons the key ---------


def test_a_put_whose_bytes_do_not_match_its_checksum_leaves_the_key_writable(
    make_cluster: MakeCluster,
) -> None:
    """Finding 4: the worker took a same-host writer's late checksum as given; a forged
    one (or an engine whose DMA landed after commit took the sum) left the key present
    but unreadable, and a correct writer's later put was refused (first writer wins).
    Now the worker checks its own copy: a mismatch stores nothing, and the next
    correct put stores the key."""
    c = make_cluster(workers=1, dram_size="64MiB", max_value_size="1MiB")
    k = key(0, "forged")
    v = value_for(k, 512 << 10)
    with Client(c.address, transport="shm") as cl:
        slots = cl.reserve_local(NS, [k], [len(v)])
        assert slots.views[0] is not None
        slots.views[0][:] = v
        with mock.patch.object(xxhash, "xxh3_64_intdigest", lambda *a, **kw: 12345):
            assert slots.commit([True]) == [False], "a block that does not match is refused"
        assert cl.batch_exists(NS, [k]) == [False], "the key stays absent"
        assert cl.batch_put(NS, [k], [v]) == [True], "the next correct writer stores it"
        assert cl.batch_get(NS, [k]) == [v]


# ---- finding 5: what one client can keep pinned is bounded --------------------------


def test_a_frozen_client_keeps_at_most_its_share_of_the_arena(make_cluster: MakeCluster) -> None:
    """Finding 5: hazard pins were unbounded: a client that pin_local'ed every block
    and froze kept the whole arena (a fresh client stored 8 of 60 blocks). Now a
    client's pins are bounded by its budget (half the arena): the other half serves
    everyone else."""
    c = make_cluster(workers=1, dram_size="64MiB", max_value_size="1MiB")
    old = [key(i, "frozen") for i in range(60)]
    with Client(c.address, transport="shm") as frozen, Client(c.address, transport="shm") as fresh:
        for s in range(0, 60, 10):
            assert all(
                frozen.batch_put(NS, old[s : s + 10], [value_for(k, MiB) for k in old[s : s + 10]])
            )
        pins = frozen.pin_local(NS, old)  # and never released while the other works
        try:
            assert 0 < pins.count <= 32
            # The other client needs 28 MiB at once (one batch).
            new = [key(i, "fresh") for i in range(28)]
            vals = [value_for(k, MiB) for k in new]
            stored = sum(fresh.batch_put(NS, new, vals))
            assert stored == 28, f"a frozen client's pins kept the arena: {stored} of 28 stored"
            assert fresh.batch_get(NS, new) == vals
            # What it did pin is still exactly what it read.
            for k, view in zip(old, pins.views, strict=True):
                assert view is None or bytes(view) == value_for(k, MiB)
        finally:
            pins.release()


def test_a_page_naming_every_block_is_revoked_not_obeyed(make_cluster: MakeCluster) -> None:
    """Finding 5, hostile: a process writes the hazard word of every live block into
    its page (it can read them all in the index) and freezes. The worker holds what a
    page names only up to the page's budget; a page past it is revoked, and the fresh
    client stores all its blocks."""
    c = make_cluster(workers=1, dram_size="64MiB", max_value_size="1MiB")
    old = [key(i, "named") for i in range(60)]
    with Client(c.address, transport="shm") as cl:
        for s in range(0, 60, 10):
            assert all(
                cl.batch_put(NS, old[s : s + 10], [value_for(k, MiB) for k in old[s : s + 10]])
            )
        [path] = sockets_of(c)
        hog = attacker(
            """
            import numpy as np
            s, fds = steal(PARAMS["path"])
            # fds: arena, index, page (, inbox). The index's entries: after a 64-byte
            # header, nbuckets*8 key words, then 64-byte entries of 8 words.
            idx = mmap.mmap(fds[1], os.fstat(fds[1]).st_size, mmap.MAP_SHARED, mmap.PROT_READ)
            nb = struct.unpack_from("<Q", idx, 16)[0]
            words = np.frombuffer(idx, dtype="<u8", offset=64 + nb * 64, count=nb * 64)
            words = words.reshape(-1, 8)
            live = words[words[:, 7] == 1]
            haz = ((live[:, 5] >> np.uint64(32)) + np.uint64(1)) << np.uint64(32)
            haz |= live[:, 0] >> np.uint64(32)
            page = mmap.mmap(fds[2], os.fstat(fds[2]).st_size, mmap.MAP_SHARED,
                             mmap.PROT_READ | mmap.PROT_WRITE)
            h = np.frombuffer(page, dtype="<u8")
            h[8 : 8 + len(haz)] = haz
            h[0] = len(haz)
            print("RESULT=" + json.dumps({"named": int(len(haz))}), flush=True)
            sys.stdout.close()
            time.sleep(60)
            """,
            path=path,
        )
        try:
            line = hog.stdout.readline()  # type: ignore[union-attr]
            assert json.loads(line[len("RESULT=") :])["named"] == 60
            # Another client needs 28 MiB at once (one batch).
            new = [key(i, "fresh") for i in range(28)]
            vals = [value_for(k, MiB) for k in new]
            stored = sum(cl.batch_put(NS, new, vals))
            assert stored == 28, f"a page naming every block kept the arena: {stored} of 28"
            assert cl.batch_get(NS, new) == vals
        finally:
            hog.kill()
            hog.communicate()


# ---- finding 6: a client's pages cannot stall the worker ----------------------------


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def test_junk_in_many_pages_does_not_stall_the_worker(make_cluster: MakeCluster) -> None:
    """Finding 6: the upkeep drained every page's log and collected every page's
    hazard words under the store lock every 20 ms; 256 pages of junk pushed another
    client's 1-key EXISTS to 3.3 s, the worker missed heartbeats and left the map, and
    its RSS grew by 316 MiB. Now a drain and a reap do bounded work, off the lock."""
    c = make_cluster(workers=1, dram_size="64MiB", max_value_size="1MiB", worker_ttl="2s")
    ks = [key(i, "live") for i in range(40)]
    with Client(c.address, transport="tcp") as cl:
        assert all(cl.batch_put(NS, ks, [value_for(k, MiB) for k in ks]))
    [w] = c.worker_procs
    [path] = sockets_of(c)
    rss0 = rss(w.pid)
    junk = attacker(
        """
        import numpy as np
        held = []
        for i in range(256):
            try:
                s, fds = steal(PARAMS["path"])
            except OSError:
                break
            if len(fds) < 3:
                continue
            page = mmap.mmap(fds[2], os.fstat(fds[2]).st_size, mmap.MAP_SHARED,
                             mmap.PROT_READ | mmap.PROT_WRITE)
            h = np.frombuffer(page, dtype="<u8")
            h[8:] = np.random.randint(1, 2**63, size=len(h) - 8, dtype=np.uint64)
            h[0] = 1 << 40  # "all words in use"
            h[1] = 1 << 40  # a ring head far ahead
            held.append((s, page))
            for fd in fds:
                os.close(fd)
        print("RESULT=" + json.dumps({"pages": len(held)}), flush=True)
        sys.stdout.close()
        rng = np.random.default_rng()
        while True:  # keep churning the words and the logs
            for s, page in held:
                h = np.frombuffer(page, dtype="<u8")
                h[8:4104] = rng.integers(1, 2**63, size=4096, dtype=np.uint64)
                h[1] += 4096
            time.sleep(0.01)
        """,
        path=path,
    )
    try:
        line = junk.stdout.readline()  # type: ignore[union-attr]
        assert json.loads(line[len("RESULT=") :])["pages"] >= 200
        lat: list[float] = []
        with Client(c.address, transport="tcp") as other:
            t_end = time.monotonic() + 4
            while time.monotonic() < t_end:
                t0 = time.perf_counter()
                assert other.batch_exists(NS, ks[:1]) == [True]
                lat.append(time.perf_counter() - t0)
                time.sleep(0.005)
            # Puts that evict (every eviction checks the pages' hazard words).
            more = [key(i, "evicting") for i in range(40)]
            for s in range(0, 40, 8):
                assert all(
                    other.batch_put(
                        NS, more[s : s + 8], [value_for(k, MiB) for k in more[s : s + 8]]
                    )
                )
            assert [x.id for x in other.workers()] == [w.ready["id"]], "the worker left the map"
        p99 = float(np.percentile(lat, 99))
        assert p99 < 0.25, f"a 1-key EXISTS took {p99 * 1000:.0f} ms (p99) beside junk pages"
        assert rss(w.pid) - rss0 < 96 * MiB, "the worker's memory grew with the junk"
    finally:
        junk.kill()
        junk.communicate()


# ---- finding 7: one hung engine does not block its host's writes --------------------


def test_a_hung_engines_leases_do_not_block_its_neighbours(make_cluster: MakeCluster) -> None:
    """Finding 7: lease budgets were keyed by the client's address, which every engine
    on a host shares: six reserve_local calls left open by one hung process refused
    every other same-host put (0 of 60 stored) until the idle timeout. Now a lease is
    the client's own (an inbox region: nothing is held at the worker), and budgets are
    per client identity."""
    c = make_cluster(workers=1, dram_size="64MiB", max_value_size="1MiB")
    with Client(c.address, transport="shm") as hung, Client(c.address, transport="shm") as other:
        leases = [
            hung.reserve_local(NS, [key(i * 8 + j, "hung") for j in range(8)], [MiB] * 8)
            for i in range(6)
        ]
        try:
            new = [key(i, "neighbour") for i in range(60)]
            stored = 0
            for s in range(0, 60, 6):
                part = new[s : s + 6]
                stored += sum(other.batch_put(NS, part, [value_for(k, MiB) for k in part]))
            assert stored == 60, f"one client's open leases blocked its host: {stored} of 60"
        finally:
            for lease in leases:
                lease.abort()
