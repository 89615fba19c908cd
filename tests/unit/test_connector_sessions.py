"""Session hints read from a request's transfer params and their send queue (no
engine): absent means no hint, bad values are refused with the reason, a full
queue drops (counted) instead of blocking the scheduler."""

from __future__ import annotations

import threading

import pytest

from kvstore_client.connectors.sessions import Hint, HintQueue, parse_hint


def test_parse_hint() -> None:
    assert parse_hint(None) == (None, None)
    assert parse_hint({"other": 1}) == (None, None)
    assert parse_hint({"session_id": "s1", "session_state": "paused"}) == (
        Hint("s1", "paused"),
        None,
    )
    assert parse_hint({"session_id": "s1"}) == (Hint("s1", "active"), None)
    assert parse_hint({"session_id": "s", "session_state": "ended", "session_ttl": "30"}) == (
        Hint("s", "ended", 30.0),
        None,
    )


@pytest.mark.parametrize(
    ("params", "why"),
    [
        ({"session_id": "s", "session_state": "sleeping"}, "must be one of"),
        ({"session_id": "", "session_state": "active"}, "non-empty"),
        ({"session_id": 7, "session_state": "active"}, "non-empty string"),
        ({"session_id": "x" * 10_000}, "at most"),
        ({"session_state": "paused"}, "without a session_id"),
        ({"session_id": "s", "session_ttl": -1}, "positive"),
        ({"session_id": "s", "session_ttl": "soon"}, "could not convert"),
    ],
)
def test_bad_hints_are_refused_with_the_reason(params: dict[str, object], why: str) -> None:
    hint, bad = parse_hint(params)
    assert hint is None and bad is not None and why in bad


def test_a_full_queue_drops_and_counts_never_blocks() -> None:
    gate = threading.Event()
    sent: list[tuple[Hint, list[bytes]]] = []
    counts = [0, 0]

    def send(h: Hint, hashes: list[bytes]) -> None:
        gate.wait(10)
        if h.session == "boom":
            raise ConnectionError("store down")
        sent.append((h, hashes))

    def result(ok: int, dropped: int) -> None:
        counts[0] += ok
        counts[1] += dropped

    q = HintQueue(send, result, maxsize=2)
    try:
        assert q.offer(Hint("a", "paused"), [b"\x01" * 16])  # taken by the thread, waits
        while q._q.qsize():
            pass
        assert q.offer(Hint("boom", "paused"), [])
        assert q.offer(Hint("c", "ended"), [])
        assert not q.offer(Hint("d", "ended"), [])  # full: dropped at once
        gate.set()
        q.join()
        assert [h.session for h, _ in sent] == ["a", "c"]
        assert counts == [2, 2]  # "d" dropped (full), "boom" dropped (send failed)
    finally:
        gate.set()
        q.close()
