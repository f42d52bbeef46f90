"""Tiny random-weight models and a word-level tokenizer, written offline (nothing downloaded).

`write_tiny_llama`: a dense 2-layer Llama. `write_tiny_laguna`: a 4-layer Laguna (3 sliding-window
layers, 1 full-attention layer, dense MLPs, no attention sinks), which SGLang serves with its
hybrid SWA KV pool (a full sub-pool and a sliding-window sub-pool).

    python tiny_model.py OUT_DIR [--model llama|laguna] [--sliding-window N]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

WORDS = [f"w{i}" for i in range(250)]
VOCAB_SIZE = 3 + len(WORDS)  # <unk>, <s>, </s>, then the words


def _write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)


def _write_generation_config(out: Path) -> None:
    # SGLang reads the chat template only for chat requests; plain prompts need none.
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1,
                                                           "eos_token_id": 2}))


def write_tiny_llama(out: Path, *, seed: int = 0, kv_heads: int = 2) -> Path:
    """Write a 2-layer Llama (hidden 64, 4 heads, `kv_heads` KV heads of 16 dims) with its
    tokenizer to ``out``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(out)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    _write_generation_config(out)
    return out


def write_tiny_laguna(out: Path, *, seed: int = 0, sliding_window: int = 32) -> Path:
    """Write a 4-layer hybrid sliding-window Laguna with its tokenizer to ``out``.

    Hidden 64, 4 query heads, 2 KV heads of 16 dims on every layer; layers 0-2 attend to the
    last ``sliding_window`` tokens (HF counts the window inclusively, SGLang's laguna.py uses
    ``sliding_window - 1``), layer 3 to all of them. Every MLP is dense
    (``mlp_layer_types``), so no MoE is built; the ``num_experts``/``moe_*`` fields are only
    there because the config classes require them. Per-head softplus output gates
    (``gating``) as the released model has; plain RoPE (theta 10^4) on both layer types.
    """
    import torch
    from transformers import LagunaConfig, LagunaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(out)
    layers = 4
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}
    config = LagunaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_attention_heads_per_layer=[4] * layers,
        layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"],
        mlp_layer_types=["dense"] * layers, sliding_window=sliding_window, gating=True,
        rope_parameters={"full_attention": dict(rope), "sliding_attention": dict(rope)},
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, attention_bias=False, rms_norm_eps=1e-6,
        max_position_embeddings=1024, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = LagunaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    _write_generation_config(out)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", choices=("llama", "laguna"), default="llama")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sliding-window", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=2, help="llama only")
    args = parser.parse_args()
    if args.model == "laguna":
        print(write_tiny_laguna(args.out, seed=args.seed, sliding_window=args.sliding_window))
    else:
        print(write_tiny_llama(args.out, seed=args.seed, kv_heads=args.kv_heads))
