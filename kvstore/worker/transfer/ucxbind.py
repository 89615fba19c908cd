"""Keep a ucx:// server to the address its worker was told (``--host``).

ucxx creates its listener on every interface (it takes no bind address: UCX's
connection manager listens on ``0.0.0.0:PORT``) and UCX opens a transport socket on
every network device. For a worker started with a specific ``--host`` this module:

- limits UCX's network devices to the one that holds that address, by setting
  ``UCX_NET_DEVICES`` before UCX starts in the process (unless the operator set it):
  UCX then opens its transport sockets on that device only (``lo`` for 127.0.0.1);
- tells, for each endpoint the listener accepts, the local address the connection
  came in on (``ucp_ep_query``, ``UCP_EP_ATTR_FIELD_LOCAL_SOCKADDR``), so the server
  closes endpoints that arrived on any other address before reading a frame.

The connection manager's own socket still listens on every address: a peer can open
a TCP connection to it and go through UCX's handshake, then its endpoint is closed.
docs/UCX.md says so; a firewall closes that too.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import glob
import ipaddress
import logging
import os
import socket
import struct
from typing import Any

log = logging.getLogger("kvstore.worker.ucx")

WILDCARDS = ("0.0.0.0", "::", "")
SIOCGIFADDR = 0x8915
UCP_EP_ATTR_FIELD_LOCAL_SOCKADDR = 1 << 1
LOCAL_SOCKADDR_OFFSET = 8 + 32  # ucp_ep_attr_t: field_mask, name[UCP_ENTITY_NAME_MAX]


def _ipv4_of(ifname: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def _ipv6_of(ifname: str) -> set[str]:
    out: set[str] = set()
    with contextlib.suppress(OSError), open("/proc/net/if_inet6") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5] == ifname:
                out.add(str(ipaddress.IPv6Address(bytes.fromhex(parts[0]))))
    return out


def device_of(host: str) -> str | None:
    """The network interface that holds address ``host`` (a loopback address: ``lo``),
    None when no interface of this network namespace has it."""
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        try:
            addr = ipaddress.ip_address(socket.gethostbyname(host))
        except OSError:
            return None
    for _, name in socket.if_nameindex():
        if addr.version == 4 and _ipv4_of(name) == str(addr):
            return name
        if addr.version == 6 and str(addr) in _ipv6_of(name):
            return name
    if addr.is_loopback:
        return "lo"
    return None


def restrict_devices(host: str) -> str | None:
    """Before UCX starts: limit its network devices to ``host``'s interface (sets
    ``UCX_NET_DEVICES`` unless already set). Returns the device chosen, None when
    nothing was changed (a wildcard host, the operator's own setting, no device)."""
    if host in WILDCARDS or os.environ.get("UCX_NET_DEVICES"):
        return None
    dev = device_of(host)
    if dev is not None:
        os.environ["UCX_NET_DEVICES"] = dev
    return dev


class LocalAddress:
    """The local address of an accepted endpoint, read through libucp (the library
    ucxx itself loaded)."""

    def __init__(self) -> None:
        self._query: Any = None
        try:
            import libucx  # type: ignore[import-untyped, unused-ignore]

            base = os.path.dirname(libucx.__file__)
            path = sorted(glob.glob(os.path.join(base, "lib", "libucp.so*")))[0]
            lib = ctypes.CDLL(path)
            self._query = lib.ucp_ep_query
            self._query.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            self._query.restype = ctypes.c_int
        except (ImportError, IndexError, OSError, AttributeError) as e:
            log.warning("cannot read ucx endpoints' local addresses (%s): not filtered", e)

    def of(self, ep: Any) -> str | None:
        """The IP address the endpoint's connection arrived on, None when unknown."""
        if self._query is None:
            return None
        try:
            handle = int(ep.ucp_endpoint)
        except (AttributeError, TypeError, ValueError):
            return None
        buf = ctypes.create_string_buffer(1024)
        struct.pack_into("Q", buf, 0, UCP_EP_ATTR_FIELD_LOCAL_SOCKADDR)
        if self._query(handle, buf) != 0:
            return None
        family = struct.unpack_from("H", buf, LOCAL_SOCKADDR_OFFSET)[0]
        o = LOCAL_SOCKADDR_OFFSET
        if family == socket.AF_INET:
            return socket.inet_ntop(socket.AF_INET, buf.raw[o + 4 : o + 8])
        if family == socket.AF_INET6:
            return socket.inet_ntop(socket.AF_INET6, buf.raw[o + 8 : o + 24])
        return None


def same_address(got: str, host: str) -> bool:
    """``got`` (an endpoint's local address) is ``host``; an IPv4-mapped IPv6 address
    counts as its IPv4 address."""
    try:
        a, b = ipaddress.ip_address(got), ipaddress.ip_address(host)
    except ValueError:
        return got == host
    if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
        a = a.ipv4_mapped
    return a == b
