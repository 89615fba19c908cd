"""Is anything listening at an address? One TCP connect, used to prove a process gone."""

from __future__ import annotations

import asyncio
import contextlib


async def refuses(host: str, port: int, timeout: float = 1.0) -> bool:
    """True when ``host:port`` actively refuses a TCP connection (nothing listens).

    False when it accepts, times out or fails otherwise: only a refusal proves that
    the process that listened there is gone.
    """
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except ConnectionRefusedError:
        return True
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return False


async def address_refuses(addr: str, timeout: float = 1.0) -> bool:
    """:func:`refuses` for a ``host:port`` text; False when it is not one."""
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return False
    return await refuses(host.strip("[]"), int(port), timeout)


async def address_accepts(addr: str, timeout: float = 1.0) -> bool:
    """True when something accepts a TCP connection at ``host:port`` right now."""
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return False
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(host.strip("[]"), int(port)), timeout
        )
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True
