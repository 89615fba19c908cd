"""The scheduler side of the vLLM connector: lookups, load planning, save planning.

Runs in vLLM's scheduler process; no call here waits on the store: a lookup runs
in a small thread pool and vLLM is told "ask me again" (None) until it is done or
past its deadline (a miss). See :mod:`kvstore_client.connectors.vllm` for the flow.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch  # type: ignore[import-not-found, unused-ignore]

from ...keys import leading_run
from ..holder import ClientHolder
from ..naming import embeds_digest, extra_keys
from ..planning import (
    BandwidthMeter,
    LoadPolicy,
    Lookups,
    RequestTracker,
    all_ranks,
)
from ..stats import Counters, record
from .common import (
    NAME,
    KVStoreConnectorMetadata,
    KVStoreWorkerMetadata,
    Setup,
    Transfer,
)

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


class SchedulerSide:
    """One per engine, in the scheduler process."""

    def __init__(self, setup: Setup, kv_cache_config: Any, interval: Counters) -> None:
        self.s = setup
        self._interval = interval
        cfg = setup.cfg
        num_blocks = max(1, int(kv_cache_config.num_blocks))
        total = sum(int(t.size) for t in kv_cache_config.kv_cache_tensors)
        self._bytes_per_token = total / num_blocks / setup.block
        min_hit = cfg.min_hit_tokens if cfg.min_hit_tokens is not None else setup.block
        self._policy = LoadPolicy(min_hit, cfg.prefill_tokens_per_s)
        self._holder = ClientHolder(cfg.master, cfg.timeout_s)
        self._lookups: Lookups[list[bool]] = Lookups(
            cfg.lookup_concurrency, cfg.lookup_timeout_s, cfg.lookup_wait_s
        )
        self._namespaces = setup.all_ns()  # every rank's: a hit needs all shards
        self._trackers: dict[str, RequestTracker] = {}
        self._requests: dict[str, Any] = {}
        self._loads_out: list[Transfer] = []
        self._meter = BandwidthMeter()
        self._holder.start()

    def _ask(self, hashes: list[bytes]) -> list[bool]:
        """Lookup thread: which hashes every rank holds (one batched call per rank)."""
        client = self._holder.get(wait=self.s.cfg.lookup_timeout_s)
        if client is None or not hashes:
            return [False] * len(hashes)
        t0 = time.perf_counter()
        flags = all_ranks([client.batch_exists(ns, hashes) for ns in self._namespaces])
        record(NAME, self._interval, "lookup_seconds", time.perf_counter() - t0)
        return flags

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
            tr = self._trackers[rid] = RequestTracker(rid, self.s.block, request_extra(request))
        self._requests[rid] = request
        if not self.s.may_load:  # kv_producer: saves only, never looks up
            return 0, False
        tokens = request.all_token_ids
        if tr.looked_up_tokens != len(tokens):
            tr.extend_hashes(tokens)
            hashes = list(tr.hashes)
            state, res = self._lookups.poll((rid, len(tokens)), lambda: self._ask(hashes))
            if state == "pending":
                return None, False
            if state == "timeout":
                record(NAME, self._interval, "lookup_timeouts", 1)
            elif state == "error":
                log.warning("kvstore lookup failed: %s", res)
            tr.present = (
                list(res) if state == "done" and isinstance(res, list) else [False] * len(hashes)
            )
            tr.hit_blocks = leading_run(tr.present)
            tr.looked_up_tokens = len(tokens)
            record(NAME, self._interval, "lookups", 1)
            record(NAME, self._interval, "lookup_tokens", len(tokens))
        ext = tr.plan_hit(
            request.num_tokens,
            num_computed_tokens,
            self._policy,
            self._bytes_per_token,
            self._meter.bytes_per_s,
        )
        return ext, ext > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """After blocks were allocated; plans the load of the hit."""
        tr = self._trackers.get(request.request_id)
        if tr is None:
            return
        block_ids = blocks.get_block_ids()[self.s.kv_group]
        if num_external_tokens > 0:
            refs = tr.plan_load(block_ids, num_external_tokens)
            if refs:
                self._loads_out.append(
                    Transfer(
                        tr.req_id,
                        [r.block_id for r in refs],
                        [r.hash for r in refs],
                        [r.index for r in refs],
                    )
                )
            record(NAME, self._interval, "hit_tokens", num_external_tokens)
            tr.decision = "loading"
        elif tr.decision in ("short_hit", "slow_load"):
            name = "skipped_short_blocks" if tr.decision == "short_hit" else "skipped_slow_blocks"
            record(NAME, self._interval, name, tr.skipped_blocks())
            tr.decision = "counted"

    def _plan_save(self, tr: RequestTracker, computed: int, meta: KVStoreConnectorMetadata) -> None:
        req = self._requests.get(tr.req_id)
        if req is None or not self.s.may_save:
            return
        refs, skipped = tr.blocks_to_save(computed, req.all_token_ids)
        record(NAME, self._interval, "skipped_present_blocks", skipped)
        if refs:
            meta.saves.append(
                Transfer(
                    tr.req_id,
                    [r.block_id for r in refs],
                    [r.hash for r in refs],
                    [r.index for r in refs],
                )
            )

    def build_connector_meta(self, scheduler_output: Any) -> KVStoreConnectorMetadata:
        """Once per step: this step's loads and saves."""
        meta = KVStoreConnectorMetadata(loads=self._loads_out)
        self._loads_out = []
        if not self.s.active:
            return meta
        g = self.s.kv_group
        sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tr = self._trackers.get(new.req_id)
            if tr is None:
                continue
            tr.block_ids = list(new.block_ids[g])
            self._plan_save(tr, new.num_computed_tokens + sched.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            tr = self._trackers.get(rid)
            if tr is None:
                continue
            nb = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                if nb is not None:
                    tr.block_ids = list(nb[g])
            elif nb is not None:
                tr.block_ids.extend(nb[g])
            self._plan_save(tr, cached.num_computed_tokens[i] + sched.get(rid, 0), meta)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        """Learn failed loads (those blocks get written again), save outcomes (the
        watermark moves on success; failures are planned again) and bandwidth."""
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(wm, KVStoreWorkerMetadata):
            return
        for rid, idx in wm.failed.items():
            tr = self._trackers.get(rid)
            if tr is not None:
                tr.mark_missing(idx)
        for rid, idx in wm.saved.items():
            tr = self._trackers.get(rid)
            if tr is not None:
                tr.save_done(idx, ok=True)
        for rid, idx in wm.save_failed.items():
            tr = self._trackers.get(rid)
            if tr is not None:
                tr.save_done(idx, ok=False)
        for nbytes, secs in wm.load_samples:
            self._meter.add(nbytes, secs)

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """Saves were copied out during the steps, so blocks can be freed (False)."""
        rid = request.request_id
        self._trackers.pop(rid, None)
        self._requests.pop(rid, None)
        self._lookups.forget(rid)
        return False, None

    def shutdown(self) -> None:
        self._lookups.shutdown()
        self._holder.close()
