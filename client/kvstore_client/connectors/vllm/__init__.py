"""vLLM connector: KV-cache blocks to and from a kvstore cluster (KVConnectorBase_V1).

Load it out of tree::

    --kv-transfer-config '{"kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore_client.connectors.vllm",
        "kv_role": "kv_both", "kv_connector_extra_config": {"master": "HOST:PORT"}}'

Settings (``kv_connector_extra_config``) are those of
:class:`~kvstore_client.connectors.config.ConnectorConfig`; an unknown key is an
error. ``kv_role``: ``kv_producer`` only saves, ``kv_consumer`` only loads.

Shape (as vLLM's own offloading connector): this facade makes one
:class:`~.scheduler.SchedulerSide` in the scheduler process or one
:class:`~.worker.WorkerSide` per worker and delegates each call to it.

- Scheduler process (never waits on the store). ``get_num_new_matched_tokens``
  hashes the request's full blocks (chained xxh3-128 of token ids plus LoRA name and
  path / cache salt / multimodal / prompt-embedding keys, see
  :mod:`kvstore_client.connectors.naming`) and looks them up (every rank's
  namespace, batched): from same-host workers' shared indexes on its own thread
  when they can tell (``lookup_inline``), else in a small pool; until it answers
  vLLM hears "ask me again" (None); past ``lookup_timeout_s`` it is a miss. A full
  hit is capped at ``num_tokens - 1``; hits shorter than ``min_hit_tokens`` or
  slower to load than to recompute are skipped and counted. Under the default
  ``load_mode: auto`` a hit loads in the step that schedules the request when its
  load is shorter than a step (the worker waits for it in ``start_load_kv``), else
  asynchronously (the request waits in WAITING_FOR_REMOTE_KVS). The
  ``lookup`` and ``save_policy`` settings switch the lookup and the save plan to
  the ablation baselines (see ConnectorConfig). ``build_connector_meta`` ships the loads and, per
  scheduled request, the full blocks past its save watermark the store lacks. The
  watermark moves when the workers confirm the save, so a failed or dropped save
  is planned again (up to three attempts).
- Worker process: see :mod:`kvstore_client.connectors.vllm.worker`.

Hybrid models (``SupportsHMA``: full-attention groups plus Mamba-style state
groups in vLLM's "align" mode): KV blocks go under the namespace, the recurrent
state vLLM offers at each committed block boundary under ``.../state`` with the
hash of the block ending there; a hit of k blocks needs KV blocks 0..k-1 and the
state at k, and loads both (the state into the state group's block k-1, where vLLM
reads a prefix hit's state), or fails the request's load as a whole. Group kinds
it cannot serve (sliding window, state without "align", a pure state model, ...)
switch the connector off with one warning: never a wrong hit.
Context parallelism (DCP / PCP) is refused at start (see docs/CONNECTORS.md).
"""

from __future__ import annotations

import sys
import time
import weakref
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found, unused-ignore]
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from ..config import ConnectorConfig
from ..stats import Counters, stats_empty
from .common import (
    KVStoreConnectorMetadata,
    KVStoreConnectorStats,
    KVStorePromMetrics,
    KVStoreWorkerMetadata,
    _ranks,
    make_setup,
)
from .scheduler import SchedulerSide
from .worker import WorkerSide

__all__ = [
    "KVStoreConnector",
    "KVStoreConnectorMetadata",
    "KVStoreConnectorStats",
    "KVStoreWorkerMetadata",
    "check_settings",
    "wait_for_saves",
]


def check_settings(extra_config: Any) -> ConnectorConfig:
    """Parse ``kv_connector_extra_config`` as the connector will: a ValueError naming an
    unknown key and the nearest known one, or a bad value and its key."""
    if not isinstance(extra_config, dict):
        raise ValueError(
            f"kvstore connector: kv_connector_extra_config must be a JSON object, "
            f"not {type(extra_config).__name__}"
        )
    return ConnectorConfig.from_dict(dict(extra_config))


def _check_at_config_time() -> None:
    """Check the settings while vLLM builds its config, seconds into ``vllm serve``.

    The connector itself is made only once the model is loaded and the KV cache sized
    (tens of seconds later), so a typo in ``kv_connector_extra_config`` used to show
    only then. vLLM imports this module from ``KVConnectorFactory.get_connector_class``
    while ``VllmConfig`` is being built (it asks the class whether it supports the
    hybrid KV cache manager), before any model loading: the calling frames hold that
    ``kv_transfer_config``. When one of them names this module, its extra config is
    checked here and a mistake fails the start at once. Nothing is checked (and
    nothing fails) when the module is imported any other way; the connector checks
    the same settings again when it is made."""
    frame = sys._getframe(1)
    for _ in range(64):
        if frame is None:
            return
        ktc = frame.f_locals.get("kv_transfer_config")
        if ktc is not None and getattr(ktc, "kv_connector_module_path", None) == __name__:
            check_settings(getattr(ktc, "kv_connector_extra_config", None) or {})
            return
        frame = frame.f_back  # type: ignore[assignment]


_check_at_config_time()

# Live worker-side connectors of this process, for wait_for_saves().
_LIVE: weakref.WeakSet[KVStoreConnector] = weakref.WeakSet()


def wait_for_saves(timeout: float = 30.0) -> bool:
    """Block until every write handed off by this process's connectors is done.

    For tests and graceful shutdown; the engine itself never waits for writes.
    Returns False if some were still running at the deadline."""
    deadline = time.monotonic() + timeout
    return all(c.drain_saves(max(0.0, deadline - time.monotonic())) for c in list(_LIVE))


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """See the module docstring. One instance per role (scheduler, each worker)."""

    worker_side: type[WorkerSide] = WorkerSide  # what a worker process runs

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        kvt = self._kv_transfer_config
        self._setup = s = make_setup(vllm_config, kv_cache_config, kvt)
        self._interval = Counters()
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            # A block missing at load is a cache miss: recompute it rather than fail
            # the request (vLLM's default policy is "fail"; it reads the policy
            # after making the connector). "load_failure_policy": "fail" keeps it.
            if s.cfg.load_failure_policy == "recompute":
                kvt.kv_load_failure_policy = "recompute"
            kev = getattr(vllm_config, "kv_events_config", None)
            events = bool(getattr(kev, "enable_kv_cache_events", False))
            self._sched = SchedulerSide(s, kv_cache_config, self._interval, kv_events=events)
            self._ns = s.ns(0, 0)
        else:
            from ..naming import resolve_ranks

            ranks = resolve_ranks(_ranks(), s.tp_size, s.pp_size)
            self._worker = self.worker_side(s, kv_cache_config, self._interval, ranks)
            self._ns = self._worker.ns
            _LIVE.add(self)

    # ---- properties the engine reads ----------------------------------------------

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache: a dropped save is a future miss, not a lost hand-off."""
        return False

    @property
    def namespace(self) -> str:
        """This side's namespace (the scheduler: rank 0's)."""
        return self._ns

    # ==== scheduler side ============================================================

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Scheduler, per waiting request; never blocks on the store. Returns
        (tokens to load, async), or (None, False): "ask me again"."""
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Scheduler, after blocks were allocated; plans the load of the hit."""
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVStoreConnectorMetadata:
        """Scheduler, once per step: this step's loads and saves."""
        assert self._sched is not None
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        """Scheduler: failed loads, save outcomes, load bandwidth from the workers."""
        assert self._sched is not None
        self._sched.update_connector_output(connector_output)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler, once per request: True (blocks held until the workers report
        the request in ``finished_sending``) when saves were shipped for it."""
        assert self._sched is not None
        return self._sched.request_finished(request)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler, once per request of a several-group model: as request_finished."""
        assert self._sched is not None
        return self._sched.request_finished(request)

    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> dict[Any, int]:
        """Scheduler, after ``update_state_after_alloc``: the hit's tokens by the store
        tier that held them when looked up (DRAM: ``host``, SSD: ``disk``; a worker
        that cannot tell, or the ablation lookups: ``external_unspecified``), for
        vLLM's per-source prefix-cache metrics."""
        if self._sched is None or not num_external_tokens:
            return {}
        from vllm.v1.metrics.cache_hit_source import (  # type: ignore[import-not-found, unused-ignore]
            CacheHitSource,
        )

        got = self._sched.hit_sources(request, num_external_tokens)
        return {CacheHitSource(k): v for k, v in got.items() if v}

    def take_events(self) -> list[Any]:
        """Scheduler, each step: the store's newly confirmed blocks as KV cache events
        (``BlockStored``, medium CPU, locality REMOTE) when the engine publishes KV
        events; see :mod:`.events`."""
        return self._sched.take_events() if self._sched is not None else []

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        """Scheduler: the groups a load restores (attention and, for hybrid models,
        the state at the hit's boundary)."""
        assert self._sched is not None
        return self._sched.get_loaded_kv_cache_group_ids()

    def get_kv_connector_stats(self) -> KVStoreConnectorStats | None:
        """Either side: this interval's counters (None when nothing happened)."""
        d = self._interval.take()
        return None if stats_empty(d) else KVStoreConnectorStats(data=d)

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVStoreConnectorStats | None:
        return KVStoreConnectorStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVStorePromMetrics:
        """vLLM's /metrics: the connector's counters as ``vllm:kvstore_*``."""
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ==== worker side ===============================================================

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Worker, once: the paged KV tensors, one per layer (in model order)."""
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Worker, before a step's forward: wait for writes still reading the blocks
        of requests preempted this step (vLLM frees those blocks at once)."""
        assert self._worker is not None
        self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Worker, each step: start this step's loads (never blocks on the store,
        except with ``load_mode: sync``: then it returns once they are in the cache)."""
        assert self._worker is not None
        self._worker.start_load_kv(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for per layer: asynchronous loads land between steps, and
        synchronous ones are complete when ``start_load_kv`` returns."""
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Worker, each step, non-blocking: finished requests whose writes are done
        (their blocks may be freed), and requests whose loads are complete."""
        assert self._worker is not None
        sent = self._worker.finished_sends(finished_req_ids)
        done, _ = self._worker.done_loads()
        return (sent or None), (done or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Worker, each step, non-blocking: loads complete, and (several-group models)
        those that lost blocks, per request, as vLLM requires for them."""
        assert self._worker is not None
        sent = self._worker.finished_sends(finished_req_ids)
        done, failed = self._worker.done_loads()
        if len(self._kv_cache_config.kv_cache_groups) > 1:
            self._worker.block_ids_with_load_errors()
        else:
            failed = set()
        return KVConnectorTransferResults(
            finished_sending=sent, finished_recving=done, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Worker: block ids that were hits at lookup but did not arrive (recompute)."""
        assert self._worker is not None
        return self._worker.block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVStoreWorkerMetadata | None:
        """Worker, each step: failed loads, save outcomes, bandwidth samples."""
        assert self._worker is not None
        return self._worker.take_meta()

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Worker, after each attention layer: plans the step's saves once; no copy
        here (the writer reads the registered tensors after the step)."""
        assert self._worker is not None
        self._worker.save_kv_layer(layer_name, self._connector_metadata)

    def wait_for_save(self) -> None:
        """Worker, once per step: hand the step's blocks to the background writer
        (on CUDA: one event recorded on the forward's stream; never a device sync)."""
        assert self._worker is not None
        self._worker.wait_for_save(self._connector_metadata)

    def reset_cache(self) -> bool:
        """Scheduler, on the engine's prefix-cache reset (``reset_prefix_cache``, e.g.
        after a weight update): True, and the shared store is left as it is. Its
        blocks belong to every engine of the same model identity, not to this one,
        and are addressed by that identity (model, revision, quantization, KV dtype,
        layout): an engine whose weights changed must run under a new identity
        (e.g. ``revision``), whose namespaces share nothing with the old. Dropping
        the store's blocks is an operator's call, never one engine's."""
        return True

    def finish_forward(self) -> None:
        """Worker, right after the forward (the model no longer reads this step's
        KV): the step's saves are handed over here, as ``wait_for_save`` would (which
        then has nothing left): on CUDA the gather is queued after the forward and
        the forward's stream waits for it, before anything reuses the blocks."""
        if self._worker is not None and self._connector_metadata is not None:
            self._worker.wait_for_save(self._connector_metadata)

    def reset_capture_state(self) -> None:
        """Worker, after CUDA graph capture: the hooks do nothing while capturing;
        forget any step state from it."""
        if self._worker is not None:
            self._worker.reset_capture_state()

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """False: nothing happens per layer inside the forward (``save_kv_layer``
        only plans, ``wait_for_layer_load`` has nothing to wait for), and the
        per-step hooks run outside captured graphs, so full CUDA graphs replay
        safely. vLLM asks while it builds its config (with CUDA graphs on), so the
        settings are checked here too: a mistake fails the start at once."""
        check_settings(extra_config)
        return False

    def drain_saves(self, timeout: float) -> bool:
        """Worker side: wait up to ``timeout`` seconds for the writes handed off so far;
        False if some were still running then. The scheduler side has none (True)."""
        return self._worker is None or self._worker.drain_saves(timeout)

    def shutdown(self) -> None:
        """Either side: let queued writes finish (bounded), then close the client."""
        if self._worker is not None:
            self._worker.shutdown()
        if self._sched is not None:
            self._sched.shutdown()
