"""Random-weight models of the other model families for the GPU benchmarks: config and tokenizer.

    python benchmarks/make_random_family.py TOKENIZER_MODEL_DIR OUT_DIR --shape gemma3-1b

writes OUT_DIR/config.json from the architecture's own transformers config class and copies the
tokenizer files of a small model (vLLM's `load_format="dummy"` fills the weights, so nothing
large moves to the GPU machine). The vocabulary is the tokenizer's. Shapes:

- `gemma3-tiny`: Gemma 3 text, 8 layers in the pattern 3 sliding-window (window 128) + 1 full,
  hidden 256, 4 heads, 2 KV heads of 64: vLLM makes one KV cache group per position of the
  pattern (4 groups) over one KV buffer per layer slot;
- `gemma3-1b`: Gemma 3 1B's shape (26 layers, 5 sliding (window 512) + 1 full, hidden 1152,
  4 heads, 1 KV head of 256, MLP 6912);
- `gemma3-4b`: Gemma 3 4B's shape (34 layers, 5 sliding (window 1024) + 1 full, hidden 2560,
  8 heads, 4 KV heads of 256, MLP 10240; 3.2 B parameters with this vocabulary);
- `gemma3-27b-24l`: Gemma 3 27B's layer width (hidden 5376, 32 heads, 16 KV heads of 128, MLP
  21504, window 1024) over 24 of its 62 layers (20 sliding + 4 full; vLLM makes 6 KV cache
  groups over 4 layer slots): about 10 B parameters (18.5 GiB in bf16), so a decode step of 64
  sequences waits on the GPU rather than on the host, as `make_random_llama.py --size
  17b-wide` does for dense models;
- `deepseek-v2-tiny`: DeepSeek V2 MLA, 4 dense layers, hidden 256, 4 heads, a 512 + 64 latent
  (18,432 bytes per 16-token block per layer), Q/K heads of 128 + 64 and V heads of 128 (the
  head sizes Hopper's MLA decode and FlashAttention 3 prefill accept);
- `deepseek-v2-lite-dense`: DeepSeek V2 Lite's attention and width (27 layers, hidden 2048,
  16 heads, the same latent and heads) with dense MLPs of 10944 (2.6 B parameters with this
  vocabulary) instead of its experts;
- `nemotron-h-tiny`: Nemotron-H, 4 layers in the pattern Mamba-2, MLP, attention, MLP
  (hidden 256, 8 Mamba heads of 64, state 64; 4 heads, 2 KV heads of 64): vLLM makes a Mamba
  state group and an attention group over one page size.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

_GEMMA3_TINY = dict(num_hidden_layers=8, hidden_size=256, intermediate_size=512,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    sliding_window=128,
                    layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 2)


def _gemma3_layer_types(layers: int) -> list[str]:
    """Gemma 3's pattern: five sliding-window layers, then one full-attention layer."""
    return [("full_attention" if (i + 1) % 6 == 0 else "sliding_attention")
            for i in range(layers)]


_GEMMA3_1B = dict(num_hidden_layers=26, hidden_size=1152, intermediate_size=6912,
                  num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                  sliding_window=512, layer_types=_gemma3_layer_types(26))
_GEMMA3_4B = dict(num_hidden_layers=34, hidden_size=2560, intermediate_size=10240,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                  sliding_window=1024, layer_types=_gemma3_layer_types(34))
_GEMMA3_27B_24L = dict(num_hidden_layers=24, hidden_size=5376, intermediate_size=21504,
                       num_attention_heads=32, num_key_value_heads=16, head_dim=128,
                       query_pre_attn_scalar=168, sliding_window=1024,
                       layer_types=_gemma3_layer_types(24))
_MLA = dict(q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
            v_head_dim=128, rope_scaling=None, n_routed_experts=4, n_shared_experts=1,
            num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=128)
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma3-tiny": ("gemma3", _GEMMA3_TINY),
    "gemma3-1b": ("gemma3", _GEMMA3_1B),
    "gemma3-4b": ("gemma3", _GEMMA3_4B),
    "gemma3-27b-24l": ("gemma3", _GEMMA3_27B_24L),
    "deepseek-v2-tiny": ("deepseek_v2", dict(
        num_hidden_layers=4, first_k_dense_replace=4, hidden_size=256, intermediate_size=512,
        num_attention_heads=4, num_key_value_heads=4, **_MLA)),
    "nemotron-h-tiny": ("nemotron_h", dict(
        num_hidden_layers=4, hybrid_override_pattern="M-*-", hidden_size=256,
        intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        mamba_num_heads=8, mamba_head_dim=64, ssm_state_size=64, n_groups=1, conv_kernel=4,
        expand=2)),
    "deepseek-v2-lite-dense": ("deepseek_v2", dict(
        num_hidden_layers=27, first_k_dense_replace=27, hidden_size=2048,
        intermediate_size=10944, num_attention_heads=16, num_key_value_heads=16, **_MLA)),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")


def make(source: Path, target: Path, shape: str) -> dict[str, Any]:
    from transformers import AutoTokenizer, DeepseekV2Config, Gemma3TextConfig, NemotronHConfig

    architecture, settings = SHAPES[shape]
    tokenizer = AutoTokenizer.from_pretrained(source)
    ids = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
               max_position_embeddings=4096)
    config: Any
    if architecture == "gemma3":
        config = Gemma3TextConfig(**settings, **ids)
        config.architectures = ["Gemma3ForCausalLM"]
    elif architecture == "nemotron_h":
        config = NemotronHConfig(**settings, **ids)
        config.architectures = ["NemotronHForCausalLM"]
    else:
        config = DeepseekV2Config(**settings, **ids)
        config.architectures = ["DeepseekV2ForCausalLM"]
    config.dtype = "bfloat16"
    target.mkdir(parents=True, exist_ok=True)
    for weights in [*target.glob("*.safetensors"), *target.glob("*.bin")]:
        weights.unlink()
    config.save_pretrained(target)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, target / name)
    return json.loads((target / "config.json").read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a small model directory with a tokenizer")
    parser.add_argument("target", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    args = parser.parse_args(argv)
    config = make(args.source, args.target, args.shape)
    layers = config.get("num_hidden_layers") or len(config.get("layers_block_type") or [])
    print(f"{args.target}: {config['model_type']}, {layers} layers, "
          f"vocabulary {config['vocab_size']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
