"""TLS and bearer tokens, shared by clients and daemons.

Off by default (plain loopback development). In production every daemon and
client gets the same CA (``tls_ca``), daemons a certificate and key, and, with
mutual TLS, clients too. A token travels as gRPC metadata
``authorization: Bearer <token>`` and, on the transfer plane, in an AUTH frame
at the start of each connection.

Every :class:`~kvstore_client.Client` also has an *identity*: 16 random bytes made
when it starts, never shown anywhere, sent with its token (gRPC metadata
``kvstore-client``, the AUTH frame with ``wire.FLAG_IDENTITY``, the shm:// hand-over).
A worker counts what a client holds (read pins, reservations, hazard words) and which
sessions it may cut by this identity, not by its address: every engine on a host
connects from the same address. Guessing another client's identity takes 2^128 tries;
a process that can read another's memory is that process, as far as any store can tell.
"""

from __future__ import annotations

import os
import secrets
import socket
import ssl
from dataclasses import dataclass

import grpc

from .errors import InvalidArgument

AUTH_HEADER = "authorization"
CLIENT_HEADER = "kvstore-client"  # gRPC metadata: the calling client's identity, in hex
IDENTITY_BYTES = 16


def new_identity() -> bytes:
    """A fresh client identity (see the module docstring)."""
    return secrets.token_bytes(IDENTITY_BYTES)


@dataclass(slots=True, frozen=True)
class Tls:
    """Paths of PEM files. ``ca`` verifies the peer; ``cert``/``key`` identify us."""

    ca: str = ""
    cert: str = ""
    key: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.ca or self.cert)

    @staticmethod
    def from_env() -> Tls | None:
        """KVSTORE_TLS_CA / KVSTORE_TLS_CERT / KVSTORE_TLS_KEY, or None when unset."""
        t = Tls(
            os.environ.get("KVSTORE_TLS_CA", ""),
            os.environ.get("KVSTORE_TLS_CERT", ""),
            os.environ.get("KVSTORE_TLS_KEY", ""),
        )
        return t if t.enabled else None

    def _read(self, path: str) -> bytes | None:
        if not path:
            return None
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise InvalidArgument(f"cannot read TLS file {path}: {e}") from e

    # ---- gRPC ------------------------------------------------------------------

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self._read(self.ca),
            private_key=self._read(self.key),
            certificate_chain=self._read(self.cert),
        )

    def server_credentials(self, require_client_cert: bool) -> grpc.ServerCredentials:
        key, cert = self._read(self.key), self._read(self.cert)
        if key is None or cert is None:
            raise InvalidArgument("a TLS server needs both a certificate and a key")
        return grpc.ssl_server_credentials(
            [(key, cert)],
            root_certificates=self._read(self.ca),
            require_client_auth=require_client_cert,
        )

    # ---- transfer plane ----------------------------------------------------------

    def client_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca or None)
        if self.cert:
            ctx.load_cert_chain(self.cert, self.key or None)
        return ctx

    def server_context(self, require_client_cert: bool) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.ca or None)
        ctx.load_cert_chain(self.cert, self.key or None)
        ctx.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_NONE
        return ctx


def open_channel(
    addr: str, tls: Tls | None, options: list[tuple[str, int]] | None = None
) -> grpc.Channel:
    """A gRPC channel, TLS when configured."""
    if tls is not None and tls.enabled:
        return grpc.secure_channel(addr, tls.channel_credentials(), options=options)
    return grpc.insecure_channel(addr, options=options)


def metadata(token: str | None, identity: bytes = b"") -> tuple[tuple[str, str], ...] | None:
    """gRPC call metadata carrying the bearer token and the client's identity."""
    md: list[tuple[str, str]] = []
    if token:
        md.append((AUTH_HEADER, f"Bearer {token}"))
    if identity:
        md.append((CLIENT_HEADER, identity.hex()))
    return tuple(md) or None


def wrap_client_socket(sock: socket.socket, tls: Tls | None, host: str) -> socket.socket:
    """TLS-wrap a connected transfer socket when configured (verifies the server name)."""
    if tls is None or not tls.enabled:
        return sock
    return tls.client_context().wrap_socket(sock, server_hostname=host)
