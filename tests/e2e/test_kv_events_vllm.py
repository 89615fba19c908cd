"""KV events of a worker decode with vLLM's own event classes (msgspec, KVEventBatch);
and the connector's ``take_events``: a real engine publishing KV cache events
announces the blocks the store confirmed, in the engine's own block hashes.

Runs where vLLM is importable (.venv-e2e); skipped elsewhere like every e2e test.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstore.cluster import LocalCluster, free_port
from kvstore_client import Client
from tests.helpers import key, value_for
from tests.integration.test_sessions import NS, Sub, replay

from .engines import Engine


def test_worker_kv_events_decode_with_vllm_classes(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    import msgspec
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
    )

    decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
    pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    c = make_cluster(
        workers=1,
        dram_size="64MiB",
        max_value_size="1MiB",
        extra_worker_args=["--kv-events", pub, "--kv-events-replay", rep],
    )
    sub = Sub(pub)
    time.sleep(0.3)
    try:
        keys = [key(i, "vllm-ev") for i in range(64)]
        with Client(c.address) as cl:
            cl.batch_put(NS, keys, [value_for(k, 4096) for k in keys])
            cl.remove(NS, keys[:3])
        sub.messages(lambda m: len(m) >= 2)
        batches = [decode(p) for _, _, p in replay(rep, 0)]
        assert isinstance(batches[0], KVEventBatch)
        assert batches[0].events == [AllBlocksCleared()]
        events = [e for b in batches[1:] for e in b.events]
        stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
        removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
        assert stored == keys, "every put block, in order, as the connector's 16-byte hashes"
        assert removed == keys[:3]
        assert {e.medium for e in events} == {"CPU"}
        assert all(e.block_size == 16 for e in events if isinstance(e, BlockStored))
    finally:
        sub.close()


def test_the_connector_announces_the_stores_blocks_in_vllms_event_stream(
    make_cluster: Callable[..., LocalCluster], tiny_model: str, tmp_path: Path
) -> None:
    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    c = make_cluster(workers=1, dram_size="128MiB")
    ep = f"tcp://127.0.0.1:{free_port()}"
    e = Engine("events", tiny_model, tmp_path, master=c.address)
    e.cfg["kv_events"] = ep
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.bind(ep)  # vLLM's publisher connects to a host:port endpoint (binds only to *)
    decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
    events: list[BlockStored] = []
    seqs: list[int] = []

    def read(until: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not until() and time.monotonic() < deadline:
            if sock.poll(100):
                _, seq, payload = sock.recv_multipart()
                seqs.append(int.from_bytes(seq, "big"))
                events.extend(ev for ev in decode(payload).events if isinstance(ev, BlockStored))

    try:
        e.start()
        e.wait_ready()
        rng = random.Random(5)
        block = e.block_size
        # ZMQ's slow joiner: batches published before the connection is up are
        # dropped; one-block requests until an event arrives.
        for _ in range(10):
            e.generate([rng.randrange(3, 1000) for _ in range(block + 8)], 1)
            read(lambda: bool(events), 2.0)
            if events:
                break
        events.clear()
        prompt = [rng.randrange(3, 1000) for _ in range(8 * block + 5)]
        e.generate(prompt, 4)
        read(lambda: False, 2.0)
        # The engine publishes on its steps: a busy engine steps all the time; here a
        # second request drives the steps that report the last confirmations.
        e.generate([rng.randrange(3, 1000) for _ in range(40)], 2)
        stored = lambda: [ev for ev in events if ev.locality == "REMOTE"]  # noqa: E731
        read(lambda: len({tuple(ev.token_ids) for ev in stored()}) >= 8, 20.0)
    finally:
        e.stop()
        sock.close(0)
        ctx.term()
    own = [ev for ev in events if ev.locality != "REMOTE"]
    own_hash = {h: toks for ev in own for h, toks in _per_block(ev)}
    store = {h: toks for ev in stored() for h, toks in _per_block(ev)}
    assert all(ev.medium == "CPU" for ev in stored())
    want = [tuple(prompt[i * block : (i + 1) * block]) for i in range(8)]
    by_tokens = {toks: h for h, toks in store.items()}
    assert all(w in by_tokens for w in want), (
        f"every full prompt block announced as stored: {len(events)} events, "
        f"{len(stored())} of the store, seqs {seqs}: "
        f"{[(ev.locality, len(ev.block_hashes), len(ev.token_ids)) for ev in events]}"
    )
    for toks in want:  # the engine's own hash for the same tokens
        assert own_hash.get(by_tokens[toks]) == toks
    first = next(ev for ev in stored() if tuple(ev.token_ids) == want[0])
    assert first.parent_block_hash is None
    second = next(ev for ev in stored() if tuple(ev.token_ids) == want[1])
    assert second.parent_block_hash == by_tokens[want[0]]


def _per_block(ev: Any) -> list[tuple[Any, tuple[int, ...]]]:
    n = ev.block_size
    return [(h, tuple(ev.token_ids[i * n : (i + 1) * n])) for i, h in enumerate(ev.block_hashes)]
