"""The store client of a connector, made lazily and re-made after failures, so an
unreachable store turns into misses, never into a failed engine start."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ..client import Client

log = logging.getLogger(__name__)


class ClientHolder:
    """A :class:`Client` made in a background thread, so no caller ever waits for an
    unreachable master longer than it asked to: ``get(wait)`` returns the client, or
    None when it is not there within ``wait`` seconds (callers treat that as a miss).
    A failed attempt is retried at most every ``retry_s`` seconds. ``on_connect`` runs
    on the connecting thread with each new client before ``get`` waiters wake.
    Thread-safe."""

    def __init__(
        self,
        master: str,
        timeout: float,
        retry_s: float = 5.0,
        factory: Callable[..., Client] = Client,
        on_connect: Callable[[Client], None] | None = None,
    ) -> None:
        self.master = master
        self.timeout = timeout
        self.retry_s = retry_s
        self._factory = factory
        self._on_connect = on_connect  # called on the connecting thread, once per client
        self._client: Client | None = None
        self._next_try = 0.0
        self._lock = threading.Lock()
        self._attempt: threading.Event | None = None  # set when the running attempt ends
        self._closed = False

    def start(self) -> None:
        """Begin connecting now (idempotent)."""
        self._kick()

    def _kick(self) -> threading.Event | None:
        with self._lock:
            if self._client is not None or self._closed:
                return None
            if self._attempt is not None:
                return self._attempt
            if time.monotonic() < self._next_try:
                return None
            done = self._attempt = threading.Event()
        threading.Thread(target=self._connect, args=(done,), name="kvstore-connect",
                         daemon=True).start()  # fmt: skip
        return done

    def _connect(self, done: threading.Event) -> None:
        client: Client | None = None
        try:
            client = self._factory(self.master, timeout=self.timeout)
        except Exception as e:
            log.warning("kvstore at %s unreachable (%s); lookups are misses meanwhile",
                        self.master, e)  # fmt: skip
        with self._lock:
            if client is not None and self._closed:
                client.close()
                client = None
            self._client = client
            if client is None:
                self._next_try = time.monotonic() + self.retry_s
            self._attempt = None
        if client is not None and self._on_connect is not None:
            try:
                self._on_connect(client)
            except Exception as e:  # a hook's failure never loses the client
                log.warning("kvstore connector: on-connect hook failed: %s", e)
        done.set()

    def get(self, wait: float = 0.0) -> Client | None:
        c = self._client
        if c is not None:
            return c
        done = self._kick()
        if done is not None and wait > 0:
            done.wait(wait)
        return self._client

    def close(self) -> None:
        with self._lock:
            self._closed = True
            c, self._client = self._client, None
        if c is not None:
            c.close()
