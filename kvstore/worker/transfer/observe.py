"""Per-frame request accounting shared by every transfer server (tcp://, ucx://)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from kvstore_client import wire
from kvstore_client.errors import KVStoreError, to_grpc_code

# Operation names for kvstore_requests_total{op} (a small fixed set).
OP_NAMES = {
    wire.OP_PUT: "put",
    wire.OP_GET: "get",
    wire.OP_EXISTS: "exists",
    wire.OP_REMOVE: "remove",
    wire.OP_GET_LOC: "shm_get",
    wire.OP_PUT_LOC: "shm_reserve",
    wire.OP_PUT_COMMIT: "shm_commit",
    wire.OP_RELEASE: "shm_release",  # not counted by tcp:// (one-way, between reads)
}


@contextlib.contextmanager
def observe_frame(on_request: Callable[[str, str, float], None] | None, op: int) -> Iterator[None]:
    """Time the frame served inside the block and report (op, status code, seconds):
    OK, the error's gRPC code, or UNAVAILABLE when the connection broke mid-frame."""
    t0 = time.perf_counter()
    code = "OK"
    try:
        yield
    except KVStoreError as e:
        code = to_grpc_code(e).name
        raise
    except BaseException:
        code = "UNAVAILABLE"
        raise
    finally:
        if on_request is not None:
            on_request(OP_NAMES.get(op, "other"), code, time.perf_counter() - t0)
