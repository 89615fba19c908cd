"""Synthetic coding-agent traces in the agentic JSON format (``kvstore bench synth``).

Sessions follow the workload shape of the design brief: ~33 turns per session
(log-normal spread), each turn adding ~2.2K input tokens on average, input:output ~131:1,
think-time pauses log-normal with median ~5 s and p99 ~80 s, a tool/system prompt shared
by every session, and sub-agents that fork from the parent's context (their first block
ids are the parent's ids at the fork, then their own). A sub-agent starts when the
parent's request that launched it ends and runs alongside the parent (as in the real
traces, where the parent's next turn can land while a sub-agent is still running), so
``think_time`` keeps its own distribution. A context that would exceed the model window
is compacted to the shared prefix plus a summary, as agents do.

Output documents carry the same fields as the real files, so
:func:`traces.load_agentic` reads them back. They use ``hash_id_scope: "global"`` with a
``hash_id_space`` naming the generator run, because the shared prefix is the same blocks
in every session: load the files of one run together to see cross-session hits.
Generation is a pure function of (sessions, seed, block_size, shape).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["SynthShape", "generate", "write"]

_Z99 = 2.3263478740408408  # standard normal 99th percentile


@dataclass(frozen=True, slots=True)
class SynthShape:
    """Knobs of the generated workload; the defaults follow the design brief."""

    turns_median: float = 33.0
    """Median parent turns per session (log-normal, sigma ``turns_sigma``)."""
    turns_sigma: float = 0.5
    turn_tokens_mean: float = 2200.0
    """Mean input tokens added per turn (log-normal, sigma ``turn_tokens_sigma``)."""
    turn_tokens_sigma: float = 1.0
    first_user_tokens: float = 1500.0
    """Median tokens of the first user message, after the shared prefix."""
    io_ratio: float = 131.0
    """Total input tokens / total output tokens."""
    think_median_s: float = 5.0
    think_p99_s: float = 80.0
    tool_tokens: int = 12_000
    system_tokens: int = 2_800
    streaming_fraction: float = 0.1
    """Share of requests of type "s" (the rest are "n")."""
    subagent_prob: float = 0.03
    """Chance that a parent turn (not the last) starts a sub-agent."""
    subagent_turns_median: float = 8.0
    subagent_task_tokens: float = 800.0
    """Median tokens of a sub-agent's task prompt, after the forked context."""
    context_limit: int = 190_000
    """A context about to exceed this is compacted to the shared prefix + a summary."""
    summary_tokens: int = 12_000
    model: str = "synth-model"
    subagent_model: str | None = None
    """Model of sub-agents; None = the parent's (so the forked prefix is shareable)."""


def generate(
    sessions: int, seed: int, block_size: int = 64, shape: SynthShape | None = None
) -> list[dict[str, Any]]:
    """Generate ``sessions`` agentic conversation documents, deterministic in ``seed``.

    Returns one JSON-serialisable dict per session (fields as in the real agentic
    files: id, models, block_size, hash_id_scope, hash_id_space, tool_tokens,
    system_tokens, requests, totals). ``hash_ids`` of a request are the ids of its full
    ``block_size``-token input blocks (``in // block_size`` of them); ids of one run form
    one space: the shared prefix has the same ids in every session and a sub-agent's
    first ids are its parent's. Raises ValueError for a negative ``sessions`` or a
    non-positive ``block_size``.
    """
    if type(sessions) is not int or sessions < 0:
        raise ValueError(f"sessions must be a non-negative int, got {sessions!r}")
    if type(block_size) is not int or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    gen = _Gen(np.random.default_rng(seed), block_size, shape or SynthShape())
    space = f"synth-s{seed}-b{block_size}"
    return [gen.session(f"synth_{seed}_{i:04d}", space) for i in range(sessions)]


def write(
    dir: str | os.PathLike[str],
    sessions: int,
    seed: int,
    block_size: int = 64,
    shape: SynthShape | None = None,
) -> list[Path]:
    """Generate as :func:`generate` and write one ``<id>.json`` per session into ``dir``.

    Creates ``dir`` if needed, overwrites files of the same name, returns the paths in
    session order.
    """
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    for doc in generate(sessions, seed, block_size, shape):
        p = out / f"{doc['id']}.json"
        p.write_text(json.dumps(doc, separators=(",", ":")) + "\n", encoding="utf-8")
        paths.append(p)
    return paths


class _Gen:
    """One generator run: the random stream and the id counter shared by all sessions."""

    def __init__(self, rng: np.random.Generator, block_size: int, shape: SynthShape) -> None:
        self.rng = rng
        self.bs = block_size
        self.sh = shape
        self.prefix_tokens = shape.tool_tokens + shape.system_tokens
        n_shared = self.prefix_tokens // block_size
        self.shared_ids = list(range(1, n_shared + 1))
        self.next_id = n_shared + 1
        self.think_sigma = math.log(shape.think_p99_s / shape.think_median_s) / _Z99
        # Per-turn growth: log-normal with the requested mean.
        s = shape.turn_tokens_sigma
        self.inc_mu = math.log(shape.turn_tokens_mean) - s * s / 2

    # -- random draws (Python scalars, so the documents serialise as plain JSON) --

    def _lognormal(self, median: float, sigma: float) -> float:
        return float(self.rng.lognormal(math.log(median), sigma))

    def _think(self) -> float:
        return round(self._lognormal(self.sh.think_median_s, self.think_sigma), 3)

    def _increment(self) -> int:
        return max(1, round(float(self.rng.lognormal(self.inc_mu, self.sh.turn_tokens_sigma))))

    def _output(self, tin: int) -> int:
        noise = float(self.rng.lognormal(-0.125, 0.5))  # mean 1
        return max(1, round(tin / self.sh.io_ratio * noise))

    def _kind(self) -> str:
        return "s" if float(self.rng.random()) < self.sh.streaming_fraction else "n"

    @staticmethod
    def _api_time(tin: int, tout: int) -> float:
        return round(0.8 + tin * 1.5e-5 + tout / 60.0, 2)

    def _extend(self, ctx: list[int], tokens: int) -> list[int]:
        """Grow the context's id chain to cover the full blocks of ``tokens`` tokens."""
        need = tokens // self.bs
        missing = need - len(ctx)
        if missing > 0:
            ctx.extend(range(self.next_id, self.next_id + missing))
            self.next_id += missing
        return ctx[:need]

    def _turns(self, median: float) -> int:
        return max(1, round(self._lognormal(median, self.sh.turns_sigma)))

    # -- documents --

    def session(self, sid: str, space: str) -> dict[str, Any]:
        sh = self.sh
        ctx = list(self.shared_ids)
        tin = self.prefix_tokens + max(1, round(self._lognormal(sh.first_user_tokens, 0.8)))
        n_turns = self._turns(sh.turns_median)
        requests: list[dict[str, Any]] = []
        models = [sh.model]
        p_in = p_out = s_in = s_out = n_sub = 0
        t = 0.0
        think = 0.0
        for i in range(n_turns):
            last = i == n_turns - 1
            tout = self._output(tin)
            api = self._api_time(tin, tout)
            req = self._request(t, sh.model, tin, tout, self._extend(ctx, tin), api, think, last)
            requests.append(req)
            p_in += tin
            p_out += tout
            resume = t + api  # earliest time the next turn can start
            if not last and float(self.rng.random()) < sh.subagent_prob:
                n_sub += 1
                sub, sub_in, sub_out = self._subagent(n_sub, resume, ctx[: tin // self.bs])
                requests.append(sub)
                s_in += sub_in
                s_out += sub_out
                if sub["models"][0] not in models:
                    models.append(sub["models"][0])
            next_t = round(resume + self._think(), 3)
            think = round(next_t - t - api, 3)
            t = next_t
            tin += self._increment()
            if tin > sh.context_limit:  # compaction: shared prefix + a fresh summary
                ctx = list(self.shared_ids)
                tin = self.prefix_tokens + sh.summary_tokens
        doc: dict[str, Any] = {
            "id": sid,
            "models": models,
            "block_size": self.bs,
            "hash_id_scope": "global",
            "hash_id_space": space,
            "tool_tokens": sh.tool_tokens,
            "system_tokens": sh.system_tokens,
            "requests": requests,
            "totals": {
                "parent_tokens": {"input": p_in, "output": p_out},
                "subagent_tokens": {"input": s_in, "output": s_out},
                "combined_tokens": {"input": p_in + s_in, "output": p_out + s_out},
                "subagent_count": n_sub,
            },
        }
        return doc

    def _request(
        self,
        t: float,
        model: str,
        tin: int,
        tout: int,
        ids: list[int],
        api: float,
        think: float,
        last: bool,
    ) -> dict[str, Any]:
        return {
            "t": round(t, 3),
            "type": self._kind(),
            "model": model,
            "in": tin,
            "out": tout,
            "hash_ids": ids,
            "input_types": ["text"],
            "output_types": ["text"] if last else ["text", "tool_use"],
            "stop": "end_turn" if last else "tool_use",
            "api_time": api,
            "think_time": think,
        }

    def _subagent(self, n: int, start: float, fork: list[int]) -> tuple[dict[str, Any], int, int]:
        """A sub-agent entry starting at ``start`` whose context begins with ``fork``.

        Returns the entry and its total input and output tokens.
        """
        sh = self.sh
        model = sh.subagent_model or sh.model
        # Only the forked full blocks are shared; the partial block after them is the
        # sub-agent's own, so its context starts on the block boundary.
        ctx = list(fork)
        base = len(fork) * self.bs
        tin = base + max(self.bs, round(self._lognormal(sh.subagent_task_tokens, 0.8)))
        n_turns = self._turns(sh.subagent_turns_median)
        reqs: list[dict[str, Any]] = []
        t = 0.0
        think = 0.0
        total_in = total_out = 0
        end = 0.0
        for i in range(n_turns):
            last = i == n_turns - 1
            tout = self._output(tin)
            api = self._api_time(tin, tout)
            reqs.append(
                self._request(t, model, tin, tout, self._extend(ctx, tin), api, think, last)
            )
            total_in += tin
            total_out += tout
            end = t + api
            if last:
                break
            think = self._think()
            t = round(t + api + think, 3)
            tin += self._increment()
            if tin > sh.context_limit:
                ctx = list(self.shared_ids)
                tin = self.prefix_tokens + sh.summary_tokens
        entry = {
            "t": round(start, 3),
            "type": "subagent",
            "agent_id": f"agent_{n:03d}",
            "subagent_type": "general-purpose",
            "duration_ms": round(end * 1000),
            "total_tokens": reqs[-1]["in"] + reqs[-1]["out"],
            "tool_use_count": n_turns - 1,
            "status": "completed",
            "requests": reqs,
            "models": [model],
            "tool_tokens": sh.tool_tokens,
            "system_tokens": sh.system_tokens,
        }
        return entry, total_in, total_out
