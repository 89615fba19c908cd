"""Tenants: bearer tokens, the namespaces each tenant owns, and their byte quotas.

Off unless a daemon gets ``--tenants-file``. The file (YAML)::

    tenants:
      - name: team-a
        token_sha256: 3f1d...        # sha256 hex of the token (or `token:` in clear, dev only)
        namespaces: [team-a]         # owns "team-a" and everything under "team-a/"
        quota: 10GiB                 # bytes per worker (> 0); omit for no quota
      - name: ops
        token_sha256: 9ab0...
        admin: true                  # every namespace, and cluster calls (workers use this)

Every call must carry a known token (else UNAUTHENTICATED); touching a namespace
the tenant does not own is PERMISSION_DENIED; writing past the quota is
RESOURCE_EXHAUSTED.

The file is checked strictly at load, and any doubt is an InvalidArgument that
names the file, the tenant and the key: ``admin`` must be a YAML boolean (a
quoted ``"false"`` is an error, not admin); ``quota`` a positive size (0 or a
negative number is an error: omit the key for no quota); ``token_sha256`` 64 hex
digits (upper case is accepted and normalised); no two tenants may share a
token, a name, or overlapping namespaces (one owning ``shared`` and another
``shared/y`` would let the first read the second's data).

This module is plain data and checks: the master imports it, so it imports no
worker code. The worker builds its quota book from :attr:`Tenants.quotas` and
:meth:`Tenants.quota_account`.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from kvstore_client.errors import InvalidArgument, PermissionDenied, Unauthenticated
from kvstore_client.keys import check_namespace
from kvstore_client.security import CLIENT_HEADER, IDENTITY_BYTES

from .config import parse_size

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_KEYS = frozenset({"name", "token", "token_sha256", "namespaces", "quota", "admin"})


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    namespaces: tuple[str, ...]
    quota: int | None = None
    admin: bool = False

    def owns(self, ns: str) -> bool:
        return self.admin or any(_under(ns, p) for p in self.namespaces)


def _under(ns: str, prefix: str) -> bool:
    """True when ``ns`` is ``prefix`` or below ``prefix/``."""
    return ns == prefix or ns.startswith(prefix + "/")


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Tenants:
    """Token -> tenant, namespace -> owning tenant.

    The constructor checks what must hold whatever the source: unique names,
    unique tokens and disjoint namespaces between tenants (InvalidArgument).
    """

    def __init__(self, entries: Sequence[tuple[Tenant, str]], *, origin: str = "tenants") -> None:
        self.tenants = [t for t, _ in entries]
        seen: dict[str, str] = {}
        for t in self.tenants:
            if t.name in seen:
                raise InvalidArgument(f"{origin}: tenant name {t.name!r} is used twice")
            seen[t.name] = t.name
        self._by_digest: dict[str, Tenant] = {}
        for t, digest in entries:
            other = self._by_digest.get(digest)
            if other is not None:
                raise InvalidArgument(
                    f"{origin}: tenants {other.name!r} and {t.name!r} have the same token"
                )
            self._by_digest[digest] = t
        owners: list[tuple[str, Tenant]] = [(p, t) for t in self.tenants for p in t.namespaces]
        for i, (p, t) in enumerate(owners):
            for q, u in owners[i + 1 :]:
                if u is not t and (_under(p, q) or _under(q, p)):
                    raise InvalidArgument(
                        f"{origin}: namespaces overlap between tenants: {t.name!r} owns {p!r} "
                        f"and {u.name!r} owns {q!r}"
                    )

    @staticmethod
    def load(path: str) -> Tenants:
        """Read and check a tenants file; InvalidArgument naming the key on any error."""
        try:
            with open(path) as f:
                data = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as e:
            raise InvalidArgument(f"cannot read tenants file {path}: {e}") from e
        items = data.get("tenants") if isinstance(data, dict) else None
        if not isinstance(items, list) or not items:
            raise InvalidArgument(f"{path}: want a non-empty 'tenants:' list")
        return Tenants([_entry(path, i, item) for i, item in enumerate(items)], origin=path)

    def authenticate(self, token: str | None) -> Tenant:
        """The tenant of a token; Unauthenticated when missing or unknown."""
        if not token:
            raise Unauthenticated("this cluster requires a bearer token")
        digest = token_digest(token)
        for known, tenant in self._by_digest.items():
            if hmac.compare_digest(known, digest):
                return tenant
        raise Unauthenticated("unknown token")

    @staticmethod
    def authorize(tenant: Tenant, ns: str) -> None:
        if not tenant.owns(ns):
            raise PermissionDenied(f"tenant {tenant.name!r} does not own namespace {ns!r}")

    def owner(self, ns: str) -> str | None:
        """Name of the non-admin tenant owning ``ns`` (the account its bytes count to)."""
        for t in self.tenants:
            if not t.admin and t.owns(ns):
                return t.name
        return None

    @property
    def quotas(self) -> dict[str, int]:
        """Byte quota per tenant name, for the tenants that have one."""
        return {t.name: t.quota for t in self.tenants if t.quota is not None}

    def quota_account(self, ns: str) -> str | None:
        """The quota account ``ns`` is charged to (its owner's name), or None."""
        return self.owner(ns)


def _entry(path: str, i: int, item: Any) -> tuple[Tenant, str]:
    """One checked ``tenants:`` entry -> (tenant, sha256 hex of its token)."""
    if not isinstance(item, dict):
        raise InvalidArgument(f"{path}: tenant {i} must be a mapping")
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"{path}: tenant {i} needs a name (a string)")
    where = f"{path}: tenant {name!r}"
    unknown = set(item) - _KEYS
    if unknown:
        raise InvalidArgument(f"{where}: unknown keys {sorted(unknown)}")
    if "token" in item and "token_sha256" in item:
        raise InvalidArgument(f"{where}: give token or token_sha256, not both")
    if "token_sha256" in item:
        digest = item["token_sha256"]
        if not isinstance(digest, str) or not _HEX64.match(digest.lower()):
            raise InvalidArgument(
                f"{where}: token_sha256 must be 64 hex digits (sha256sum of the token)"
            )
        digest = digest.lower()
    elif "token" in item:
        token = item["token"]
        if not isinstance(token, str) or not token:
            raise InvalidArgument(f"{where}: token must be a non-empty string")
        digest = token_digest(token)
    else:
        raise InvalidArgument(f"{where} needs token or token_sha256")
    admin = item.get("admin", False)
    if not isinstance(admin, bool):
        raise InvalidArgument(f"{where}: admin must be true or false (unquoted), not {admin!r}")
    raw = item.get("namespaces", [])
    if not isinstance(raw, list) or not all(isinstance(n, str) for n in raw):
        raise InvalidArgument(f"{where}: namespaces must be a list of strings")
    try:
        namespaces = tuple(check_namespace(n) for n in raw)
    except InvalidArgument as e:
        raise InvalidArgument(f"{where}: namespaces: {e}") from e
    if not namespaces and not admin:
        raise InvalidArgument(f"{where} owns no namespaces")
    quota = item.get("quota")
    if quota is not None:
        if isinstance(quota, bool) or not isinstance(quota, int | str):
            raise InvalidArgument(f"{where}: quota must be a size such as 10GiB")
        try:
            quota = parse_size(quota)
        except InvalidArgument as e:
            raise InvalidArgument(f"{where}: quota: {e}") from e
        if quota <= 0:
            raise InvalidArgument(
                f"{where}: quota must be positive ({quota} given); omit it for no quota"
            )
    return Tenant(name, namespaces, quota, admin), digest


def client_identity(metadata: Sequence[tuple[str, str | bytes]] | None) -> bytes:
    """The calling client's identity (``kvstore-client`` metadata: 32 hex digits), or
    b"" when it sent none or a malformed one (see kvstore_client.security)."""
    for k, v in metadata or ():
        if k == CLIENT_HEADER:
            text = v.decode(errors="replace") if isinstance(v, bytes) else v
            if len(text) == 2 * IDENTITY_BYTES:
                try:
                    return bytes.fromhex(text)
                except ValueError:
                    return b""
            return b""
    return b""


def bearer(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The token of an ``authorization: Bearer ...`` metadata entry."""
    for k, v in metadata or ():
        if k == "authorization":
            text = v.decode() if isinstance(v, bytes) else v
            if text.startswith("Bearer "):
                return text[len("Bearer ") :]
    return None
