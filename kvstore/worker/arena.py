"""The DRAM arena: one pre-allocated, pre-faulted anonymous shared-memory file (a memfd).

The arena has no name in any file system: it is a ``memfd_create`` file that lives
exactly as long as some process holds it (the worker, and same-host clients that
were handed its descriptor over the worker's Unix socket, see
``worker/transfer/shm.py``). So a worker that is SIGKILLed or OOM-killed leaves no
arena behind in /dev/shm: the kernel frees the memory with the last holder.

Its pages are ordinary shared memory, charged to the worker's memory cgroup (a
container's memory limit), or, with ``huge_page`` (``--huge-pages 2MiB|1GiB``), huge
pages from the kernel's reserved pool (``MFD_HUGETLB``), charged to the hugetlb
controller instead. Before allocating, the arena checks that it fits: in the host's
MemAvailable and under every memory cgroup limit above the worker (cgroup v2 and v1),
or in the free huge pages of that size; otherwise it fails with one line instead of
being OOM-killed while faulting in.

The arena is faulted in at start (a first touch costs ~30x a memcpy). Each arena has
a random identity (``id``, and a 16-bit ``tag`` of it that travels in every shm://
answer), so a client can never mistake a restarted worker's arena for the old one.

Then it is sealed (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE``): the
worker's own mapping, made before the seal, stays writable, and no other mapping of the
memory can ever be (not through the read-only descriptor handed to clients, nor a
reopen of it through /proc, whose memfd inodes are mode 0777). ``sealed`` says whether
the kernel enforces it (checked by trying: Linux 5.1 for regular pages, 5.13 for huge
pages); a worker hands its arena to same-host clients only when it does
(docs/SECURITY.md).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import uuid
from dataclasses import dataclass

import numpy as np

from kvstore_client.errors import ResourceExhausted

from ..config import format_size

MADV_POPULATE_WRITE = 23  # Linux >= 5.14; Python 3.11's mmap module lacks the name
F_SEAL_FUTURE_WRITE = 0x0010  # Linux 5.1: no new writable mapping; Python 3.11 lacks it
SHM_PREFIX = "kvstore-"
MFD_HUGE_SHIFT = 26  # linux/memfd.h: log2(page size) << MFD_HUGE_SHIFT selects the size
NO_LIMIT = 1 << 60  # cgroup v1 reports "no limit" as a huge number (page-rounded LONG_MAX)


def available_memory(meminfo: str = "/proc/meminfo") -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where it cannot be read)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass(frozen=True, slots=True)
class CgroupRoom:
    """The tightest memory cgroup above a process: how much more it may use."""

    path: str  # the cgroup directory whose limit binds
    limit: int  # its limit in bytes
    room: int  # limit - (usage - inactive file cache): what a new allocation may take


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat_value(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_dirs(proc_cgroup: str, root: str) -> list[tuple[str, int]]:
    """The memory cgroup directories of this process, leaf first, up to the mount root,
    each with its version (2 or 1)."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    for line in lines:
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "" and os.path.exists(os.path.join(root, "memory.max")):
            version, mount = 2, root  # a cgroup v2 (unified) mount with the memory controller
        elif hid == "0" and controllers == "":
            mounted = os.path.join(root, "cgroup.controllers")
            try:
                with open(mounted) as f:
                    if "memory" not in f.read().split():
                        continue
            except OSError:
                continue
            version, mount = 2, root
        elif "memory" in controllers.split(","):
            version, mount = 1, os.path.join(root, "memory")
        else:
            continue
        leaf = os.path.join(mount, path.lstrip("/"))
        if not os.path.isdir(leaf):  # a cgroup namespace: the mount root is our own group
            leaf = mount
        out = []
        d = os.path.normpath(leaf)
        top = os.path.normpath(mount)
        while True:
            out.append((d, version))
            if d == top or len(d) <= len(top):
                break
            d = os.path.dirname(d)
        return out
    return []


def cgroup_room(
    proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup"
) -> CgroupRoom | None:
    """The memory cgroup (this one or an ancestor) with the least room left, or None
    where no memory limit applies or none can be read. Room is the limit minus the
    usage net of inactive file cache (what the kernel reclaims before OOM-killing,
    the "working set" kubelet uses), so page cache does not count against the arena.
    """
    best: CgroupRoom | None = None
    for d, version in _cgroup_dirs(proc_cgroup, root):
        if version == 2:
            limit = _read_int(os.path.join(d, "memory.max"))
            usage = _read_int(os.path.join(d, "memory.current"))
            inactive = _stat_value(os.path.join(d, "memory.stat"), "inactive_file")
        else:
            limit = _read_int(os.path.join(d, "memory.limit_in_bytes"))
            usage = _read_int(os.path.join(d, "memory.usage_in_bytes"))
            inactive = _stat_value(os.path.join(d, "memory.stat"), "total_inactive_file")
        if limit is None or limit >= NO_LIMIT:
            continue
        room = limit - max(0, (usage or 0) - inactive)
        if best is None or room < best.room:
            best = CgroupRoom(d, limit, room)
    return best


def free_huge_pages(page: int, sysfs: str = "/sys/kernel/mm/hugepages") -> int | None:
    """Free huge pages of ``page`` bytes in the kernel's pool (None: size not supported)."""
    return _read_int(os.path.join(sysfs, f"hugepages-{page // 1024}kB", "free_hugepages"))


def check_room(size: int, huge_page: int = 0) -> None:
    """Raise ResourceExhausted (one line, naming what to change) unless an arena of
    ``size`` bytes fits: in free huge pages of ``huge_page`` bytes, or else in the host's
    MemAvailable and under every memory cgroup limit above this process."""
    if huge_page:
        free = free_huge_pages(huge_page)
        if free is None:
            raise ResourceExhausted(
                f"this kernel has no {format_size(huge_page)} huge pages "
                f"(/sys/kernel/mm/hugepages); use --huge-pages 2MiB or 1GiB, or none"
            )
        need = -(-size // huge_page)
        if free < need:
            raise ResourceExhausted(
                f"the DRAM arena needs {need} free {format_size(huge_page)} huge pages "
                f"({format_size(size)}), the kernel has {free} free: reserve more "
                f"(vm.nr_hugepages, or hugepages-{format_size(huge_page).replace(' ', '')} "
                "in Kubernetes), lower --dram-size, or drop --huge-pages"
            )
        return
    free = available_memory()
    if free is not None and free < size:
        raise ResourceExhausted(
            f"this host has {format_size(free)} of memory available, the DRAM arena needs "
            f"{format_size(size)}; lower --dram-size"
        )
    cg = cgroup_room()
    if cg is not None and cg.room < size:
        raise ResourceExhausted(
            f"the memory cgroup {cg.path} (limit {format_size(cg.limit)}) has room for "
            f"{format_size(max(0, cg.room))} more, the DRAM arena needs {format_size(size)}; "
            "lower --dram-size or raise the container's memory limit"
        )


def seal(fd: int, page: int) -> bool:
    """Seal a memfd against size changes and new writable mappings; True when the
    kernel enforces it (a writable mapping of a read-only reopen is refused)."""
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE)
    except OSError:
        return False
    try:
        probe = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        m = mmap.mmap(probe, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError:
        return True  # refused: the seal holds
    finally:
        os.close(probe)
    m.close()
    return False


class Arena:
    """An anonymous shared-memory file of ``size`` bytes mapped read-write here.

    ``directory`` is kept for the worker's hand-over socket (the arena itself is
    not a file there); ``name`` only labels the memfd (visible in /proc/PID/fd).
    ``huge_page`` (bytes, 0 = regular pages) backs the arena with huge pages of that
    size; ``size`` must then be a multiple of it.
    """

    def __init__(
        self,
        size: int,
        directory: str = "/dev/shm",
        name: str | None = None,
        huge_page: int = 0,
    ) -> None:
        if size <= 0:
            raise ValueError("arena size must be positive")
        if huge_page and (huge_page & (huge_page - 1) or size % huge_page):
            raise ValueError("huge_page must be a power of two that divides the arena size")
        check_room(size, huge_page)
        self.size = size
        self.directory = directory
        self.huge_page = huge_page
        self.id = uuid.uuid4().hex[:16]
        self.tag = int(self.id[:4], 16)  # 16 bits of the identity, sent in shm answers
        flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
        if huge_page:
            flags |= os.MFD_HUGETLB | (huge_page.bit_length() - 1) << MFD_HUGE_SHIFT
        self.fd = os.memfd_create(name or f"{SHM_PREFIX}arena-{self.id}", flags)
        try:
            os.ftruncate(self.fd, size)
            self._mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            os.close(self.fd)
            if huge_page and e.errno == errno.ENOMEM:  # the pool ran dry since the check
                raise ResourceExhausted(
                    f"cannot reserve {format_size(size)} of {format_size(huge_page)} huge "
                    "pages for the DRAM arena: reserve more or lower --dram-size"
                ) from None
            raise
        except BaseException:
            os.close(self.fd)
            raise
        self.view = memoryview(self._mm)
        self._prefault()
        self.sealed = seal(self.fd, huge_page or mmap.PAGESIZE)

    def _prefault(self) -> None:
        try:
            self._mm.madvise(MADV_POPULATE_WRITE)
        except (OSError, ValueError):
            # Older kernels: touch one byte per page (huge pages were reserved by mmap,
            # so touching them cannot fail).
            np.frombuffer(self._mm, dtype=np.uint8)[:: mmap.PAGESIZE] = 0

    def read_only_fd(self) -> int:
        """A new read-only descriptor of the arena (for a client; close it after
        handing it over)."""
        return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)

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
