"""The transfer bench's goals (concurrency 1, one worker) and how each point meets them.

Each transport is judged against its own ceiling, measured in the same run: the
network paths (tcp://, ucx://) against a bare socket stream, the same-host path
(shm://, one copy through the worker's arena) against a memcpy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .points import Point

__all__ = ["MEMCPY_TARGETS", "SAME_HOST", "TARGETS", "evaluate_targets"]

TARGETS = [  # name, op, block, batch, goal vs Mooncake, goal vs the bare socket
    ("get 1 MiB x32", "get", 1 << 20, 32, 2.0, 0.75),
    ("put 1 MiB x32", "put", 1 << 20, 32, 4.0, 0.65),
    ("get 64 KiB x32", "get", 64 << 10, 32, 2.0, None),
    ("put 64 KiB x32", "put", 64 << 10, 32, 2.0, None),
]
# Same-host transports: their ceiling is a memcpy, not the socket (issue 42's goals).
SAME_HOST = frozenset({"shm"})
MEMCPY_TARGETS = {  # name -> goal as a fraction of memcpy
    "get 1 MiB x32": 0.8,
    "put 1 MiB x32": 0.7,
    "get 64 KiB x32": 0.6,
    "put 64 KiB x32": 0.5,
}
UCX_VS_TCP = 1.0  # ucx:// at least as fast as tcp:// in the same run (issue 24)


def evaluate_targets(
    points: list[Point],
    exists: list[dict[str, Any]],
    socket_gib_s: float,
    socket_range: tuple[float, float] | None = None,
    memcpy_gib_s: float | None = None,
) -> list[dict[str, Any]]:
    """The goals (concurrency 1, one worker) for each kvstore transport; ucx:// is also
    judged against tcp:// in the same run (``vs tcp://``, goal :data:`UCX_VS_TCP`).

    Network transports are judged against the bare socket: ``socket_gib_s`` is the
    median of its runs and ``socket_range`` their (min, max); a goal is "yes" only if
    met even against the fastest run, "no" only if missed even against the slowest,
    else "within noise" (so one noisy run cannot flip the verdict between runs).
    Same-host transports (:data:`SAME_HOST`) are judged against ``memcpy_gib_s`` (the
    better of its runs) instead, never against the socket. ``met`` is the verdict at
    the median.
    """
    by = {(p.system, p.transport, p.key): p for p in points}
    ex = {(e["system"], e["transport"], e["workers"]): e for e in exists}
    out: list[dict[str, Any]] = []

    def add(
        tr: str, name: str, value: float, goal: float, span: tuple[float, float] | None = None
    ) -> None:
        lo, hi = span or (value, value)
        verdict = "yes" if lo >= goal else "no" if hi < goal else "within noise"
        out.append({"transport": tr, "name": name, "value": value, "goal": goal,
                    "met": value >= goal, "range": [lo, hi], "verdict": verdict})  # fmt: skip

    for tr in sorted({p.transport for p in points if p.system == "kvstore"}):
        for name, op, block, batch, vs_mc, vs_sock in TARGETS:
            kv = by.get(("kvstore", tr, (op, block, batch, 1, 1)))
            mc = by.get(("mooncake", "tcp", (op, block, batch, 1, 1)))
            if kv is not None and mc is not None and mc.gib_s > 0:
                add(tr, f"{name} vs Mooncake", kv.gib_s / mc.gib_s, vs_mc)
            if tr in SAME_HOST:
                if kv is not None and memcpy_gib_s:
                    add(tr, f"{name} vs memcpy", kv.gib_s / memcpy_gib_s, MEMCPY_TARGETS[name])
            elif kv is not None and vs_sock is not None and socket_gib_s > 0:
                lo_s, hi_s = socket_range or (socket_gib_s, socket_gib_s)
                span = (kv.gib_s / hi_s, kv.gib_s / lo_s) if lo_s > 0 else None
                add(tr, f"{name} vs bare socket", kv.gib_s / socket_gib_s, vs_sock, span)
            tcp = by.get(("kvstore", "tcp", (op, block, batch, 1, 1)))
            if tr == "ucx" and kv is not None and tcp is not None and tcp.gib_s > 0:
                add(tr, f"{name} vs tcp://", kv.gib_s / tcp.gib_s, UCX_VS_TCP)
        kv_ex, mc_ex = ex.get(("kvstore", tr, 1)), ex.get(("mooncake", "tcp", 1))
        if kv_ex and mc_ex:
            r = kv_ex["keys_per_s"] / mc_ex["keys_per_s"]
            add(tr, "batch_exists x1024 vs batch_is_exist", r, 1.0)
    return out
