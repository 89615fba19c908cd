"""`kvstore bench synth`: write synthetic coding-agent traces (see :mod:`synth`)."""

from __future__ import annotations

import click

__all__ = ["synth_cmd"]


@click.command("synth")
@click.option("--sessions", type=click.IntRange(min=1), required=True, help="Conversations.")
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--block-size", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--out", type=click.Path(file_okay=False), required=True, help="Output directory.")
def synth_cmd(sessions: int, seed: int, block_size: int, out: str) -> None:
    """Write SESSIONS agentic trace files (one JSON per conversation) into OUT.

    The files follow the agentic trace format and share one id space per run, so replay
    them together: kvstore bench replay OUT/*.json --format agentic.
    """
    import json

    from .synth import write

    paths = write(out, sessions, seed, block_size)
    requests = tokens = subagents = 0
    for p in paths:
        doc = json.loads(p.read_text(encoding="utf-8"))
        totals = doc["totals"]
        tokens += totals["combined_tokens"]["input"]
        subagents += totals["subagent_count"]
        requests += sum(len(r.get("requests", [r])) for r in doc["requests"])
    click.echo(
        f"wrote {len(paths)} sessions to {out}: {requests} requests "
        f"({subagents} sub-agents), {tokens:,} input tokens in {block_size}-token blocks"
    )
