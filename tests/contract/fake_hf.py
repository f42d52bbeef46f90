"""An offline Hugging Face cache with the configs and toy tokenizers vLLM's core tests load."""

from __future__ import annotations

import json
from pathlib import Path

_SNAPSHOT = "0" * 40
_TOY_VOCAB = ["<unk>", "<s>", "</s>", "<pad>"] + [f"w{i}" for i in range(60)]

MODELS: dict[str, dict[str, object]] = {
    "facebook/opt-125m": {
        "model_type": "opt", "architectures": ["OPTForCausalLM"], "hidden_size": 768,
        "num_attention_heads": 12, "num_hidden_layers": 12, "ffn_dim": 3072,
        "max_position_embeddings": 2048, "vocab_size": 50272, "word_embed_proj_dim": 768,
        "torch_dtype": "float16", "do_layer_norm_before": True, "bos_token_id": 2,
        "eos_token_id": 2, "pad_token_id": 1,
    },
    "Qwen/Qwen3-0.6B": {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "num_hidden_layers": 28, "intermediate_size": 3072, "max_position_embeddings": 40960,
        "vocab_size": 151936, "torch_dtype": "bfloat16", "rope_theta": 1000000,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    },
    "Qwen/Qwen1.5-7B": {
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 4096,
        "num_attention_heads": 32, "num_key_value_heads": 32, "num_hidden_layers": 32,
        "intermediate_size": 11008, "max_position_embeddings": 32768, "vocab_size": 151936,
        "torch_dtype": "bfloat16", "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    },
}


def _tokenizer_json() -> str:
    vocab = {token: index for index, token in enumerate(_TOY_VOCAB)}
    return json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None,
        "decoder": None, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    })


def build_fake_hf_home(home: Path) -> Path:
    """Write `home/hub/models--org--name/...` for every model in MODELS; returns `home`."""
    for repo, config in MODELS.items():
        base = home / "hub" / f"models--{repo.replace('/', '--')}"
        snapshot = base / "snapshots" / _SNAPSHOT
        snapshot.mkdir(parents=True, exist_ok=True)
        (base / "refs").mkdir(exist_ok=True)
        (base / "refs" / "main").write_text(_SNAPSHOT, encoding="utf-8")
        (snapshot / "config.json").write_text(json.dumps(config), encoding="utf-8")
        (snapshot / "tokenizer.json").write_text(_tokenizer_json(), encoding="utf-8")
        (snapshot / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>",
            "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
            "model_max_length": 2048,
        }), encoding="utf-8")
        (snapshot / "generation_config.json").write_text("{}", encoding="utf-8")
    return home
