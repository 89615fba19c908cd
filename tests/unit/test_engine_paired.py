"""The engine bench's side-by-side figures (kvstore_bench.engine.paired)."""

from __future__ import annotations

from typing import Any

from kvstore_bench.engine.paired import by_engine, by_engine_line, compute_ms_per_token, paired


def req(
    script: str, turn: int, cached: int, ttft: float, *, engine: int = 0, start: float = 0.0
) -> dict[str, Any]:
    return {
        "script": script,
        "turn": turn,
        "engine": engine,
        "prompt_tokens": 1000,
        "cached_tokens": cached,
        "start_s": start,
        "ttft_ms": ttft,
        "step_ms": ttft,
    }


def test_later_turns_are_compared_class_by_class() -> None:
    a = [
        req("s", 0, 0, 900.0),  # a first turn: left out
        req("s", 1, 500, 40.0),
        req("s", 2, 0, 200.0),
        req("t", 1, 0, 300.0),
        req("t", 2, 640, 50.0),
        req("u", 1, 0, 10.0),  # not in the other run: left out
    ]
    b = [
        req("s", 0, 0, 800.0),
        req("s", 1, 500, 60.0),
        req("s", 2, 0, 100.0),
        req("t", 1, 320, 70.0),
        req("t", 2, 0, 150.0),
    ]
    got = paired(a, b)
    assert got["hit_both"] == {"count": 1, "first_ttft_p50_ms": 40.0, "second_ttft_p50_ms": 60.0}
    assert got["miss_both"] == {"count": 1, "first_ttft_p50_ms": 200.0, "second_ttft_p50_ms": 100.0}
    assert got["hit_first_only"]["count"] == 1 and got["hit_second_only"]["count"] == 1
    assert got["hit_second_only"]["first_ttft_p50_ms"] == 300.0
    empty = paired(a, [])
    assert all(v == {"count": 0, "first_ttft_p50_ms": None, "second_ttft_p50_ms": None}
               for v in empty.values())  # fmt: skip


def test_compute_speed_counts_every_token_of_the_step() -> None:
    # Two requests whose first tokens came from one 100 ms step on engine 0 (1,000 and
    # 600 tokens computed), one alone on engine 1 (500 tokens in 100 ms), and one that
    # computed too few tokens to count.
    rs = [
        req("a", 1, 0, 100.0, start=1.0),
        req("b", 1, 400, 100.0, start=1.0005),
        req("c", 1, 500, 100.0, engine=1, start=1.0),
        req("d", 1, 900, 5.0, start=5.0),
    ]
    # per request: 100 / 1600, 100 / 1600, 100 / 500 -> p50 (lower middle) 1/16
    assert compute_ms_per_token(rs) == 100.0 / 1600
    assert compute_ms_per_token([rs[3]]) is None


def test_each_engine_gets_its_own_hit_rate_and_ttft() -> None:
    rs = [
        req("s", 0, 0, 900.0, engine=0),
        req("s", 1, 0, 5000.0, engine=1),  # engine 1 misses and queues
        req("s", 2, 800, 30.0, engine=0),
        req("t", 0, 0, 700.0, engine=1),
        req("t", 1, 600, 50.0, engine=0),
        req("t", 2, 0, 9000.0, engine=1),
    ]
    per = by_engine(rs)
    assert list(per) == ["0", "1"]
    assert per["0"] == {
        "requests": 3,
        "token_hit_rate": 1400 / 3000,
        "later_turns": 2,
        "later_turn_hits": 2,
        "ttft_p50_ms": 50.0,
        "ttft_p95_ms": 900.0,
    }
    assert per["1"]["token_hit_rate"] == 0.0
    assert per["1"]["later_turn_hits"] == 0
    assert per["1"]["ttft_p50_ms"] == 5000.0
    assert per["1"]["ttft_p95_ms"] == 9000.0
    line = by_engine_line("mooncake", rs)
    assert line == (
        "mooncake by engine: 0: 47% hits, TTFT p50 50 ms; 1: 0% hits, TTFT p50 5,000 ms"
    )
    assert by_engine_line("x", [r for r in rs if r["engine"] == 0]) is None
    assert by_engine([]) == {}
