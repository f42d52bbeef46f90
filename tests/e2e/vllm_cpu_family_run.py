"""Runs inside an engine venv: one tiny random-weight model of a model family, built or served.

    python vllm_cpu_family_run.py model FAMILY OUT_DIR
    python vllm_cpu_family_run.py generate FAMILY MODEL_DIR RESULT_JSON

Families (each model built offline from its architecture's own transformers config class, with
the BPE tokenizer of `vllm_cpu_run.write_tiny_llama`):

- `sliding-window`: Gemma 3 text, 3 sliding-window layers (window 64) and 1 full layer: vLLM
  makes 4 KV cache groups overlaying one buffer;
- `mla`: DeepSeek V2, 2 dense layers of MLA (a 512 + 64 latent: 36,864-byte blocks of 32
  tokens, which tile no power-of-two page);
- `mamba`: Nemotron-H, a Mamba-2 layer and an attention layer (vLLM pads the attention page to
  the Mamba state page and raises the attention block to 288 tokens);
- `fp8-kv`: a Llama with `kv_cache_dtype="fp8"`.

`generate` runs the shared workload of `vllm_cpu_run` (greedy, prefix caching on where the
family's stock engine allows it) and then one long request (40 prompt tokens, 400 generated),
and writes the tokens, vLLM's counters, the pool's pages before / at the peak of / after each
burst, and the most blocks each KV cache group held at once (from vLLM's own managers).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__:  # imported by the tests for its constants
    from . import vllm_cpu_run as base
else:  # run as a script in an engine venv, next to vllm_cpu_run.py
    import vllm_cpu_run as base

BLOCK_SIZE = 32  # vLLM's CPU attention (AMX here) needs a multiple of 32
KV_CACHE_BYTES = 16 << 20
LONG_PROMPT = 40
LONG_TOKENS = 400
WINDOW = 64
FAMILIES = ("sliding-window", "mla", "mamba", "fp8-kv")


def _tokenizer_ids(out: Path) -> dict[str, int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    return {"vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}


def write_model(family: str, out: Path) -> None:
    import torch

    base.write_tiny_llama(out)  # the tokenizer (and a Llama that the families below replace)
    for weights in out.glob("*.safetensors"):
        weights.unlink()
    ids = _tokenizer_ids(out)
    torch.manual_seed(0)
    common = dict(hidden_size=256, intermediate_size=512, max_position_embeddings=1024, **ids)
    if family == "sliding-window":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        config = Gemma3TextConfig(
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            sliding_window=WINDOW, initializer_range=0.2,
            layer_types=["sliding_attention"] * 3 + ["full_attention"], **common)
        model: Any = Gemma3ForCausalLM(config)
    elif family == "mla":
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        config = DeepseekV2Config(
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            first_k_dense_replace=2, n_routed_experts=4, n_shared_experts=1,
            num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=128,
            q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64,
            v_head_dim=64, rope_scaling=None, **common)
        model = DeepseekV2ForCausalLM(config)
    elif family == "mamba":
        from transformers import NemotronHConfig, NemotronHForCausalLM

        config = NemotronHConfig(
            num_hidden_layers=4, hybrid_override_pattern="M-*-", num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, mamba_num_heads=8, mamba_head_dim=64,
            ssm_state_size=64, n_groups=1, conv_kernel=4, expand=2, **common)
        model = NemotronHForCausalLM(config)
    elif family == "fp8-kv":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=64, **common)
        model = LlamaForCausalLM(config)
    else:
        raise SystemExit(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    model.to(torch.bfloat16).save_pretrained(out)


def _engine_kwargs(family: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"enable_prefix_caching": True}
    if family == "mamba":
        # vLLM 0.32's Mamba-2 prefix caching ('align' mode) fails on prompts longer than one
        # block in the stock engine (mamba_mixer2.py conv_ssm_forward: index out of bounds).
        kwargs["enable_prefix_caching"] = False
    if family == "fp8-kv":
        kwargs["kv_cache_dtype"] = "fp8"
    return kwargs


def held_blocks(managers: Any) -> list[int]:
    """Distinct non-null blocks each KV cache group's manager (vLLM's `single_type_managers`)
    holds now; a block shared by requests through a prefix-cache hit counts once. A dict that
    changes size under the read raises RuntimeError: the caller reads again."""
    counts = []
    for manager in managers:
        held = {block.block_id for blocks in list(manager.req_to_blocks.values())
                for block in list(blocks) if not block.is_null}
        counts.append(len(held))
    return counts


class GroupSampler:
    """The most distinct non-null blocks each KV cache group held at once (a prefix-cache hit
    shares blocks between requests: each counts once)."""

    def __init__(self, llm: Any) -> None:
        core = llm.llm_engine.engine_core.engine_core
        self._managers = core.scheduler.kv_cache_manager.coordinator.single_type_managers
        self.kinds = [type(m.kv_cache_spec).__name__ for m in self._managers]
        self.peak = [0] * len(self._managers)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def held(self) -> list[int]:
        return held_blocks(self._managers)

    def _run(self) -> None:
        while not self._stop.is_set():
            # A dict that changed size under the read is read again next time.
            with contextlib.suppress(RuntimeError):
                self.peak = [max(a, b) for a, b in zip(self.peak, self.held(), strict=True)]
            self._stop.wait(0.002)

    def __enter__(self) -> GroupSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _idle_reading(read: Any) -> tuple[dict[str, int] | None, float]:
    if read is None:
        return None, -1.0
    started = time.monotonic()
    reading = read()
    after = 0.0
    while time.monotonic() - started < base.IDLE_WAIT_S - 0.1:
        reading = read()
        after = time.monotonic() - started
        time.sleep(0.05)
    return reading, after


def _burst(llm: Any, prompts: list[Any], params: Any, read: Any) -> dict[str, Any]:
    before = read() if read else None
    with GroupSampler(llm) as groups:
        if read:
            with base.MemorySampler(read) as sampler:
                results = llm.generate(prompts, params, use_tqdm=False)
            peak: dict[str, int] | None = sampler.peak
        else:
            results = llm.generate(prompts, params, use_tqdm=False)
            peak = None
    idle, idle_after_s = _idle_reading(read)
    return {"outputs": [list(r.outputs[0].token_ids) for r in results],
            "cached_tokens": [int(r.num_cached_tokens or 0) for r in results],
            "group_kinds": groups.kinds, "group_peak_blocks": groups.peak,
            "group_idle_blocks": groups.held(),
            "kv": {"before": before, "peak": peak, "idle": idle,
                   "idle_after_s": idle_after_s}}


def generate(family: str, model: Path, result_path: Path) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(model), max_model_len=base.MAX_MODEL_LEN, max_num_seqs=base.MAX_NUM_SEQS,
              block_size=BLOCK_SIZE, enforce_eager=True, distributed_executor_backend="uni",
              kv_cache_memory_bytes=KV_CACHE_BYTES, seed=0, disable_log_stats=False,
              **_engine_kwargs(family))
    read = base.kv_memory_reader()
    shared = _burst(llm, [TokensPrompt(prompt_token_ids=ids) for ids in base.workload_token_ids()],
                    SamplingParams(temperature=0.0, max_tokens=base.MAX_TOKENS, ignore_eos=True),
                    read)
    rng = random.Random(2)
    long_prompt = [rng.randrange(4, 1000) for _ in range(LONG_PROMPT)]
    long = _burst(llm, [TokensPrompt(prompt_token_ids=long_prompt)],
                  SamplingParams(temperature=0.0, max_tokens=LONG_TOKENS, ignore_eos=True),
                  read)
    core = llm.llm_engine.engine_core.engine_core
    block_tokens = [int(m.kv_cache_spec.block_size)
                    for m in core.scheduler.kv_cache_manager.coordinator.single_type_managers]
    result = {"family": family, "shared": shared, "long": long,
              "block_tokens": block_tokens, "metrics": base.metric_totals(llm)}
    result_path.write_text(json.dumps(result))


def main(argv: list[str]) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if argv[1] == "model":
        write_model(argv[2], Path(argv[3]))
        return 0
    if argv[1] == "generate":
        generate(argv[2], Path(argv[3]), Path(argv[4]))
        return 0
    raise SystemExit(f"unknown command {argv[1]!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv))
