"""The store's side of agent sessions: a hint and a prefetch, as streams of stimuli.

The decisions live in the pure state machines (:mod:`kvstore.worker.sessions`, the
tier policy, the tier state); these functions only hand them bounded stimuli through
the store (:class:`~.storehost.StoreHost`: the store takes its lock for each) and do
the I/O they ask for in between, like the rest of
:class:`~kvstore.worker.store.BlockStore`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from kvstore_client.errors import InvalidArgument

from .sessions import REFUSED, check_hint
from .storehost import StoreHost
from .storerecords import LOOKUP_SLICES
from .tiers.blocks import Held
from .tiers.policy import SessionHint, SessionKeys
from .tiers.stimuli import (
    Advance,
    ChainBytes,
    ChainNext,
    ChainOpen,
    Claim,
    Drain,
    PrefetchRoom,
    RecordCuts,
    RecordHits,
    SessionKnown,
    SessionOwner,
    SetRoom,
)


@dataclass(frozen=True, slots=True)
class HintAnswer:
    """What a hint did: ``matched`` leading blocks of the session's chain here are
    present (``active`` hints; 0 otherwise); ``resend``: the session is another
    client's here and this hint did not show its chain: send the whole chain
    (SessionTable.claim)."""

    matched: int = 0
    resend: bool = False


def hint(
    host: StoreHost,
    ns: str,
    session: str,
    state: str,
    keys: Sequence[bytes],
    ttl: float | None,
    depths: Sequence[int] = (),
    cuts: Sequence[tuple[str, int, int]] = (),
    client: bytes = b"",
    whole: bool = False,
) -> HintAnswer:
    """Apply a session hint from ``client`` (its identity; b"": an old client) (see
    :mod:`kvstore.worker.sessions`). For ``active``, ``matched`` is how many leading
    blocks of the session's whole chain here (every key it listed so far, in order,
    not only this hint's: hints are incremental) are present, counted into its hit
    rate. InvalidArgument for a bad state, id or TTL (nothing changes). Any thread.

    A session another client holds here changes hands only as SessionTable.claim
    says (``whole``: the hint carries the sender's whole chain); a refused hint
    changes nothing and answers ``resend``.

    A long hint runs in slices with the store lock released between them: its hashes
    but the last slice's are added in the session's current state, then the last
    slice comes with the state change; the session's room within its share is
    measured over its chain slice by slice, and the chain's prefix match is sliced
    too; a state change of a long chain (SessionTable.move_slice) moves its keys a
    slice at a time. Another client's lookup waits for one slice at most, not the
    whole chain.

    ``depths`` (empty, or one per key) are the keys' depths in the whole chain;
    ``cuts`` are other workers' cut notices the client carries, ``(session, depth,
    turn)`` of this namespace: recorded first (those of ``client``'s own sessions
    only, SessionTable.cut_from), then walked a slice per hold of the lock
    (StoreHost.walk_cuts)."""
    check_hint(session, state, ttl)
    if depths and len(depths) != len(keys):
        raise InvalidArgument(f"{len(depths)} depths for {len(keys)} hashes")
    step = host.slice_keys * LOOKUP_SLICES
    for i in range(0, len(cuts), step):
        host.apply(RecordCuts(ns, tuple(cuts[i : i + step]), client))
    host.walk_cuts()  # these, and those of blocks lost here since the last walk
    host.expire_due(time.monotonic())  # without a demoter thread to expire sessions
    if not _claim(host, ns, session, client, keys, depths, whole, step):
        return HintAnswer(resend=True)
    _advance(host, ns, session, step)  # an earlier change of this session, if pending
    now = time.monotonic()
    cut = max(0, len(keys) - step)
    if cut and state == "ended" and not host.apply(SessionKnown(ns, session)):
        cut = 0  # an unknown session's end does nothing
    for i in range(0, cut, step):
        j = min(i + step, cut)
        host.tell(SessionKeys(ns, session, tuple(keys[i:j]), now, tuple(depths[i:j]), client))
        host.execute()
    host.tell(
        SessionHint(
            ns, session, state, tuple(keys[cut:]), ttl, now, False, tuple(depths[cut:]), client
        )
    )
    host.execute()
    _advance(host, ns, session, step)
    drain(host)  # sessions this hint pushed out of a full table
    chain = _chain(host, ns, session, client, step)
    if not chain:
        return HintAnswer()
    _measure_room(host, ns, session, chain, step)
    if state != "active":
        return HintAnswer()
    hits = host.match_prefix(ns, chain)
    host.apply(RecordHits(ns, session, hits, len(chain)))
    return HintAnswer(hits)


def _claim(
    host: StoreHost,
    ns: str,
    session: str,
    client: bytes,
    keys: Sequence[bytes],
    depths: Sequence[int],
    whole: bool,
    step: int,
) -> bool:
    """May ``client``'s hint change the session (SessionTable.claim)? The hint's keys
    are indexed outside the lock, and only when another client holds the session; a
    pending state change of its chain moves first, ``step`` keys per hold of the lock
    (a session that starts over would finish it at once)."""
    holder = host.apply(SessionOwner(ns, session))
    if holder is None or holder == client:
        return True
    _advance(host, ns, session, step)
    shown = dict(zip(keys, depths, strict=True)) if depths else dict.fromkeys(keys, -1)
    verdict = host.apply(Claim(ns, session, client, shown, whole))
    host.execute()
    drain(host)  # a long chain that started over leaves a slice at a time
    return verdict != REFUSED


def _chain(host: StoreHost, ns: str, session: str, client: bytes, step: int) -> list[bytes]:
    """The session's chain here, in order, copied ``step`` keys per hold of the lock
    ([] when it is gone, ended or another client's). A chain that grows meanwhile
    (another hint of it) is copied up to where it grew: what this hint measures."""
    cursor = host.apply(ChainOpen(ns, session, client))
    if cursor is None:
        return []
    out: list[bytes] = []
    while True:
        part = host.apply(ChainNext(cursor, step))
        if part is None:  # the chain grew (or ended) meanwhile
            return out
        out += part
        if len(part) < step:
            return out


def drain(host: StoreHost) -> None:
    """Give up the keys of sessions that left the table with a long chain (expired
    or pushed out), a slice per hold of the store lock."""
    step = host.slice_keys * LOOKUP_SLICES
    while host.apply(Drain(step)):
        host.execute()


def _advance(host: StoreHost, ns: str, session: str, step: int) -> None:
    """Move a pending state change of the session to its end, ``step`` keys per hold
    of the store lock."""
    while host.apply(Advance(ns, session, step)):
        host.execute()


def _measure_room(
    host: StoreHost, ns: str, session: str, chain: Sequence[bytes], step: int
) -> None:
    """What the session may still add within its share: its chain's bytes counted
    slice by slice, in order, up to the share (TierPolicy.session_admits)."""
    share = host.session_share
    if share <= 0:
        return
    held = 0
    for i in range(0, len(chain), step):
        held += host.apply(ChainBytes(ns, chain[i : i + step]))
        if held >= share:
            break
    host.apply(SetRoom(ns, session, max(0, share - held)))


def prefetch(host: StoreHost, todo: Sequence[tuple[str, Sequence[bytes]]]) -> None:
    """Copy the SSD-only blocks of resumed sessions into DRAM (the demoter thread):
    each verified against its checksum, committed only if still on SSD, and only
    while DRAM is below its low watermark (a prefetch never evicts: when the cache is
    full, promoting one session's blocks would push out another's)."""
    if not todo or host.ssd is None:
        return
    room = host.apply(PrefetchRoom())
    txn = host.ssd.begin_read()
    try:
        for ns, keys in todo:
            for k in keys:
                got = host.ssd.view(txn, ns, k)
                if got is None or host.stopping():
                    continue
                header, view = got
                room -= len(view)
                if room < 0:  # a prefetch never evicts: only into free DRAM
                    return
                if xxhash.xxh3_64_intdigest(view) != header.checksum:
                    host.bad_ssd(ns, k)
                else:
                    host.promote(ns, k, Held(view, header.checksum, None), prefetched=True)
    finally:
        txn.abort()
