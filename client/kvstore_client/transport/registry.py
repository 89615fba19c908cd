"""The transports, registered by URL scheme: each implementation module registers one
:class:`Scheme` when it is imported (``tcp`` in :mod:`.tcp`, ``shm`` in :mod:`.shm`,
``ucx`` in :mod:`.ucx`), and :class:`kvstore_client.routing.Links` asks the registry,
never a concrete class, which transports to open for a worker and which one carries
its calls. A new transport is one module that registers its scheme.

Every link has the ``tcp`` scheme's pool (the base: control frames, and the transfer
when no other applies); of the other schemes that the client's ``transport=`` choice
asks for and that opened for the worker, the highest :attr:`Scheme.rank` wins.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..proto import master_pb2
    from ..security import Tls


class Opened(Protocol):
    """What a scheme keeps per worker (a connection pool, a mapping): closed when the
    worker leaves the map or the client closes."""

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Credentials:
    """Who this client is to the workers (see :mod:`kvstore_client.security`)."""

    tls: Tls | None
    token: str
    identity: bytes


@dataclass(frozen=True, slots=True)
class Scheme:
    """One transport. ``wanted(choice)``: whether the client's ``transport=`` choice
    ("auto", "tcp", "shm", "ucx") uses it. ``open(url, endpoints, creds)``: what it
    keeps for a worker whose first endpoint of this scheme is ``url`` (``endpoints``:
    all it advertises), or None when it cannot reach that worker (a worker on another
    host has no arena to map). ``transfer(opened, base, info)``: the
    :class:`~kvstore_client.transport.Transfer` over it (``base``: the worker's tcp://
    pool, which carries control frames)."""

    name: str
    rank: int
    wanted: Callable[[str], bool]
    open: Callable[[str, Sequence[str], Credentials], Any]
    transfer: Callable[[Any, Any, master_pb2.WorkerInfo], Any]

    @property
    def prefix(self) -> str:
        return f"{self.name}://"

    def find(self, endpoints: Sequence[str]) -> str:
        """The first of ``endpoints`` of this scheme, or ""."""
        return next((e for e in endpoints if e.startswith(self.prefix)), "")


_SCHEMES: dict[str, Scheme] = {}


def register(scheme: Scheme) -> None:
    """Make ``scheme`` known (a module registers its transport when imported)."""
    _SCHEMES[scheme.name] = scheme


def scheme(name: str) -> Scheme:
    """The registered scheme ``name``; KeyError when no module registered it."""
    return _SCHEMES[name]


def schemes() -> list[Scheme]:
    """Every registered scheme, the preferred (highest rank) first."""
    return sorted(_SCHEMES.values(), key=lambda s: -s.rank)


__all__ = ["Credentials", "Opened", "Scheme", "register", "scheme", "schemes"]
