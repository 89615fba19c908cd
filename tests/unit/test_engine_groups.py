"""Many traces in groups (issue 46): `--trace-group I/N` and `engine-groups`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvstore_bench.engine.groups import (
    aggregate,
    engine_groups_cmd,
    group_rows,
    parse_group,
    pick_group,
)


def test_n_groups_cover_every_trace_once() -> None:
    traces = [f"t{i}" for i in range(10)]
    groups = [pick_group(traces, (i, 3)) for i in range(3)]
    assert sorted(t for g in groups for t in g) == sorted(traces)
    assert groups[1] == ["t1", "t4", "t7"]
    assert parse_group("2/4") == (2, 4)
    for bad in ("4/4", "x", "1/0", "-1/2"):
        with pytest.raises(ValueError):
            parse_group(bad)


def _doc(kv_hit: float, ttft: float, lm: dict[str, object]) -> dict[str, object]:
    kv = {
        "ran": True,
        "status": "ok",
        "token_hit_rate": kv_hit,
        "own_cache_hit_rate": 0.1,
        "store_hit_rate": kv_hit - 0.1,
        "ttft_ms": {"p50": ttft},
        "input_tokens_per_s": 1000.0,
    }
    point = {"fraction": 0.25, "memory_bytes": 1, "configs": {"kvstore": kv, "lmcache": lm}}
    return {"meta": {}, "sweep": [point]}


def test_mean_and_spread_over_groups_and_a_failed_group_is_not_averaged(tmp_path: Path) -> None:
    ok_lm = {"ran": True, "status": "ok", "token_hit_rate": 0.3, "ttft_ms": {"p50": 90.0}}
    bad_lm = {"ran": False, "status": "failed", "failure": "did not run: x"}
    docs = [_doc(0.4, 20.0, ok_lm), _doc(0.6, 40.0, bad_lm)]
    agg = aggregate(docs)
    kv = agg["0.25"]["kvstore"]["token_hit_rate"]
    assert kv.mean == pytest.approx(0.5) and kv.stdev == pytest.approx(0.1414, abs=1e-3)
    lm = agg["0.25"]["lmcache"]["token_hit_rate"]
    assert lm.values == [0.3] and lm.failed == 1
    rows = {r[1]: r for r in group_rows(agg)}
    assert rows["kvstore"][2] == "2" and rows["kvstore"][3] == "50.0% sd 14.1 (40.0-60.0%)"
    assert rows["lmcache"][2] == "1 (1 FAILED)"
    paths = []
    for i, d in enumerate(docs):
        paths.append(tmp_path / f"g{i}.json")
        paths[-1].write_text(json.dumps(d))
    out = tmp_path / "groups.json"
    r = CliRunner().invoke(engine_groups_cmd, [*map(str, paths), "--json", str(out)])
    assert r.exit_code == 1  # a group's lmcache run failed
    doc = json.loads(out.read_text())
    assert doc["points"]["0.25"]["kvstore"]["ttft_ms.p50"]["mean"] == pytest.approx(30.0)
