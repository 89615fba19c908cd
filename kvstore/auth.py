"""Tenants: bearer tokens, the namespaces each tenant owns, and their byte quotas.

Off unless a daemon gets ``--tenants-file``. The file (YAML)::

    tenants:
      - name: team-a
        token_sha256: 3f1d...        # sha256 hex of the token (or `token:` in clear, dev only)
        namespaces: [team-a]         # owns "team-a" and everything under "team-a/"
        quota: 10GiB                 # bytes per worker; omit for no quota
      - name: ops
        token_sha256: 9ab0...
        admin: true                  # every namespace, and cluster calls (workers use this)

Every call must carry a known token (else UNAUTHENTICATED); touching a namespace
the tenant does not own is PERMISSION_DENIED; writing past the quota is
RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass

import yaml

from kvstore_client.errors import InvalidArgument, PermissionDenied, Unauthenticated
from kvstore_client.keys import check_namespace

from .config import parse_size
from .worker.tiers.policy import QuotaBook


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    namespaces: tuple[str, ...]
    quota: int | None = None
    admin: bool = False

    def owns(self, ns: str) -> bool:
        return self.admin or any(ns == p or ns.startswith(p + "/") for p in self.namespaces)


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Tenants:
    """Token -> tenant, namespace -> owning tenant."""

    def __init__(self, entries: Sequence[tuple[Tenant, str]]) -> None:
        self._by_digest = {digest: t for t, digest in entries}
        self.tenants = [t for t, _ in entries]
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise InvalidArgument("tenant names must be unique")

    @staticmethod
    def load(path: str) -> Tenants:
        try:
            with open(path) as f:
                data = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as e:
            raise InvalidArgument(f"cannot read tenants file {path}: {e}") from e
        items = data.get("tenants") if isinstance(data, dict) else None
        if not isinstance(items, list) or not items:
            raise InvalidArgument(f"{path}: want a non-empty 'tenants:' list")
        entries: list[tuple[Tenant, str]] = []
        for i, item in enumerate(items):
            if not isinstance(item, dict) or not item.get("name"):
                raise InvalidArgument(f"{path}: tenant {i} needs a name")
            unknown = set(item) - {"name", "token", "token_sha256", "namespaces", "quota", "admin"}
            if unknown:
                raise InvalidArgument(f"{path}: tenant {item['name']}: unknown keys {unknown}")
            digest = item.get("token_sha256") or (
                token_digest(str(item["token"])) if item.get("token") else ""
            )
            if not digest:
                raise InvalidArgument(f"{path}: tenant {item['name']} needs token or token_sha256")
            namespaces = tuple(check_namespace(n) for n in item.get("namespaces", []))
            admin = bool(item.get("admin", False))
            if not namespaces and not admin:
                raise InvalidArgument(f"{path}: tenant {item['name']} owns no namespaces")
            quota = parse_size(item["quota"]) if item.get("quota") is not None else None
            entries.append((Tenant(str(item["name"]), namespaces, quota, admin), str(digest)))
        return Tenants(entries)

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

    def quota_book(self) -> QuotaBook:
        """Byte quotas per tenant, for the worker's store."""
        return QuotaBook({t.name: t.quota for t in self.tenants if t.quota}, key_of=self.owner)


def bearer(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The token of an ``authorization: Bearer ...`` metadata entry."""
    for k, v in metadata or ():
        if k == "authorization":
            text = v.decode() if isinstance(v, bytes) else v
            if text.startswith("Bearer "):
                return text[len("Bearer ") :]
    return None
