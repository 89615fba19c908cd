"""The same requests side by side: what one configuration's run did with each request
against another's, from their ``per_request`` lists (:mod:`.report`).

Two figures that a table of per-configuration percentiles hides:

- :func:`compute_ms_per_token`: how fast a run's engines computed, as the p50 over
  requests that computed at least ``MIN_TOKENS`` tokens of their step's duration per
  token the step computed (theirs plus those of the requests whose first token came
  from the same step on the same engine). On a shared machine it moves from run to
  run; when two runs differ in it, their TTFTs differ for that reason too.
- :func:`paired`: the later turns (turn > 0) both runs served, in four classes (a hit
  in both, in the first only, in the second only, a miss in both), each with its count
  and both runs' TTFT p50. A miss in one run is not the same request as a miss in
  another: comparing the classes compares like with like.
- :func:`by_engine`: each engine's share of the run (requests, token hit rate, hits
  among later turns, TTFT p50/p95). Turns alternate between engines, so the engines of
  one run should look alike; when one engine misses and queues while the other hits,
  the run's TTFT p50 is the fast engine's and says little about the store.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

__all__ = ["MIN_TOKENS", "by_engine", "by_engine_line", "compute_ms_per_token", "paired"]

MIN_TOKENS = 256  # requests computing fewer tokens than this do not set the speed
SAME_STEP_S = 0.002  # first tokens this close on one engine came from one step

Request = dict[str, Any]


def _pick(xs: Sequence[float], q: float) -> float | None:
    """Nearest rank, as the report's ``percentiles`` (which imports this module)."""
    v = sorted(xs)
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))] if v else None


def _p50(xs: Sequence[float]) -> float | None:
    return _pick(xs, 0.5)


def _end(r: Request) -> float:
    return float(r["start_s"]) + float(r["ttft_ms"]) / 1e3


def compute_ms_per_token(requests: Sequence[Request]) -> float | None:
    """Step milliseconds per token computed in the step (p50); None without requests
    computing at least :data:`MIN_TOKENS`."""
    ends: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for r in requests:
        ends[r["engine"]].append((_end(r), r["prompt_tokens"] - r["cached_tokens"]))
    out: list[float] = []
    for r in requests:
        own = r["prompt_tokens"] - r["cached_tokens"]
        if own < MIN_TOKENS or r["step_ms"] <= 0:
            continue
        end = _end(r)
        step_tokens = sum(
            n for t, n in ends[r["engine"]] if abs(t - end) < SAME_STEP_S
        )  # its own tokens are among them
        out.append(r["step_ms"] / max(own, step_tokens))
    return _p50(out)


def paired(a: Sequence[Request], b: Sequence[Request]) -> dict[str, dict[str, float | None]]:
    """Later turns both runs served, by class: ``hit_both``, ``hit_first_only``,
    ``hit_second_only``, ``miss_both``; each ``{count, first_ttft_p50_ms,
    second_ttft_p50_ms}`` (p50s None for an empty class)."""
    bk = {(r["script"], r["turn"]): r for r in b}
    groups: dict[str, list[tuple[float, float]]] = {
        k: [] for k in ("hit_both", "hit_first_only", "hit_second_only", "miss_both")
    }
    for r in a:
        o = bk.get((r["script"], r["turn"]))
        if o is None or r["turn"] == 0:
            continue
        ha, hb = r["cached_tokens"] > 0, o["cached_tokens"] > 0
        k = (
            ("hit_both" if hb else "hit_first_only")
            if ha
            else ("hit_second_only" if hb else "miss_both")
        )
        groups[k].append((r["ttft_ms"], o["ttft_ms"]))
    return {
        k: {
            "count": len(v),
            "first_ttft_p50_ms": _p50([x for x, _ in v]),
            "second_ttft_p50_ms": _p50([y for _, y in v]),
        }
        for k, v in groups.items()
    }


def by_engine(requests: Sequence[Request]) -> dict[str, dict[str, float | int | None]]:
    """Per engine (keys ``"0"``, ``"1"``, ...): ``requests``, ``token_hit_rate``
    (cached over prompt tokens), ``later_turns`` and ``later_turn_hits`` (turns > 0, and
    those with cached tokens), ``ttft_p50_ms`` and ``ttft_p95_ms``."""
    groups: dict[int, list[Request]] = defaultdict(list)
    for r in requests:
        groups[int(r["engine"])].append(r)
    out: dict[str, dict[str, float | int | None]] = {}
    for e in sorted(groups):
        rs = groups[e]
        prompt = sum(r["prompt_tokens"] for r in rs)
        later = [r for r in rs if r["turn"] > 0]
        ttfts = [float(r["ttft_ms"]) for r in rs]
        out[str(e)] = {
            "requests": len(rs),
            "token_hit_rate": sum(r["cached_tokens"] for r in rs) / prompt if prompt else None,
            "later_turns": len(later),
            "later_turn_hits": sum(1 for r in later if r["cached_tokens"] > 0),
            "ttft_p50_ms": _p50(ttfts),
            "ttft_p95_ms": _pick(ttfts, 0.95),
        }
    return out


def by_engine_line(name: str, requests: Sequence[Request]) -> str | None:
    """One printed line: each engine's hit rate and TTFT p50; None with fewer than two
    engines."""
    per = by_engine(requests)
    if len(per) < 2:
        return None

    def cell(d: dict[str, float | int | None]) -> str:
        h, t = d["token_hit_rate"], d["ttft_p50_ms"]
        hit = "-" if h is None else f"{100 * h:.0f}%"
        return f"{hit} hits, TTFT p50 {'-' if t is None else f'{t:,.0f}'} ms"

    return f"{name} by engine: " + "; ".join(f"{e}: {cell(d)}" for e, d in per.items())
