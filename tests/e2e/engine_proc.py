"""One vLLM engine in its own process, driven by JSON lines (used by the e2e tests).

``python -m tests.e2e.engine_proc '{"model": DIR, "master": "HOST:PORT" | null, ...}'``
(also ``"kv_role"``, ``"extra"``: connector settings, ``"engine"``: ``vllm.LLM`` arguments,
``"kv_events"``: a ZMQ endpoint to publish KV cache events on)
starts ``vllm.LLM`` (in-process engine core: VLLM_ENABLE_V1_MULTIPROCESSING=0), runs
one warm-up request, prints ``{"event": "ready"}`` and then answers one JSON line per
request line on stdout (everything else the libraries print goes to stderr):

- ``{"op": "generate", "prompt": [ids], "max_tokens": n, "top": k, "params": {...}}``
  (``params``: the request's ``kv_transfer_params``, optional) -> ``{"tokens",
  "logprobs", "gaps", "num_cached_tokens", "seconds", "stats"}`` (``gaps``: with
  ``top`` >= 2, the top-2 logprob gap per position); ``seconds`` is the wall time of the
  request (with ``max_tokens=1``, its time to first token), ``stats`` the connector
  counters of this request (process totals before/after; writes are waited for).
- ``{"op": "exit"}``.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from typing import Any

BLOCK = 32
MAX_LEN = 4096


def make_llm(cfg: dict[str, Any]) -> Any:
    from vllm import LLM

    kw: dict[str, Any] = dict(
        model=cfg["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=MAX_LEN,
        block_size=BLOCK,
        dtype="float32",
        seed=0,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=256 << 20,
    )
    kw.update(cfg.get("engine", {}))  # e.g. a hybrid model lets vLLM pick its block size
    kw = {k: v for k, v in kw.items() if v is not None}
    if cfg.get("master"):
        extra = {"master": cfg["master"], "lookup_timeout_s": 1.0}
        extra.update(cfg.get("extra", {}))
        kw["kv_transfer_config"] = {
            "kv_connector": "KVStoreConnector",
            "kv_connector_module_path": cfg.get(
                "connector_module", "kvstore_client.connectors.vllm"
            ),
            "kv_role": cfg.get("kv_role", "kv_both"),
            "kv_connector_extra_config": extra,
        }
    if cfg.get("kv_events"):  # publish KV cache events over ZMQ at this endpoint
        from vllm.config import KVEventsConfig

        kw["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=cfg["kv_events"]
        )
    return LLM(**kw)


def generate(
    llm: Any, prompt: list[int], max_tokens: int, top: int = 0, params: Any = None
) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvstore_client.connectors.stats import TOTALS

    sp = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        logprobs=top,
        detokenize=False,
        ignore_eos=True,
        extra_args={"kv_transfer_params": params} if params is not None else None,
    )
    before = TOTALS.peek()
    t0 = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0]
    seconds = time.perf_counter() - t0
    stats: dict[str, Any] = {}
    if llm.llm_engine.vllm_config.kv_transfer_config is not None:
        from kvstore_client.connectors.vllm import wait_for_saves

        wait_for_saves(30.0)
        after = TOTALS.peek()
        # Counters as deltas; timers (lists of samples) as the sum of this call's samples.
        stats = {
            k: sum(v[len(before[k]) :]) if isinstance(v, list) else v - before[k]
            for k, v in after.items()
        }
    comp = out.outputs[0]
    logprobs = [
        lp[tok].logprob for tok, lp in zip(comp.token_ids, comp.logprobs or [], strict=False)
    ]
    # With ``top`` >= 2: per position, the gap between the two best logprobs (a
    # near-tie there may flip the greedy token under tiny numeric differences).
    gaps = []
    for lp in comp.logprobs or []:
        best = sorted((v.logprob for v in lp.values()), reverse=True)
        gaps.append(best[0] - best[1] if len(best) > 1 else float("inf"))
    return {
        "tokens": list(comp.token_ids),
        "gaps": gaps if top >= 2 else [],
        "logprobs": logprobs,
        "num_cached_tokens": out.num_cached_tokens,
        "seconds": seconds,
        "stats": stats,
    }


def main() -> None:
    cfg = json.loads(sys.argv[1])
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # library output goes to stderr; stdout carries only answers
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    llm = make_llm(cfg)
    rng = random.Random(cfg.get("warmup_seed", 99))
    # The first request pays one-off kernel set-up; keep it out of the measurements.
    generate(llm, [rng.randrange(3, 1000) for _ in range(2048 + 7)], 2)
    # The block size the engine resolved (a hybrid model's is chosen by vLLM from its
    # state size, which depends on the dtype and the CPU): checks derive token counts
    # from it.
    block = llm.llm_engine.vllm_config.cache_config.block_size
    ready: dict[str, Any] = {"event": "ready", "block_size": block}
    if cfg.get("master"):
        from kvstore_client.connectors.vllm import _LIVE

        ready["namespace"] = next(iter(_LIVE)).namespace
    proto.write(json.dumps(ready) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("op") == "exit":
            break
        try:
            ans = generate(
                llm,
                req["prompt"],
                int(req.get("max_tokens", 8)),
                int(req.get("top", 0)),
                req.get("params"),
            )
        except Exception as e:  # report, keep serving
            ans = {"error": f"{type(e).__name__}: {e}"}
        proto.write(json.dumps(ans) + "\n")
    proto.write(json.dumps({"event": "bye"}) + "\n")
    proto.flush()
    os._exit(0)  # skip engine teardown: its worker threads can hang at exit


if __name__ == "__main__":
    main()
