"""Write a tiny Llama-style model with random weights at a real initialisation scale.

vLLM's ``load_format="dummy"`` fills weights with values so small that every block's
attention looks alike, so a wrong block would go unnoticed. Here the weights come
from transformers' own initialiser with ``initializer_range=0.1`` and a fixed seed,
saved as safetensors: logits differ clearly between prompts and a wrong KV block
changes the output. No tokenizer is written; tests pass token ids
(``skip_tokenizer_init=True``).

Run as a script to write the model: ``python -m tests.e2e.tiny_model DIR``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB = 1000
MAX_LEN = 4096
SEED = 1234
# Bump when the architecture or the weights change, so cached copies are rewritten.
REVISION = 1


def llama_config() -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
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


def lfm2_config() -> dict[str, object]:
    """A tiny LFM2: short convolutions and full attention, alternating."""
    return {
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
    }


def write_tiny_lfm2(path: str | Path) -> Path:
    """Write the tiny LFM2 to ``path`` (idempotent: a complete copy is kept)."""
    out = Path(path)
    stamp = out / "kvstore-tiny.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("revision") == REVISION:
        return out
    import torch
    from transformers import Lfm2Config, Lfm2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    cfg = Lfm2Config(**{k: v for k, v in lfm2_config().items() if k != "architectures"})
    model = Lfm2ForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    stamp.write_text(json.dumps({"revision": REVISION, "seed": SEED}))
    return out


def write_tiny_llama(path: str | Path) -> Path:
    """Write the model to ``path`` (idempotent: a complete copy is kept)."""
    out = Path(path)
    stamp = out / "kvstore-tiny.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("revision") == REVISION:
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    cfg = LlamaConfig(**{k: v for k, v in llama_config().items() if k != "architectures"})
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    stamp.write_text(json.dumps({"revision": REVISION, "seed": SEED}))
    return out


def qwen3_next_config() -> dict[str, object]:
    """A tiny Qwen3-Next: gated delta net (linear attention) and full attention,
    a small MoE in every layer; bf16 (vLLM's CPU gated-delta-net kernels need it)."""
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "vocab_size": VOCAB,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 256,
        "shared_expert_intermediate_size": 256,
        "decoder_sparse_step": 1,
        "layer_types": [
            "linear_attention",
            "full_attention",
            "linear_attention",
            "full_attention",
        ],
        "max_position_embeddings": MAX_LEN,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.1,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
    }


def granite_hybrid_config() -> dict[str, object]:
    """A tiny GraniteMoeHybrid (Granite 4): Mamba-2 layers and full attention."""
    return {
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "model_type": "granitemoehybrid",
        "vocab_size": VOCAB,
        "hidden_size": 256,
        "intermediate_size": 512,
        "shared_intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 0,
        "num_experts_per_tok": 0,
        "position_embedding_type": "rope",
        "layer_types": ["mamba", "attention", "mamba", "attention"],
        "mamba_n_heads": 8,
        "mamba_n_groups": 1,
        "mamba_d_state": 64,
        "mamba_d_head": 64,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_chunk_size": 256,
        "max_position_embeddings": MAX_LEN,
        "rms_norm_eps": 1e-5,
        "initializer_range": 0.1,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "float32",
    }


def _write(path: str | Path, cfg_name: str, model_name: str, conf: dict[str, object]) -> Path:
    out = Path(path)
    stamp = out / "kvstore-tiny.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("revision") == REVISION:
        return out
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    dtype = getattr(torch, str(conf["torch_dtype"]))
    cfg = getattr(transformers, cfg_name)(**{k: v for k, v in conf.items() if k != "architectures"})
    model = getattr(transformers, model_name)(cfg).to(dtype)
    model.save_pretrained(out, safe_serialization=True)
    stamp.write_text(json.dumps({"revision": REVISION, "seed": SEED}))
    return out


def write_tiny_qwen3_next(path: str | Path) -> Path:
    """Write the tiny Qwen3-Next (bf16) to ``path`` (idempotent)."""
    return _write(path, "Qwen3NextConfig", "Qwen3NextForCausalLM", qwen3_next_config())


def write_tiny_granite_hybrid(path: str | Path) -> Path:
    """Write the tiny GraniteMoeHybrid to ``path`` (idempotent)."""
    return _write(
        path, "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", granite_hybrid_config()
    )


if __name__ == "__main__":
    print(write_tiny_llama(sys.argv[1] if len(sys.argv) > 1 else "/tmp/kvstore-tiny-llama"))
