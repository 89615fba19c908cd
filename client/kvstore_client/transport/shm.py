"""Client half of the shm:// transport: map a same-host worker's arena and copy directly.

The worker advertises ``shm:///dev/shm/kvstore-...?host=HOSTID``. A client on
the same host (same host id) that may open the file (its mode is 0600: the
worker's user only) maps it once; then a get is one GET_LOC round trip for the
locations, one numpy copy per block out of the mapping (checked against the
block's xxh3-64), and a one-way RELEASE. A put is a PUT_LOC round trip for
reserved slots, copies into them, and a PUT_COMMIT round trip. Control frames
travel over the tcp:// connection (codec in kvstore_client.wire).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import urllib.parse
from collections.abc import Sequence

import numpy as np
import xxhash

from .. import wire
from .tcp import GetResult, TcpConnection


def host_id() -> str:
    """This machine and boot: equal ids mean the same kernel, hence shared /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def shm_url(path: str) -> str:
    return f"shm://{path}?host={urllib.parse.quote(host_id(), safe='')}"


def parse_shm_url(url: str) -> tuple[str, str]:
    """``shm://PATH?host=ID`` -> (path, host id)."""
    u = urllib.parse.urlsplit(url)
    if u.scheme != "shm":
        raise ValueError(f"not an shm:// URL: {url}")
    host = urllib.parse.parse_qs(u.query).get("host", [""])[0]
    return u.path, host


class ShmArena:
    """A read-write mapping of a worker's arena file."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            # MAP_POPULATE: fault the whole mapping in now, not one page per first touch.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._mm = mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.path = path
        self.array = np.frombuffer(self._mm, dtype=np.uint8)

    def close(self) -> None:
        self.array = np.empty(0, dtype=np.uint8)
        with contextlib.suppress(BufferError):
            self._mm.close()


def try_map(endpoints: Sequence[str]) -> ShmArena | None:
    """Map the arena of a worker on this host if its file may be opened, else None."""
    me = host_id()
    for url in endpoints:
        if not url.startswith("shm://"):
            continue
        path, host = parse_shm_url(url)
        if host != me:
            return None
        try:
            return ShmArena(path)
        except OSError:
            return None
    return None


def _as_array(buf: memoryview) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint8)


def get(
    conn: TcpConnection,
    arena: ShmArena,
    ns: bytes,
    hashes: Sequence[bytes],
    buffers: Sequence[memoryview] | None,
) -> GetResult:
    """Read blocks through the mapping (inline for blocks outside the arena)."""
    conn._req += 1
    req = conn._req
    sock = conn.sock
    head = wire.encode_request_header(wire.OP_GET_LOC, ns, len(hashes), req)
    wire.send_buffers(sock, [head, b"".join(hashes)])
    h = conn._answer(wire.OP_GET_LOC, req)
    meta = wire.recv_exact(sock, h.count * wire.LOC_ENTRY.size)
    entries = list(wire.LOC_ENTRY.iter_unpack(meta))
    found = [False] * h.count
    values: list[bytearray | None] = [None] * h.count
    total = 0
    try:
        # Inline payloads come first on the wire, in order.
        for i, (status, size, checksum, _) in enumerate(entries):
            if status != wire.LOC_INLINE:
                continue
            total += size
            if buffers is None:
                buf = bytearray(size)
                wire.recv_into_exact(sock, memoryview(buf))
                if xxhash.xxh3_64_intdigest(buf) == checksum:
                    values[i], found[i] = buf, True
            elif buffers[i].nbytes != size:
                wire.discard(sock, size, conn._scratch)
            else:
                wire.recv_into_exact(sock, buffers[i])
                found[i] = xxhash.xxh3_64_intdigest(buffers[i]) == checksum
        src = arena.array
        for i, (status, size, checksum, off) in enumerate(entries):
            if status != wire.LOC_ARENA or off + size > len(src):
                continue
            total += size
            if buffers is None:
                buf = bytearray(size)
                dst = _as_array(memoryview(buf))
            elif buffers[i].nbytes != size:
                continue
            else:
                dst = _as_array(buffers[i])
            np.copyto(dst, src[off : off + size])
            if xxhash.xxh3_64_intdigest(dst.data) == checksum:
                found[i] = True
                if buffers is None:
                    values[i] = buf
    finally:
        # One-way: the worker unpins; no answer to wait for.
        wire.send_buffers(sock, [wire.encode_request_header(wire.OP_RELEASE, ns, 0, req)])
    return GetResult(found, values, total)


def put(
    conn: TcpConnection,
    arena: ShmArena,
    ns: bytes,
    hashes: Sequence[bytes],
    values: Sequence[memoryview],
    checksums: Sequence[int],
) -> bytes:
    """Write blocks through the mapping; returns one wire.PUT_* status per block."""
    conn._req += 1
    req = conn._req
    sock = conn.sock
    entries = bytearray(len(hashes) * wire.PUT_ENTRY.size)
    for i, (key, v, c) in enumerate(zip(hashes, values, checksums, strict=True)):
        wire.PUT_ENTRY.pack_into(entries, i * wire.PUT_ENTRY.size, key, v.nbytes, c)
    head = wire.encode_request_header(wire.OP_PUT_LOC, ns, len(hashes), req)
    wire.send_buffers(sock, [head, entries])
    h = conn._answer(wire.OP_PUT_LOC, req)
    locs = list(wire.PUT_LOC_ENTRY.iter_unpack(wire.recv_exact(sock, h.count * 16)))
    dst = arena.array
    flags = bytearray(h.count)
    for i, (status, off) in enumerate(locs):
        if status == wire.PUT_LOC_SLOT:
            n = values[i].nbytes
            if off + n <= len(dst):
                np.copyto(dst[off : off + n], _as_array(values[i]))
                flags[i] = 1
    commit = wire.encode_request_header(wire.OP_PUT_COMMIT, ns, h.count, req)
    wire.send_buffers(sock, [commit, flags])
    h = conn._answer(wire.OP_PUT_COMMIT, req)
    status = bytes(wire.recv_exact(sock, h.count))
    # Entries refused at PUT_LOC keep their PUT_LOC status (present / full).
    return bytes(
        s if loc[0] == wire.PUT_LOC_SLOT else loc[0] for s, loc in zip(status, locs, strict=True)
    )
