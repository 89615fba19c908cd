"""KV events: which blocks this worker holds, published over ZMQ in vLLM's wire format.

Cache-aware routers (llm-d, Dynamo, vLLM's own tools) subscribe to engines' KV
events; a worker started with ``--kv-events tcp://HOST:PORT`` publishes the same
messages for the blocks in its tiers, so a router can count a prefix cached in the
store like one cached in an engine.

Wire format (vLLM ``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``): a PUB
socket sends three frames per message, ``(topic, seq, payload)``: ``topic`` is
UTF-8 (``<topic>`` then the namespace, e.g. ``kvstore/llama3-8b/bf16/b16/tp0of1``;
a subscriber filters by prefix), ``seq`` an 8-byte big-endian sequence number
counting messages from 0, and ``payload`` a msgpack ``KVEventBatch``:
``[ts, [event, ...]]`` where each event is a map tagged by ``"type"``:

- ``{"type": "BlockStored", "block_hashes": [bytes16, ...], "parent_block_hash": None,
  "token_ids": [], "block_size": N, "lora_id": None, "medium": M, "lora_name": None}``
- ``{"type": "BlockRemoved", "block_hashes": [...], "medium": M}``
- ``{"type": "AllBlocksCleared"}`` (first message after start, topic ``<topic>``).

``medium`` is the tier, with vLLM's names: ``"CPU"`` for DRAM, ``"STORAGE"`` for SSD.
Block hashes are the connector's 16-byte chained hashes (the store's keys);
``block_size`` is the tokens per block read from the namespace's ``/bN/`` part
(0 when it has none). A replay ROUTER socket (``--kv-events-replay``) answers a
request frame of an 8-byte big-endian start sequence with every buffered message
from there as ``(topic, seq, payload)`` frames, then ``(b"", seq=-1, b"")``.

Memory is bounded in bytes, whatever subscribers do: the history keeps at most
``history_steps`` messages and ``history_bytes`` payload bytes (the oldest go
first); one message carries at most ``MESSAGE_HASHES`` block hashes; a replay is
sent as the peer reads it (a cursor per peer, at most ``REPLAY_HWM`` messages
queued for it, nothing copied), at most ``replay_peers`` replays run at once (a
request beyond that is answered with the end frame at once: ask again later), and
a peer that reads nothing for ``REPLAY_STALL`` seconds is given up. A peer that
asks from 0 and never reads thus costs at most REPLAY_HWM messages.

Batching: the store appends (stored?, medium, blocks) records to a bounded queue
under its lock (no encoding there); a publisher thread drains it every
``interval`` seconds, merges consecutive records of one kind, tier and namespace
into one event and sends one message per namespace per drain, so a burst of puts
becomes a few messages. Records over ``max_pending`` blocks are dropped and
counted (``dropped``): a slow publisher never grows memory without bound.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import msgpack  # type: ignore[import-untyped]
import zmq

from kvstore_client.errors import InvalidArgument

log = logging.getLogger(__name__)

DRAM = "CPU"  # vLLM's MEDIUM_CPU
SSD = "STORAGE"  # vLLM's MEDIUM_STORAGE
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MESSAGE_HASHES = 4096  # block hashes per message (about 75 KiB of msgpack)
REPLAY_HWM = 16  # messages queued for one replay peer
REPLAY_STALL = 10.0  # seconds a replay peer may read nothing before it is given up
REPLAY_BURST = 256  # messages sent to one peer per turn of the publisher loop
_BLOCK_TOKENS = re.compile(r"(?:^|/)b(\d+)(?:/|$)")


def block_tokens(ns: str) -> int:
    """Tokens per block named by the namespace's ``/bN/`` component, else 0."""
    m = _BLOCK_TOKENS.search(ns)
    return int(m.group(1)) if m else 0


def stored_event(hashes: Sequence[bytes], medium: str, block_size: int) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
    }


def removed_event(hashes: Sequence[bytes], medium: str) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium}


def encode_batch(ts: float, events: list[dict[str, Any]]) -> bytes:
    """A KVEventBatch (array-like: ``[ts, events]``, data_parallel_rank omitted)."""
    out: bytes = msgpack.packb([ts, events], use_bin_type=True)
    return out


class EventSink:
    """The store's side: a bounded queue of block records (thread-safe appends)."""

    def __init__(self, max_pending: int = 1 << 20) -> None:
        self.max_pending = max_pending
        self._q: deque[tuple[bool, str, Sequence[tuple[str, bytes]]]] = deque()
        self._pending = 0
        self._lock = threading.Lock()
        self.dropped = 0

    def add(self, stored: bool, medium: str, items: Sequence[tuple[str, bytes]]) -> None:
        """Record blocks (``(ns, key)``) stored in / removed from ``medium``."""
        with self._lock:
            if self._pending + len(items) > self.max_pending:
                self.dropped += len(items)
                return
            self._pending += len(items)
            self._q.append((stored, medium, items))

    def drain(self) -> list[tuple[bool, str, Sequence[tuple[str, bytes]]]]:
        with self._lock:
            out = list(self._q)
            self._q.clear()
            self._pending = 0
        return out


def merge(
    records: Iterable[tuple[bool, str, Sequence[tuple[str, bytes]]]], max_hashes: int = 4096
) -> dict[str, list[dict[str, Any]]]:
    """Records -> events per namespace, consecutive ones of a kind and tier merged
    (order within a namespace is kept: a store then a removal stays in that order)."""
    out: dict[str, list[dict[str, Any]]] = {}
    last: dict[str, tuple[bool, str, list[bytes]]] = {}
    for stored, medium, items in records:
        for ns, key in items:
            cur = last.get(ns)
            if cur is None or cur[0] != stored or cur[1] != medium or len(cur[2]) >= max_hashes:
                cur = (stored, medium, [])
                last[ns] = cur
                ev = (
                    stored_event(cur[2], medium, block_tokens(ns))
                    if stored
                    else removed_event(cur[2], medium)
                )
                ev["block_hashes"] = cur[2]  # filled in place as records arrive
                out.setdefault(ns, []).append(ev)
            cur[2].append(bytes(key))
    return out


class KvEventPublisher:
    """Publishes a sink's records over ZMQ PUB (+ optional replay ROUTER) on a thread.

    ``endpoint``: bind address (``tcp://HOST:PORT``; port 0 picks one, see
    :attr:`endpoint` after :meth:`start`). Never raises into the store: a send that
    fails is logged and counted.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay: str = "",
        topic: str = "kvstore/",
        interval: float = 0.01,
        buffer_steps: int = 10_000,
        history_bytes: int = 32 << 20,
        replay_peers: int = 8,
        sink: EventSink | None = None,
    ) -> None:
        self.sink = sink or EventSink()
        self.topic = topic
        self.interval = interval
        self.seq = 0
        self.sent = 0
        self.errors = 0
        self.replays_refused = 0  # replay requests beyond replay_peers
        self.replays_stalled = 0  # replay peers given up (read nothing for REPLAY_STALL)
        self.history_bytes = history_bytes
        self.replay_peers = replay_peers
        self._buffer: deque[tuple[bytes, int, bytes]] = deque(maxlen=buffer_steps)
        self._buffered = 0  # payload bytes in _buffer
        self._peers: dict[bytes, list[float]] = {}  # peer -> [next seq, last progress]
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket[bytes] | None = None
        self.endpoint = self._bind(self._pub, endpoint)
        self.replay_endpoint = ""
        if replay:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.setsockopt(zmq.SNDHWM, REPLAY_HWM)
            self._replay.setsockopt(zmq.SNDBUF, 256 << 10)
            self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)  # full or gone: an error
            self.replay_endpoint = self._bind(self._replay, replay)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kv-events", daemon=True)

    def _bind(self, sock: zmq.Socket[bytes], endpoint: str) -> str:
        try:
            if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
                port = sock.bind_to_random_port(endpoint[:-2])
                return f"{endpoint[:-2]}:{port}"
            sock.bind(endpoint)
            return endpoint
        except zmq.ZMQError as e:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            self._ctx.term()
            raise InvalidArgument(f"cannot bind KV events to {endpoint}: {e}") from e

    def start(self, cleared: bool = True) -> None:
        """Start publishing; first an AllBlocksCleared (a restarted worker's DRAM is empty)."""
        if cleared:
            self._send(
                self.topic.encode(), encode_batch(time.time(), [{"type": "AllBlocksCleared"}])
            )
        self._thread.start()

    def _send(self, topic: bytes, payload: bytes) -> None:
        seq = self.seq
        self.seq += 1
        try:
            self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
            self.sent += 1
        except zmq.ZMQError:
            self.errors += 1
            log.exception("KV event send failed")
        buf = self._buffer
        if buf.maxlen is not None and len(buf) == buf.maxlen:
            self._buffered -= len(buf[0][2])
        buf.append((topic, seq, payload))
        self._buffered += len(payload)
        while self._buffered > self.history_bytes and len(buf) > 1:
            self._buffered -= len(buf.popleft()[2])

    def flush(self) -> None:
        """Send what the sink holds now (one message per namespace)."""
        records = self.sink.drain()
        if not records:
            return
        now = time.time()
        for ns, events in merge(records, MESSAGE_HASHES).items():
            topic = (self.topic + ns).encode()
            batch: list[dict[str, Any]] = []
            hashes = 0
            for ev in events:  # at most MESSAGE_HASHES hashes per message
                n = len(ev.get("block_hashes", ()))
                if batch and hashes + n > MESSAGE_HASHES:
                    self._send(topic, encode_batch(now, batch))
                    batch, hashes = [], 0
                batch.append(ev)
                hashes += n
            if batch:
                self._send(topic, encode_batch(now, batch))

    def _serve_replay(self) -> None:
        """Take a replay request: the peer gets a cursor (or, beyond replay_peers
        replays at once, the end frame now); :meth:`_pump` sends as it reads."""
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("bad KV-event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        if client not in self._peers and len(self._peers) >= self.replay_peers:
            self.replays_refused += 1
            with contextlib.suppress(zmq.ZMQError):
                self._replay.send_multipart((client, b"", b"", END_SEQ, b""), zmq.NOBLOCK)
            return
        self._peers[client] = [float(int.from_bytes(start, "big")), time.monotonic()]

    def _pump(self) -> None:
        """Send each replaying peer what fits in its queue (REPLAY_HWM messages), from
        its cursor; the end frame when it has all; give up peers that stall or left."""
        assert self._replay is not None
        now = time.monotonic()
        buf = self._buffer
        for client, cur in list(self._peers.items()):
            done = False
            for _ in range(REPLAY_BURST):
                base = buf[0][1] if buf else self.seq
                nxt = max(int(cur[0]), base)  # what left the history is skipped
                i = nxt - base
                end = i >= len(buf)
                if end:
                    frames = (client, b"", b"", END_SEQ, b"")
                else:
                    topic, seq, payload = buf[i]
                    frames = (client, b"", topic, seq.to_bytes(8, "big"), payload)
                try:
                    self._replay.send_multipart(frames, zmq.NOBLOCK)
                except zmq.Again:  # its queue is full: it is not reading (yet)
                    if now - cur[1] > REPLAY_STALL:
                        self.replays_stalled += 1
                        done = True
                    break
                except zmq.ZMQError:  # the peer is gone
                    done = True
                    break
                cur[0], cur[1] = nxt + 1, now
                if end:
                    done = True
                    break
            if done:
                del self._peers[client]

    def _loop(self) -> None:
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set():
            if self._replay is not None:
                # Replays in flight: come back soon to refill their queues.
                wait = 1 if self._peers else int(self.interval * 1000)
                ready = dict(poller.poll(wait))
                try:
                    if self._replay in ready:
                        self._serve_replay()
                    if self._peers:
                        self._pump()
                except zmq.ZMQError:
                    log.exception("KV event replay failed")
            else:
                self._stop.wait(self.interval)
            try:
                self.flush()
            except Exception:  # never let a bad record kill the publisher
                self.errors += 1
                log.exception("KV event publishing failed")

    def close(self) -> None:
        """Send what is left, then close the sockets. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        try:
            self.flush()
        except Exception:
            log.exception("KV event publishing failed")
        self._pub.close(linger=100)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
