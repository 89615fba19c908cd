"""The scheduler's KV lookup in each of the connector's ``lookup`` modes (no engine
import; the client is passed in, so this is tested against a real cluster)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .planning import all_ranks


def kv_lookup(
    client: Any, namespaces: Sequence[str], hashes: Sequence[bytes], mode: str
) -> list[bool]:
    """Per hash: present in every namespace (every rank's shard) of the store.

    ``mode`` (the connector's ``lookup`` setting):

    - ``"batch"``: one ``batch_exists`` per namespace; blocks present after a miss
      are reported present too (the save plan skips them).
    - ``"per_block"``: one ``batch_exists`` call per block and namespace, block after
      block, stopping at the first miss (the naive baseline); everything from the
      first miss on is reported absent.
    - ``"prefix"``: one ``match_prefix`` per namespace; the shortest leading run
      over the namespaces is present, the rest absent.

    Raises ValueError for another mode; store errors propagate (the caller treats
    them as a miss)."""
    if not hashes or not namespaces:
        return [False] * len(hashes)
    if mode == "batch":
        return all_ranks([client.batch_exists(ns, hashes) for ns in namespaces])
    if mode == "prefix":
        run = min(int(client.match_prefix(ns, hashes)) for ns in namespaces)
        return [i < run for i in range(len(hashes))]
    if mode == "per_block":
        flags: list[bool] = []
        for h in hashes:
            hit = all(client.batch_exists(ns, [h])[0] for ns in namespaces)
            flags.append(hit)
            if not hit:
                break
        return flags + [False] * (len(hashes) - len(flags))
    raise ValueError(f"unknown lookup mode {mode!r}")
