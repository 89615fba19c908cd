"""`kvstore bench engine --repeat N`: every configuration N times, reported by its median.

One run's TTFT p50 does not settle a comparison on a shared machine: nine runs of the
same command put kvstore's p50 anywhere from 46 to 98 ms (docs/BENCHMARKS.md). With
``--repeat N`` each configuration runs N times, the configurations in turn (run r starts
at the r-th configuration, so a slow stretch of the machine does not fall on one of
them alone), and each is reported by its median run:

- the table row is the run whose TTFT p50 is the median (the lower one of two middles),
  a real run, every column from it;
- :attr:`Summary.repeats` lists every run's hit rate, TTFT p50, input tokens/s and wall
  time, and :func:`repeat_rows` gives, per configuration, the median of each with its
  range. The hit-rate plot uses the median hit rate.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from .report import Summary, failed

__all__ = ["REPEAT_COLUMNS", "median_run", "repeat_rows", "rotations"]

REPEAT_COLUMNS = ("memory", "config", "runs", "hit rate median (range)", "TTFT p50 median (range)")


def rotations(names: Sequence[str], n: int) -> list[list[str]]:
    """The order of each of ``n`` rounds: round r starts at the r-th name."""
    k = len(names)
    return [list(names[r % k :]) + list(names[: r % k]) if k else [] for r in range(n)]


def _ttft_p50(s: Summary) -> float:
    v = s.ttft_ms.get("p50")
    return v if v is not None and math.isfinite(v) else math.inf


def median_run(runs: Sequence[Summary]) -> Summary:
    """The run of one configuration to report: the median by TTFT p50 among those that
    ran (else the first), with every run's figures in its ``repeats``."""
    done = [s for s in runs if s.ran and s.requests]
    pick = sorted(done, key=_ttft_p50)[(len(done) - 1) // 2] if done else runs[0]
    pick.repeats = [
        {
            "ran": float(s.ran),
            "token_hit_rate": s.token_hit_rate,
            "ttft_p50_ms": s.ttft_ms.get("p50", math.nan),
            "input_tokens_per_s": s.input_tokens_per_s,
            "wall_s": s.wall_s,
        }
        for s in runs
    ]
    if done:
        pick.median_hit_rate = statistics.median(s.token_hit_rate for s in done)
    bad = [s for s in runs if failed(s)]
    if bad and not failed(pick):  # one failed run of N fails the configuration
        pick.failure = f"{len(bad)} of {len(runs)} runs failed: {failed(bad[0])}"
    return pick


def _spread(xs: list[float], fmt: str) -> str:
    xs = [x for x in xs if math.isfinite(x)]
    if not xs:
        return "-"
    med = statistics.median(xs)
    return f"{fmt.format(med)} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def repeat_rows(memory: str, summaries: Sequence[Summary]) -> list[list[str]]:
    """Per configuration run more than once: :data:`REPEAT_COLUMNS`."""
    rows: list[list[str]] = []
    for s in summaries:
        done = [r for r in s.repeats if r["ran"]]
        if len(s.repeats) < 2:
            continue
        rows.append(
            [
                memory,
                s.name,
                f"{len(done)} of {len(s.repeats)}",
                _spread([100 * r["token_hit_rate"] for r in done], "{:.1f}%"),
                _spread([r["ttft_p50_ms"] for r in done], "{:.0f} ms"),
            ]
        )
    return rows
