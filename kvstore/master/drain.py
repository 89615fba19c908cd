"""Master.Drain's call to the worker: Store.HandOff (see kvstore.worker.handoff).

The master takes the worker out of the map itself (Membership.drain, committed like
any membership change), then asks the worker over its gRPC address to hand its DRAM
blocks to their next owners, passing the operator's token along. The handler in
:mod:`.server` is the only caller.
"""

from __future__ import annotations

import grpc

from kvstore_client.proto import store_pb2, store_pb2_grpc
from kvstore_client.security import Tls

DEFAULT_TIMEOUT_S = 60.0
MAX_TIMEOUT_S = 3600.0
SLACK_S = 10.0  # the call's deadline beyond the hand-off's own bound


def check_timeout(timeout_s: float) -> float:
    """The hand-off's bound: ``timeout_s`` (0: the default); ValueError outside 0..1 h."""
    if not 0 <= timeout_s <= MAX_TIMEOUT_S:
        raise ValueError(f"timeout_s {timeout_s:g} is not within 0..{MAX_TIMEOUT_S:g}")
    return timeout_s or DEFAULT_TIMEOUT_S


async def ask_hand_off(
    grpc_addr: str, tls: Tls | None, metadata: tuple[tuple[str, str], ...], timeout_s: float
) -> store_pb2.HandOffResponse:
    """Store.HandOff on the worker at ``grpc_addr``; grpc.aio.AioRpcError on failure."""
    if tls is not None and tls.enabled:
        channel = grpc.aio.secure_channel(grpc_addr, tls.channel_credentials())
    else:
        channel = grpc.aio.insecure_channel(grpc_addr)
    async with channel:
        stub = store_pb2_grpc.StoreStub(channel)
        resp: store_pb2.HandOffResponse = await stub.HandOff(
            store_pb2.HandOffRequest(timeout_s=timeout_s),
            timeout=timeout_s + SLACK_S,
            metadata=metadata,
        )
        return resp
