"""What every engine connector does with the store, written once: :class:`StoreConnector`,
the base of vLLM's worker and scheduler sides (:mod:`.vllm`) and of SGLang's HiCache
backend (:mod:`.sglang`).

It holds the connector's :class:`~.holder.ClientHolder` (a client made lazily, re-made
after failures: an unreachable store is misses, never a failed engine start) and does
the store write both engines need: one batched put, then "is each block in the store
now?". A block the put did not store is in the store when its owner said it was
already there (another writer, another engine), and otherwise (owner unreachable,
refused) when some owner holds it: those, and only those, are asked with one
``batch_exists``. A full store raises as :meth:`Client.batch_put
<kvstore_client.client.Client.batch_put>` does; the connectors log it and count the
blocks as not cached.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..client import Client
from ..outcomes import PutOutcome, raise_for_room
from .holder import ClientHolder


@dataclass(slots=True)
class Written:
    """One store write's result, per block: ``held``, in the store afterwards (written
    now or already there); ``stored``, written by this put. ``present``: how many
    blocks were found already there (skipped)."""

    held: list[bool]
    stored: list[bool]
    present: int


class StoreConnector:
    """See the module docstring. A subclass calls :meth:`attach` with its holder once,
    in its constructor (SGLang builds the backend through its own base's signature)."""

    _holder: ClientHolder

    def attach(self, holder: ClientHolder) -> None:
        """Use ``holder``'s client and start connecting now (in the background)."""
        self._holder = holder
        holder.start()

    @property
    def holder(self) -> ClientHolder:
        """The connector's client holder (``holder.get(wait)``: the client or None)."""
        return self._holder

    def store_client(self, wait: float = 0.0) -> Client | None:
        """The client, waiting at most ``wait`` seconds for it; None: treat as a miss."""
        return self._holder.get(wait=wait)

    def close_store(self) -> None:
        self._holder.close()

    @staticmethod
    def write(
        client: Client, ns: str, hashes: list[bytes], values: Sequence[Any], parts: bool
    ) -> Written:
        """The one store write of a connector: a batched put of ``values`` (``parts``:
        each block the list of its buffers, sent without joining them), then one
        ``batch_exists`` for the blocks neither stored nor found already there."""
        outcomes = client.put_outcomes(ns, hashes, values, parts=parts)
        raise_for_room(outcomes)
        stored = [o is PutOutcome.STORED for o in outcomes]
        held = [o.in_store for o in outcomes]
        present = sum(o is PutOutcome.PRESENT for o in outcomes)
        rest = [i for i, h in enumerate(held) if not h]
        if rest:  # its owner was down or refused it: does another owner hold it?
            there = client.batch_exists(ns, [hashes[i] for i in rest])
            present += sum(there)
            for i, t in zip(rest, there, strict=True):
                held[i] = t
        return Written(held, stored, present)


__all__ = ["StoreConnector", "Written"]
