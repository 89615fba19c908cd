"""Random-weight model presets for the engine bench.

Weights come from transformers' own initialiser (``initializer_range=0.1``, fixed seed)
and are saved as safetensors, so logits differ clearly between prompts and a wrong KV
block changes the output (vLLM's ``load_format="dummy"`` values are too small for that).
No tokenizer: the bench sends token ids.

- ``tiny``: the e2e tests' Llama (2 layers, hidden 256; tests/e2e/tiny_model.py), 2 KiB
  of KV per token in float32. Prefill is so cheap that loading rarely pays.
- ``larger``: a Llama with 8 layers, hidden 1024, GQA 16/4, head 64 (~110 M parameters,
  16 KiB of KV per token): prefill costs more per KV byte, closer to a real model's
  ratio of prefill time to transfer time.
- ``lfm2``: the hybrid LFM2 (attention + short convolutions); needs the hybrid connector
  (state blocks), not there yet: :func:`preset_unavailable` says so.

Writing a model needs torch and transformers, so it runs in the engine venv:
``python -m kvstore_bench.engine_models PRESET DIR`` (idempotent).
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["PRESETS", "model_config", "preset_unavailable", "write_model"]

VOCAB = 1000
MAX_LEN = 4096
SEED = 1234
REVISION = 1

_BASE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB,
    "max_position_embeddings": MAX_LEN,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
    "hidden_act": "silu",
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
    },
    "larger": {
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 64,
    },
    "lfm2": {},
}


def preset_unavailable(preset: str) -> str | None:
    """Why ``preset`` cannot run now, or None."""
    if preset not in PRESETS:
        return f"unknown model preset {preset!r} (one of {', '.join(PRESETS)})"
    if preset == "lfm2":
        return (
            "the lfm2 preset needs the hybrid connector (KV + recurrent state blocks), "
            "which has not landed yet"
        )
    return None


def model_config(preset: str) -> dict[str, Any]:
    """The HF config of ``preset`` (a Llama)."""
    return {**_BASE, **PRESETS[preset]}


def write_model(preset: str, path: str | Path) -> Path:
    """Write ``preset`` to ``path`` (a complete copy of the same revision is kept)."""
    why = preset_unavailable(preset)
    if why:
        raise ValueError(why)
    out = Path(path)
    stamp = out / "kvstore-bench-model.json"
    want = {"revision": REVISION, "seed": SEED, "preset": preset}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return out
    torch = importlib.import_module("torch")
    transformers = importlib.import_module("transformers")
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    cfg = transformers.LlamaConfig(
        **{k: v for k, v in model_config(preset).items() if k != "architectures"}
    )
    model = transformers.LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    stamp.write_text(json.dumps(want))
    return out


if __name__ == "__main__":
    print(write_model(sys.argv[1], sys.argv[2]))
