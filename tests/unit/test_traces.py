"""Trace loaders and chained block hashes (kvstore_bench.traces)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import xxhash

from kvstore_bench.traces import (
    IdSpace,
    Request,
    Session,
    TraceFormatError,
    block_hashes,
    iter_requests,
    load_agentic,
    load_mooncake,
)


def _traces_dir() -> Path | None:
    here = Path(__file__).resolve().parents[2]
    env = os.environ.get("KVSTORE_TRACES")
    for cand in (env, here / "shared" / "traces", here.parent / "shared" / "traces"):
        if cand and (Path(cand) / "agentic").is_dir():
            return Path(cand)
    return None


TRACES = _traces_dir()
needs_traces = pytest.mark.skipif(TRACES is None, reason="shared/traces not found")


def _req(t: float, ids: Any, tin: int | None = None, **kw: Any) -> dict[str, Any]:
    r: dict[str, Any] = {
        "t": t,
        "type": "n",
        "model": "m1",
        "in": tin if tin is not None else 64 * len(ids) + 10,
        "out": 5,
        "hash_ids": ids,
        "think_time": 1.0,
    }
    r.update(kw)
    return r


def _doc(requests: Any, **kw: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "id": "conv",
        "models": ["m1"],
        "block_size": 64,
        "hash_id_scope": "local",
        "tool_tokens": 100,
        "system_tokens": 20,
        "requests": requests,
    }
    d.update(kw)
    return d


def _write(tmp: Path, name: str, doc: object) -> Path:
    p = tmp / name
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return p


def _all(sessions: list[Session]) -> list[Request]:
    return list(iter_requests(sessions))


# ----------------------------------------------------------------------- agentic


def test_local_ids_are_namespaced_per_file(tmp_path: Path) -> None:
    doc = _doc([_req(0, [1, 2, 3]), _req(5, [1, 2, 3, 4])])
    a = _write(tmp_path, "a.json", doc)
    b = _write(tmp_path, "b.json", {**doc, "id": "other"})
    sa, sb = load_agentic([a, b])
    assert sa.id == "conv" and sb.id == "other"
    ra, rb = sa.requests, sb.requests
    assert ra[1].block_ids[:3] == ra[0].block_ids  # same file: equal ids stay equal
    assert not set(ra[1].block_ids) & set(rb[1].block_ids)  # other file: disjoint
    assert ra[0].block_tokens == 64 and ra[0].session == "conv"


def test_same_file_twice_gets_two_sessions_and_id_spaces(tmp_path: Path) -> None:
    p = _write(tmp_path, "a.json", _doc([_req(0, [1, 2])]))
    s1, s2 = load_agentic([p, p])
    assert (s1.id, s2.id) == ("conv", "conv#1")
    assert not set(s1.requests[0].block_ids) & set(s2.requests[0].block_ids)


def test_ids_are_namespaced_per_model(tmp_path: Path) -> None:
    doc = _doc([_req(0, [1, 2]), _req(1, [1, 2], model="m2")], models=["m1", "m2"])
    (s,) = load_agentic(_write(tmp_path, "a.json", doc))
    r1, r2 = s.requests
    assert (r1.model, r2.model) == ("m1", "m2")
    assert not set(r1.block_ids) & set(r2.block_ids)


def test_global_scope_is_shared_by_space(tmp_path: Path) -> None:
    g = {"hash_id_scope": "global", "hash_id_space": "x"}
    a = _write(tmp_path, "a.json", _doc([_req(0, [1, 2, 3])], id="a", **g))
    b = _write(tmp_path, "b.json", _doc([_req(0, [1, 2, 9])], id="b", **g))
    c = _write(tmp_path, "c.json", _doc([_req(0, [1, 2, 3])], id="c", hash_id_scope="global"))
    sa, sb, sc = load_agentic([a, b, c])
    ia, ib, ic = (s.requests[0].block_ids for s in (sa, sb, sc))
    assert ia[:2] == ib[:2] and ia[2] != ib[2]
    assert not set(ia) & set(ic)  # another space ("global" by default)


def test_directory_argument_loads_json_files_in_name_order(tmp_path: Path) -> None:
    for name in ("b.json", "a.json"):
        _write(tmp_path, name, _doc([_req(0, [1])], id=name[0]))
    (tmp_path / "notes.txt").write_text("ignored")
    assert [s.id for s in load_agentic(tmp_path)] == ["a", "b"]


def test_subagents_become_children_with_absolute_times(tmp_path: Path) -> None:
    sub = {
        "t": 20.5,
        "type": "subagent",
        "agent_id": "agent_001",
        "models": ["small"],
        "requests": [
            {"t": 0.0, "type": "n", "in": 200, "out": 3, "hash_ids": [50, 51, 52]},
            {"t": 4.0, "type": "n", "in": 300, "out": 3, "hash_ids": [50, 51, 52, 53]},
        ],
    }
    doc = _doc([_req(0, [1, 2]), _req(10, [1, 2, 3], type="s"), sub, _req(22, [1, 2, 3, 4])])
    (s,) = load_agentic(_write(tmp_path, "a.json", doc))
    assert [r.t for r in s.requests] == [0, 10, 22]
    assert s.requests[1].kind == "s" and s.parent is None
    (child,) = s.children
    assert child.id == "conv/agent_001" and child.parent == "conv" and child.start == 20.5
    assert [r.t for r in child.requests] == [20.5, 24.5]
    assert all(r.parent_session == "conv" and r.model == "small" for r in child.requests)
    assert [x.id for x in s.walk()] == ["conv", "conv/agent_001"]
    merged = _all([s])
    assert [r.t for r in merged] == [0, 10, 20.5, 22, 24.5]
    assert merged[2].session == "conv/agent_001"


def test_iter_requests_merges_sessions_in_time_order(tmp_path: Path) -> None:
    a = _write(tmp_path, "a.json", _doc([_req(0, [1]), _req(10, [1, 2])], id="a"))
    b = _write(tmp_path, "b.json", _doc([_req(0, [1]), _req(5, [1, 2])], id="b"))
    got = [(r.session, r.t) for r in iter_requests(load_agentic([a, b]))]
    assert got == [("a", 0), ("b", 0), ("b", 5), ("a", 10)]


def test_missing_think_time_is_inferred(tmp_path: Path) -> None:
    r0 = _req(0, [1], api_time=3.0)
    r1 = _req(10, [1, 2])
    del r1["think_time"]
    (s,) = load_agentic(_write(tmp_path, "a.json", _doc([r0, r1])))
    assert s.requests[1].think_time == pytest.approx(7.0)


def test_model_defaults_to_the_single_listed_model(tmp_path: Path) -> None:
    r = _req(0, [1])
    del r["model"]
    (s,) = load_agentic(_write(tmp_path, "a.json", _doc([r])))
    assert s.requests[0].model == "m1"
    with pytest.raises(TraceFormatError, match=r"requests\[0\]\.model missing"):
        load_agentic(_write(tmp_path, "b.json", _doc([r], models=["m1", "m2"])))


def test_regrouping_keeps_prefix_identity(tmp_path: Path) -> None:
    ids1 = list(range(1, 11))  # 10 blocks
    ids2 = [*range(1, 9), 20, 21, 22]  # shares 8 blocks, then diverges
    ids3 = [1, 2, 3, 30, 31, 32, 33, 34]  # diverges inside group 1 (for k=2)
    p = _write(tmp_path, "a.json", _doc([_req(0, ids1), _req(1, ids2), _req(2, ids3)]))
    r1, r2, r3 = load_agentic(p, block_tokens=128)[0].requests
    assert r1.block_tokens == 128
    assert (len(r1.block_ids), len(r2.block_ids), len(r3.block_ids)) == (5, 5, 4)
    assert r1.block_ids[:4] == r2.block_ids[:4] and r1.block_ids[4] != r2.block_ids[4]
    assert r3.block_ids[0] == r1.block_ids[0] and r3.block_ids[1] != r1.block_ids[1]
    assert len(set(r1.block_ids)) == 5
    q1, q2, _ = load_agentic(p, block_tokens=192)[0].requests  # k=3: full groups only
    assert (len(q1.block_ids), len(q2.block_ids)) == (3, 3)
    assert q1.block_ids[:2] == q2.block_ids[:2] and q1.block_ids[2] != q2.block_ids[2]
    same = load_agentic(p, block_tokens=64)[0].requests
    assert [len(r.block_ids) for r in same] == [10, 11, 8]
    for bad in (96, 32, 0, -64):
        with pytest.raises(ValueError):
            load_agentic(p, block_tokens=bad)


def test_shared_id_space_keeps_loader_calls_apart(tmp_path: Path) -> None:
    p = _write(tmp_path, "a.json", _doc([_req(0, [0, 1, 2])]))
    m = _write(
        tmp_path,
        "m.jsonl",
        '{"timestamp": 0, "input_length": 1500, "output_length": 1, "hash_ids": [0, 1, 2]}\n',
    )
    space = IdSpace()
    a = load_agentic(p, ids=space)[0].requests[0].block_ids
    b = load_mooncake(m, ids=space)[0].requests[0].block_ids
    assert not set(a) & set(b)
    assert len(space) == 6


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("{not json", "not valid JSON"),
        ([1, 2], "top level must be a JSON object"),
        (_doc([], block_size=0), "block_size must be an integer >= 1"),
        (_doc([], hash_id_scope="weird"), "hash_id_scope must be one of"),
        (_doc({"a": 1}), "requests must be a list"),
        (_doc([5]), r"requests\[0\] must be an object"),
        (_doc([{k: v for k, v in _req(0, [1]).items() if k != "in"}]), r"requests\[0\]\.in"),
        (_doc([_req(0, "1,2")]), r"requests\[0\]\.hash_ids must be a list"),
        (_doc([_req(0, [1, "2"])]), r"requests\[0\]\.hash_ids\[1\] must be an integer"),
        (_doc([_req(0, [1, True])]), r"hash_ids\[1\] must be an integer"),
        (_doc([_req(-1, [1])]), r"requests\[0\]\.t must be a non-negative number"),
        (_doc([_req(0, [1], out=2.5)]), r"requests\[0\]\.out must be an integer"),
        (_doc([_req(0, [1]), {"t": 1, "type": "subagent"}]), r"requests\[1\]\.requests must"),
        (
            _doc([{"t": 1, "type": "subagent", "requests": [_req(0, [1], model=7)]}]),
            r"requests\[0\]\.requests\[0\]\.model must be a non-empty string",
        ),
    ],
)
def test_malformed_agentic_files_are_reported(
    tmp_path: Path, content: object, fragment: str
) -> None:
    p = _write(tmp_path, "bad.json", content)
    with pytest.raises(TraceFormatError, match=fragment) as ei:
        load_agentic(p)
    assert str(p) in str(ei.value)


def test_missing_file_raises_oserror(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        load_agentic(tmp_path / "absent.json")


# ---------------------------------------------------------------------- mooncake


def _mc_line(ts: int, ids: list[int], tin: int = 1000) -> str:
    return json.dumps({"timestamp": ts, "input_length": tin, "output_length": 7, "hash_ids": ids})


def test_mooncake_lines_become_single_request_sessions(tmp_path: Path) -> None:
    text = "\n".join([_mc_line(0, [0, 1]), "", _mc_line(1500, [0, 2]), _mc_line(3000, [5])])
    p = _write(tmp_path, "trace.jsonl", text + "\n")
    ss = load_mooncake(p)
    assert [s.id for s in ss] == ["trace:0", "trace:1", "trace:2"]
    assert [s.start for s in ss] == [0.0, 1.5, 3.0]
    r0, r1, _ = (s.requests[0] for s in ss)
    assert r1.t == 1.5 and r1.block_tokens == 512 and r1.model == "mooncake"
    assert r0.block_ids[0] == r1.block_ids[0] and r0.block_ids[1] != r1.block_ids[1]
    assert (r0.input_tokens, r0.output_tokens, r0.kind) == (1000, 7, "n")
    assert [s.id for s in load_mooncake(p, limit=2)] == ["trace:0", "trace:1"]
    assert load_mooncake(p, limit=0) == []
    with pytest.raises(ValueError):
        load_mooncake(p, limit=-1)


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ("{oops", "line 2: not valid JSON"),
        ("[1]", "line 2: must be a JSON object"),
        ('{"timestamp": 1, "input_length": 5, "output_length": 1}', "line 2: hash_ids must"),
        (
            '{"timestamp": "x", "input_length": 5, "output_length": 1, "hash_ids": []}',
            "line 2: timestamp must be a non-negative number",
        ),
        (
            '{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [1.5]}',
            r"line 2: hash_ids\[0\] must be an integer",
        ),
    ],
)
def test_malformed_mooncake_lines_are_reported(tmp_path: Path, line: str, fragment: str) -> None:
    p = _write(tmp_path, "bad.jsonl", _mc_line(0, [1]) + "\n" + line + "\n")
    with pytest.raises(TraceFormatError, match=fragment):
        load_mooncake(p)


# ------------------------------------------------------------------------ hashes


def test_block_hashes_are_chained() -> None:
    salt = b"llama3-8b/bf16/b64/tp0of1"
    h = block_hashes([7, 8, 9], salt)
    assert all(isinstance(x, bytes) and len(x) == 16 for x in h)
    prev = bytes(16)
    for bid, got in zip([7, 8, 9], h, strict=True):
        prev = xxhash.xxh3_128_digest(prev + bid.to_bytes(8, "little") + salt)
        assert got == prev
    other = block_hashes([7, 8, 10, 9], salt)
    assert other[:2] == h[:2] and other[2] != h[2] and other[3] != h[2]
    assert block_hashes([1, 8, 9], salt)[1:] != h[1:]  # a different head changes the rest
    assert not set(block_hashes([7, 8, 9], b"other")) & set(h)
    assert block_hashes([], salt) == []


def test_block_hashes_cache_gives_the_same_chain() -> None:
    cache: dict[int, bytes] = {}
    a = block_hashes([1, 2, 3], b"s", cache)
    b = block_hashes([1, 2, 3, 4, 5], b"s", cache)
    assert a == block_hashes([1, 2, 3], b"s")
    assert b == block_hashes([1, 2, 3, 4, 5], b"s")
    assert set(cache) == {1, 2, 3, 4, 5}


def test_block_hashes_rejects_bad_ids() -> None:
    with pytest.raises(ValueError):
        block_hashes([1, -1], b"")
    with pytest.raises(ValueError):
        block_hashes([2**64], b"")


# ------------------------------------------------------------------- real traces


@pytest.fixture(scope="module")
def agentic() -> list[Session]:
    assert TRACES is not None
    return load_agentic(TRACES / "agentic")


@needs_traces
def test_every_real_agentic_file_loads(agentic: list[Session]) -> None:
    assert TRACES is not None
    files = sorted((TRACES / "agentic").glob("*.json"))
    assert [s.source for s in agentic] == [str(p) for p in files]
    assert len({s.id for s in agentic}) == len(files)
    n = 0
    for s in agentic:
        for sub in s.walk():
            ts = [r.t for r in sub.requests]
            assert ts == sorted(ts) and ts[0] >= sub.start
            for r in sub.requests:
                # Agentic traces list the input's full 64-token blocks only.
                assert len(r.block_ids) == r.input_tokens // 64
                assert r.model and r.kind in ("n", "s") and r.think_time >= 0
                n += 1
    assert n == sum(1 for _ in iter_requests(agentic))
    children = [c for s in agentic for c in s.walk() if c.parent is not None]
    assert children, "the sample holds sub-agents (trace_0276)"
    for c in children:
        assert all(r.parent_session == c.parent for r in c.requests)


@needs_traces
def test_real_mooncake_trace_loads() -> None:
    assert TRACES is not None
    ss = load_mooncake(TRACES / "mooncake" / "conversation_trace.jsonl")
    assert len(ss) == 12031
    reqs = [s.requests[0] for s in ss]
    assert [r.t for r in reqs] == sorted(r.t for r in reqs)
    assert 3000 < reqs[-1].t < 4000  # about an hour
    # Mooncake chains end with the partial block: ceil(input / 512) ids.
    assert all(len(r.block_ids) == math.ceil(r.input_tokens / 512) for r in reqs)
