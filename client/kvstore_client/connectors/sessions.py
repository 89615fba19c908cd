"""Session hints from the engine: a request's ``session_id`` / ``session_state``
(``active`` | ``paused`` | ``ended``, optional ``session_ttl`` seconds) become
:meth:`Client.session_hint <kvstore_client.client.Client.session_hint>` calls with
the request's block hashes, sent by one background thread from a bounded queue (the
scheduler never waits on them; a full queue drops the hint, counted). No engine or
torch import.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgument
from ..sessions import check_hint

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class Hint:
    """A session hint read from a request: ``session`` is now ``state``."""

    session: str
    state: str
    ttl: float | None = None


def parse_hint(params: Any) -> tuple[Hint | None, str | None]:
    """The hint in a request's transfer params: (hint, None); (None, None) when it
    has none; (None, why) when it is malformed (an unknown state, an empty or huge
    id, a bad ttl). A session id without a state means ``active``."""
    if not isinstance(params, Mapping):
        return None, None
    sid, state, ttl = (params.get(k) for k in ("session_id", "session_state", "session_ttl"))
    if sid is None and state is None and ttl is None:
        return None, None
    if sid is None:
        return None, "session_state or session_ttl without a session_id"
    state = "active" if state is None else state
    try:
        ttl_s = None if ttl is None else float(ttl)
        check_hint(sid, state, ttl_s)
    except (TypeError, ValueError, InvalidArgument) as e:
        return None, str(e)
    return Hint(sid, state, ttl_s), None


class HintQueue:
    """Hints waiting to be sent by one daemon thread through ``send(hint, hashes)``.

    ``offer`` never blocks: False when ``maxsize`` hints already wait (the hint is
    dropped; hints are advice). ``on_result(sent, dropped)`` counts each outcome;
    a ``send`` that raises counts as dropped (logged once per kind of error)."""

    def __init__(
        self,
        send: Callable[[Hint, list[bytes]], None],
        on_result: Callable[[int, int], None],
        maxsize: int = 1024,
    ) -> None:
        self._send = send
        self._on_result = on_result
        self._q: queue.Queue[tuple[Hint, list[bytes]] | None] = queue.Queue(maxsize)
        self._logged: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="kvstore-hints", daemon=True)
        self._thread.start()

    def offer(self, hint: Hint, hashes: list[bytes]) -> bool:
        try:
            self._q.put_nowait((hint, hashes))
        except queue.Full:
            self._on_result(0, 1)
            return False
        return True

    def _run(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                self._send(*item)
                self._on_result(1, 0)
            except Exception as e:  # advice: a refused or failed hint is dropped
                kind = type(e).__name__
                if kind not in self._logged:
                    self._logged.add(kind)
                    log.warning("kvstore session hint not sent: %s", e)
                self._on_result(0, 1)
            finally:
                self._q.task_done()

    def join(self) -> None:
        """Wait until every queued hint was sent or dropped (tests)."""
        self._q.join()

    def close(self) -> None:
        with contextlib.suppress(queue.Full):  # else a daemon thread ends with the process
            self._q.put_nowait(None)
