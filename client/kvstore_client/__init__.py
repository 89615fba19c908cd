"""kvstore client: put, get and look up KV-cache blocks in a kvstore cluster.

from kvstore_client import Client
with Client("127.0.0.1:7700") as c:
    c.batch_put("llama3-8b/bf16/b16/tp0of1", hashes, values)
"""

from __future__ import annotations

from .client import Client
from .errors import (
    DeadlineExceeded,
    InvalidArgument,
    KVStoreError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from .keys import Keys
from .prefix import block_hashes, key_of
from .wire import WHERE_ABSENT, WHERE_DRAM, WHERE_SSD, WHERE_UNKNOWN

__version__ = "0.1.0"

__all__ = [
    "WHERE_ABSENT",
    "WHERE_DRAM",
    "WHERE_SSD",
    "WHERE_UNKNOWN",
    "Client",
    "DeadlineExceeded",
    "InvalidArgument",
    "KVStoreError",
    "Keys",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "Unavailable",
    "__version__",
    "block_hashes",
    "key_of",
]
