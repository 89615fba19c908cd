"""The scheduler side of the vLLM connector: lookups, load planning, save planning.

Runs in vLLM's scheduler process; no call here waits on the store: a lookup that
same-host workers' shared indexes can answer is read from them on this thread (no
I/O); any other runs in a small thread pool and vLLM is told "ask me again" (None)
until it is done or past its deadline (a miss). See
:mod:`kvstore_client.connectors.vllm` for the flow.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch  # type: ignore[import-not-found, unused-ignore]

from ...keys import Keys, leading_run
from ...wire import WHERE_ABSENT, WHERE_DRAM, WHERE_SSD
from ..base import StoreConnector
from ..holder import ClientHolder
from ..lookup import kv_lookup
from ..naming import STATE_KIND, embeds_digest, extra_keys
from ..planning import (
    BandwidthMeter,
    LoadPolicy,
    Lookups,
    RequestTracker,
    StepClock,
    all_ranks,
    choose_load,
    hybrid_hit_blocks,
)
from ..sessions import Hint, HintQueue, parse_hint
from ..stats import Counters, record
from .common import (
    NAME,
    KVStoreConnectorMetadata,
    KVStoreWorkerMetadata,
    Setup,
    StateSave,
    Transfer,
)
from .events import StoreEvents

log = logging.getLogger(__name__)


def request_extra(request: Any) -> bytes:
    """The request's ``extra`` key bytes: LoRA (name and path), cache salt,
    multimodal hashes, and a digest of its prompt embeddings if it has them."""
    lora = getattr(request, "lora_request", None)
    mm = getattr(request, "mm_features", None) or []
    emb = getattr(request, "prompt_embeds", None)
    digest = None
    if emb is not None:
        t = emb.detach().cpu().contiguous()
        raw = t.view(-1).view(torch.uint8).numpy().data
        digest = embeds_digest(raw, tuple(t.shape), str(t.dtype))
    return extra_keys(
        lora=getattr(lora, "lora_name", None) if lora is not None else None,
        lora_path=getattr(lora, "lora_path", None) if lora is not None else None,
        cache_salt=getattr(request, "cache_salt", None),
        mm_hashes=[str(getattr(f, "identifier", "")) for f in mm],
        embeds_digest=digest,
    )


Answer = tuple[list[bool], list[bool], list[int]]  # KV present, states present, tiers

HOST, DISK, UNSPECIFIED = "host", "disk", "external_unspecified"  # vLLM's CacheHitSource
_SOURCE = {WHERE_DRAM: HOST, WHERE_SSD: DISK}


def hit_sources(tiers: list[int], indices: list[int], block: int, tokens: int) -> dict[str, int]:
    """A hit's ``tokens`` by the tier that supplies them: the blocks ``indices`` at the
    tier the lookup saw (``wire.WHERE_*``; DRAM is vLLM's "host", SSD its "disk",
    an unknown tier "external_unspecified"), the last block's share cut so the counts
    sum to ``tokens``. Only non-zero counts."""
    out: dict[str, int] = {}
    left = tokens
    for i in indices:
        n = min(block, left)
        if n <= 0:
            break
        src = _SOURCE.get(tiers[i], UNSPECIFIED) if i < len(tiers) else UNSPECIFIED
        out[src] = out.get(src, 0) + n
        left -= n
    if left > 0:
        out[UNSPECIFIED] = out.get(UNSPECIFIED, 0) + left
    return out


def _local_all(
    client: Any, namespaces: list[str], hashes: Sequence[bytes]
) -> tuple[list[bool], bool] | None:
    """Per hash, present in every namespace, from same-host shared indexes only, and
    whether a worker wants to see the lookup too; None when one needs an answer."""
    each = [client.exists_local(ns, hashes) for ns in namespaces]
    if any(e is None for e in each):
        return None
    return all_ranks([e[0] for e in each]), any(e[1] for e in each)


class SchedulerSide(StoreConnector):
    """One per engine, in the scheduler process."""

    def __init__(self, setup: Setup, kv_cache_config: Any, interval: Counters,
                 kv_events: bool = False) -> None:  # fmt: skip
        self.s = setup
        self._interval = interval
        cfg = setup.cfg
        num_blocks = max(1, int(kv_cache_config.num_blocks))
        total = sum(int(t.size) for t in kv_cache_config.kv_cache_tensors)
        self._bytes_per_token = total / num_blocks / setup.block
        min_hit = cfg.min_hit_tokens if cfg.min_hit_tokens is not None else setup.block
        self._policy = LoadPolicy(min_hit, cfg.prefill_tokens_per_s)
        holder = ClientHolder(cfg.master, cfg.timeout_s)
        self._lookups: Lookups[Answer] = Lookups(
            cfg.lookup_concurrency, cfg.lookup_timeout_s, cfg.lookup_wait_s
        )
        self._save_known = cfg.save_policy == "all"  # send blocks the store had too
        self._sync_load = cfg.load_mode == "sync"
        # load_mode auto: per hit, in the step when its load is shorter than a step
        # (models with several KV cache groups load asynchronously: vLLM recomputes a
        # failed load there only from per-request failures).
        self._auto_load = cfg.load_mode == "auto" and len(kv_cache_config.kv_cache_groups) == 1
        self._clock = StepClock()
        self._namespaces = setup.all_ns()  # every rank's: a hit needs all shards
        self._state_ns = setup.all_ns(STATE_KIND)
        self._gids: dict[str, list[list[int]]] = {}  # per request, block ids per group
        self._trackers: dict[str, RequestTracker] = {}
        self._requests: dict[str, Any] = {}
        self._loads_out: list[Transfer] = []
        # Requests with saves shipped: their blocks are held after they finish
        # until the workers' writes have read them (zero-copy saves).
        self._saving: set[str] = set()
        self._meter = BandwidthMeter()
        # Session hints (kv_transfer_params): sent off the scheduler's path.
        self._hint_of: dict[str, Hint] = {}
        self._no_save: set[str] = set()  # requests of a session's last turn (save_ended off)
        self._hint_after_saves: dict[str, tuple[Hint, list[bytes]]] = {}
        self._bad_hint_logged = False
        self._hints = HintQueue(self._send_hint, self._hint_result) if cfg.session_hints else None
        # KV cache events for the blocks the store confirmed (vLLM publishes them when
        # its kv_events_config enables them); requests finished before their saves were
        # confirmed are kept for them until the workers report them finished sending.
        hash_block = int(getattr(kv_cache_config, "hash_block_size", 0) or setup.block)
        on = kv_events and not setup.hybrid
        self._events = StoreEvents(setup.block, hash_block, setup.attn_groups[0]) if on else None
        self._event_src: dict[str, Any] = {}
        # Per request: the tier of each looked-up block, and its hit's tokens by tier.
        self._tiers: dict[str, list[int]] = {}
        self._sources: dict[str, dict[str, int]] = {}
        self.attach(holder)

    def _send_hint(self, hint: Hint, hashes: list[bytes]) -> None:
        """Hint thread: the hint for every rank's namespace."""
        client = self.store_client(self.s.cfg.timeout_s)
        if client is None:
            raise ConnectionError("no kvstore client (master unreachable)")
        for ns in self._namespaces:
            client.session_hint(ns, hint.session, hint.state, hint.ttl, hashes=hashes)

    def _hint_result(self, sent: int, dropped: int) -> None:
        record(NAME, self._interval, "session_hints", sent)
        record(NAME, self._interval, "session_hints_dropped", dropped)

    def _read_hint(self, request: Any, tr: RequestTracker) -> None:
        """A new request: remember its session hint. The session is active while the
        request runs, so an ``active`` hint goes out at once whatever its state (the
        store prefetches the session's prefix); a ``paused`` or ``ended`` state goes
        out when it finishes."""
        if self._hints is None:
            return
        hint, bad = parse_hint(getattr(request, "kv_transfer_params", None))
        if bad is not None:
            record(NAME, self._interval, "session_hints_bad", 1)
            if not self._bad_hint_logged:
                self._bad_hint_logged = True
                log.warning("kvstore connector: session hint ignored (logged once): %s", bad)
            return
        if hint is None:
            return
        self._hint_of[tr.req_id] = hint
        if hint.state == "ended" and not self.s.cfg.save_ended:
            self._no_save.add(tr.req_id)  # its session's last turn: no one reads it later
        tr.extend_hashes(request.all_token_ids)
        now = hint if hint.state == "active" else Hint(hint.session, "active", hint.ttl)
        self._hints.offer(now, list(tr.hashes))

    def _ask(self, hashes: Sequence[bytes]) -> Answer:
        """Lookup thread: which KV blocks every rank holds (as the ``lookup`` setting
        asks: see :func:`kv_lookup`) and, for hybrid models, which boundary states
        (one batched call per rank, in every mode)."""
        client = self.store_client(self.s.cfg.lookup_timeout_s)
        if client is None or not hashes:
            return [False] * len(hashes), [False] * len(hashes), []
        t0 = time.perf_counter()
        if self.s.cfg.lookup == "batch":  # with the tier of each hit (hit sources)
            codes = [client.batch_where(ns, hashes) for ns in self._namespaces]
            kv = all_ranks([[c != WHERE_ABSENT for c in each] for each in codes])
            tiers = [max(t) for t in zip(*codes, strict=True)]
        else:
            kv = kv_lookup(client, self._namespaces, hashes, self.s.cfg.lookup)
            tiers = []  # the ablation modes do not ask: hits of unknown tier
        state: list[bool] = []
        n = leading_run(kv)
        if self.s.hybrid and n:  # states only matter under the KV run
            state = all_ranks([client.batch_exists(ns, hashes[:n]) for ns in self._state_ns])
        record(NAME, self._interval, "lookup_seconds", time.perf_counter() - t0)
        return kv, state, tiers

    def _lookup(
        self, rid: str, n: int, hashes: Sequence[bytes]
    ) -> tuple[str, Answer | BaseException | None]:
        """The lookup's state and result (as :meth:`Lookups.poll`). In the default
        ``batch`` mode, when every owner is a same-host worker whose shared index can
        tell, the lookup runs on this thread with no I/O (microseconds): the request
        is scheduled in this step. A hand-off to the lookup pool costs it a step
        whenever the pool thread gets the GIL later than ``lookup_wait_s``, which a
        busy engine process makes the common case. Anything else goes to the pool."""
        client = self.store_client(0)
        inline = self.s.cfg.lookup_inline and self.s.cfg.lookup == "batch"
        if inline and client is not None and hashes:
            t0 = time.perf_counter()
            try:
                kv = _local_all(client, self._namespaces, hashes)
                n_run = leading_run(kv[0]) if kv is not None else 0
                state: tuple[list[bool], bool] | None = ([], False)
                if kv is not None and self.s.hybrid and n_run:
                    state = _local_all(client, self._state_ns, hashes[:n_run])
            except Exception:  # the pool's lookup will report it
                kv = None
            if kv is not None and state is not None:
                record(NAME, self._interval, "lookup_seconds", time.perf_counter() - t0)
                record(NAME, self._interval, "lookups_local", 1)
                if kv[1] or state[1]:  # the workers see it too (after this answer)
                    self._lookups.fire(lambda: kv_lookup(client, self._namespaces, hashes, "batch"))
                tiers = [WHERE_DRAM if hit else WHERE_ABSENT for hit in kv[0]]  # in the arena
                return "done", (kv[0], state[0], tiers)
        return self._lookups.poll((rid, n), lambda: self._ask(hashes))

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Per waiting request; vLLM may call again for the same request. Returns
        (tokens to load, async), or (None, False) while the lookup runs."""
        if not self.s.active:
            return 0, False
        rid = request.request_id
        tr = self._trackers.get(rid)
        if tr is None:
            tr = self._trackers[rid] = RequestTracker(
                rid,
                self.s.block,
                request_extra(request),
                save_known=self._save_known,
                past_local=self.s.cfg.hit_past_local and not self.s.hybrid,
            )
            self._read_hint(request, tr)
        self._requests[rid] = request
        if not self.s.may_load:  # kv_producer: saves only, never looks up
            return 0, False
        tokens = request.all_token_ids
        # vLLM asks again while the request waits: reuse a recent answer, never an
        # old one (what the store held then may be evicted since)
        stale = time.monotonic() - tr.looked_up_at > self.s.cfg.lookup_max_age_s
        if tr.looked_up_tokens != len(tokens) or stale:
            tr.extend_hashes(tokens)
            hashes = Keys(tr.hashes)  # checked and packed once for every rank's lookup
            state, res = self._lookup(rid, len(tokens), hashes)
            if state == "pending":
                return None, False
            if state == "timeout":
                record(NAME, self._interval, "lookup_timeouts", 1)
            elif state == "error":
                log.warning("kvstore lookup failed: %s", res)
            kv, st, tiers = res if state == "done" and isinstance(res, tuple) else ([], [], [])
            self._tiers[rid] = tiers
            tr.present = list(kv) or [False] * len(hashes)
            tr.state_present = list(st)
            if self.s.hybrid:
                # The state at boundary k covers k blocks; vLLM must compute at
                # least one token, so k stops below the prompt's end.
                cap = (request.num_tokens - 1) // self.s.block
                tr.hit_blocks = hybrid_hit_blocks(tr.present[:cap], tr.state_present[:cap])
            else:
                tr.hit_blocks = leading_run(tr.present)
            tr.looked_up_tokens = len(tokens)
            tr.looked_up_at = time.monotonic()
            record(NAME, self._interval, "lookups", 1)
            record(NAME, self._interval, "lookup_tokens", len(tokens))
        ext = tr.plan_hit(
            request.num_tokens,
            num_computed_tokens,
            self._policy,
            self._bytes_per_token,
            self._meter.bytes_per_s,
        )
        sync = self._sync_load
        if self._auto_load and ext:
            load_s = self._meter.load_seconds(ext * self._bytes_per_token)
            how = choose_load(ext, load_s, self._clock.step_s, self.s.cfg.prefill_tokens_per_s)
            if how == "recompute":  # cheaper than this load, counted as a slow load
                tr.ext_tokens, tr.decision, ext = 0, "slow_load", 0
            sync = how == "sync"
        # Loaded in the step (load_mode sync, or auto): vLLM schedules the request now;
        # the worker loads its blocks in start_load_kv and the forward waits for them.
        tr.sync_load = bool(sync and ext)
        return ext, ext > 0 and not sync

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """After blocks were allocated; plans the load of the hit (hybrid models:
        the KV blocks and the state at the hit's end, into the state group's block
        of that boundary, where vLLM reads the state of a prefix hit)."""
        tr = self._trackers.get(request.request_id)
        if tr is None:
            return
        ids = blocks.get_block_ids()
        if num_external_tokens > 0:
            refs = tr.plan_load(ids[self.s.attn_groups[0]], num_external_tokens)
            t = Transfer(
                tr.req_id,
                [[ids[g][r.index] for r in refs] for g in self.s.attn_groups],
                [r.hash for r in refs],
                [r.index for r in refs],
            )
            if self.s.hybrid and refs:
                k = refs[-1].index + 1
                t.state_ids = [ids[g][k - 1] for g in self.s.state_groups]
                t.state_hash = tr.hashes[k - 1]
            t.sync = tr.sync_load
            self._sources[request.request_id] = hit_sources(
                self._tiers.get(request.request_id, []), [r.index for r in refs],
                self.s.block, num_external_tokens)  # fmt: skip
            if refs:
                self._loads_out.append(t)
            record(NAME, self._interval, "hit_tokens", num_external_tokens)
            tr.decision = "loading"
        elif tr.decision in ("short_hit", "slow_load"):
            name = "skipped_short_blocks" if tr.decision == "short_hit" else "skipped_slow_blocks"
            record(NAME, self._interval, name, tr.skipped_blocks())
            tr.decision = "counted"

    def hit_sources(self, request: Any, num_external_tokens: int) -> dict[str, int]:
        """The request's external hit tokens by tier (see :func:`hit_sources`)."""
        got = self._sources.get(request.request_id)
        if got is None or sum(got.values()) != num_external_tokens:
            return {UNSPECIFIED: num_external_tokens} if num_external_tokens else {}
        return got

    def get_loaded_kv_cache_group_ids(self) -> tuple[int, ...]:
        """The groups a load restores: every attention group and, at the hit's
        boundary, every state group."""
        return tuple(sorted(self.s.attn_groups + self.s.state_groups))

    def _plan_save(self, tr: RequestTracker, computed: int, meta: KVStoreConnectorMetadata) -> None:
        req = self._requests.get(tr.req_id)
        if req is None or not self.s.may_save or tr.req_id in self._no_save:
            return
        refs, skipped = tr.blocks_to_save(computed, req.all_token_ids)
        record(NAME, self._interval, "skipped_present_blocks", skipped)
        gids = self._gids.get(tr.req_id)
        if refs and gids is not None:
            self._saving.add(tr.req_id)
            meta.saves.append(
                Transfer(
                    tr.req_id,
                    [[gids[g][r.index] for r in refs] for g in self.s.attn_groups],
                    [r.hash for r in refs],
                    [r.index for r in refs],
                )
            )

    def build_connector_meta(self, scheduler_output: Any) -> KVStoreConnectorMetadata:
        """Once per step: this step's loads and saves."""
        self._clock.tick(time.monotonic())
        meta = KVStoreConnectorMetadata(loads=self._loads_out)
        self._loads_out = []
        if not self.s.active:
            return meta
        meta.preempted = sorted(getattr(scheduler_output, "preempted_req_ids", None) or ())
        g = self.s.attn_groups[0]
        sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tr = self._trackers.get(new.req_id)
            if tr is None:
                continue
            self._gids[new.req_id] = [list(b) for b in new.block_ids]
            tr.block_ids = list(new.block_ids[g])
            self._plan_save(tr, new.num_computed_tokens + sched.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            tr = self._trackers.get(rid)
            if tr is None:
                continue
            nb = cached.new_block_ids[i]
            gids = self._gids.setdefault(rid, [[] for _ in nb or ()])
            if rid in cached.resumed_req_ids:
                if nb is not None:
                    self._gids[rid] = gids = [list(b) for b in nb]
            elif nb is not None:
                for have, more in zip(gids, nb, strict=False):
                    have.extend(more)
            if gids:
                tr.block_ids = list(gids[g])
            self._plan_save(tr, cached.num_computed_tokens[i] + sched.get(rid, 0), meta)
        if self.s.hybrid and self.s.may_save:
            self._plan_state_saves(scheduler_output, meta)
        return meta

    def _plan_state_saves(self, scheduler_output: Any, meta: KVStoreConnectorMetadata) -> None:
        """The boundary states vLLM offers this step (its committed "align"
        snapshots): one per boundary whose state block exists in every state group
        and whose block hash is known, unless the store held it at lookup (and
        ``save_policy`` is "new")."""
        bs = getattr(scheduler_output, "kv_connector_block_state", None)
        offers = getattr(bs, "boundary_state_offloads", None) or {}
        for rid, entries in offers.items():
            tr = self._trackers.get(rid)
            req = self._requests.get(rid)
            if tr is None or req is None or rid in self._no_save:
                continue
            tr.extend_hashes(req.all_token_ids)
            by_boundary: dict[int, dict[int, int]] = {}
            for group, block_id, boundary in entries:
                by_boundary.setdefault(int(boundary), {})[int(group)] = int(block_id)
            for boundary, blocks in sorted(by_boundary.items()):
                k = boundary // self.s.block
                if boundary % self.s.block or not 0 < k <= len(tr.hashes):
                    continue
                if any(blocks.get(g, 0) == 0 for g in self.s.state_groups):
                    continue  # missing, or vLLM's null block 0: no state there
                known = k - 1 < len(tr.state_present) and tr.state_present[k - 1]
                if known and not self._save_known:
                    record(NAME, self._interval, "skipped_present_blocks", 1)
                    continue
                ids = [blocks[g] for g in self.s.state_groups]
                self._saving.add(rid)
                meta.state_saves.append(StateSave(rid, k - 1, tr.hashes[k - 1], ids))

    def update_connector_output(self, connector_output: Any) -> None:
        """Learn failed loads (those blocks get written again), save outcomes (the
        watermark moves on success; failures are planned again) and bandwidth."""
        sent = getattr(connector_output, "finished_sending", None) or ()
        for rid in sent:
            later = self._hint_after_saves.pop(rid, None)
            if later is not None and self._hints is not None:
                self._hints.offer(*later)
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(wm, KVStoreWorkerMetadata):
            self._worker_meta(wm)
        for rid in sent:  # its last saves' outcomes came with it or before
            self._event_src.pop(rid, None)

    def _worker_meta(self, wm: KVStoreWorkerMetadata) -> None:
        for rid, idx in wm.failed.items():
            tr = self._trackers.get(rid)
            if tr is not None:
                tr.mark_missing(idx)
        for rid, idx in wm.saved.items():
            tr = self._trackers.get(rid)
            if tr is not None:
                tr.save_done(idx, ok=True)
            req = self._requests.get(rid) or self._event_src.get(rid)
            if self._events is not None and req is not None:
                self._events.stored(req, idx)
        for rid, idx in wm.save_failed.items():
            tr = self._trackers.get(rid)
            if tr is not None:
                tr.save_done(idx, ok=False)
        for nbytes, secs in wm.load_samples:
            self._meter.add(nbytes, secs)

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """True (vLLM holds the request's blocks) when saves were shipped for it: the
        workers write straight from the cache, so the blocks are freed only once each
        worker reports the request in ``finished_sending`` (WorkerSide.finished_sends)."""
        rid = request.request_id
        delay = rid in self._saving
        self._saving.discard(rid)
        if delay and self._events is not None:
            self._event_src[rid] = request
        hint = self._hint_of.pop(rid, None)
        tr = self._trackers.get(rid)
        if hint is not None and tr is not None and self._hints is not None:
            tr.extend_hashes(request.all_token_ids)  # the whole chain, output included
            if delay:  # after its last writes, so the store tags blocks it holds
                self._hint_after_saves[rid] = (hint, list(tr.hashes))
            else:
                self._hints.offer(hint, list(tr.hashes))
        self._trackers.pop(rid, None)
        self._tiers.pop(rid, None)
        self._sources.pop(rid, None)
        self._requests.pop(rid, None)
        self._gids.pop(rid, None)
        self._no_save.discard(rid)
        self._lookups.forget(rid)
        return delay, None

    def take_events(self) -> list[Any]:
        """The KV cache events since the last call (see :mod:`.events`)."""
        return self._events.take() if self._events is not None else []

    def shutdown(self) -> None:
        if self._hints is not None:
            self._hints.close()
        self._lookups.shutdown()
        self.close_store()
