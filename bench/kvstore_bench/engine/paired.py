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
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

__all__ = ["MIN_TOKENS", "compute_ms_per_token", "paired"]

MIN_TOKENS = 256  # requests computing fewer tokens than this do not set the speed
SAME_STEP_S = 0.002  # first tokens this close on one engine came from one step

Request = dict[str, Any]


def _p50(xs: Sequence[float]) -> float | None:
    v = sorted(xs)
    return v[(len(v) - 1) // 2] if v else None


def _end(r: Request) -> float:
    return float(r["start_s"]) + float(r["ttft_ms"]) / 1e3


def compute_ms_per_token(requests: Sequence[Request]) -> float | None:
    """Step milliseconds per token computed in the step (p50); None without requests
    computing at least :data:`MIN_TOKENS`."""
    by_engine: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for r in requests:
        by_engine[r["engine"]].append((_end(r), r["prompt_tokens"] - r["cached_tokens"]))
    for ends in by_engine.values():
        ends.sort()
    out: list[float] = []
    for r in requests:
        own = r["prompt_tokens"] - r["cached_tokens"]
        if own < MIN_TOKENS or r["step_ms"] <= 0:
            continue
        end = _end(r)
        step_tokens = sum(
            n for t, n in by_engine[r["engine"]] if abs(t - end) < SAME_STEP_S
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
