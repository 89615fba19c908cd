"""The DRAM arena: one pre-allocated, pre-faulted shared-memory file.

The file lives in a tmpfs (``/dev/shm`` by default) with mode 0600, so only the
worker's user can map it; same-host clients with that right map it directly.
The arena is faulted in at start (a first touch costs ~30x a memcpy), and the
file is unlinked when the worker stops.
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


class Arena:
    """A shared-memory file of ``size`` bytes mapped read-write into this process."""

    def __init__(self, size: int, directory: str = "/dev/shm", name: str | None = None) -> None:
        if size <= 0:
            raise ValueError("arena size must be positive")
        st = os.statvfs(directory)
        free = st.f_bavail * st.f_frsize
        if free < size:
            raise ResourceExhausted(
                f"{directory} has {free} bytes free, the DRAM arena needs {size}; "
                "lower --dram-size or enlarge the tmpfs"
            )
        self.size = size
        self.path = os.path.join(
            directory, name or f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        )
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(self._fd, size)
            self._mm = mmap.mmap(self._fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self._fd)
            os.unlink(self.path)
            raise
        self.view = memoryview(self._mm)
        self._prefault()

    def _prefault(self) -> None:
        try:
            self._mm.madvise(MADV_POPULATE_WRITE)
        except (OSError, ValueError):
            # Older kernels: touch one byte per page (tmpfs space was checked above).
            np.frombuffer(self._mm, dtype=np.uint8)[:: mmap.PAGESIZE] = 0

    def slot(self, offset: int, size: int) -> memoryview:
        """A view of ``size`` bytes at ``offset`` (no copy)."""
        return self.view[offset : offset + size]

    def close(self) -> None:
        """Unmap and unlink. Views still held elsewhere keep the mapping alive."""
        try:
            self.view.release()
            self._mm.close()
        except BufferError:
            pass  # a view is still exported; the mapping goes with the process
        with contextlib.suppress(OSError):
            os.close(self._fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
