"""A random-weight Llama of a chosen size for the GPU benchmarks: config.json and tokenizer only.

    python benchmarks/make_random_llama.py TOKENIZER_MODEL_DIR OUT_DIR --size 3b

copies a small model's directory (its tokenizer is kept), drops its weights and writes a
bigger config.json; vLLM's `load_format="dummy"` fills the weights, so nothing large moves to
the GPU machine. Sizes (Llama layout, bf16, 128-wide heads):

- `1b`: hidden 2048, 16 layers, 16 heads, 8 KV heads, MLP 8192 (1.01 B parameters,
  64 KiB of KV per token);
- `3b`: hidden 3072, 28 layers, 24 heads, 8 KV heads, MLP 8192 (2.8 B parameters,
  112 KiB of KV per token): large enough that GPU work, not the scheduler's Python,
  dominates a decode step of a hundred sequences;
- `8b`: Llama 3 8B's shape (hidden 4096, 32 layers, MLP 14336; 128 KiB of KV per token);
- `17b-wide`: Llama 3 70B's layer width over 20 layers (hidden 8192, 64 heads, 8 KV heads,
  MLP 28672; 17.1 B parameters, 80 KiB of KV per token): each kernel launch carries several
  times the 8b's GPU work, so an eager decode step of 512 sequences waits on the GPU, not on
  the host launching it.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

SIZES: dict[str, dict[str, int]] = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=16, num_key_value_heads=8),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
               num_attention_heads=24, num_key_value_heads=8),
    # Llama 3 8B's shape: GPU work dominates a decode step of 128 sequences on an H200
    # (the 3b step is bound by the engine's CPU loop).
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8),
    # Eager mode launches every kernel from Python: an 8b step of 128 sequences is host work
    # (about 21 ms eager against 8 ms with CUDA graphs on an H200). Wider layers and fewer of
    # them put more GPU work behind each launch.
    "17b-wide": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=20,
                     num_attention_heads=64, num_key_value_heads=8),
}
HEAD_DIM = 128


def parameters(config: dict[str, int]) -> int:
    """Weights of a Llama with this config (attention, MLP, embeddings and head)."""
    hidden, mlp = config["hidden_size"], config["intermediate_size"]
    kv_width = config["num_key_value_heads"] * HEAD_DIM
    per_layer = hidden * hidden * 2 + hidden * kv_width * 2 + 3 * hidden * mlp
    return config["num_hidden_layers"] * per_layer + 2 * config["vocab_size"] * hidden


def make(source: Path, target: Path, size: str) -> dict[str, int]:
    shutil.copytree(source, target, dirs_exist_ok=True)
    for weights in [*target.glob("*.safetensors"), *target.glob("*.bin")]:
        weights.unlink()
    config = json.loads((target / "config.json").read_text())
    config.update(SIZES[size], head_dim=HEAD_DIM, max_position_embeddings=4096)
    (target / "config.json").write_text(json.dumps(config, indent=1))
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a small model directory with a tokenizer")
    parser.add_argument("target", type=Path)
    parser.add_argument("--size", choices=sorted(SIZES), default="3b")
    args = parser.parse_args(argv)
    config = make(args.source, args.target, args.size)
    print(f"{args.target}: {parameters(config) / 1e9:.2f} B parameters")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
