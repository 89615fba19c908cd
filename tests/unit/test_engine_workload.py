"""The engine bench's workload builder and ideal-hit accounting (pure, no engines)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore_bench.engine.report import percentiles
from kvstore_bench.engine.run import load_failures
from kvstore_bench.engine.workload import (
    Timed,
    WorkloadShape,
    block_tokens_of,
    build_scripts,
    cacheable,
    ideal_hits,
)
from kvstore_bench.traces import Request, Session


def _session(sid: str, turns: list[tuple[list[int], int]], start: float = 0.0) -> Session:
    reqs = tuple(
        Request(
            session=sid,
            t=start + 10.0 * k,
            input_tokens=len(ids) * 64 + tail,
            output_tokens=200,
            block_ids=tuple(ids),
            block_tokens=64,
            model="m",
            think_time=5.0 if k else 0.0,
        )
        for k, (ids, tail) in enumerate(turns)
    )
    return Session(id=sid, start=start, requests=reqs)


SHAPE = WorkloadShape(token_scale=0.5, time_scale=10.0, max_output=16, max_len=4096, engines=2)


def test_shared_ids_give_shared_tokens_and_turns_alternate_engines() -> None:
    s = _session("a", [([1, 2], 10), ([1, 2, 3], 0), ([1, 2, 3, 4], 5)])
    (script,) = build_scripts([s], SHAPE)
    t0, t1, t2 = script.turns
    assert t0.prompt[:64] == t1.prompt[:64] == t2.prompt[:64]  # blocks 1, 2 -> 32 tokens each
    assert t1.prompt[:96] == t2.prompt[:96]
    assert t0.prompt[64:] != t1.prompt[64:69]  # a tail is unique to its request
    assert len(t0.prompt) == 64 + 5 and len(t1.prompt) == 96 and len(t2.prompt) == 128 + 2
    assert [t.engine for t in script.turns] == [0, 1, 0]
    assert t0.pause_s == 0.0 and t1.pause_s == 0.5
    assert all(t.max_tokens == 16 for t in script.turns)  # 200 * 0.5 capped
    assert block_tokens_of(7, 32, 1000) == block_tokens_of(7, 32, 1000)
    assert min(min(t.prompt) for t in script.turns) >= 3


def test_sessions_stop_at_the_first_turn_that_does_not_fit() -> None:
    s = _session("a", [([1], 0), (list(range(1, 300)), 0), ([1], 0)])
    (script,) = build_scripts([s], SHAPE)
    assert [t.index for t in script.turns] == [0]
    assert build_scripts([s], WorkloadShape(max_turns=1, token_scale=0.5))[0].turns[0].index == 0


def test_ideal_hits_count_only_requests_finished_before_the_start() -> None:
    a = tuple(range(3, 3 + 100))
    b = a[:64] + tuple(range(500, 540))
    reqs = [
        Timed(a, engine=0, start=0.0, end=1.0),
        Timed(b, engine=1, start=2.0, end=3.0),  # shares 64 tokens with a, on another engine
        Timed(b, engine=1, start=2.5, end=3.5),  # started before b finished: only a counts
        Timed(b, engine=1, start=4.0, end=5.0),
    ]
    shared, own = ideal_hits(reqs, 32)
    assert shared == [0, 64, 64, 96]  # never the last token: (104 - 1) // 32 * 32 = 96
    assert own == [0, 0, 0, 96]
    assert cacheable(64, 32) == 32 and cacheable(65, 32) == 64


def test_percentiles_nearest_rank() -> None:
    p = percentiles([float(x) for x in range(1, 101)] + [float("nan")])
    assert p == {"p50": 50.0, "p95": 95.0, "p99": 99.0}
    assert percentiles([]) == {}


def test_missing_engine_venv_is_a_clear_error(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from kvstore_bench.engine.cli import engine_cmd

    res = CliRunner().invoke(engine_cmd, ["--engine-python", str(tmp_path / "nope" / "python")])
    assert res.exit_code != 0
    assert "make e2e" in res.output


def test_ablations_without_a_connector_knob_say_so(tmp_path: Path) -> None:
    from kvstore_bench.engine.peers import ABLATIONS, Context, NotRunnable, make_backing

    ctx = Context(Path("python"), tmp_path, 64 << 20, 32)
    for name, (extra, _why) in ABLATIONS.items():
        if extra is None:
            with pytest.raises(NotRunnable, match="no connector knob"):
                make_backing(name, ctx)
    with pytest.raises(NotRunnable, match="prefix run"):
        make_backing("kvstore-load-or-recompute", ctx)  # needs the prefix run's speed
    with pytest.raises(ValueError):
        make_backing("nosuch", ctx)


def test_lfm2_preset_counts_hits_in_the_hybrids_128_token_blocks() -> None:
    from kvstore_bench.engine.models import (
        block_size,
        engine_block_size,
        model_config,
        preset_unavailable,
    )
    from tests.e2e.tiny_model import lfm2_config

    assert preset_unavailable("lfm2") is None
    assert block_size("lfm2") == 128  # vLLM's resolved attention block for the tiny LFM2
    assert engine_block_size("lfm2") is None  # vLLM sizes a hybrid's blocks itself
    assert block_size("tiny") == engine_block_size("tiny") == 32
    assert model_config("lfm2") == lfm2_config()  # the e2e test's model, no torch needed
    # A 300-token prefix shared across engines: 2 whole 128-token blocks for the hybrid
    # (9 of 32 tokens for the Llama presets); never the prompt's last token.
    a = tuple(range(3, 303))
    b = a + tuple(range(400, 450))
    reqs = [Timed(a, 0, 0.0, 1.0), Timed(b, 1, 2.0, 3.0), Timed(a[:257], 1, 4.0, 5.0)]
    assert ideal_hits(reqs, block_size("lfm2"))[0] == [0, 256, 256]
    assert ideal_hits(reqs, block_size("tiny"))[0] == [0, 288, 256]
    assert cacheable(256, 128) == 128 and cacheable(257, 128) == 256


def test_unknown_model_preset_is_refused_before_anything_starts(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from kvstore_bench.engine.cli import engine_cmd

    res = CliRunner().invoke(engine_cmd, ["--model", "nosuch", "--engine-python", "x"])
    assert res.exit_code != 0 and "unknown model preset" in res.output


def test_outputs_that_differ_from_prefix_are_listed_with_their_cache_hits() -> None:
    from kvstore_bench.engine.report import summarize
    from kvstore_bench.engine.run import ConfigRun, Result
    from kvstore_bench.engine.workload import Script, Turn

    prompt = tuple(range(3, 303))
    scripts = [Script("s", 0.0, (Turn("s", 0, prompt, 4, 0.0, 0), Turn("s", 1, prompt, 4, 0.0, 1)))]

    def res(turn: int, cached: int, tokens: list[int], lp: float) -> Result:
        return Result("s", turn, turn, 300, cached, 0.1, 0.2, turn, turn + 0.5, tokens, [lp])

    ref = ConfigRun("prefix", True, results=[res(0, 0, [5, 6], -1.0), res(1, 0, [5, 6], -1.0)])
    run = ConfigRun("kvstore", True, results=[res(0, 0, [5, 6], -1.0), res(1, 256, [5, 7], -1.2)])
    s = summarize(run, scripts, 128, ref)
    assert s.equal_outputs == 0.5 and s.first_logprob_within_tol == 0.5
    (m,) = s.mismatches
    assert (m["turn"], m["cached_tokens"], m["prefix_cached_tokens"]) == (1, 256, 0)
    assert m["first_differing_token"] == 1 and abs(m["first_logprob_diff"] - 0.2) < 1e-9
    # every request is listed, so that one request can be compared across configurations
    assert [(r["turn"], r["cached_tokens"], r["ttft_ms"]) for r in s.per_request] == [
        (0, 0, 100.0),
        (1, 256, 100.0),
    ]
    assert s.per_request[1]["ideal_tokens"] == 256  # the whole prompt but its last block
    assert set(s.per_request[1]) >= {"script", "engine", "prompt_tokens", "start_s", "steps"}


def test_pauses_are_scaled_then_capped_and_the_last_turn_ends_the_session() -> None:
    import dataclasses

    s = _session("s", [([1, 2], 0), ([1, 2, 3], 5), ([1, 2, 3, 4], 5)])
    reqs = list(s.requests)
    reqs[2] = dataclasses.replace(reqs[2], think_time=77_589.0)  # an overnight gap
    s = dataclasses.replace(s, requests=tuple(reqs))
    [plain] = build_scripts([s], SHAPE)
    assert [t.pause_s for t in plain.turns] == [0.0, 0.5, 7758.9]
    [capped] = build_scripts([s], dataclasses.replace(SHAPE, max_pause_s=10.0))
    assert [t.pause_s for t in capped.turns] == [0.0, 0.5, 10.0]
    assert [t.session_state for t in capped.turns] == ["paused", "paused", "ended"]


def test_load_failures_are_read_from_vllm_logs() -> None:
    line = (
        "(MainProcess pid=1) WARNING 12-03 00:46:19 [scheduler.py:3426] Recovered from KV "
        "load failure: {} request(s) rescheduled ({} tokens affected).\n"
    )
    logs = [line.format(1, 256) + "noise\n" + line.format(2, 96), "", line.format(1, 32)]
    assert load_failures(logs) == (4, 384)
    assert load_failures(["nothing to see\n"]) == (0, 0)
