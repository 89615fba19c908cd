"""The datagram beat: one 32-byte UDP datagram per worker beat (see master.proto,
"Datagram beats"), shared by the worker that sends it and the master that checks it.

Layout (little-endian): magic "KB", version 1, flags, binding id (uint32), sequence
number (uint64), then a 16-byte MAC: keyed BLAKE2b of the first 16 bytes with the
binding's 32-byte key. Pure functions, no I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

__all__ = [
    "FLAG_ATTENTION",
    "HEADER",
    "KEY_BYTES",
    "MAC_BYTES",
    "MAGIC",
    "RETRY_CAP_S",
    "RETRY_S",
    "SIZE",
    "VERSION",
    "decode",
    "encode",
    "mac",
    "verify",
]

MAGIC = b"KB"
VERSION = 1
FLAG_ATTENTION = 0x01  # the sender would like an answer on its Beats stream soon
HEADER = struct.Struct("<2sBBIQ")  # magic, version, flags, binding id, sequence number
MAC_BYTES = 16
KEY_BYTES = 32
SIZE = HEADER.size + MAC_BYTES  # 32
# A sender told datagrams_lost asks for datagrams again this much later, doubling ...
RETRY_S = 10.0
RETRY_CAP_S = 300.0  # ... up to this


def mac(key: bytes, header: bytes | memoryview) -> bytes:
    """The MAC of a datagram's ``header`` (its first 16 bytes) under ``key``."""
    return hashlib.blake2b(header, key=key, digest_size=MAC_BYTES).digest()


def encode(key: bytes, binding: int, seq: int, flags: int = 0) -> bytes:
    """The datagram of beat ``seq`` of ``binding``."""
    head = HEADER.pack(MAGIC, VERSION, flags, binding, seq)
    return head + mac(key, head)


def decode(data: bytes | memoryview) -> tuple[int, int, int] | None:
    """(binding id, sequence number, flags) of a well-formed datagram, its MAC not yet
    checked; None for anything of another size, magic or version."""
    if len(data) != SIZE:
        return None
    magic, version, flags, binding, seq = HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        return None
    return binding, seq, flags


def verify(key: bytes, data: bytes | memoryview) -> bool:
    """Whether the MAC of a well-formed datagram is right under ``key``."""
    return hmac.compare_digest(mac(key, data[: HEADER.size]), bytes(data[HEADER.size : SIZE]))
