"""The worker side of the vLLM connector: moves block bytes between vLLM's paged KV
cache and the store, through the block mover of :mod:`..blockcopy`.

Two paths, one stored byte order (a block written by one reads with the other):

- **Host zero copy** (a CPU cache whose blocks are one run of memory each, and
  ``zero_copy`` on): each block is the list of its per-layer runs in the cache,
  given to the client's multi-part calls: ``start_load_kv`` starts one
  ``batch_get_into_parts`` per request straight into its blocks (in-flight bytes
  capped by ``max_pending_load_mb``); the background writer does one
  ``batch_put_parts`` reading the cache.
- **Mover** (a CUDA cache, a CPU layout that is not one run per block, or
  ``zero_copy`` off): rows allocated once at ``register_kv_caches``
  (``staging_mb`` per direction: pinned host rows, and on CUDA as many device
  rows). A save's step hook (``finish_forward``, else ``wait_for_save``) queues the
  gather of the step's blocks into device rows on a side stream after an event on
  the forward's stream, and makes the forward's stream wait for that gather (so
  nothing reuses a block before it is read); the background writer downloads
  them to the pinned rows (DMA), waits for the
  ticket (in its own thread) and puts the rows. A load runs in the loader thread:
  the store's bytes land in the pinned rows, are uploaded and scattered into the
  cache on the load stream; the request is reported finished receiving only once
  that ticket is done (``load_mode: sync``: the forward's stream waits for it,
  the host does not). Transfers larger than the rows go in chunks.

Since the writer reads the cache after the step, a finished request's blocks are
held (the scheduler's ``request_finished`` returns True) until
:meth:`WorkerSide.finished_sends` reports its writes done, and
``handle_preemptions`` waits for writes of preempted requests. Nothing in the
forward's hooks synchronizes the device, and nothing runs while a CUDA graph is
being captured.

MLA at tensor parallel > 1: every rank holds the same latent cache, so all ranks
share one namespace (``tp0of1``), each rank writes the blocks whose index is its
rank modulo the TP size, and every rank loads them all.

Hybrid models: a stored KV value is one block of every layer of the attention
groups; a stored state value is one block of every layer of the state groups (the
recurrent state after that many tokens), under the state namespace with the hash
of the block that ends at that boundary. A hybrid load fills the KV blocks and the
state block together, or reports the request as failed (never KV without state).
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import logging
import threading
import time
from collections import deque
from typing import Any

from ...client import Client
from ...keys import leading_run
from ...transport.pins import ArenaPins, ArenaSlots
from .. import blockcopy as bc
from ..base import StoreConnector
from ..holder import ClientHolder
from ..naming import STATE_KIND
from ..planning import StagingBudget
from ..stats import Counters, record
from .common import NAME, KVStoreConnectorMetadata, KVStoreWorkerMetadata, Setup, Transfer
from .jobs import Loaded, PendingLoad, Rows, StepSave, make_rows

log = logging.getLogger(__name__)


class WorkerSide(StoreConnector):
    """One per worker process (TP / PP rank)."""

    def __init__(self, setup: Setup, kv_cache_config: Any, interval: Counters,
                 ranks: tuple[int, int, int, int]) -> None:  # fmt: skip
        self.s = setup
        self._interval = interval
        tp, _, pp, _ = ranks
        self._tp = tp
        self.ns = setup.ns(tp, pp)
        self.state_ns = setup.ns(tp, pp, STATE_KIND)
        self._num_blocks = int(kv_cache_config.num_blocks)
        self._group_of: dict[str, tuple[str, int]] = {}
        for j, g in enumerate(setup.attn_groups):
            for name in kv_cache_config.kv_cache_groups[g].layer_names:
                self._group_of[name] = ("kv", j)
        for j, g in enumerate(setup.state_groups):
            for name in kv_cache_config.kv_cache_groups[g].layer_names:
                self._group_of[name] = ("state", j)
        # With session hints on, the scheduler's client sends them and this one
        # writes the sessions' blocks: its puts are marked so session shares apply.
        writer = functools.partial(Client, session_writer=setup.cfg.session_hints)
        holder = ClientHolder(setup.cfg.master, setup.cfg.timeout_s, factory=writer,
                              on_connect=self._connected_now)  # fmt: skip
        self._layers: dict[str, bc.LayerGeometry] = {}
        self._state_layers: dict[str, bc.LayerGeometry] = {}
        self._block_bytes = 0
        self._state_bytes = 0
        self._budget = StagingBudget(setup.cfg.max_pending_load_mb << 20)
        self._queued: deque[Transfer] = deque()
        self._loads: dict[str, PendingLoad] = {}
        self._invalid: set[int] = set()
        self._meta = KVStoreWorkerMetadata()
        self._meta_lock = threading.Lock()
        self._step: StepSave | None = None
        self._step_seen = False
        self._handed: Any = None  # the step metadata whose saves were handed over
        self._save_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="kvstore-save")
        self._load_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="kvstore-load")
        # Loads of this step (the forward waits for them) never queue behind the
        # asynchronous jobs: their own thread, the rows taken in turn (``_rows_lock``).
        self._sync_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="kvstore-load-now")
        self._rows_lock = threading.Lock()
        self._save_futs: list[cf.Future[None]] = []
        self._pending_save_bytes = 0
        self._save_lock = threading.Lock()
        # Delayed freeing (saves read the cache after the step): requests that had
        # saves planned, their saves not yet written, and those finished.
        self._saving: dict[str, int] = {}
        self._had_saves: set[str] = set()
        self._finishing: set[str] = set()
        self._zero_copy = False
        self.mover: bc.HostMover | bc.CudaMover = bc.HostMover()
        self._rows: dict[str, Rows] = {}  # "load", "save", "state_load", "state_save"
        self._last_load: bc.Ticket = bc.DONE  # the loader's last copy out of its rows
        self._registered = bc.Registrations()  # arenas page-locked for DMA
        self.attach(holder)

    # ---- set-up ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Once: the paged cache tensors, one per layer (in model order); a state
        layer may hold several tensors (e.g. conv and SSM state). Allocates the
        mover path's rows (never again afterwards)."""
        if not self.s.active:
            return
        off = {"kv": 0, "state": 0}
        device = None
        for name, value in kv_caches.items():
            kind, group = self._group_of.get(name, ("kv", 0))
            tensors = list(value) if isinstance(value, list | tuple) else [value]
            for i, t in enumerate(tensors):
                layer = bc.describe(t, self._num_blocks, off[kind], group)
                key = name if len(tensors) == 1 else f"{name}#{i}"
                (self._layers if kind == "kv" else self._state_layers)[key] = layer
                off[kind] += layer.nbytes
                device = t.device if device is None else device
        self._block_bytes, self._state_bytes = off["kv"], off["state"]
        every = [*self._layers.items(), *self._state_layers.items()]
        why = next((f"layer {n}: {ly.why_not}" for n, ly in every if ly.flat is None), "")
        if not self.s.cfg.zero_copy:
            why = "zero_copy is off in the connector's config"
        self._zero_copy = not why
        if why and device is not None:
            self.mover = bc.mover_for(device)
            self._make_all_rows(device)
            path = "CUDA streams" if self.mover.device_rows else "staging rows"
            log.info("kvstore connector: blocks move through %s: %s", path, why)
            if (client := self.store_client()) is not None:
                self._connected_now(client)  # connected first: register its arenas now
        log.info("kvstore connector: %d KV layers (%d bytes per block), %d state tensors "
                 "(%d bytes per state), namespace %s", len(self._layers), off["kv"],
                 len(self._state_layers), off["state"], self.ns)  # fmt: skip

    def _make_all_rows(self, device: Any) -> None:
        budget = self.s.cfg.staging_mb << 20
        on_dev = self.mover.device_rows
        if self._block_bytes:
            cap = max(1, budget // self._block_bytes)
            for d in ("load", "save"):
                self._rows[d] = make_rows(cap, self._block_bytes, device, on_dev)
        if self._state_bytes:
            cap = max(1, min(64, budget // self._state_bytes))
            for d in ("state_load", "state_save"):
                self._rows[d] = make_rows(cap, self._state_bytes, device, on_dev)

    def _parts(self, state: bool, ids: list[list[int]], n: int) -> list[list[memoryview]]:
        layers = list((self._state_layers if state else self._layers).values())
        return [bc.value_views(layers, ids, row) for row in range(n)]

    # ---- loads --------------------------------------------------------------------

    def _get(self, ns: str, hashes: list[bytes], dest: list[Any],
             client: Client | None = None) -> cf.Future[list[bool]]:  # fmt: skip
        """The one store read: blocks ``hashes`` into ``dest`` (a future): per block
        the list of its parts in the cache (zero copy: one multi-part read), or a
        byte view of a host row (mover path). Without ``client`` (the step's thread:
        never blocks) a client still connecting (the engine just started) is waited
        for on the loader thread, bounded by ``timeout_s`` as saves wait: a hit is
        never thrown away because the connection was not up yet."""
        client = client or self.store_client()
        if client is None:
            return self._load_pool.submit(self._get_connected, ns, hashes, dest)
        if dest and isinstance(dest[0], list):
            return client.batch_get_into_parts(ns, hashes, dest)
        return client.batch_get_into(ns, hashes, dest)

    def _connected(self) -> Client | None:
        """The client, waiting for a connection still being made (``timeout_s`` at
        most); None: the store is unreachable, loads are misses."""
        return self.store_client(self.s.cfg.timeout_s)

    def _get_connected(self, ns: str, hashes: list[bytes], dest: list[Any]) -> list[bool]:
        client = self._connected()
        if client is None:
            return [False] * len(hashes)
        return list(self._get(ns, hashes, dest, client).result())

    def start_load_kv(self, meta: Any) -> None:
        """Each step: queue this step's asynchronous loads and start those the staging
        cap allows (never blocks on the store). Loads the scheduler planned inside
        this step (``load_mode: sync``, or ``auto`` for a load shorter than a step)
        start at once and are waited for: it returns once they are in the cache, or
        on CUDA queued before the forward on its stream (a failed one's blocks are
        reported by :meth:`block_ids_with_load_errors` and vLLM recomputes them)."""
        if bc.capturing():
            return
        now: list[Transfer] = []
        if isinstance(meta, KVStoreConnectorMetadata):
            every = self.s.cfg.load_mode == "sync"
            now = [t for t in meta.loads if t.sync or every]
            self._queued.extend(t for t in meta.loads if not (t.sync or every))
            self.note_saves(meta)
        self._start_queued()
        if now:
            self._load_now(now)

    def _load_now(self, trs: list[Transfer]) -> None:
        """Loads of this step: started past the staging cap (the forward needs them),
        each wait bounded by the client's deadline (``timeout_s``); on CUDA the
        forward's stream then waits for their copies. These requests are running, so
        they are never reported as finished receiving, only their failed blocks."""
        started = [self._begin(tr, 0, now=True) for tr in trs]  # outside the budget
        for pl in started:
            if pl.job is not None:
                cf.wait([pl.job])
                if pl.job.exception() is None and isinstance(self.mover, bc.CudaMover):
                    self.mover.join(pl.job.result().ticket)
            got, _ = self._finish_load(pl)
            record(NAME, self._interval, "sync_loaded_blocks", got)

    def _nbytes(self, tr: Transfer) -> int:
        hybrid = tr.state_hash is not None
        return len(tr.hashes) * self._block_bytes + (self._state_bytes if hybrid else 0)

    def _start_queued(self) -> None:
        while self._queued:
            tr = self._queued[0]
            nbytes = self._nbytes(tr)
            if not self._budget.admit(nbytes):
                return
            self._queued.popleft()
            self._loads[tr.req_id] = self._begin(tr, nbytes)

    def _begin(self, tr: Transfer, nbytes: int, now: bool = False) -> PendingLoad:
        """Start one load: a job of the loader thread (mover path; ``now``: of the
        step's own loader, never behind asynchronous jobs), or the client's reads
        straight into the cache (zero copy)."""
        state_hash = self._state_hash(tr)
        pl = PendingLoad(tr, nbytes, time.perf_counter())
        if not self._zero_copy:
            pool = self._sync_pool if now else self._load_pool
            pl.job = pool.submit(self._load_job, tr, state_hash)
            pl.job.add_done_callback(pl.stamp)
            return pl
        n = len(tr.hashes)
        pl.future = self._get(self.ns, tr.hashes, self._parts(False, tr.block_ids, n))
        if state_hash is not None and tr.state_ids is not None:
            sids = [[b] for b in tr.state_ids]
            pl.state_future = self._get(self.state_ns, [state_hash], self._parts(True, sids, 1))
            pl.state_future.add_done_callback(pl.stamp)
        pl.future.add_done_callback(pl.stamp)
        return pl

    def _load_job(self, tr: Transfer, state_hash: bytes | None) -> Loaded:
        """Loader thread (mover path): fetch into the host rows chunk by chunk, copy
        each chunk's leading run into the cache; stops at the first miss. The rows
        are this job's until it returns; a pin is released on every path, once the
        copies reading it are done."""
        self.mover.bind_thread()
        with self._rows_lock:
            return self._load_rows(tr, state_hash)

    def _load_rows(self, tr: Transfer, state_hash: bytes | None) -> Loaded:
        flags: list[bool] = []
        tickets: list[bc.Ticket] = []
        n = len(tr.hashes)
        layers = list(self._layers.values())
        rows = self._rows.get("load")
        at = 0
        while rows is not None and at < n:
            k = min(rows.cap, n - at)
            got, srcs, pins = self._fetch(self.ns, tr.hashes[at : at + k], rows)
            try:
                flags += got
                run = leading_run(got)
                if run:
                    ids = [g[at : at + run] for g in tr.block_ids]
                    tickets.append(self._land(layers, ids, rows, run, srcs))
            finally:
                self._release(pins)
            if run < k:
                break
            at += k
        flags += [False] * (n - len(flags))
        state: list[bool] | None = None
        srows = self._rows.get("state_load")
        if state_hash is not None and tr.state_ids is not None and srows is not None:
            state = [False]
            if all(flags):
                state, ssrcs, spins = self._fetch(self.state_ns, [state_hash], srows)
                try:
                    if state[0]:
                        slayers = list(self._state_layers.values())
                        sids = [[b] for b in tr.state_ids]
                        tickets.append(self._land(slayers, sids, srows, 1, ssrcs))
                finally:
                    self._release(spins)
        return Loaded(flags, state, bc.AllTickets(tickets))

    def _release(self, pins: ArenaPins | None) -> None:
        """Give back pinned slots once the copies reading them are done (a pin
        released under a DMA still reading it would let the worker reuse the slot)."""
        if pins is not None:
            try:
                self._last_load.wait()
            finally:
                pins.release()

    def _read(self, client: Client | None, ns: str, hashes: list[bytes], views: list[memoryview]
              ) -> list[bool]:  # fmt: skip
        if client is None:
            return [False] * len(hashes)
        try:
            return list(self._get(ns, hashes, views, client).result())
        except Exception as e:
            log.warning("kvstore load of %d blocks failed: %s", len(hashes), e)
            return [False] * len(hashes)

    def _fetch(self, ns: str, hashes: list[bytes], rows: Rows
               ) -> tuple[list[bool], list[Any] | None, ArenaPins | None]:  # fmt: skip
        """Blocks ``hashes``, once the last copy out of the rows is done: those a
        same-host worker holds are pinned in its arena and copied from their slots
        (the copy source; no host copy), the others are read into the first host
        rows. Returns (hit flags, per block its source or None when every block is
        in the rows, the pins to release once copied). A failed read is a miss."""
        self._last_load.wait()
        k = len(hashes)
        client = self._connected()
        pins = None
        if client is not None:
            try:
                pins = client.pin_local(ns, hashes)
            except Exception as e:  # a bug: the rows path still works
                log.warning("kvstore arena pins failed: %s", e)
        if pins is None or not pins.count:
            if pins is not None:
                pins.release()
            return self._read(client, ns, hashes, rows.views[:k]), None, None
        try:
            if self.mover.device_rows and len(self._register(pins.arenas)) < len(pins.arenas):
                # An arena the driver would not page-lock: DMA from it would read
                # pageable memory. Read the blocks into the pinned rows instead.
                pins.release()
                return self._read(client, ns, hashes, rows.views[:k]), None, None
            flags = [v is not None for v in pins.views]
            rest = [i for i, v in enumerate(pins.views) if v is None]
            if rest:
                got = self._read(client, ns, [hashes[i] for i in rest],
                                 [rows.views[i] for i in rest])  # fmt: skip
                for i, g in zip(rest, got, strict=True):
                    flags[i] = g
            srcs = [rows.host[i] if v is None else bc.host_tensor(v)
                    for i, v in enumerate(pins.views)]  # fmt: skip
        except BaseException:
            pins.release()  # nothing was queued from them yet
            raise
        record(NAME, self._interval, "arena_loaded_blocks", pins.count)
        return flags, srcs, pins

    def _connected_now(self, client: Client) -> None:
        """A client connected (or the cache was registered after it did): page-lock
        the same-host arenas now, on the loader thread, so no load's first DMA waits
        for a registration (it may take a while for a big arena)."""
        if self.mover.device_rows:
            self._load_pool.submit(self._register_quietly, client)

    def _register_quietly(self, client: Client) -> None:
        try:
            self.mover.bind_thread()
            self._register(client.local_arenas())
        except Exception as e:  # loads register on first use instead
            log.warning("kvstore connector: registering the arenas failed: %s", e)

    def _register(self, arenas: list[Any]) -> set[str]:
        """Page-lock these arena mappings for DMA (CUDA) where not yet done; the ids of
        those that are (see :class:`~..blockcopy.Registrations`)."""
        return self._registered.register(arenas) if self.mover.device_rows else set()

    def _land(self, layers: list[bc.LayerGeometry], ids: list[list[int]], rows: Rows,
              k: int, srcs: list[Any] | None = None) -> bc.Ticket:  # fmt: skip
        """The first ``k`` blocks -> the cache's blocks ``ids``: from the host rows, or
        from ``srcs`` (arena slots or rows), through device rows on CUDA."""
        m = self.mover
        target = rows.dev if m.device_rows else rows.host
        if srcs is not None:
            m.upload(srcs[:k], target[:k])
        elif m.device_rows:
            m.upload([rows.host], target[:k])
        t = m.scatter(layers, ids, target[:k])
        self._last_load = t
        return t

    def _state_hash(self, tr: Transfer) -> bytes | None:
        """The hash of the state a hybrid load fills in (its last block's); called
        once per load as it starts. The tests' fault-injecting worker side
        (tests/e2e/faults.py) overrides it."""
        return tr.state_hash

    def _result(self, fut: cf.Future[list[bool]] | None, n: int, rid: str) -> list[bool]:
        if fut is None:
            return []
        try:
            return fut.result()
        except Exception as e:
            log.warning("kvstore load for %s failed: %s", rid, e)
            return [False] * n

    def _outcome(self, pl: PendingLoad) -> tuple[list[bool], list[bool] | None]:
        tr = pl.transfer
        if pl.job is None:
            flags = self._result(pl.future, len(tr.hashes), tr.req_id)
            state = None
            if pl.state_future is not None:
                state = self._result(pl.state_future, 1, tr.req_id)
            return flags, state
        try:
            got = pl.job.result()
            return got.flags, got.state
        except Exception as e:
            log.warning("kvstore load for %s failed: %s", tr.req_id, e)
            return [False] * len(tr.hashes), None if tr.state_hash is None else [False]

    def _finish_load(self, pl: PendingLoad) -> tuple[int, bool]:
        """Account for a load whose bytes are in the cache: (blocks that arrived and
        are used, False when some did not arrive). A hybrid load is all or nothing:
        KV blocks without their state are never used."""
        tr = pl.transfer
        flags, state = self._outcome(pl)
        ok = leading_run(flags)
        state_ok = state is None or all(state)
        if state is not None and not (state_ok and ok == len(flags)):
            ok, state_ok = 0, False
        if state is not None and state_ok:
            record(NAME, self._interval, "loaded_states", 1)
        self._budget.release(pl.nbytes)
        secs = (pl.landed or time.perf_counter()) - pl.started
        nbytes = ok * self._block_bytes
        record(NAME, self._interval, "loaded_blocks", ok)
        record(NAME, self._interval, "loaded_bytes", nbytes)
        record(NAME, self._interval, "load_seconds", secs)
        lost = ok < len(flags) or not state_ok
        with self._meta_lock:
            self._meta.load_samples.append((nbytes, secs))
            if lost:
                self._meta.failed[tr.req_id] = tr.indices[ok:] or tr.indices[-1:]
        if lost:
            record(NAME, self._interval, "load_failed_blocks", len(flags) - ok)
            for ids in tr.block_ids:
                self._invalid.update(ids[ok:])
        return ok, not lost

    def done_loads(self) -> tuple[set[str], set[str]]:
        """Non-blocking: (requests whose loads are complete, their bytes in the
        cache, and those of them that lost blocks). Starts queued loads as staging
        frees up."""
        done = {rid for rid, pl in self._loads.items() if pl.done()}
        failed = {rid for rid in done if not self._finish_load(self._loads.pop(rid))[1]}
        if done:
            self._start_queued()
        return done, failed

    def block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def take_meta(self) -> KVStoreWorkerMetadata | None:
        with self._meta_lock:
            wm = self._meta
            if wm.empty():
                return None
            self._meta = KVStoreWorkerMetadata()
        return wm

    # ---- saves --------------------------------------------------------------------

    def _report_saves(self, refs: list[tuple[str, int, bytes]], ok: list[bool]) -> None:
        with self._meta_lock:
            for (rid, index, _), good in zip(refs, ok, strict=True):
                d = self._meta.saved if good else self._meta.save_failed
                d.setdefault(rid, []).append(index)

    def note_saves(self, meta: Any) -> None:
        """Each step (idempotent): remember the requests this step saves for, whose
        blocks the scheduler holds after they finish until :meth:`finished_sends`
        reports them (see SchedulerSide.request_finished)."""
        if isinstance(meta, KVStoreConnectorMetadata):
            self._had_saves.update(t.req_id for t in meta.saves)
            self._had_saves.update(x.req_id for x in meta.state_saves)

    def finished_sends(self, finished_req_ids: set[str]) -> set[str]:
        """Each step, non-blocking: finished requests that had saves, once none of
        their writes is still reading the cache (their blocks may then be freed)."""
        self._finishing.update(r for r in finished_req_ids if r in self._had_saves)
        with self._save_lock:
            out = {r for r in self._finishing if not self._saving.get(r)}
        self._finishing -= out
        self._had_saves -= out
        return out

    def handle_preemptions(self, meta: Any) -> None:
        """Before a step's forward: a preempted request's blocks are freed at once
        and may be overwritten by this step, so wait for writes still reading them
        (rare, bounded by ``timeout_s``)."""
        gone = getattr(meta, "preempted", None) or ()
        with self._save_lock:
            busy = any(self._saving.get(r) for r in gone)
        if busy and not self.drain_saves(self.s.cfg.timeout_s):
            log.warning("kvstore connector: saves of preempted requests still running")

    def _striped(self, index: int) -> bool:
        """MLA at TP > 1: this rank writes the blocks whose index is its rank
        modulo the TP size (all ranks hold the same latent cache)."""
        tps = self.s.tp_size
        return not (self.s.mla and tps > 1) or index % tps == self._tp

    def _begin_save(self, meta: Any) -> StepSave | None:
        self._step_seen = True
        if not isinstance(meta, KVStoreConnectorMetadata):
            return None
        self.note_saves(meta)
        saves = meta.saves
        states = meta.state_saves if self._state_layers else []
        groups = max(1, len(self.s.attn_groups))
        refs: list[tuple[str, int, bytes]] = []
        ids: list[list[int]] = [[] for _ in range(groups)]
        for t in saves:
            for row, (i, h) in enumerate(zip(t.indices, t.hashes, strict=True)):
                if self._striped(i):
                    refs.append((t.req_id, i, h))
                    for j in range(groups):
                        ids[j].append(t.block_ids[j][row])
        states = [x for x in states if self._striped(x.index)]
        if not refs and not states:
            return None
        srefs = [(x.req_id, x.index, x.hash) for x in states]
        sids = [[x.block_ids[j] for x in states] for j in range(len(self.s.state_groups))]
        need = len(refs) * self._block_bytes + len(srefs) * self._state_bytes
        limit = self.s.cfg.max_pending_save_mb << 20
        with self._save_lock:
            over = self._pending_save_bytes + need > limit
        if over or not self._layers:
            record(NAME, self._interval, "dropped_save_blocks", len(refs) + len(srefs))
            self._report_saves(refs, [False] * len(refs))
            return None
        self._step = StepSave(refs, ids, srefs, sids, need)
        return self._step

    def save_kv_layer(self, layer_name: str, meta: Any) -> None:
        """After each attention layer: only plans the step's saves (once); every
        copy happens after the forward, in the background writer."""
        if not self._step_seen and not bc.capturing():
            self._begin_save(meta)

    def wait_for_save(self, meta: Any) -> None:
        """Once per step: hand this step's blocks and boundary states to the
        background writer; returns without waiting for the store or the device (on
        CUDA it only records an event on the forward's stream)."""
        if bc.capturing() or (meta is not None and meta is self._handed):
            return
        self._handed = meta  # finish_forward and wait_for_save: one hand-off a step
        step = self._step if self._step_seen else self._begin_save(meta)
        self._step, self._step_seen = None, False
        if step is None:
            return
        if isinstance(self.mover, bc.CudaMover):
            try:
                self._gather_now(self.mover, step)
            except Exception as e:  # never into the engine's step: the blocks go uncached
                log.warning("kvstore save of %d blocks failed: %s", len(step.refs), e)
                self._report_saves(step.refs, [False] * len(step.refs))
                return
        with self._save_lock:
            self._pending_save_bytes += step.nbytes
            for r in step.requests():
                self._saving[r] = self._saving.get(r, 0) + 1
        fut = self._save_pool.submit(self._put, step)
        self._save_futs = [f for f in self._save_futs if not f.done()]
        self._save_futs.append(fut)

    def _gather_now(self, m: bc.CudaMover, step: StepSave) -> None:
        """CUDA, on the step's thread: queue the gather of the step's blocks on the
        save stream after the forward's event, into device rows of this step (the
        writer only downloads them), and make the forward's stream wait for that
        gather: whatever the engine queues next (the next forward, zeroing a reused
        block, preemption, hybrid state copies) runs after it, so the bytes
        committed are the forward's (issue 47, finding 5). Launches only: no sync."""
        step.ready = m.mark()
        for state in (False, True):
            refs, ids = (step.state_refs, step.state_ids) if state else (step.refs, step.ids)
            if not refs:
                continue
            layers = list((self._state_layers if state else self._layers).values())
            rows = m.save_rows(len(refs), self._state_bytes if state else self._block_bytes)
            m.join(m.gather(layers, ids, rows, after=step.ready))
            if state:
                step.state_gathered = rows
            else:
                step.gathered = rows

    def reset_capture_state(self) -> None:
        """After CUDA graph capture: forget a step planned while capturing."""
        self._step, self._step_seen = None, False

    def _put_rows(self, client: Any, ns: str, hashes: list[bytes], src: list[Any]) -> list[bool]:
        """The one store write: one batched put of ``src`` (per block the list of
        its parts in the cache, or a host row's byte view); True per block that is
        in the store afterwards (written now, or already there by another writer)."""
        return self.write(client, ns, hashes, src, bool(src) and isinstance(src[0], list)).held

    def _put_moved(self, client: Any, ns: str, layers: list[bc.LayerGeometry],
                   hashes: list[bytes], ids: list[list[int]], rows: Rows,
                   gathered: Any) -> list[bool]:  # fmt: skip
        """Mover path, writer thread, chunk by chunk: reserve slots on same-host
        workers, gather the blocks (on CUDA: ``gathered`` at the step) and
        copy each into its reserved arena slot (one DMA, no host copy) or, without a
        slot, into its pinned row; wait for that copy here; then commit the slots
        (checksummed over the slots) and put the rows. True per block in the store
        afterwards."""
        ok: list[bool] = []
        for at in range(0, len(hashes), rows.cap):
            k = min(rows.cap, len(hashes) - at)
            chunk = [g[at : at + k] for g in ids]
            hs = hashes[at : at + k]
            slots = self._reserve(client, ns, hs, rows.host.shape[1])
            pre = None if gathered is None else gathered[at : at + k]
            if slots is None:
                self._copy_out(layers, chunk, rows, k, None, pre)
                ok += self._put_rows(client, ns, hs, rows.views[:k])
                continue
            try:
                self._copy_out(layers, chunk, rows, k, slots, pre)
                got = slots.commit([v is not None for v in slots.views])
            except BaseException:
                slots.abort()  # every copy into them is done or was never queued
                raise
            got = [g or p for g, p in zip(got, slots.present, strict=True)]
            rest = [i for i, v in enumerate(slots.views) if v is None and not slots.present[i]]
            if rest:
                put = self._put_rows(client, ns, [hs[i] for i in rest],
                                     [rows.views[i] for i in rest])  # fmt: skip
                for i, g in zip(rest, put, strict=True):
                    got[i] = g
            record(NAME, self._interval, "arena_stored_blocks", slots.count)
            ok += got
        return ok

    def _copy_out(self, layers: list[bc.LayerGeometry], chunk: list[list[int]], rows: Rows,
                  k: int, slots: ArenaSlots | None, pre: Any) -> None:  # fmt: skip
        """Gather ``k`` blocks (on CUDA: ``pre``, gathered at the step) and copy
        each into its reserved arena slot or its pinned row; returns once every copy
        queued here is done. On a timeout (or an error after a copy was queued) it
        still waits for the copies before raising: a slot aborted or a row reused
        under a DMA still writing it would take wrong bytes."""
        m = self.mover
        dests = [rows.host[i] for i in range(k)]
        # An inbox the driver would not page-lock takes no DMA: the blocks go to the
        # pinned rows and from there into their slots by a host copy.
        direct = slots is not None and not (
            m.device_rows and len(self._register(slots.arenas)) < len(slots.arenas)
        )
        if slots is not None and direct:
            dests = [d if v is None else bc.host_tensor(v)
                     for d, v in zip(dests, slots.views, strict=True)]  # fmt: skip
        queued: list[bc.Ticket] = []
        try:
            if isinstance(m, bc.CudaMover):
                if pre is None:
                    pre = rows.dev[:k]
                    queued.append(m.gather(layers, chunk, pre))
                queued.append(m.download(pre, dests if direct else [rows.host]))
            else:
                queued.append(m.gather(layers, chunk, rows.host[:k]))
                if slots is not None:
                    queued.append(m.download(rows.host[:k], dests))
            if not bc.AllTickets(queued).wait(self.s.cfg.timeout_s):
                raise TimeoutError("the device copy of a save did not complete")
            if slots is not None and not direct:
                for row, v in zip(dests, slots.views, strict=True):
                    if v is not None:
                        bc.host_tensor(v).copy_(row)
        except BaseException:
            # A DMA always ends: never abort a slot or reuse a row under one, even
            # one queued by a call that raised before returning its ticket.
            bc.AllTickets([*queued, m.fence()]).wait()
            raise

    def _reserve(self, client: Any, ns: str, hashes: list[bytes], width: int
                 ) -> ArenaSlots | None:  # fmt: skip
        """Slots reserved on same-host workers for these blocks, or None when none
        (or the reservation failed: the rows path still works)."""
        try:
            slots: ArenaSlots = client.reserve_local(ns, hashes, [width] * len(hashes))
        except Exception as e:
            log.warning("kvstore arena reservation failed: %s", e)
            return None
        if not slots.count and not any(slots.present):
            return None
        return slots

    def _put(self, step: StepSave) -> None:
        """Background writer: the store writes of a step (KV blocks, then states)."""
        t0 = time.perf_counter()
        hashes = [h for _, _, h in step.refs]
        ok = [False] * len(hashes)
        try:
            self.mover.bind_thread()
            client = self.store_client(self.s.cfg.timeout_s)
            if client is not None:
                if hashes:
                    ok = self._write(client, False, hashes, step.ids, step.gathered)
                    record(NAME, self._interval, "stored_blocks", sum(ok))
                    record(NAME, self._interval, "stored_bytes", sum(ok) * self._block_bytes)
                if step.state_refs:
                    sh = [h for _, _, h in step.state_refs]
                    st = self._write(client, True, sh, step.state_ids, step.state_gathered)
                    record(NAME, self._interval, "stored_states", sum(st))
            record(NAME, self._interval, "store_seconds", time.perf_counter() - t0)
        except Exception as e:  # a full store or a bug: the blocks are simply not cached
            log.warning("kvstore save of %d blocks failed: %s", len(hashes), e)
        finally:
            record(NAME, self._interval, "store_failed_blocks", ok.count(False))
            self._report_saves(step.refs, ok)
            with self._save_lock:
                self._pending_save_bytes -= step.nbytes
                for r in step.requests():
                    left = self._saving.get(r, 0) - 1
                    if left > 0:
                        self._saving[r] = left
                    else:
                        self._saving.pop(r, None)

    def _write(self, client: Any, state: bool, hashes: list[bytes], ids: list[list[int]],
               gathered: Any) -> list[bool]:  # fmt: skip
        ns = self.state_ns if state else self.ns
        if self._zero_copy:
            return self._put_rows(client, ns, hashes, self._parts(state, ids, len(hashes)))
        layers = list((self._state_layers if state else self._layers).values())
        rows = self._rows["state_save" if state else "save"]
        return self._put_moved(client, ns, layers, hashes, ids, rows, gathered)

    def drain_saves(self, timeout: float) -> bool:
        futs = list(self._save_futs)
        if not futs:
            return True
        _, not_done = cf.wait(futs, timeout=timeout)
        return not not_done

    def shutdown(self) -> None:
        self.drain_saves(self.s.cfg.timeout_s)
        self._save_pool.shutdown(wait=False, cancel_futures=True)
        self._load_pool.shutdown(wait=False, cancel_futures=True)
        self._sync_pool.shutdown(wait=False, cancel_futures=True)
        self._registered.undo_all()
        self.close_store()
