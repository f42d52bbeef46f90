"""A tiny random-weight Llama and a word-level tokenizer, written offline (nothing downloaded)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

WORDS = [f"w{i}" for i in range(250)]


def write_tiny_llama(out: Path, *, seed: int = 0) -> Path:
    """Write a 2-layer Llama (hidden 64, 4 heads, 2 KV heads) with its tokenizer to ``out``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    # SGLang reads the chat template only for chat requests; plain prompts need none.
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1,
                                                           "eos_token_id": 2}))
    return out


if __name__ == "__main__":
    print(write_tiny_llama(Path(sys.argv[1])))
