"""The engine bench's workload: agent sessions turned into token-id prompts for real engines.

Pure (no processes, no engines): :func:`build_scripts` maps trace sessions
(:mod:`kvstore_bench.traces`) to :class:`Script` objects, one per session or sub-agent,
whose :class:`Turn` objects carry the prompt token ids, the output length, the scaled
pause before the turn and the engine the turn is routed to. :func:`ideal_hits` says how
many prompt tokens an ideal shared cache (or an ideal per-engine cache) could have
served, given the order in which the requests really ran.

Token ids come from the traces' block ids: trace block ``g`` (a global id, so equal ids
mean equal prefixes) becomes ``round(block_size * token_scale)`` ids drawn from a
generator seeded by ``g``; shared prefixes in the trace are shared tokens here. The part
of a request's input beyond its listed full blocks is made of tokens unique to that
request. Ids avoid 0..2 (pad, bos, eos of the tiny model).
"""

from __future__ import annotations

import dataclasses
import random
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import xxhash

from ..traces import Session

__all__ = [
    "Script",
    "Turn",
    "WorkloadShape",
    "block_tokens_of",
    "build_scripts",
    "ideal_hits",
]

FIRST_ID = 3  # 0, 1, 2: pad, bos, eos


@dataclass(frozen=True, slots=True)
class WorkloadShape:
    """How traces are scaled to fit a small engine.

    ``token_scale`` multiplies every token count (trace blocks, tails, outputs);
    ``time_scale`` divides every pause between turns, and ``max_pause_s`` caps it after
    that (a trace's overnight gap would otherwise stop the run for minutes; 0 = no cap);
    ``max_turns``
    keeps the first turns of each
    session (0 = all); ``max_output`` caps output tokens; ``max_len`` is the engine's
    context: a session stops at its first turn whose prompt plus output would not fit.
    ``engines`` is the number of engines turns are routed over; ``vocab`` the model's.
    """

    token_scale: float = 0.05
    time_scale: float = 50.0
    max_pause_s: float = 0.0
    max_turns: int = 0
    max_output: int = 32
    max_len: int = 4096
    engines: int = 2
    vocab: int = 1000


@dataclass(frozen=True, slots=True)
class Turn:
    """One request: ``index`` is the turn number within its script (0-based), ``engine``
    the engine it is sent to, ``pause_s`` the (scaled) pause after the previous turn of
    the script finished. ``session_state`` is the session's state once this turn is
    done: ``paused`` (the agent runs a tool, another turn follows) or ``ended`` (its
    last turn); it becomes a session hint where the configuration takes them."""

    script: str
    index: int
    prompt: tuple[int, ...]
    max_tokens: int
    pause_s: float
    engine: int
    session_state: str = "paused"


@dataclass(frozen=True, slots=True)
class Script:
    """A session or sub-agent as the bench plays it: turns in order, one after the other.

    ``start_s`` is the (scaled) time the script starts after the run starts; a
    sub-agent's ``parent`` names its parent script and ``after_turn`` the parent turn
    after which it starts (its start is also never earlier than ``start_s``)."""

    id: str
    start_s: float
    turns: tuple[Turn, ...]
    parent: str | None = None
    after_turn: int = -1


def block_tokens_of(block_id: int, n: int, vocab: int) -> list[int]:
    """The ``n`` token ids standing for trace block ``block_id`` (deterministic)."""
    rng = random.Random(0x6B76_0000_0000 ^ block_id)
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


def _tail_tokens(key: str, n: int, vocab: int) -> list[int]:
    rng = random.Random(key)
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


def _capped(seconds: float, cap: float) -> float:
    return min(seconds, cap) if cap > 0 else seconds


def _scaled(n: float, scale: float, minimum: int) -> int:
    return max(minimum, round(n * scale))


def build_scripts(sessions: Sequence[Session], shape: WorkloadShape) -> list[Script]:
    """Scripts for ``sessions`` (and their sub-agents), routed round-robin.

    Turn ``k`` of top-level session ``i`` goes to engine ``(i + k) % engines``, so
    consecutive turns of a session land on different engines; a sub-agent's turns
    continue the rotation from the parent turn it forks after. Raises ValueError for a
    shape that cannot hold even one block.
    """
    if shape.token_scale <= 0 or shape.time_scale <= 0 or shape.engines < 1:
        raise ValueError("token_scale and time_scale must be > 0 and engines >= 1")
    out: list[Script] = []
    for i, top in enumerate(sessions):
        _build(top, shape, i, None, -1, out)
    return out


def _build(
    s: Session,
    shape: WorkloadShape,
    rotation: int,
    parent: str | None,
    after_turn: int,
    out: list[Script],
) -> None:
    cache: dict[int, list[int]] = {}
    turns: list[Turn] = []
    for k, r in enumerate(s.requests):
        if shape.max_turns and k >= shape.max_turns:
            break
        per_block = _scaled(r.block_tokens, shape.token_scale, 1)
        prompt: list[int] = []
        for bid in r.block_ids:
            toks = cache.get(bid)
            if toks is None:
                toks = cache[bid] = block_tokens_of(bid, per_block, shape.vocab)
            prompt.extend(toks)
        tail = r.input_tokens - len(r.block_ids) * r.block_tokens
        if tail > 0 or not prompt:
            n = _scaled(max(tail, 1), shape.token_scale, 1)
            prompt.extend(_tail_tokens(f"{s.id}/{k}", n, shape.vocab))
        max_tokens = min(shape.max_output, _scaled(r.output_tokens, shape.token_scale, 1))
        if len(prompt) + max_tokens > shape.max_len:
            break  # this and later turns do not fit the engine's context
        pause = max(0.0, r.think_time) if k else 0.0  # the first turn waits for start_s
        turns.append(
            Turn(
                script=s.id,
                index=k,
                prompt=tuple(prompt),
                max_tokens=max_tokens,
                pause_s=_capped(pause / shape.time_scale, shape.max_pause_s),
                engine=(rotation + k) % shape.engines,
            )
        )
    if not turns:
        return
    turns[-1] = dataclasses.replace(turns[-1], session_state="ended")
    out.append(
        Script(
            id=s.id,
            start_s=s.start / shape.time_scale,
            turns=tuple(turns),
            parent=parent,
            after_turn=after_turn,
        )
    )
    for child in s.children:
        # the parent turn the sub-agent forks after: the last one that started before it
        fork = max((k for k, r in enumerate(s.requests) if r.t <= child.start), default=-1)
        if fork >= len(turns):
            continue  # its parent was cut before the fork
        _build(child, shape, rotation + fork + 1, s.id, fork, out)


# ---------------------------------------------------------------------------- ideal


def chain_hashes(prompt: Sequence[int], block: int) -> list[bytes]:
    """Chained hashes of the full ``block``-token blocks of ``prompt``."""
    out: list[bytes] = []
    prev = b"\0" * 16
    for j in range(len(prompt) // block):
        prev = xxhash.xxh3_128_digest(
            prev + array("i", prompt[j * block : (j + 1) * block]).tobytes()
        )
        out.append(prev)
    return out


def cacheable(prompt_len: int, block: int) -> int:
    """Most prompt tokens an engine can take from a cache: whole blocks, never the last
    token (it is always computed to produce the first output)."""
    return max(0, (prompt_len - 1) // block) * block


@dataclass(frozen=True, slots=True)
class Timed:
    """A request as it ran: its prompt, its engine, when it started and finished."""

    prompt: tuple[int, ...]
    engine: int
    start: float
    end: float


def ideal_hits(requests: Iterable[Timed], block: int) -> tuple[list[int], list[int]]:
    """Per request (in the given order): tokens an ideal cache could serve.

    Returns ``(shared, own)``: ``shared`` counts the longest prefix of whole blocks seen in
    any request that finished before this one started (one cache for all engines);
    ``own`` the same over requests of the same engine only (each engine's own prefix
    cache, never evicting). Both are capped by :func:`cacheable`.
    """
    reqs = list(requests)
    hashes = [chain_hashes(r.prompt, block) for r in reqs]
    by_end = sorted(range(len(reqs)), key=lambda i: reqs[i].end)
    shared: list[int] = []
    own: list[int] = []
    for i, r in enumerate(reqs):
        seen_all: set[bytes] = set()
        seen_own: set[bytes] = set()
        for j in by_end:
            if reqs[j].end > r.start:
                break
            seen_all.update(hashes[j])
            if reqs[j].engine == r.engine:
                seen_own.update(hashes[j])
        cap = cacheable(len(r.prompt), block)
        shared.append(min(cap, _leading(hashes[i], seen_all) * block))
        own.append(min(cap, _leading(hashes[i], seen_own) * block))
    return shared, own


def _leading(chain: list[bytes], seen: set[bytes]) -> int:
    n = 0
    for h in chain:
        if h not in seen:
            break
        n += 1
    return n
