"""The connectors' settings, one typed config that rejects what it does not know.
No engine or torch import."""

from __future__ import annotations

import difflib
from collections.abc import Collection
from dataclasses import dataclass, fields
from typing import Any

# Keys SGLang puts into its storage backend's extra config for its own use.
SGLANG_OWN_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})

# The ablation knobs' values, the default first.
SAVE_POLICIES = ("new", "all")
LOOKUP_MODES = ("batch", "per_block", "prefix")
LOAD_MODES = ("auto", "async", "sync")


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_bool(v: object, key: str = "value") -> bool:
    """true/false, 1/0 and the words of ``_TRUE`` / ``_FALSE``; anything else (e.g.
    ``"maybe"``) is a ValueError naming ``key``, never a silent False."""
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in _TRUE + _FALSE:
        return v.strip().lower() in _TRUE
    raise ValueError(
        f"kvstore connector: {key} must be true or false (or {'/'.join(_TRUE)}, "
        f"{'/'.join(_FALSE)}), not {v!r}"
    )


def nearest_key(key: object, known: Collection[str]) -> str | None:
    """The known key a misspelt ``key`` most likely meant (``mastr`` -> ``master``,
    ``lookup_timeout`` -> ``lookup_timeout_s``), or None when none is close."""
    text = str(key).strip().lower().replace("-", "_")
    if text in known:
        return text
    near = difflib.get_close_matches(text, list(known), n=1, cutoff=0.6)
    if near:
        return near[0]
    prefixed = [k for k in known if k.startswith(text) or text.startswith(k)]
    return min(prefixed, key=len) if len(text) >= 4 and prefixed else None


@dataclass(slots=True, frozen=True)
class ConnectorConfig:
    """The connector's settings (vLLM: ``kv_connector_extra_config``; SGLang:
    ``--hicache-storage-backend-extra-config``). An unknown key is an error that
    names it and lists the known ones (a typo never silently falls back to a
    default).

    master               "host:port[,host:port]" of the kvstore master (required;
                         ``kvstore_master`` is accepted as its alias)
    timeout_s            deadline of data calls (get, put), default 5
    lookup_timeout_s     deadline of one prefix lookup, default 0.05; a lookup past
                         it is a miss, never a stalled scheduler
    lookup_wait_s        how long the scheduler waits for a lookup before vLLM is
                         told "ask me again" (it asks on its next step), default 0.002
    lookup_concurrency   lookups in flight at once, default 4
    lookup_max_age_s     vLLM asks again about a request it could not schedule yet;
                         a lookup older than this is made again (blocks may have been
                         evicted while the request queued, and a load planned from
                         the old answer would fail and reschedule it), a younger one
                         is reused; default 0.5, 0 = look up on every ask
    lookup_inline        answer a lookup on the scheduler's own thread when every
                         owner is a same-host worker whose shared index can tell
                         (no I/O, microseconds; default true): the request is
                         scheduled in that step instead of waiting for a lookup
                         thread; false sends every lookup to the lookup threads
    min_hit_tokens       hits shorter than this are recomputed; default one block
    prefill_tokens_per_s the engine's prefill speed, for the load-or-recompute
                         rule; unset = always load
    model_id             overrides the model (and revision) in the namespace
    max_pending_save_mb  unwritten save bytes allowed before new saves are dropped
    max_pending_load_mb  load staging bytes in flight; later loads wait, default 1024
    staging_mb           rows allocated once per direction for the mover path (a CUDA
                         cache, or a host layout that cannot be zero copy): pinned
                         host memory, and on CUDA as much device memory; larger
                         transfers go in chunks; default 256
    load_failure_policy  "recompute" (default: blocks missing at load are recomputed)
                         or "fail" (vLLM fails the request)
    zero_copy            move blocks straight between the paged KV cache and the
                         store with multi-part calls (default true); false, a
                         cache layout whose blocks are not one run of CPU memory,
                         or a CUDA cache copies through the block mover's rows
                         (same stored bytes)
    session_hints        send the sessions hints of requests' kv_transfer_params
                         (``session_id``, ``session_state``) to the store, default true
    save_ended           save the blocks of a request whose session hint says
                         ``ended`` (its session's last turn), default false: no
                         later turn of the session reads them, and each one written
                         to a full store pushes out a block a live session will
                         read (blocks the store holds are kept, and another session
                         that shares them writes them in its own turn)
    save_policy          "new" (default: a request's blocks the store held at lookup
                         are not sent again) or "all" (every full block the request
                         computes or loads is sent; the store still skips keys it
                         holds) -- an ablation baseline
    lookup               "batch" (default: one batched exists per rank namespace),
                         "per_block" (one exists call per block, in order, until the
                         first miss: the naive baseline) or "prefix" (one
                         ``Client.match_prefix`` per rank namespace); hybrid models'
                         state lookups are the same in every mode
    load_mode            "auto" (default: per hit, from the measured load time and
                         step time: sync when the load is shorter than a step, else
                         async; with ``prefill_tokens_per_s`` set, recompute when
                         that costs less than the load, plus a step for an async
                         one), "async" (a hit loads between steps while the request
                         waits in WAITING_FOR_REMOTE_KVS) or "sync" (the load runs in
                         the step that schedules the request, and the worker waits
                         for it before the forward); "sync" is refused for models
                         with several KV cache groups (hybrid), where "auto" always
                         loads asynchronously
    hit_past_local       when the engine's own prefix cache holds more of a prompt
                         than the store's leading run, the hit goes on with the
                         store's blocks after the engine's (default true: a chained
                         key names its whole prefix); false counts only the store's
                         run from the first block -- an ablation baseline; hybrid
                         models never go past it (a hit needs the state at its end)
    """

    master: str
    timeout_s: float = 5.0
    lookup_timeout_s: float = 0.05
    lookup_wait_s: float = 0.002
    lookup_concurrency: int = 4
    lookup_max_age_s: float = 0.5
    lookup_inline: bool = True
    min_hit_tokens: int | None = None
    prefill_tokens_per_s: float | None = None
    model_id: str | None = None
    max_pending_save_mb: int = 1024
    max_pending_load_mb: int = 1024
    staging_mb: int = 256
    load_failure_policy: str = "recompute"
    zero_copy: bool = True
    session_hints: bool = True
    save_ended: bool = False
    save_policy: str = "new"
    lookup: str = "batch"
    load_mode: str = "auto"
    hit_past_local: bool = True

    def ablations(self) -> list[str]:
        """The ablation settings (``save_policy``, ``lookup``, ``load_mode``,
        ``lookup_inline``, ``hit_past_local``) set to something other than their
        default, as "key=value"."""
        pairs = [("save_policy", self.save_policy, SAVE_POLICIES),
                 ("lookup", self.lookup, LOOKUP_MODES),
                 ("load_mode", self.load_mode, LOAD_MODES)]  # fmt: skip
        out = [f"{k}={v}" for k, v, allowed in pairs if v != allowed[0]]
        flags = [("lookup_inline", self.lookup_inline), ("hit_past_local", self.hit_past_local)]
        return out + [f"{k}=false" for k, on in flags if not on]

    @classmethod
    def known_keys(cls) -> list[str]:
        return sorted({f.name for f in fields(cls)} | {"kvstore_master"})

    @classmethod
    def from_dict(cls, d: dict[str, Any], ignore: Collection[str] = ()) -> ConnectorConfig:
        """Parse ``d``; ``ignore`` names keys that belong to the engine, not to us.
        Raises ValueError on a missing master, an unknown key or a bad value."""
        unknown = sorted(set(d) - set(cls.known_keys()) - set(ignore))
        if unknown:
            guesses = [f"{k!r}: did you mean {near!r}?" for k in unknown
                       if (near := nearest_key(k, cls.known_keys()))]  # fmt: skip
            raise ValueError(
                f"kvstore connector: unknown setting(s) {unknown}"
                + (f" ({'; '.join(guesses)})" if guesses else "")
                + f"; known: {cls.known_keys()}"
            )
        master = d.get("master") or d.get("kvstore_master")
        if not master:
            raise ValueError('the kvstore connector needs "master": "HOST:PORT" in its config')

        def opt(k: str, conv: type[float] | type[int]) -> Any:
            v = d.get(k)
            if v in (None, ""):
                return None
            try:
                return conv(v)
            except (TypeError, ValueError):
                raise ValueError(f"kvstore connector: {k} must be a number, not {v!r}") from None

        def num(k: str, conv: type[float] | type[int], default: float, positive: bool) -> Any:
            v = opt(k, conv)
            v = default if v is None else v
            if v < 0 or (positive and v == 0):
                raise ValueError(f"kvstore connector: {k} must be positive, not {v!r}")
            return v

        def choice(k: str, allowed: tuple[str, ...]) -> str:
            v = str(d.get(k, allowed[0]))
            if v not in allowed:
                names = " or ".join(f'"{a}"' for a in allowed)
                raise ValueError(f"kvstore connector: {k} must be {names}, not {v!r}")
            return v

        policy = choice("load_failure_policy", ("recompute", "fail"))
        return cls(
            master=str(master),
            timeout_s=num("timeout_s", float, 5.0, True),
            lookup_timeout_s=num("lookup_timeout_s", float, 0.05, True),
            lookup_wait_s=num("lookup_wait_s", float, 0.002, False),
            lookup_concurrency=num("lookup_concurrency", int, 4, True),
            lookup_max_age_s=num("lookup_max_age_s", float, 0.5, False),
            lookup_inline=parse_bool(d.get("lookup_inline", True), "lookup_inline"),
            min_hit_tokens=opt("min_hit_tokens", int),
            prefill_tokens_per_s=opt("prefill_tokens_per_s", float),
            model_id=d.get("model_id") or None,
            max_pending_save_mb=num("max_pending_save_mb", int, 1024, False),
            max_pending_load_mb=num("max_pending_load_mb", int, 1024, True),
            staging_mb=num("staging_mb", int, 256, True),
            load_failure_policy=policy,
            zero_copy=parse_bool(d.get("zero_copy", True), "zero_copy"),
            session_hints=parse_bool(d.get("session_hints", True), "session_hints"),
            save_ended=parse_bool(d.get("save_ended", False), "save_ended"),
            save_policy=choice("save_policy", SAVE_POLICIES),
            lookup=choice("lookup", LOOKUP_MODES),
            load_mode=choice("load_mode", LOAD_MODES),
            hit_past_local=parse_bool(d.get("hit_past_local", True), "hit_past_local"),
        )
