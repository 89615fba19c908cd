"""The DRAM arena: one pre-allocated, pre-faulted anonymous shared-memory file (a memfd).

The arena has no name in any file system: it is a ``memfd_create`` file that lives
exactly as long as some process holds it (the worker, and same-host clients that
were handed its descriptor over the worker's Unix socket, see
``worker/transfer/shm.py``). So a worker that is SIGKILLed or OOM-killed leaves no
arena behind in /dev/shm: the kernel frees the memory with the last holder.

The arena is faulted in at start (a first touch costs ~30x a memcpy). Each arena has
a random identity (``id``, and a 16-bit ``tag`` of it that travels in every shm://
answer), so a client can never mistake a restarted worker's arena for the old one.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import uuid

import numpy as np

from kvstore_client.errors import ResourceExhausted

MADV_POPULATE_WRITE = 23  # Linux >= 5.14; Python 3.11's mmap module lacks the name
SHM_PREFIX = "kvstore-"


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class Arena:
    """An anonymous shared-memory file of ``size`` bytes mapped read-write here.

    ``directory`` is kept for the worker's hand-over socket (the arena itself is
    not a file there); ``name`` only labels the memfd (visible in /proc/PID/fd).
    """

    def __init__(self, size: int, directory: str = "/dev/shm", name: str | None = None) -> None:
        if size <= 0:
            raise ValueError("arena size must be positive")
        free = available_memory()
        if free is not None and free < size:
            raise ResourceExhausted(
                f"this host has {free} bytes of memory available, the DRAM arena needs "
                f"{size}; lower --dram-size"
            )
        self.size = size
        self.directory = directory
        self.id = uuid.uuid4().hex[:16]
        self.tag = int(self.id[:4], 16)  # 16 bits of the identity, sent in shm answers
        self.fd = os.memfd_create(name or f"{SHM_PREFIX}arena-{self.id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self._mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.view = memoryview(self._mm)
        self._prefault()

    def _prefault(self) -> None:
        try:
            self._mm.madvise(MADV_POPULATE_WRITE)
        except (OSError, ValueError):
            # Older kernels: touch one byte per page.
            np.frombuffer(self._mm, dtype=np.uint8)[:: mmap.PAGESIZE] = 0

    def slot(self, offset: int, size: int) -> memoryview:
        """A view of ``size`` bytes at ``offset`` (no copy)."""
        return self.view[offset : offset + size]

    def close(self) -> None:
        """Unmap and close. Views still held elsewhere keep the mapping alive; clients
        that mapped the arena keep their own reference until they unmap it."""
        try:
            self.view.release()
            self._mm.close()
        except BufferError:
            pass  # a view is still exported; the mapping goes with the process
        with contextlib.suppress(OSError):
            os.close(self.fd)
