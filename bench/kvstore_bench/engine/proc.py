"""One vLLM engine in its own process for the engine bench (runs in the e2e venv).

``python -m kvstore_bench.engine.proc CONFIG_JSON`` builds ``vllm.LLM`` (in-process
engine core: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), runs one warm-up request, prints
``{"event": "ready"}`` and then serves requests concurrently: it reads JSON lines from
stdin on a thread and steps the engine in its main loop, so several requests batch
together as they would behind a server. stdout carries only protocol lines (library
output goes to stderr):

- in: ``{"op": "add", "id": str, "prompt": [ids], "max_tokens": n, "params": {...}}``
  (greedy, EOS ignored; ``params``, optional: the request's ``kv_transfer_params``, e.g.
  session hints)
- in: ``{"op": "exit"}``: stop at once (unfinished requests are dropped)
- out, once: ``{"event": "ready", "block_size": n, "kv_blocks": n, "kv_cache_bytes": n}``
  (the resolved tokens per KV block, the blocks of KV cache vLLM allocated and the bytes
  it was configured with: what the engine really got, whatever the bench asked for)
- out: ``{"event": "done", "id", "tokens", "logprobs", "num_cached_tokens",
  "local_cached_tokens", "external_cached_tokens", "ttft_s", "e2e_s", "steps", "wait_s",
  "step_s"}`` where ``local_cached_tokens`` came from the engine's own prefix cache and
  ``external_cached_tokens`` from the KV connector (vLLM's prefill stats; -1 where vLLM
  gave none), and ``ttft_s`` runs from the request's
  arrival in this process to the end of the step that produced its first token, ``e2e_s``
  to its last; ``steps`` counts the engine steps from its arrival to that one (inclusive),
  ``step_s`` is that step's duration and ``wait_s = ttft_s - step_s`` (lookup, waiting
  for remote KV, steps that did not schedule it)
- out: ``{"event": "error", "id", "error"}`` for a request the engine refused

CONFIG_JSON: ``model``, ``block_size`` (null: vLLM picks it), ``max_len``,
``kv_cache_bytes``, ``dtype``, ``kv_transfer_config`` (a dict or null) and ``warmup_seed``.
Nothing here is imported by the bench itself (it lives in another venv); vLLM is imported
by name at run time.
"""

from __future__ import annotations

import importlib
import json
import os
import queue
import random
import sys
import threading
import time
from typing import Any


def _llvmlite_workaround() -> None:
    """vLLM's CPU platform scans every module attribute's ``__dict__`` when it registers
    its kernel overrides; llvmlite's lazy library wrapper (imported with lmcache through
    numba) answers ``__dict__`` with a function wrapper and the scan raises
    ``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``. Give the wrapper
    a plain empty ``__dict__`` answer first. Harmless where llvmlite is absent."""
    try:
        ffi = importlib.import_module("llvmlite.binding.ffi")
    except ImportError:
        return
    table = getattr(getattr(ffi, "lib", None), "_fntab", None)
    if isinstance(table, dict):
        table.setdefault("__dict__", {})


def make_llm(cfg: dict[str, Any]) -> Any:
    """The engine, as ``vllm.LLM`` with token-id prompts (no tokenizer)."""
    vllm = importlib.import_module("vllm")
    kw: dict[str, Any] = dict(
        model=cfg["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=int(cfg["max_len"]),
        dtype=cfg.get("dtype", "float32"),
        seed=0,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=int(cfg["kv_cache_bytes"]),
    )
    if cfg.get("block_size") is not None:  # None: vLLM resolves it (a hybrid's is 128)
        kw["block_size"] = int(cfg["block_size"])
    if cfg.get("kv_transfer_config"):
        kw["kv_transfer_config"] = cfg["kv_transfer_config"]
        _llvmlite_workaround()
    return vllm.LLM(**kw)


def sampling(max_tokens: int, params: dict[str, Any] | None = None) -> Any:
    vllm = importlib.import_module("vllm")
    return vllm.SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        logprobs=0,
        detokenize=False,
        ignore_eos=True,
        extra_args={"kv_transfer_params": params} if params else None,
    )


def token_prompt(ids: list[int]) -> Any:
    inputs = importlib.import_module("vllm.inputs")
    return inputs.TokensPrompt(prompt_token_ids=ids)


class Server:
    """Steps the engine; admits requests from a queue filled by the stdin thread."""

    def __init__(self, llm: Any, out: Any) -> None:
        self.engine = llm.llm_engine
        self.out = out
        self.inbox: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.arrived: dict[str, float] = {}
        self.first: dict[str, tuple[float, int, float]] = {}  # end, steps, step duration
        self.steps: dict[str, int] = {}
        # (own prefix cache, connector) tokens per request, from vLLM's prefill stats
        self.sources: dict[str, tuple[int, int]] = {}
        self._watch_prefill_stats()

    def _watch_prefill_stats(self) -> None:
        """Read each request's prefill stats (local and external cached tokens) off the
        engine core's outputs as they pass: the in-process client's ``get_output``,
        wrapped; the request outputs carry only their sum."""
        core = self.engine.engine_core
        get_output = core.get_output

        def watched() -> Any:
            outs = get_output()
            for o in getattr(outs, "outputs", None) or []:
                ps = getattr(o, "prefill_stats", None)
                if ps is None:
                    continue
                rid = str(o.request_id)
                if rid not in self.arrived:  # vLLM appends "-" + 8 random characters
                    rid = rid.rsplit("-", 1)[0]
                self.sources[rid] = (
                    int(ps.num_local_cached_tokens),
                    int(ps.num_external_cached_tokens),
                )
            return outs

        core.get_output = watched

    def emit(self, msg: dict[str, Any]) -> None:
        self.out.write(json.dumps(msg) + "\n")
        self.out.flush()

    def read_stdin(self) -> None:
        for line in sys.stdin:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if msg.get("op") == "exit":
                break
            self.inbox.put(msg)
        self.inbox.put(None)

    def admit(self, msg: dict[str, Any]) -> None:
        rid = str(msg["id"])
        try:
            self.engine.add_request(
                rid,
                token_prompt(list(msg["prompt"])),
                sampling(int(msg["max_tokens"]), msg.get("params")),
            )
        except Exception as e:  # report, keep serving
            self.emit({"event": "error", "id": rid, "error": f"{type(e).__name__}: {e}"})
            return
        self.arrived[rid] = time.perf_counter()
        self.steps[rid] = 0

    def serve(self) -> None:
        threading.Thread(target=self.read_stdin, daemon=True).start()
        while True:
            busy = bool(self.arrived)
            try:
                msg = self.inbox.get(block=not busy)
                while True:
                    if msg is None:
                        return
                    self.admit(msg)
                    msg = self.inbox.get_nowait()
            except queue.Empty:
                pass
            if not self.arrived:
                continue
            for rid in self.arrived:
                self.steps[rid] += 1
            t_step = time.perf_counter()
            outputs = self.engine.step()
            now = time.perf_counter()
            for o in outputs:
                self.handle(o, now, now - t_step)

    def handle(self, o: Any, now: float, step_s: float) -> None:
        rid = str(o.request_id)
        if rid not in self.arrived:
            return
        comp = o.outputs[0] if o.outputs else None
        if comp is not None and comp.token_ids and rid not in self.first:
            self.first[rid] = (now, self.steps.get(rid, 0), step_s)
        if not o.finished:
            return
        t0 = self.arrived.pop(rid)
        self.steps.pop(rid, None)
        first, steps, first_step = self.first.pop(rid, (now, 0, step_s))
        local, external = self.sources.pop(rid, (-1, -1))
        tokens = list(comp.token_ids) if comp is not None else []
        lps = comp.logprobs if comp is not None and comp.logprobs else []
        logprobs = [float(lp[t].logprob) for t, lp in zip(tokens, lps, strict=False) if t in lp]
        self.emit(
            {
                "event": "done",
                "id": rid,
                "tokens": tokens,
                "logprobs": logprobs,
                "num_cached_tokens": int(o.num_cached_tokens or 0),
                "local_cached_tokens": local,
                "external_cached_tokens": external,
                "ttft_s": first - t0,
                "e2e_s": now - t0,
                "steps": steps,
                "wait_s": max(0.0, first - t0 - first_step),
                "step_s": first_step,
            }
        )


def main() -> None:
    cfg = json.loads(sys.argv[1])
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # library output goes to stderr; stdout carries only protocol lines
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    llm = make_llm(cfg)
    rng = random.Random(int(cfg.get("warmup_seed", 99)))
    # The first request pays one-off set-up; keep it out of the measurements.
    warm = [rng.randrange(3, 1000) for _ in range(min(1024, int(cfg["max_len"]) - 8))]
    llm.generate([token_prompt(warm)], sampling(2), use_tqdm=False)
    # the attention block size vLLM resolved (a hybrid's is set after the layers are built)
    cache = llm.llm_engine.vllm_config.cache_config
    ready = {
        "event": "ready",
        "block_size": cache.block_size,
        "kv_blocks": cache.num_gpu_blocks,
        "kv_cache_bytes": cache.kv_cache_memory_bytes,
    }
    out.write(json.dumps(ready) + "\n")
    Server(llm, out).serve()
    _log_connector_totals()
    out.write(json.dumps({"event": "bye"}) + "\n")
    out.flush()
    os._exit(0)  # skip engine teardown: its worker threads can hang at exit


def _log_connector_totals() -> None:
    """The kvstore connector's counters since start, one line in the engine's log
    (lookups, timeouts, hit tokens, failed loads, saves): why a run hit what it hit."""
    try:
        from kvstore_client.connectors.stats import TOTALS, reduce_stats
    except ImportError:
        return
    totals = reduce_stats(TOTALS.peek())
    if totals:
        print("kvstore connector totals: " + json.dumps(totals, sort_keys=True), file=sys.stderr)


if __name__ == "__main__":
    main()
