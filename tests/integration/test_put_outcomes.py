"""Put outcomes (issue 44): ``Client.put_outcomes`` says per block what a put did:
stored now, already present, refused and why (over quota here), or its owner
unreachable; ``batch_put`` keeps its booleans and raises for a full quota; the
connectors' store write (``StoreConnector.write``) asks ``batch_exists`` only for what
the put neither stored nor found present."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.cluster import LocalCluster
from kvstore_client import Client
from kvstore_client.connectors.base import StoreConnector
from kvstore_client.errors import QuotaExceeded
from kvstore_client.outcomes import PutOutcome
from tests.conftest import MakeCluster
from tests.helpers import key, value_for

NS = "t/outcomes"


def test_outcomes_say_stored_present_and_unreachable(make_cluster: MakeCluster) -> None:
    c = make_cluster(workers=2, dram_size="32MiB")
    keys = [key(i, "outcome") for i in range(16)]
    vals = [value_for(k, 4096) for k in keys]
    with Client(c.address, transport="tcp") as cl:
        assert cl.put_outcomes(NS, keys[:8], vals[:8]) == [PutOutcome.STORED] * 8
        got = cl.put_outcomes(NS, keys, [[v[:100], v[100:]] for v in vals], parts=True)
        assert got == [PutOutcome.PRESENT] * 8 + [PutOutcome.STORED] * 8
        assert all(o.in_store and not o.refused for o in got)
        # the booleans of batch_put are the outcomes' STORED
        assert cl.batch_put(NS, keys, vals) == [False] * 16
        c.worker_procs[0].kill()
        more = [key(i, "after-kill") for i in range(32)]
        out = cl.put_outcomes(NS, more, [value_for(k, 512) for k in more])
        assert set(out) == {PutOutcome.STORED, PutOutcome.UNREACHABLE}
        assert cl.batch_exists(NS, [k for k, o in zip(more, out, strict=True)
                                    if o is PutOutcome.UNREACHABLE]) == [False] * out.count(
            PutOutcome.UNREACHABLE)  # fmt: skip


def test_over_quota_is_an_outcome_and_batch_put_still_raises(
    make_cluster: MakeCluster, tmp_path: Path
) -> None:
    c = _tenants(make_cluster, tmp_path, "64KiB")
    keys = [key(i, "empty") for i in range(4096)]
    with Client(c.address, token="tok-a") as a:
        out = a.put_outcomes("a", keys, [b""] * len(keys))
        assert PutOutcome.QUOTA in out and PutOutcome.STORED in out
        assert all(o.refused for o in out if o is PutOutcome.QUOTA)
        assert "quota" in PutOutcome.QUOTA.why
        assert sum(a.batch_exists("a", keys)) == out.count(PutOutcome.STORED)
        more = [key(i, "more") for i in range(4096)]
        with pytest.raises(QuotaExceeded):
            a.batch_put("a", more, [b""] * len(more))
        with pytest.raises(QuotaExceeded):  # the connectors' write raises it too
            StoreConnector.write(a, "a", more, [b""] * len(more), False)


def test_the_connector_write_counts_present_blocks_as_held(make_cluster: MakeCluster) -> None:
    c = make_cluster(workers=1, dram_size="32MiB")
    keys = [key(i, "conn") for i in range(6)]
    vals = [value_for(k, 1024) for k in keys]
    with Client(c.address) as cl:
        assert cl.batch_put(NS, keys[:3], vals[:3]) == [True] * 3
        w = StoreConnector.write(cl, NS, keys, vals, False)
        assert w.held == [True] * 6
        assert w.stored == [False] * 3 + [True] * 3
        assert w.present == 3


def _tenants(make_cluster: MakeCluster, tmp_path: Path, quota: str) -> LocalCluster:
    f = tmp_path / "tenants.yaml"
    f.write_text(
        "tenants:\n"
        f"  - {{name: a, token: tok-a, namespaces: [a], quota: {quota}}}\n"
        "  - {name: ops, token: tok-ops, admin: true}\n"
    )
    return make_cluster(
        workers=1,
        dram_size="32MiB",
        max_value_size="1MiB",
        extra_worker_args=["--tenants-file", str(f), "--token", "tok-ops"],
    )
