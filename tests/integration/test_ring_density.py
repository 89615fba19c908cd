"""The hash ring's density is a master setting (``--vnodes-per-gib``), published in
the shard map: small workers sit at the floor of 160 ring points, where two equal
workers' shares spread by several points (55/45 in a measured engine run: one
worker evicts while the other has room); with more points their shares even out."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from kvstore.cluster import LocalCluster
from kvstore_client import Client
from kvstore_client.sharding import vnode_count
from tests.conftest import MakeCluster
from tests.helpers import key

KV = [sys.executable, "-m", "kvstore"]


def _shares(c: LocalCluster, n: int = 40_000) -> tuple[list[float], int]:
    """The workers' shares of ``n`` keys (ascending) and each one's ring points."""
    with Client(c.address) as cl:
        view, groups = cl._d.groups([key(i, "ring") for i in range(n)])
        points = np.bincount(view.ring.owners[:, 0])
        assert len(set(points.tolist())) == 1, "equal workers, equal points"
        return sorted(len(idx) / n for _, idx in groups), int(points[0])


def test_a_denser_ring_evens_out_small_workers(make_cluster: MakeCluster) -> None:
    dense = make_cluster(workers=2, dram_size="16MiB",
                         extra_master_args=["--vnodes-per-gib", "262144"])  # fmt: skip
    shares, points = _shares(dense)
    assert points == vnode_count(16 << 20, 262144) == 4096
    assert shares[0] > 0.475 and shares[1] < 0.525, shares
    plain = make_cluster(workers=2, dram_size="16MiB")
    assert _shares(plain)[1] == 160, "the default: the floor"


def test_a_bad_density_is_a_setting_error() -> None:
    for bad in ("0", "2000000", "many"):
        out = subprocess.run([*KV, "master", "--port", "0", "--vnodes-per-gib", bad],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert out.returncode == 2, out.stderr
        assert "vnodes" in out.stderr
