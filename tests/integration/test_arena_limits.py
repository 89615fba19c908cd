"""The arena checks its room before it allocates (issue 25): against every memory cgroup
limit above the worker (not only the host's MemAvailable), against the free huge pages
with --huge-pages, and the SSD tier against its disk. A worker that cannot have its
memory fails with one line naming what to change, instead of being OOM-killed while
faulting in.

The cgroup reader is tested on cgroup trees written to a temporary directory (v2, v1,
nested limits, a cgroup namespace); the end-to-end test starts a real worker inside a
real memory cgroup with a limit below the arena, where this host lets a test make one.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.worker.arena import cgroup_room, free_huge_pages
from kvstore_client import Client
from tests.conftest import MakeCluster
from tests.helpers import key, value_for

MiB = 1 << 20
KV = [sys.executable, "-m", "kvstore"]


def _write(d: Path, **files: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name.replace("__", ".")).write_text(text)


def test_cgroup_v2_nested_limits_take_the_tightest(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _write(root, cgroup__controllers="cpu memory io\n", memory__max="max\n")
    _write(root / "kubepods", memory__max=f"{1024 * MiB}\n", memory__current=f"{900 * MiB}\n",
           memory__stat=f"anon 1\ninactive_file {100 * MiB}\n")  # fmt: skip
    _write(root / "kubepods" / "pod1", memory__max=f"{512 * MiB}\n",
           memory__current=f"{10 * MiB}\n", memory__stat="inactive_file 0\n")  # fmt: skip
    proc = tmp_path / "cgroup"
    proc.write_text("0::/kubepods/pod1\n")
    room = cgroup_room(str(proc), str(root))
    assert room is not None
    # pod1 has 502 MiB of room, but its parent only 1024 - (900 - 100) = 224 MiB.
    assert room.path == str(root / "kubepods") and room.room == 224 * MiB
    assert room.limit == 1024 * MiB


def test_cgroup_v1_and_a_cgroup_namespace(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    mem = root / "memory"
    _write(mem, memory__limit_in_bytes="9223372036854771712\n", memory__usage_in_bytes="5\n")
    _write(mem / "docker" / "abc", memory__limit_in_bytes=f"{256 * MiB}\n",
           memory__usage_in_bytes=f"{64 * MiB}\n",
           memory__stat=f"cache 1\ntotal_inactive_file {16 * MiB}\n")  # fmt: skip
    proc = tmp_path / "cgroup"
    proc.write_text("12:pids:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    room = cgroup_room(str(proc), str(root))
    assert room is not None and room.room == (256 - 48) * MiB
    # In a cgroup namespace the path reads "/" and the mount root is the group itself.
    ns_root = tmp_path / "ns"
    _write(ns_root / "memory", memory__limit_in_bytes=f"{128 * MiB}\n",
           memory__usage_in_bytes=f"{8 * MiB}\n")  # fmt: skip
    proc.write_text("4:memory:/\n")
    room = cgroup_room(str(proc), str(ns_root))
    assert room is not None and room.room == 120 * MiB


def test_no_limit_no_room_check(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _write(root, cgroup__controllers="memory\n", memory__max="max\n", memory__current="1\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/\n")
    assert cgroup_room(str(proc), str(root)) is None
    assert cgroup_room(str(tmp_path / "absent"), str(root)) is None


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[Path]:
    """A child memory cgroup of this process's own, with ``limit``; skip where this host
    does not let the test make one (no permission, no memory controller)."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    made: Path | None = None
    for line in lines:
        hid, controllers, path = line.split(":", 2)
        name = f"kvstore-test-{uuid.uuid4().hex[:8]}"
        try:
            if "memory" in controllers.split(","):  # cgroup v1
                made = Path("/sys/fs/cgroup/memory") / path.lstrip("/") / name
                made.mkdir()
                (made / "memory.limit_in_bytes").write_text(str(limit))
                break
            if hid == "0" and Path("/sys/fs/cgroup/memory.max").exists():  # cgroup v2
                made = Path("/sys/fs/cgroup") / path.lstrip("/") / name
                made.mkdir()
                (made / "memory.max").write_text(str(limit))
                break
        except OSError as e:
            if made is not None and made.exists():
                made.rmdir()
            pytest.skip(f"cannot make a memory cgroup here: {e}")
    if made is None:
        pytest.skip("no memory cgroup controller here")
    try:
        yield made
    finally:
        with contextlib.suppress(OSError):
            made.rmdir()


def test_worker_under_a_cgroup_limit_below_its_arena_fails_with_one_line(
    tmp_path: Path,
) -> None:
    with memory_cgroup(192 * MiB) as cg:
        # The shell joins the cgroup, then becomes the worker: the whole worker runs in it.
        cmd = (
            f"echo $$ > {cg}/cgroup.procs && exec {' '.join(KV)} worker "
            "--master 127.0.0.1:1 --dram-size 512MiB --max-value-size 1MiB "
            f"--shm-dir {tmp_path}"
        )
        out = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=60)
    assert out.returncode not in (-9, 137), "the worker was OOM-killed while faulting in"
    assert out.returncode != 0
    err = out.stderr.strip().splitlines()
    assert len(err) == 1, out.stderr
    assert f"the memory cgroup {cg}" in err[0] and "limit 192.0 MiB" in err[0], err[0]
    assert "lower --dram-size" in err[0], err[0]


def test_huge_pages_without_a_reserve_fail_with_one_line(tmp_path: Path) -> None:
    free = free_huge_pages(2 * MiB)
    if free is None or free >= 64:
        pytest.skip("this host has 2 MiB huge pages reserved (or none at all)")
    out = subprocess.run(
        [*KV, "worker", "--master", "127.0.0.1:1", "--dram-size", "128MiB",
         "--max-value-size", "1MiB", "--huge-pages", "2MiB", "--shm-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode != 0
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and "64 free 2.0 MiB huge pages" in err[0], out.stderr
    assert "vm.nr_hugepages" in err[0]


def test_bad_huge_page_size_is_a_setting_error() -> None:
    out = subprocess.run([*KV, "worker", "--huge-pages", "3MiB"], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and "worker.huge_pages (--huge-pages)" in out.stderr


def test_ssd_size_beyond_the_disk_is_refused(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    out = subprocess.run(
        [*KV, "worker", "--master", "127.0.0.1:1", "--dram-size", "16MiB",
         "--max-value-size", "1MiB", "--ssd-path", str(tmp_path / "ssd"),
         "--ssd-size", str(free * 4)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "worker.ssd_size (--ssd-size)" in out.stderr and "free" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_arena_on_huge_pages_moves_exact_bytes(make_cluster: MakeCluster) -> None:
    """With --huge-pages the arena takes its pages from the kernel's pool (MFD_HUGETLB)
    and gives them back at exit; tcp:// and shm:// move the same bytes. Runs where at
    least 16 free 2 MiB pages are reserved (e.g. `sysctl vm.nr_hugepages=16`)."""
    before = free_huge_pages(2 * MiB)
    if before is None or before < 16:
        pytest.skip("needs 16 free 2 MiB huge pages (sysctl vm.nr_hugepages)")
    c = make_cluster(workers=1, dram_size="32MiB", max_value_size="1MiB",
                     extra_worker_args=["--huge-pages", "2MiB"])  # fmt: skip
    assert free_huge_pages(2 * MiB) == before - 16, "the arena is on huge pages"
    for t in ("tcp", "shm"):
        with Client(c.address, transport=t) as cl:
            ks = [key(i, f"huge{t}") for i in range(8)]
            vals = [value_for(k, 900 << 10) for k in ks]
            assert cl.batch_put("h/x", ks, vals) == [True] * 8
            assert cl.batch_get("h/x", ks) == vals
    c.stop()
    assert free_huge_pages(2 * MiB) == before
