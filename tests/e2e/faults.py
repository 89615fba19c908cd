"""Fault injection for the e2e engines, kept out of the product: a connector whose
worker side, before each load, reads the JSON file named by ``KVSTORE_TEST_FAULT_FILE``
(when it exists):

- ``{"remove_from_block": k}`` removes the load's blocks from k on from the store, so
  they really miss at load;
- ``{"state_from_index": i}`` loads the state stored with the load's i-th hash instead
  of the right one (a wrong-state control);
- ``{"kill_pid": pid}`` SIGKILLs that (worker) process as the load starts: the lookup
  found the blocks, the worker dies before they are read.

An engine of tests/e2e/engines.py started with ``fault_file=`` loads this module as its
connector (``kv_connector_module_path: tests.e2e.faults``)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

from kvstore_client.connectors.vllm import KVStoreConnector as _Base
from kvstore_client.connectors.vllm.common import Transfer
from kvstore_client.connectors.vllm.worker import WorkerSide

ENV = "KVSTORE_TEST_FAULT_FILE"


class FaultyWorkerSide(WorkerSide):
    def _state_hash(self, tr: Transfer) -> bytes | None:
        state_hash = tr.state_hash
        path = os.environ.get(ENV)
        if not path:
            return state_hash
        try:
            with open(path) as f:
                fault = json.load(f)
        except (OSError, ValueError):
            return state_hash
        client = self._holder.get()
        k = fault.get("remove_from_block")
        if client is not None and isinstance(k, int) and tr.hashes[k:]:
            client.remove(self.ns, tr.hashes[k:])
        pid = fault.get("kill_pid")
        if isinstance(pid, int):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            time.sleep(0.3)  # its sockets are closed by the time the load reads
        i = fault.get("state_from_index")
        if state_hash is not None and isinstance(i, int) and 0 <= i < len(tr.hashes):
            state_hash = tr.hashes[i]
        return state_hash


class KVStoreConnector(_Base):
    worker_side = FaultyWorkerSide
