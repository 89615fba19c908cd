"""KV events of a worker decode with vLLM's own event classes (msgspec, KVEventBatch).

Runs where vLLM is importable (.venv-e2e); skipped elsewhere like every e2e test.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvstore.cluster import LocalCluster, free_port
from kvstore_client import Client
from tests.helpers import key, value_for
from tests.integration.test_sessions import NS, Sub, replay


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
