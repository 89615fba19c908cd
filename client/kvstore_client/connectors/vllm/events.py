"""The store's blocks as vLLM KV cache events (``KVConnectorBase_V1.take_events``).

When the engine publishes KV cache events (``--kv-events-config`` with
``enable_kv_cache_events``), a router learns from it which prefixes the engine's own
GPU cache holds; with this connector it also learns which prefixes the shared store
holds: once the workers confirm a save, the scheduler emits a ``BlockStored`` for
each block written, in vLLM's own terms (its block hashes at the hash block size,
the parent hash, the block's token ids, the LoRA), with ``medium="CPU"`` and
``locality="REMOTE"`` (the store, not this engine's memory; every engine on the
same store can load it). Blocks another engine wrote are announced by that engine.

The store evicts on its own, and the connector does not see it: a router that
needs removals subscribes to the workers' own event stream as well (``kvstore
worker --kv-events``, docs/OPERATIONS.md), which names blocks by the connector's
16-byte hashes. Hybrid models (state groups) emit nothing: their blocks are only
loadable with the state at the hit's end.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

MEDIUM = "CPU"
LOCALITY = "REMOTE"


class StoreEvents:
    """``BlockStored`` events for blocks the store confirmed, until taken.

    ``block``: tokens per stored block; ``hash_block``: tokens per vLLM block hash
    (a divisor of ``block``; else no events)."""

    def __init__(self, block: int, hash_block: int, group: int = 0) -> None:
        self.block = block
        self.hash_block = hash_block
        self.group = group
        self.per = block // hash_block if hash_block > 0 and block % hash_block == 0 else 0
        self._out: list[Any] = []

    def stored(self, request: Any, indices: Iterable[int]) -> None:
        """Blocks ``indices`` (the connector's, ``block`` tokens each) of ``request``
        are in the store now."""
        if not self.per:
            return
        from vllm.distributed.kv_events import (  # type: ignore[import-not-found, unused-ignore]
            BlockStored,
        )
        from vllm.v1.core.kv_cache_utils import (  # type: ignore[import-not-found, unused-ignore]
            maybe_convert_block_hash,
        )

        hashes = list(getattr(request, "block_hashes", None) or ())
        tokens = request.all_token_ids
        lora = getattr(request, "lora_request", None)
        for i in sorted(set(indices)):
            lo, hi = i * self.per, (i + 1) * self.per
            if hi > len(hashes) or (i + 1) * self.block > len(tokens):
                continue  # not hashed that far (never happens for a saved block)
            self._out.append(
                BlockStored(
                    block_hashes=[maybe_convert_block_hash(h) for h in hashes[lo:hi]],
                    parent_block_hash=maybe_convert_block_hash(hashes[lo - 1]) if lo else None,
                    token_ids=list(tokens[i * self.block : (i + 1) * self.block]),
                    block_size=self.hash_block,
                    lora_id=lora.adapter_id if lora is not None else None,
                    medium=MEDIUM,
                    lora_name=lora.name if lora is not None else None,
                    group_idx=self.group,
                    locality=LOCALITY,
                    session_id=getattr(request, "session_id", None),
                )
            )

    def take(self) -> list[Any]:
        out, self._out = self._out, []
        return out
