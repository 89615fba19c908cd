"""The engine bench's side-by-side figures (kvstore_bench.engine.paired)."""

from __future__ import annotations

from typing import Any

from kvstore_bench.engine.paired import compute_ms_per_token, paired


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
