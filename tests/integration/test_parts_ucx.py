"""Multi-part values over ucx:// against real workers (`kvstore worker --ucx-port 0`):
each part travels as its own UCX message into its own buffer (FLAG_PARTS frames), and
the stored value is the same as a whole write's, readable over tcp://."""

from __future__ import annotations

import pytest

from kvstore_client import Client, InvalidArgument
from kvstore_client.transport import ucx
from tests.conftest import MakeCluster
from tests.helpers import key, value_for
from tests.integration.test_parts import empty_like, split

if not ucx.available():
    pytest.skip("ucxx is not importable: pip install 'kvstore-cache[ucx]'", allow_module_level=True)

NS = "m/bf16/b16/tp0of1"


def test_parts_over_ucx(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(
        workers=2, dram_size="64MiB", max_value_size="1MiB", extra_worker_args=["--ucx-port", "0"]
    )
    size = 48 * 1024 + 3
    keys = [key(i, "uparts") for i in range(16)]
    vals = [value_for(k, size) for k in keys]
    with Client(cluster.address, transport="ucx") as c:
        assert all(w.ucx is not None for w in c._view.workers)  # type: ignore[union-attr]
        assert c.batch_put_parts(NS, keys[:8], [split(v, 7) for v in vals[:8]]) == [True] * 8
        assert c.batch_put(NS, keys[8:], vals[8:]) == [True] * 8
        assert c.batch_get(NS, keys[:8]) == vals[:8], "written in parts, read whole"
        dest = [empty_like(split(v, 80)) for v in vals]
        short = [memoryview(bytearray(7)), memoryview(bytearray(size))]
        fut = c.batch_get_into_parts(
            NS, [*keys, key(0, "absent"), keys[1]], [*dest, [memoryview(bytearray(size))], short]
        )
        assert fut.result() == [True] * 16 + [False, False]
        assert [b"".join(bytes(p) for p in d) for d in dest] == vals
        with pytest.raises(InvalidArgument):
            c.batch_put_parts(NS, keys[:2], [[b"x"], []])
    with Client(cluster.address, transport="tcp") as c:
        assert c.batch_get(NS, keys) == vals, "tcp:// sees the blocks written in parts"
