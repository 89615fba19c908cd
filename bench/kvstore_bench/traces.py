"""Workload traces: load the agentic and Mooncake formats into one model.

Both formats give, per request, token counts and the ids of the prefix blocks of its
input (equal ids within one id space mean equal prefixes). The loaders turn them into
:class:`Session` objects holding :class:`Request` objects whose ``block_ids`` are global
ints: ids from different files, scopes and models never collide, so several traces can be
replayed at once and one simulated cache can hold all of them. :func:`block_hashes`
turns such a chain of ids into the 16-byte chained hashes the store is keyed by.

The formats are described in the traces README (``shared/traces/README.md``). Malformed
input raises :class:`TraceFormatError`, whose message names the file and the place.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard, cast

import xxhash

__all__ = [
    "HASH_LEN",
    "MOONCAKE_BLOCK_TOKENS",
    "IdSpace",
    "Request",
    "Session",
    "TraceFormatError",
    "block_hashes",
    "iter_requests",
    "load_agentic",
    "load_mooncake",
]

HASH_LEN = 16
"""Length in bytes of a block hash made by :func:`block_hashes`."""

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per hash id in the Mooncake traces (not stated in the file itself)."""

_SCOPES = ("local", "global")
_ZERO_HASH = bytes(HASH_LEN)


class TraceFormatError(ValueError):
    """A trace file is malformed; the message names the file and the offending place."""


@dataclass(frozen=True, slots=True)
class Request:
    """One inference request of a trace.

    ``t`` is in seconds since the trace start, absolute (a sub-agent's requests already
    include the parent's offset). ``block_ids`` are global ids (see :class:`IdSpace`) of
    the input's prefix blocks of ``block_tokens`` tokens each, in prefix order; equal ids
    mean equal prefixes. The chain may cover fewer tokens than ``input_tokens`` (agentic
    traces list full blocks only) or end in a partial block (Mooncake lists
    ``ceil(input_tokens / 512)`` ids). ``kind`` is the trace's request type ("n" or "s"
    in agentic traces, "n" for Mooncake); ``parent_session`` is set for the requests of
    a sub-agent.
    """

    session: str
    t: float
    input_tokens: int
    output_tokens: int
    block_ids: tuple[int, ...]
    block_tokens: int
    model: str
    kind: str = "n"
    parent_session: str | None = None
    think_time: float = 0.0


@dataclass(frozen=True, slots=True)
class Session:
    """A conversation: its own requests in time order and the sub-agents it started.

    ``start`` is the absolute time of the session's start (0.0 for an agentic file, the
    sub-agent entry's time for a child, the request's time for a Mooncake request).
    ``source`` is the file it came from; ``parent`` the id of the session that started
    this one (sub-agents only).
    """

    id: str
    start: float
    requests: tuple[Request, ...]
    children: tuple[Session, ...] = ()
    source: str = ""
    parent: str | None = None

    def walk(self) -> Iterator[Session]:
        """Yield this session, then every descendant, depth first."""
        yield self
        for child in self.children:
            yield from child.walk()


class IdSpace:
    """Assigns dense global ints (0, 1, 2, ...) to trace-local block ids.

    A trace-local id is qualified by a scope (one file for ``hash_id_scope: "local"``,
    a named space for ``"global"``), a model (KV is per model) and a grouping factor (see
    ``block_tokens`` in :func:`load_agentic`). Pass one instance to several loader calls
    to keep their ids apart; each loader call makes its own instance when given none,
    and then ids of different calls do collide. Not thread-safe.
    """

    __slots__ = ("_next", "_next_scope", "_tables")

    def __init__(self) -> None:
        self._next = 0
        self._next_scope = 0
        self._tables: dict[tuple[str, str, int], dict[Any, int]] = {}

    def __len__(self) -> int:
        """Number of global ids handed out so far."""
        return self._next

    def new_scope(self) -> str:
        """Return a scope name never returned before by this instance."""
        self._next_scope += 1
        return f"#{self._next_scope}"

    def map(self, scope: str, model: str, group: int, keys: Iterable[Any]) -> tuple[int, ...]:
        """Global ids for ``keys`` in (scope, model, group).

        Equal keys get equal ids, new keys get fresh ids in order of first appearance.
        """
        table = self._tables.setdefault((scope, model, group), {})
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        found = list(map(table.get, keys))
        if None in found:  # some keys are new: hand out ids in order of first appearance
            nxt = self._next
            for i in range(found.index(None), len(found)):
                g = found[i]
                if g is None:
                    key = keys[i]
                    g = table.get(key)
                    if g is None:
                        g = table[key] = nxt
                        nxt += 1
                    found[i] = g
            self._next = nxt
        return tuple(cast("list[int]", found))


def block_hashes(
    block_ids: Sequence[int], namespace_salt: bytes, cache: dict[int, bytes] | None = None
) -> list[bytes]:
    """Chained 16-byte hashes of a chain of block ids.

    ``h[i] = xxh3_128(h[i-1] || block_ids[i] as 8-byte little-endian || namespace_salt)``
    with ``h[-1]`` = 16 zero bytes and ``xxh3_128`` giving xxhash's 16-byte digest. Equal
    leading ids give equal leading hashes; any difference changes every later hash.

    ``cache`` (optional; one dict per salt, kept by the caller across calls) maps an id
    to its hash and is filled as a side effect. Since equal ids in a trace mean equal
    prefixes, a cached id's hash is reused instead of recomputed, which makes replaying
    a multi-turn trace O(new blocks) instead of O(whole history) per request; for a
    chain inconsistent with earlier chains the result then differs from the uncached
    one. Raises ValueError for an id outside [0, 2**64).
    """
    out: list[bytes] = []
    prev = _ZERO_HASH
    digest = xxhash.xxh3_128_digest
    for i, bid in enumerate(block_ids):
        if cache is not None:
            hit = cache.get(bid)
            if hit is not None:
                out.append(hit)
                prev = hit
                continue
        try:
            raw = bid.to_bytes(8, "little")
        except (OverflowError, AttributeError) as e:
            raise ValueError(f"block id {i} = {bid!r} is not an integer in [0, 2**64)") from e
        prev = digest(prev + raw + namespace_salt)
        if cache is not None:
            cache[bid] = prev
        out.append(prev)
    return out


def iter_requests(sessions: Iterable[Session]) -> Iterator[Request]:
    """Yield every request of ``sessions`` and their descendants, merged in time order.

    Ties keep the order of ``sessions`` and, within a session, parents before children.
    """
    everything = [r for s in sessions for sub in s.walk() for r in sub.requests]
    everything.sort(key=lambda r: r.t)  # stable
    yield from everything


# --------------------------------------------------------------------------- agentic


def load_agentic(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    block_tokens: int | None = None,
    ids: IdSpace | None = None,
) -> list[Session]:
    """Load agentic conversation files (one JSON object per file) into sessions.

    ``paths`` is a file, a directory (its ``*.json`` files in name order) or an iterable
    of them. Each file becomes one top-level session whose id is the file's ``id`` (or
    its stem); an id repeated within the call gets a ``#n`` suffix. Sub-agent entries
    become child sessions ``<parent>/<agent_id>`` starting at the entry's absolute time,
    their requests' ``t`` made absolute and ``parent_session`` set. A request's ``kind``
    is its ``type``; a missing ``think_time`` is inferred from the previous request.

    Ids: with ``hash_id_scope: "local"`` every file (every occurrence, should a file be
    given twice) is its own id space; with ``"global"`` all files naming the same
    ``hash_id_space`` (an optional field, written by :mod:`synth`; default "global")
    share one. Ids are further qualified by model. ``ids`` shares the global id
    assignment with other loader calls.

    ``block_tokens``: if given, must be a positive multiple of each file's
    ``block_size``; then every ``k = block_tokens / block_size`` consecutive ids become
    one id, identified by (last member id, group index), which still stands for the
    whole prefix; a trailing partial group is dropped.

    Raises TraceFormatError for malformed content, ValueError for a bad
    ``block_tokens`` and OSError if a file cannot be read.
    """
    if block_tokens is not None and (type(block_tokens) is not int or block_tokens <= 0):
        raise ValueError(f"block_tokens must be a positive int, got {block_tokens!r}")
    space = ids if ids is not None else IdSpace()
    files = _expand(paths, "*.json")
    names: dict[str, int] = {}
    sessions: list[Session] = []
    for path in files:
        doc = _read_json(path)
        sessions.append(_agentic_session(path, doc, block_tokens, space, names))
    return sessions


def _expand(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]], pattern: str
) -> list[Path]:
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    out: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            out.extend(sorted(q for q in p.glob(pattern) if q.is_file()))
        else:
            out.append(p)
    return out


def _read_json(path: Path) -> Any:
    with open(path, "rb") as f:
        data = f.read()
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TraceFormatError(f"{path}: not valid JSON: {e}") from None


@dataclass(slots=True)
class _FileCtx:
    """What parsing one agentic file needs besides the current list of requests."""

    path: Path
    scope: str
    trace_block: int
    group: int
    space: IdSpace


def _agentic_session(
    path: Path,
    doc: Any,
    block_tokens: int | None,
    space: IdSpace,
    names: dict[str, int],
) -> Session:
    if not isinstance(doc, dict):
        raise TraceFormatError(f"{path}: top level must be a JSON object, got {_tname(doc)}")
    bs = _get_int(doc, "block_size", path, "", minimum=1)
    scope_kind = doc.get("hash_id_scope", "local")
    if scope_kind not in _SCOPES:
        raise TraceFormatError(
            f"{path}: hash_id_scope must be one of {_SCOPES}, got {scope_kind!r}"
        )
    if scope_kind == "local":
        scope = space.new_scope()
    else:
        id_space = doc.get("hash_id_space", "global")
        if not isinstance(id_space, str):
            raise TraceFormatError(f"{path}: hash_id_space must be a string")
        scope = "global:" + id_space
    group = 1
    if block_tokens is not None:
        if block_tokens % bs:
            raise ValueError(
                f"{path}: block_tokens={block_tokens} is not a multiple of the trace's "
                f"block_size={bs}"
            )
        group = block_tokens // bs

    base = doc.get("id", path.stem)
    if not isinstance(base, str) or not base:
        raise TraceFormatError(f"{path}: id must be a non-empty string, got {base!r}")
    n = names.get(base, 0)
    names[base] = n + 1
    sid = base if n == 0 else f"{base}#{n}"

    ctx = _FileCtx(path, scope, bs, group, space)
    model = _default_model(doc, path, "")
    return _parse_session(ctx, doc, "", sid, 0.0, None, model)


def _parse_session(
    ctx: _FileCtx,
    node: dict[str, Any],
    where: str,
    sid: str,
    start: float,
    parent: str | None,
    default_model: str | None,
) -> Session:
    reqs = node.get("requests")
    if not isinstance(reqs, list):
        raise TraceFormatError(
            f"{ctx.path}: {_at(where, 'requests')} must be a list, got {_tname(reqs)}"
        )
    requests: list[Request] = []
    children: list[Session] = []
    prev: dict[str, Any] | None = None
    for i, r in enumerate(reqs):
        w = _at(where, f"requests[{i}]")
        if not isinstance(r, dict):
            raise TraceFormatError(f"{ctx.path}: {w} must be an object, got {_tname(r)}")
        kind = r.get("type", "subagent" if "requests" in r else "n")
        if not isinstance(kind, str):
            raise TraceFormatError(f"{ctx.path}: {_at(w, 'type')} must be a string")
        t_rel = _get_num(r, "t", ctx.path, w)
        if kind == "subagent":
            agent = r.get("agent_id", f"sub{len(children)}")
            if not isinstance(agent, str) or not agent:
                raise TraceFormatError(
                    f"{ctx.path}: {_at(w, 'agent_id')} must be a non-empty string"
                )
            child_model = _default_model(r, ctx.path, w) or default_model
            children.append(
                _parse_session(ctx, r, w, f"{sid}/{agent}", start + t_rel, sid, child_model)
            )
            continue
        requests.append(
            _parse_request(ctx, r, w, sid, start + t_rel, parent, default_model, kind, prev)
        )
        prev = r
    requests.sort(key=lambda q: q.t)
    children.sort(key=lambda c: c.start)
    return Session(sid, start, tuple(requests), tuple(children), str(ctx.path), parent)


def _parse_request(
    ctx: _FileCtx,
    r: dict[str, Any],
    w: str,
    sid: str,
    t: float,
    parent: str | None,
    default_model: str | None,
    kind: str,
    prev: dict[str, Any] | None,
) -> Request:
    path = ctx.path
    model = r.get("model", default_model)
    if not isinstance(model, str) or not model:
        raise TraceFormatError(
            f"{path}: {_at(w, 'model')} missing and no single model to default to"
            if model is None
            else f"{path}: {_at(w, 'model')} must be a non-empty string"
        )
    tin = _get_int(r, "in", path, w, minimum=0)
    tout = _get_int(r, "out", path, w, minimum=0)
    raw = r.get("hash_ids")
    if not isinstance(raw, list):
        raise TraceFormatError(f"{path}: {_at(w, 'hash_ids')} must be a list, got {_tname(raw)}")
    _check_ids(raw, path, w)
    if "think_time" in r:
        think = _get_num(r, "think_time", path, w)
    elif prev is not None:
        # Missing in a few real requests: infer the pause from the previous request.
        api = prev.get("api_time")
        api_s = float(api) if _is_num(api) else 0.0
        think = max(0.0, float(r["t"]) - float(prev["t"]) - api_s)
    else:
        think = 0.0
    k = ctx.group
    if k == 1:
        block_ids = ctx.space.map(ctx.scope, model, 1, raw)
    else:
        keys = [(raw[j * k + k - 1], j) for j in range(len(raw) // k)]
        block_ids = ctx.space.map(ctx.scope, model, k, keys)
    return Request(
        session=sid,
        t=t,
        input_tokens=tin,
        output_tokens=tout,
        block_ids=block_ids,
        block_tokens=ctx.trace_block * k,
        model=model,
        kind=kind,
        parent_session=parent,
        think_time=think,
    )


def _default_model(node: dict[str, Any], path: Path, where: str) -> str | None:
    models = node.get("models")
    if models is None:
        return None
    if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
        raise TraceFormatError(f"{path}: {_at(where, 'models')} must be a list of strings")
    return models[0] if len(models) == 1 else None


# -------------------------------------------------------------------------- mooncake


def load_mooncake(
    path: str | os.PathLike[str],
    limit: int | None = None,
    ids: IdSpace | None = None,
    model: str = "mooncake",
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> list[Session]:
    """Load a Mooncake JSONL trace: one request per line, each its own session.

    Each non-empty line is an object with ``timestamp`` (ms since the trace start),
    ``input_length``, ``output_length`` and ``hash_ids`` (ids global across the file,
    of ``block_tokens``-token blocks). The trace has no session ids, so request ``n``
    (0-based, in file order) becomes session ``<stem>:<n>`` with one request, ``t`` in
    seconds. ``limit`` keeps only the first ``limit`` requests. The file is one id
    space, qualified by ``model``; ``ids`` shares the global id assignment with other
    loader calls.

    Raises TraceFormatError (with the line number) for a malformed line, ValueError for a
    bad ``limit`` and OSError if the file cannot be read.
    """
    if limit is not None and (type(limit) is not int or limit < 0):
        raise ValueError(f"limit must be a non-negative int or None, got {limit!r}")
    if type(block_tokens) is not int or block_tokens <= 0:
        raise ValueError(f"block_tokens must be a positive int, got {block_tokens!r}")
    p = Path(path)
    space = ids if ids is not None else IdSpace()
    scope = space.new_scope()
    sessions: list[Session] = []
    with open(p, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(sessions) >= limit:
                break
            if not line.strip():
                continue
            w = f"line {lineno}"
            try:
                r = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise TraceFormatError(f"{p}: {w}: not valid JSON: {e}") from None
            if not isinstance(r, dict):
                raise TraceFormatError(f"{p}: {w}: must be a JSON object, got {_tname(r)}")
            ts = _get_num(r, "timestamp", p, w)
            tin = _get_int(r, "input_length", p, w, minimum=0)
            tout = _get_int(r, "output_length", p, w, minimum=0)
            raw = r.get("hash_ids")
            if not isinstance(raw, list):
                raise TraceFormatError(f"{p}: {w}: hash_ids must be a list, got {_tname(raw)}")
            _check_ids(raw, p, w)
            sid = f"{p.stem}:{len(sessions)}"
            t = ts / 1000.0
            req = Request(
                session=sid,
                t=t,
                input_tokens=tin,
                output_tokens=tout,
                block_ids=space.map(scope, model, 1, raw),
                block_tokens=block_tokens,
                model=model,
            )
            sessions.append(Session(sid, t, (req,), (), str(p)))
    return sessions


# ------------------------------------------------------------------------ validation


def _tname(v: object) -> str:
    return "null" if v is None else type(v).__name__


def _at(where: str, key: str) -> str:
    """Name a field: ``requests[3].in`` (agentic) or ``line 5: input_length`` (JSONL)."""
    if not where:
        return key
    return f"{where}: {key}" if where.startswith("line ") else f"{where}.{key}"


def _is_num(v: object) -> TypeGuard[float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _get_num(obj: dict[str, Any], key: str, path: Path, where: str) -> float:
    v = obj.get(key)
    if not _is_num(v) or v < 0:
        raise TraceFormatError(
            f"{path}: {_at(where, key)} must be a non-negative number, got {v!r}"
        )
    return float(v)


def _get_int(obj: dict[str, Any], key: str, path: Path, where: str, minimum: int) -> int:
    v = obj.get(key)
    if type(v) is not int or v < minimum:
        raise TraceFormatError(
            f"{path}: {_at(where, key)} must be an integer >= {minimum}, got {v!r}"
        )
    return v


def _check_ids(raw: list[Any], path: Path, where: str) -> None:
    if not raw or set(map(type, raw)) == {int}:
        return
    for j, x in enumerate(raw):
        if type(x) is not int:
            raise TraceFormatError(
                f"{path}: {_at(where, f'hash_ids[{j}]')} must be an integer, got {x!r}"
            )
