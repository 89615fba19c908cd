"""The engine bench's engines: each its own scratch, the KV cache the bench asked for,
and a run that failed reported as failed (issue 46).

The engines here are stand-ins (a small Python program speaking the engine protocol of
:mod:`kvstore_bench.engine.proc`), not vLLM: vLLM's CPU engine takes minutes to start on
this machine; `tests/e2e/test_bench_engine.py` runs the real ones. The stand-in does the
two things of vLLM that matter here, as vLLM 0.32 does them: it sizes its KV cache from
VLLM_CPU_KVCACHE_SPACE (GiB) when that is set, else from the ``kv_cache_bytes`` it was
given (vllm/platforms/cpu.py), and, like the Mooncake store connector, it takes the IPC
path ``<VLLM_RPC_BASE_PATH or the temp dir>/lookup_rpc_port_0_host_<host>_dp_rank0``
and fails when another engine holds it.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

import click
import pytest

from kvstore_bench.engine.peers import CACHE_SIZE_ENV, Backing, Context, engine_env
from kvstore_bench.engine.report import failed, summarize, table_rows, to_json
from kvstore_bench.engine.run import EngineError, EngineSpec, check_kv_blocks, run_config
from kvstore_bench.engine.workload import Script, WorkloadShape, build_scripts
from kvstore_bench.traces import Request, Session

BLOCK = 32
BLOCK_BYTES = 64 << 10

FAKE_ENGINE = r"""
import json, os, sys, tempfile
cfg = json.loads(sys.argv[-1])
base = os.environ.get("VLLM_RPC_BASE_PATH") or tempfile.gettempdir()
ipc = os.path.join(base, "lookup_rpc_port_0_host_test_dp_rank0")
if os.path.exists(ipc):  # another engine's socket: the collision of issue 46
    sys.exit(f"FileNotFoundError: {ipc} is another engine's")
open(ipc, "w").close()
space = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
kv_bytes = int(space) << 30 if space else int(cfg["kv_cache_bytes"])
blocks = kv_bytes // BLOCK_BYTES
ready = {"event": "ready", "block_size": cfg["block_size"], "kv_blocks": blocks,
         "kv_cache_bytes": kv_bytes, "tmpdir": os.environ.get("TMPDIR"),
         "port": os.environ.get("VLLM_PORT")}
print(json.dumps(ready), flush=True)
print(json.dumps(ready), file=sys.stderr, flush=True)
try:
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("op") == "exit":
            break
        n = len(msg["prompt"])
        print(json.dumps({"event": "done", "id": msg["id"], "tokens": [5] * msg["max_tokens"],
                          "logprobs": [-1.0] * msg["max_tokens"], "num_cached_tokens": 0,
                          "local_cached_tokens": 0, "external_cached_tokens": 0,
                          "ttft_s": 0.001, "e2e_s": 0.002, "steps": 1, "wait_s": 0.0,
                          "step_s": 0.001}), flush=True)
finally:
    os.unlink(ipc)
""".replace("BLOCK_BYTES", str(BLOCK_BYTES))


def _fake_python(tmp_path: Path) -> Path:
    exe = tmp_path / "fake-engine-python"
    exe.write_text(f"#!{sys.executable}\n{FAKE_ENGINE}")
    exe.chmod(0o755)
    return exe


def _scripts() -> list[Script]:
    def reqs(sid: str) -> tuple[Request, ...]:
        return tuple(
            Request(sid, float(k), 200, 4, (1, 2), 64, "m", think_time=0.0) for k in range(2)
        )

    sessions = [Session(id=f"s{i}", start=0.0, requests=reqs(f"s{i}")) for i in range(2)]
    return build_scripts(sessions, WorkloadShape(token_scale=0.5, max_output=2, engines=2))


def _spec(py: Path, kv_bytes: int = 4 << 20) -> EngineSpec:
    return EngineSpec(
        python=py,
        model="stand-in",
        block_size=BLOCK,
        expect_block_size=BLOCK,
        kv_cache_bytes=kv_bytes,
        block_bytes=BLOCK_BYTES,
        start_timeout_s=60,
        request_timeout_s=60,
    )


def test_an_inherited_vllm_cpu_kvcache_space_does_not_reach_the_engines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With VLLM_CPU_KVCACHE_SPACE=1 in the bench's environment, vLLM's CPU build gave
    each engine 1 GiB whatever the bench asked for; the engines get what the bench says,
    and the run reports what each allocated."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    env = engine_env(Backing("prefix"), [])
    assert not set(CACHE_SIZE_ENV) & set(env)
    py = _fake_python(tmp_path)
    ctx = Context(py, tmp_path, 1 << 20, BLOCK)
    run = run_config("prefix", ctx, _spec(py), _scripts(), engines=2)
    assert run.ran, run.why_not
    want = (4 << 20) // BLOCK_BYTES
    assert run.engine_kv_blocks == [want, want]
    assert run.engine_kv_tokens == [want * BLOCK, want * BLOCK]
    s = summarize(run, _scripts(), BLOCK)
    doc = to_json([s], {})["configs"]["prefix"]
    assert doc["engine_kv_blocks"] == [want, want] and doc["status"] == "ok"


def test_an_engine_whose_cache_is_not_what_the_bench_asked_for_fails_the_run() -> None:
    spec = _spec(Path("/nonexistent"), kv_bytes=4 << 20)
    check_kv_blocks("0", spec, 64)  # exactly what was asked
    with pytest.raises(EngineError, match="VLLM_CPU_KVCACHE_SPACE"):
        check_kv_blocks("0", spec, (1 << 30) // BLOCK_BYTES)


def test_each_engine_gets_its_own_scratch_ipc_path_and_port(tmp_path: Path) -> None:
    """Two engines on one host must not share the Mooncake connector's IPC path (one
    unlinked the other's: FileNotFoundError, and Mooncake's row was missing)."""
    py = _fake_python(tmp_path)
    ctx = Context(py, tmp_path, 1 << 20, BLOCK)
    run = run_config("prefix", ctx, _spec(py), _scripts(), engines=2)
    assert run.ran, run.why_not
    ready = [
        json.loads((tmp_path / "prefix" / f"engine-{i}.log").read_text().splitlines()[0])
        for i in range(2)
    ]
    assert ready[0]["tmpdir"] != ready[1]["tmpdir"]
    assert ready[0]["port"] != ready[1]["port"]
    assert all(not os.path.exists(r["tmpdir"]) for r in ready)  # removed after the run


def test_a_peer_whose_engines_fail_is_a_failed_run_and_fails_the_bench(tmp_path: Path) -> None:
    """An engine that does not start: a failed run in the table and the JSON, and the
    bench exits non-zero, never a row of numbers."""
    py = tmp_path / "broken-python"
    py.write_text(f"#!{sys.executable}\nimport sys\nsys.exit('RuntimeError: no engine')\n")
    py.chmod(0o755)
    ctx = Context(py, tmp_path, 1 << 20, BLOCK)
    run = run_config("prefix", ctx, _spec(py), _scripts(), engines=2)
    assert not run.ran and "no engine" in run.why_not
    s = summarize(run, _scripts(), BLOCK)
    assert "no engine" in failed(s)
    assert table_rows([s])[0][1].startswith("FAILED: did not run")
    doc = to_json([s], {})["configs"]["prefix"]
    assert doc["status"] == "failed" and "no engine" in doc["failure"]

    from kvstore.console import make_console
    from kvstore_bench.engine.cli import _fail_loudly

    with pytest.raises(click.exceptions.Exit) as e:
        _fail_loudly(make_console(stderr=True), [s])
    assert e.value.exit_code == 1


def test_requests_that_failed_make_a_failed_run() -> None:
    from kvstore_bench.engine.run import ConfigRun, Result

    scripts = _scripts()
    t = scripts[0].turns[0]
    ok = Result(t.script, 0, 0, len(t.prompt), 0, 0.01, 0.02, 0.0, 0.02, [5], [-1.0])
    bad = Result(t.script, 1, 1, len(t.prompt), 0, float("nan"), float("nan"), 0.1, 0.2, [], [])
    bad.error = "engine 1 exited with 1"
    s = summarize(ConfigRun("mooncake", True, results=[ok, bad], wall_s=1.0), scripts, BLOCK)
    assert failed(s) == "1 of 2 requests failed"
    assert table_rows([s])[0][1] == "FAILED: 1 of 2 requests failed"


def test_saturated_sessions_start_when_there_is_room_not_on_the_trace_clock(
    tmp_path: Path,
) -> None:
    """Four sessions 20 s apart on the trace's clock run back to back with
    ``--saturate`` (two busy at once), every turn once, in order within a session."""

    def reqs(sid: str) -> tuple[Request, ...]:
        return tuple(Request(sid, float(k), 200, 4, (1, 2), 64, "m") for k in range(3))

    sessions = [Session(id=f"s{i}", start=1000.0 * i, requests=reqs(f"s{i}")) for i in range(4)]
    scripts = build_scripts(sessions, WorkloadShape(token_scale=0.5, max_output=2, engines=2))
    py = _fake_python(tmp_path)
    ctx = Context(py, tmp_path, 1 << 20, BLOCK, saturate=2)
    run = run_config("prefix", ctx, _spec(py), scripts, engines=2)
    assert run.ran, run.why_not
    assert len(run.results) == 12 and not [r for r in run.results if r.error]
    assert run.wall_s < 15.0  # not 60 s of trace clock
    for sid in ("s0", "s1", "s2", "s3"):
        mine = [r for r in run.results if r.script == sid]
        assert [r.turn for r in sorted(mine, key=lambda r: r.start)] == [0, 1, 2]
    s = summarize(run, scripts, BLOCK)
    assert s.engine_busy_share is not None and 0 < s.engine_busy_share <= 1.0


def test_saturated_pauses_skip_the_time_no_engine_has_work(tmp_path: Path) -> None:
    """Two sessions whose turns are 10 s apart on the trace's clock: saturated, the
    pauses keep their order within each session, but the engines do not wait them out."""

    def reqs(sid: str) -> tuple[Request, ...]:
        return tuple(
            Request(sid, 500.0 * k, 200, 4, (1, 2), 64, "m", think_time=500.0 if k else 0.0)
            for k in range(3)
        )

    sessions = [Session(id=f"s{i}", start=0.0, requests=reqs(f"s{i}")) for i in range(2)]
    shape = WorkloadShape(token_scale=0.5, time_scale=50.0, max_output=2, engines=2)
    scripts = build_scripts(sessions, shape)
    assert all(t.pause_s == 10.0 for s in scripts for t in s.turns[1:])
    py = _fake_python(tmp_path)
    ctx = Context(py, tmp_path, 1 << 20, BLOCK, saturate=4)
    run = run_config("prefix", ctx, _spec(py), scripts, engines=2)
    assert run.ran, run.why_not
    assert len(run.results) == 6 and not [r for r in run.results if r.error]
    assert run.wall_s < 8.0  # not the 20 s of pauses
    for sid in ("s0", "s1"):
        mine = sorted((r for r in run.results if r.script == sid), key=lambda r: r.turn)
        assert all(b.start >= a.end for a, b in itertools.pairwise(mine))
