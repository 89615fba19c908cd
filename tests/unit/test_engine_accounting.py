"""The engine bench's accounting (issue 46): what the engines' own caches served apart
from what the store served, the store's share against LRU and Belady stores of the
same memory, and how busy the engines were."""

from __future__ import annotations

import pytest

from kvstore_bench.engine.memory import reference_hit_rates
from kvstore_bench.engine.report import busy_share, summarize, table_rows, to_json
from kvstore_bench.engine.run import ConfigRun, Result
from kvstore_bench.engine.workload import Script, Timed, Turn

B = 32


def _run() -> tuple[ConfigRun, list[Script]]:
    p = tuple(range(3, 3 + 4 * B + 1))
    turns = (Turn("s", 0, p, 1, 0.0, 0), Turn("s", 1, p, 1, 0.0, 1))
    scripts = [Script("s", 0.0, turns)]
    a = Result("s", 0, 0, len(p), 0, 0.01, 0.02, 0.0, 1.0, [5], [-1.0],
               local_cached_tokens=0, external_cached_tokens=0)  # fmt: skip
    b = Result("s", 1, 1, len(p), 4 * B, 0.01, 0.02, 2.0, 3.0, [5], [-1.0],
               local_cached_tokens=B, external_cached_tokens=3 * B)  # fmt: skip
    return ConfigRun("kvstore", True, results=[a, b], wall_s=4.0), scripts


def test_own_cache_and_store_tokens_are_counted_apart() -> None:
    run, scripts = _run()
    s = summarize(run, scripts, B)
    total = 2 * (4 * B + 1)
    assert s.own_cache_tokens == B and s.store_tokens == 3 * B
    assert s.own_cache_hit_rate == pytest.approx(B / total)
    assert s.store_hit_rate == pytest.approx(3 * B / total)
    assert s.token_hit_rate == pytest.approx(4 * B / total)  # the sum, as before
    doc = to_json([s], {})["configs"]["kvstore"]
    assert doc["store_hit_rate"] == s.store_hit_rate
    assert doc["per_request"][1]["store_tokens"] == 3 * B
    assert table_rows([s])[0][11] == "12.4% / 37.2%"


def test_unknown_sources_are_not_guessed() -> None:
    run, scripts = _run()
    run.results[0].local_cached_tokens = -1  # an engine that did not say
    s = summarize(run, scripts, B)
    assert s.own_cache_hit_rate is None and s.store_hit_rate is None
    assert table_rows([s])[0][11] == "-"


def test_the_references_say_what_a_store_adds_beyond_the_engines_own_caches() -> None:
    p = tuple(range(3, 3 + 4 * B + 1))
    reqs = [Timed(p, 0, 0.0, 1.0), Timed(p, 1, 2.0, 3.0), Timed(p, 0, 4.0, 5.0)]
    refs = reference_hit_rates(reqs, B, 100)
    assert refs.lru_hits == refs.opt_hits == (0, 4 * B, 4 * B)
    total = 3 * len(p)
    # the third request's engine had the whole prefix itself: the store adds nothing
    lru, opt = refs.beyond([0, 0, 4 * B], total)
    assert lru == opt == pytest.approx(4 * B / total)
    # with two blocks of room, LRU keeps the chain's tail (no prefix hit), Belady a head
    two = reference_hit_rates(reqs, B, 2)
    assert two.lru_hits == (0, 0, 0) and two.opt_hits[1] > 0


def test_busy_share_is_the_union_of_each_engines_requests_over_the_wall_time() -> None:
    spans = [(0, 0.0, 2.0), (0, 1.0, 3.0), (0, 5.0, 6.0), (1, 0.0, 10.0)]
    assert busy_share(spans, 10.0) == pytest.approx((0.4 + 1.0) / 2)
    assert busy_share([], 10.0) is None
