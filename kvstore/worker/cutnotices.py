"""Chain-cut notices a worker keeps for the clients whose sessions it cut.

When a worker loses a live session's block for good it drops the session's deeper
blocks here (:meth:`kvstore.worker.sessions.SessionTable.cut`) and keeps a notice,
``(session, depth, turn)``, for the other workers holding the rest of the chain. The
notice travels through the session's own client: the worker hands it out only in the
answer to a hint from that client (the identity the session belongs to here), and
the client carries it in its next hint of the namespace to every worker, each of which
applies it only when the session is that client's there too
(:meth:`~kvstore.worker.sessions.SessionTable.cut_from`). No other client learns that
the session exists, nor can it cut it.

Pure bookkeeping, run under the store's lock by the tier policy; bounded (the oldest
notice goes first) and indexed by (client, namespace), so handing a client its notices
costs what it takes, not what the worker holds.
"""

from __future__ import annotations

from collections import OrderedDict

MAX_CUT_NOTICES = 4096  # chains cut here whose notices no client took yet

Name = tuple[str, str]  # (namespace, session)


class CutNotices:
    """Notices not taken yet: (namespace, session) -> (depth, turn, client)."""

    def __init__(self, limit: int = MAX_CUT_NOTICES) -> None:
        self.limit = limit
        self._notes: OrderedDict[Name, tuple[int, int, bytes]] = OrderedDict()
        self._of: dict[tuple[bytes, str], set[str]] = {}  # (client, ns) -> its sessions

    def __len__(self) -> int:
        return len(self._notes)

    def add(self, ns: str, session: str, depth: int, turn: int, client: bytes) -> None:
        """The session (``client``'s here) lost its block at ``depth`` during ``turn``:
        replaces an earlier notice of it; the oldest notice goes past the limit."""
        self._pop((ns, session))
        self._notes[(ns, session)] = (depth, turn, client)
        self._of.setdefault((client, ns), set()).add(session)
        while len(self._notes) > self.limit:
            self._pop(next(iter(self._notes)))

    def take(self, ns: str, client: bytes) -> list[tuple[str, int, int]]:
        """``client``'s notices of namespace ``ns`` (session, depth, turn); each once."""
        names = self._of.pop((client, ns), None)
        if not names:
            return []
        out = []
        for name in names:
            depth, turn, _ = self._notes.pop((ns, name))
            out.append((name, depth, turn))
        return sorted(out)

    def move(self, ns: str, session: str, client: bytes) -> None:
        """The session is ``client``'s now (it showed the chain): so is its notice."""
        got = self._notes.get((ns, session))
        if got is not None and got[2] != client:
            self.add(ns, session, got[0], got[1], client)

    def forget(self, ns: str, session: str) -> None:
        """The session started over: its old chain's notice names nothing now."""
        self._pop((ns, session))

    def _pop(self, name: Name) -> None:
        got = self._notes.pop(name, None)
        if got is None:
            return
        k = (got[2], name[0])
        names = self._of.get(k)
        if names is not None:
            names.discard(name[1])
            if not names:
                del self._of[k]
