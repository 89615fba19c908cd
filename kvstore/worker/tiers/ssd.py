"""The SSD tier: one LMDB environment per worker (I/O; bookkeeping in policy.SsdIndex).

Each value is a 32-byte header and the payload:
    magic b"KVB1" | version u8 | pad 3 | payload size u64 | xxh3_64 u64 | xxh3_64(ns) u64
The LMDB key is ``namespace || 0x00 || hash``.

Sizing: the SSD size bounds the *pages* the values occupy, which is what
:meth:`SsdStore.footprint` reports and what the tier policy's index counts (a value
is stored in LMDB overflow pages: its bytes plus our 32-byte header plus LMDB's
16-byte page header, rounded up to whole pages, so a 4 KiB payload takes two 4 KiB
pages and a 1 MiB one 257). The LMDB map is larger than the SSD size by
``MAP_HEADROOM`` (copy-on-write pages of a transaction, free-list fragmentation,
deletes that need pages of their own): with the policy evicting at its watermarks
the map never fills, and the file stays sparse beyond what was written. Writes
use ``writemap=False`` (write(2), so a full disk is an error, never a SIGBUS; and
1.7 GB/s against 0.7 with writemap here) and no fsync per commit; ``close()``
fsyncs. Reads hand out zero-copy views into LMDB's memory map, valid while their
read transaction is open.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import lmdb
import xxhash

from kvstore_client.errors import ResourceExhausted

log = logging.getLogger(__name__)

MAGIC = b"KVB1"
VERSION = 1
HEADER = struct.Struct("<4sB3xQQQ")
HEADER_LEN = HEADER.size  # 32
PAGE_HEADER = 16  # LMDB's header on the first page of an overflow run
MAP_HEADROOM = 0.5  # the map is this much larger than the SSD size (see the docstring)


def lmdb_key(ns: str, key: bytes) -> bytes:
    return ns.encode() + b"\x00" + key


def split_key(k: bytes) -> tuple[str, bytes]:
    """Inverse of :func:`lmdb_key`; the hash has a fixed length (and may hold 0x00)."""
    if len(k) < 18 or k[-17] != 0:
        raise ValueError("not a kvstore key")
    return bytes(k[:-17]).decode(), bytes(k[-16:])


def ns_tag(ns: str) -> int:
    return xxhash.xxh3_64_intdigest(ns.encode())


def encode_header(ns: str, size: int, checksum: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, size, checksum, ns_tag(ns))


@dataclass(slots=True, frozen=True)
class Header:
    size: int
    checksum: int


def decode_header(ns: str, value: memoryview | bytes) -> Header | None:
    """The header if it is well-formed and matches the value's length and namespace."""
    if len(value) < HEADER_LEN:
        return None
    magic, version, size, checksum, tag = HEADER.unpack_from(value)
    if magic != MAGIC or version != VERSION or size != len(value) - HEADER_LEN or tag != ns_tag(ns):
        return None
    return Header(size, checksum)


class SsdStore:
    """LMDB-backed storage of blocks. Thread-safe (LMDB serialises writers)."""

    def __init__(self, path: str, size: int, *, sync: bool = False) -> None:
        os.makedirs(path, exist_ok=True)
        self.path = path
        self.size = size
        self.sync_writes = sync
        self.env = lmdb.open(
            path,
            map_size=size + int(size * MAP_HEADROOM) + (1 << 20),
            subdir=True,
            writemap=False,
            sync=sync,
            metasync=sync,
            readahead=True,  # values are large runs of contiguous overflow pages
            max_readers=1024,
            lock=True,
        )
        self.page_size = int(self.env.stat()["psize"])

    def footprint(self, payload: int) -> int:
        """Bytes of LMDB pages a value of ``payload`` bytes occupies (header included)."""
        n = HEADER_LEN + payload + PAGE_HEADER
        return -(-n // self.page_size) * self.page_size

    # ---- writes --------------------------------------------------------------

    def put_many(
        self, items: Sequence[tuple[str, bytes, memoryview | bytes, int]]
    ) -> list[tuple[str, bytes, int, int]]:
        """Write (ns, key, payload, checksum) items in one transaction.

        Returns (ns, key, payload size, stored size) for each item written, the stored
        size being the value's :meth:`footprint` in LMDB pages. Raises
        ResourceExhausted when the map or the disk is full (nothing is written then).
        """
        done: list[tuple[str, bytes, int, int]] = []
        try:
            with self.env.begin(write=True) as txn:
                for ns, key, payload, checksum in items:
                    n = len(payload)
                    buf = bytearray(HEADER_LEN + n)
                    HEADER.pack_into(buf, 0, MAGIC, VERSION, n, checksum, ns_tag(ns))
                    buf[HEADER_LEN:] = payload
                    txn.put(lmdb_key(ns, key), buf)
                    done.append((ns, key, n, self.footprint(n)))
        except lmdb.MapFullError as e:
            raise ResourceExhausted("SSD tier is full (LMDB map full)") from e
        except lmdb.Error as e:
            # A full disk shows up as ENOSPC, or as EIO when the kernel fails write-back;
            # either way this write did not happen and the caller must not count on it.
            raise ResourceExhausted(f"SSD tier write failed: {e}") from e
        return done

    def delete_many(self, keys: Sequence[tuple[str, bytes]]) -> None:
        try:
            with self.env.begin(write=True) as txn:
                for ns, key in keys:
                    txn.delete(lmdb_key(ns, key))
        except lmdb.Error as e:
            log.warning("SSD delete failed: %s", e)

    # ---- reads ---------------------------------------------------------------

    def begin_read(self) -> lmdb.Transaction:
        """A read transaction; views from :meth:`view` live until it ends."""
        return self.env.begin(write=False, buffers=True)

    @staticmethod
    def view(txn: lmdb.Transaction, ns: str, key: bytes) -> tuple[Header, memoryview] | None:
        """Zero-copy (header, payload view), or None if absent or the header is bad."""
        raw = txn.get(lmdb_key(ns, key))
        if raw is None:
            return None
        mv = memoryview(raw)
        h = decode_header(ns, mv)
        if h is None:
            return None
        return h, mv[HEADER_LEN:]

    def scan(self) -> Iterator[tuple[bytes, str, bytes, Header | None, int]]:
        """Every stored entry: (raw key, ns, key, header or None if malformed, bytes).

        Reads only the header of each value (the first page), not the payload.
        """
        with self.env.begin(write=False, buffers=True) as txn:
            for k, v in txn.cursor():
                raw = bytes(k)
                try:
                    ns, key = split_key(raw)
                except ValueError:  # includes UnicodeDecodeError
                    yield raw, "", b"", None, len(v)
                    continue
                yield raw, ns, key, decode_header(ns, v), len(v)

    def delete_raw(self, raw_keys: Sequence[bytes]) -> None:
        with contextlib.suppress(lmdb.Error), self.env.begin(write=True) as txn:
            for k in raw_keys:
                txn.delete(k)

    def close(self) -> None:
        """Flush to disk (fsync) and close; errors are logged, never raised."""
        try:
            self.env.sync(True)
        except lmdb.Error as e:
            log.error("SSD tier: final fsync failed: %s", e)
        self.env.close()
