"""The engine bench's ``--repeat N``: configurations in turn, reported by their median run."""

from __future__ import annotations

import json
import math

from kvstore_bench.engine.repeat import median_run, repeat_rows, rotations
from kvstore_bench.engine.report import Summary
from kvstore_bench.engine.sweep import Point, sweep_json


def _run(name: str, hit: float, p50: float) -> Summary:
    s = Summary(name, True, requests=10, wall_s=60.0, input_tokens_per_s=1000.0)
    s.token_hit_rate = hit
    s.ttft_ms = {"p50": p50, "p95": 2 * p50, "p99": 3 * p50}
    return s


def test_each_round_starts_at_the_next_configuration() -> None:
    assert rotations(["kvstore", "mooncake", "lmcache"], 4) == [
        ["kvstore", "mooncake", "lmcache"],
        ["mooncake", "lmcache", "kvstore"],
        ["lmcache", "kvstore", "mooncake"],
        ["kvstore", "mooncake", "lmcache"],
    ]
    assert rotations(["prefix"], 2) == [["prefix"], ["prefix"]]
    assert rotations([], 3) == [[], [], []]


def test_the_median_run_is_a_real_run_and_keeps_every_runs_figures() -> None:
    runs = [_run("kvstore", 0.47, 98.0), _run("kvstore", 0.46, 46.0), _run("kvstore", 0.48, 66.0)]
    pick = median_run(runs)
    assert pick is runs[2], "the run whose TTFT p50 is the median"
    assert pick.ttft_ms["p95"] == 132.0, "every column from that run"
    assert pick.median_hit_rate == 0.47
    assert [r["ttft_p50_ms"] for r in pick.repeats] == [98.0, 46.0, 66.0]
    # two runs: the lower middle; one that did not run is listed, not counted
    two = [_run("x", 0.5, 80.0), Summary("x", False, why_not="no"), _run("x", 0.3, 40.0)]
    pick = median_run(two)
    assert pick is two[2] and pick.median_hit_rate == 0.4
    assert [r["ran"] for r in pick.repeats] == [1.0, 0.0, 1.0]
    # nothing ran: the first, with no median
    none = median_run([Summary("m", False, why_not="segment"), Summary("m", False)])
    assert not none.ran and none.median_hit_rate is None


def test_repeat_rows_and_json_give_the_medians_and_ranges() -> None:
    k = median_run([_run("kvstore", 0.47, 98.0), _run("kvstore", 0.46, 46.0)])
    once = median_run([_run("lmcache", 0.39, 161.0)])
    rows = repeat_rows("0.25 (18.75 MiB)", [k, once])
    assert rows == [
        ["0.25 (18.75 MiB)", "kvstore", "2 of 2", "46.5% (46.0%-47.0%)", "72 ms (46 ms-98 ms)"]
    ]
    doc = json.loads(json.dumps(sweep_json([Point(0.25, 1 << 20, [k, once])])))
    kv = doc[0]["configs"]["kvstore"]
    assert math.isclose(kv["median_hit_rate"], 0.465) and len(kv["repeats"]) == 2
    assert kv["ttft_ms"]["p50"] == 46.0
    assert math.isclose(doc[0]["configs"]["lmcache"]["median_hit_rate"], 0.39)
