"""Random-weight model presets for the engine bench.

Weights come from transformers' own initialiser (``initializer_range=0.1``, fixed seed)
and are saved as safetensors, so logits differ clearly between prompts and a wrong KV
block changes the output (vLLM's ``load_format="dummy"`` values are too small for that).
No tokenizer: the bench sends token ids.

- ``tiny``: a Llama with 2 layers, hidden 256 (the same shape as the e2e tests' model), 2 KiB
  of KV per token in float32. Prefill is so cheap that loading rarely pays.
- ``larger``: a Llama with 8 layers, hidden 1024, GQA 16/4, head 64 (~110 M parameters,
  16 KiB of KV per token): prefill costs more per KV byte, closer to a real model's
  ratio of prefill time to transfer time.
- ``lfm2``: a hybrid LFM2 (4 layers: short convolution, attention, conv, attention;
  hidden 256; the same configuration and seed as the e2e tests' hybrid, which a unit test
  checks). vLLM sizes a hybrid's blocks itself (the engine gets no
  ``block_size``) and resolves the attention block to 128 tokens, the size the bench
  aligns its ideal to; prefix caching on puts the convolution state in ``align`` mode,
  kept at each block boundary where a prefill chunk ends.

Writing a model needs torch and transformers, so it runs in the engine venv:
``python -m kvstore_bench.engine.models PRESET DIR`` (idempotent).
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

__all__ = [
    "PRESETS",
    "block_size",
    "engine_block_size",
    "model_config",
    "preset_unavailable",
    "write_model",
]

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
    "lfm2": {
        "architectures": ["Lfm2ForCausalLM"],
        "model_type": "lfm2",
        "vocab_size": VOCAB,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": MAX_LEN,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "conv_dim": 256,
        "block_dim": 256,
        "block_ff_dim": 512,
        "block_multiple_of": 64,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
        "initializer_range": 0.1,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "float32",
    },
}
# transformers classes of each architecture: (config class, model class)
_CLASSES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM"),
}

# Tokens per KV block as the engine resolves them: what the ideal and the hit accounting
# use. The Llama presets set it; vLLM picks the hybrid's (attention block of 128 tokens).
BLOCK_SIZES: dict[str, int] = {"tiny": 32, "larger": 32, "lfm2": 128}
HYBRID = frozenset({"lfm2"})


def preset_unavailable(preset: str) -> str | None:
    """Why ``preset`` cannot run now, or None."""
    if preset not in PRESETS:
        return f"unknown model preset {preset!r} (one of {', '.join(PRESETS)})"
    return None


def block_size(preset: str) -> int:
    """Tokens per KV block of ``preset`` inside the engine (128 for the hybrid)."""
    return BLOCK_SIZES[preset]


def engine_block_size(preset: str) -> int | None:
    """The ``block_size`` the engine is built with: None for a hybrid, whose block size
    vLLM resolves itself (the e2e test does the same)."""
    return None if preset in HYBRID else BLOCK_SIZES[preset]


def model_config(preset: str) -> dict[str, Any]:
    """The HF config of ``preset`` (a Llama, or a tiny LFM2)."""
    if preset in HYBRID:
        return dict(PRESETS[preset])
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
    conf = model_config(preset)
    cfg_name, model_name = _CLASSES[str(conf["model_type"])]
    cfg = getattr(transformers, cfg_name)(**{k: v for k, v in conf.items() if k != "architectures"})
    model = getattr(transformers, model_name)(cfg).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    stamp.write_text(json.dumps(want))
    return out


if __name__ == "__main__":
    print(write_model(sys.argv[1], sys.argv[2]))
