"""Many traces in groups: `kvstore bench engine --trace-group I/N` and
`kvstore bench engine-groups A.json B.json ...` (issue 46).

One set of traces per claim is a thin margin. ``--trace-group I/N`` keeps every N-th of
the given trace files from the I-th (0-based), so N runs of the same command cover
every trace once, each group a run of its own (its own working set, its own sweep
points). ``engine-groups`` reads the ``--json`` files of such runs and gives, per
memory point and configuration, the mean and spread (sample standard deviation, min,
max) of each figure over the groups: token hit rate, its own-cache and store parts,
TTFT p50, input tokens/s. A configuration that failed in a group is counted as failed
there, never averaged in. Pure apart from reading the files.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.table import Table

from kvstore.console import make_console

__all__ = [
    "FIGURES",
    "GROUP_COLUMNS",
    "Spread",
    "aggregate",
    "engine_groups_cmd",
    "group_rows",
    "parse_group",
    "pick_group",
]

T = TypeVar("T")

# (name in the table, how to read it off a configuration's JSON)
FIGURES: tuple[tuple[str, str], ...] = (
    ("hit rate", "token_hit_rate"),
    ("own cache", "own_cache_hit_rate"),
    ("store", "store_hit_rate"),
    ("TTFT p50 ms", "ttft_ms.p50"),
    ("input tok/s", "input_tokens_per_s"),
)


def parse_group(text: str) -> tuple[int, int]:
    """``"1/4"`` -> (1, 4); ValueError unless 0 <= I < N."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError as e:
        raise ValueError(f"want I/N, e.g. 0/4: {text!r}") from e
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"want 0 <= I < N: {text!r}")
    return i, n


def pick_group(items: Sequence[T], group: tuple[int, int]) -> list[T]:
    """Every N-th item from the I-th: N groups cover every item once."""
    i, n = group
    return list(items[i::n])


@dataclass(slots=True)
class Spread:
    """One figure over the groups where the configuration ran."""

    values: list[float] = field(default_factory=list)
    failed: int = 0

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.values) if self.values else None

    @property
    def stdev(self) -> float | None:
        return statistics.stdev(self.values) if len(self.values) > 1 else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "n": len(self.values),
            "failed": self.failed,
            "mean": self.mean,
            "stdev": self.stdev,
            "min": min(self.values) if self.values else None,
            "max": max(self.values) if self.values else None,
        }


def _get(d: dict[str, Any], path: str) -> float | None:
    cur: Any = d
    for k in path.split("."):
        if not isinstance(cur, dict) or k not in cur:
            return None
        cur = cur[k]
    return float(cur) if isinstance(cur, int | float) and math.isfinite(cur) else None


def _points(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(point label, configs) of one run's JSON: its sweep points, or the one run."""
    if doc.get("sweep"):
        return [(f"{p['fraction']:g}", p["configs"]) for p in doc["sweep"]]
    return [("-", doc.get("configs", {}))]


def aggregate(docs: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, Spread]]]:
    """point -> configuration -> figure -> :class:`Spread` over ``docs`` (one per group)."""
    out: dict[str, dict[str, dict[str, Spread]]] = {}
    for doc in docs:
        for point, configs in _points(doc):
            for name, c in configs.items():
                figs = out.setdefault(point, {}).setdefault(
                    name, {key: Spread() for _, key in FIGURES}
                )
                bad = c.get("status") == "failed" or not c.get("ran", True)
                for _, key in FIGURES:
                    if bad:
                        figs[key].failed += 1
                        continue
                    v = _get(c, key)
                    if v is not None:
                        figs[key].values.append(v)
    return out


GROUP_COLUMNS = ("memory", "config", "groups", *(name for name, _ in FIGURES))


def _cell(s: Spread, key: str) -> str:
    if s.mean is None:
        return "-"
    pct = key != "input_tokens_per_s" and not key.startswith("ttft")
    scale, unit = (100.0, "%") if pct else (1.0, "")
    fmt = "{:.1f}" if pct else "{:,.0f}"
    lo, hi = min(s.values) * scale, max(s.values) * scale
    sd = "" if s.stdev is None else f" sd {fmt.format(s.stdev * scale)}"
    return f"{fmt.format(s.mean * scale)}{unit}{sd} ({fmt.format(lo)}-{fmt.format(hi)}{unit})"


def group_rows(agg: dict[str, dict[str, dict[str, Spread]]]) -> list[list[str]]:
    """One row per (point, configuration): :data:`GROUP_COLUMNS`."""
    rows: list[list[str]] = []
    for point, configs in agg.items():
        for name, figs in configs.items():
            first = figs[FIGURES[0][1]]
            groups = f"{len(first.values)}" + (f" ({first.failed} FAILED)" if first.failed else "")
            rows.append([point, name, groups, *(_cell(figs[key], key) for _, key in FIGURES)])
    return rows


@click.command("engine-groups")
@click.argument("runs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--json", "json_path", default=None, help="Write the means and spreads here.")
def engine_groups_cmd(runs: tuple[str, ...], json_path: str | None) -> None:
    """Mean and spread over groups of `kvstore bench engine --json` runs (one file per
    group of traces, e.g. from --trace-group I/N). Exits 1 if a group's run failed."""
    docs = [json.loads(Path(p).read_text()) for p in runs]
    agg = aggregate(docs)
    t = Table(title=f"engine bench over {len(docs)} groups: mean sd (min-max)")
    for c in GROUP_COLUMNS:
        t.add_column(c, overflow="fold")
    for row in group_rows(agg):
        t.add_row(*row)
    make_console(min_width=160).print(t)
    if json_path:
        doc = {
            "runs": list(runs),
            "points": {
                point: {
                    name: {key: s.as_dict() for key, s in figs.items()}
                    for name, figs in configs.items()
                }
                for point, configs in agg.items()
            },
        }
        Path(json_path).write_text(json.dumps(doc, indent=2) + "\n")
    if any(
        s.failed for configs in agg.values() for figs in configs.values() for s in figs.values()
    ):
        raise click.exceptions.Exit(1)
