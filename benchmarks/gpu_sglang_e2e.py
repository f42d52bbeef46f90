"""End to end on a GPU: stock against patched SGLang on one tiny model, one workload, one run.

Each engine runs in its own child process (a fresh `sglang.Engine`, its scheduler and
detokenizer processes, and a fresh CUDA context): the stock wheel, then the patched wheel with
`KVCACHED_ENABLE=1`. Both get the same server arguments (Triton attention, PyTorch sampling, the
same static memory fraction); stock reserves its whole KV cache at start, the patched engine
reserves address space and maps pages as requests need them. The workload is a burst of
requests in groups sharing a long prefix (greedy, fixed length), an idle pause, and the same
burst again, which now hits the prefix cache.

Checks (exit status 1 if any fails):
- greedy outputs of the patched engine are token-identical to stock in the first burst (the
  second hits the prefix cache, whose batch shapes can change bf16 rounding: reported, not
  judged);
- every request completes at full length in both engines;
- the patched engine's KV pages (kvcached's mapped bytes) grow in each burst and at least half
  of that growth is unmapped again after the idle pause, and its device memory after start is
  below stock's. With SGLang's one-token pages a cached request's slots lie on every page the
  burst used; the prefix cache's bound (`--max-cached-tokens`) also counts pages once the engine
  is idle, so memory returns with a bound above 0 too (benchmarks/RESULTS.md, "GPU truth:
  SGLang 0.5.16").

Measures, per engine: `import sglang` and engine start-up time, device memory in use (NVML,
the whole device) after start, after a warm-up and an idle pause, at its peak during each
burst and after the pause that follows it; for the patched engine the same for kvcached's
mapped KV bytes (pages in use plus the warm reserve, read from the pools' limit records).

    python benchmarks/gpu_sglang_e2e.py --out DIR \\
        --engine stock=PATH --engine patched=PATH [--model DIR | --make-model DIR]

`--engine NAME=PATH`: PATH is prepended to that child's PYTHONPATH (a directory holding that
sglang build and its dependencies; the patched one also needs kvcached_core importable).
`--make-model DIR` writes a random-weight Llama with a word-level tokenizer there first (in a
child on the stock engine's path), so no model has to be fetched.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MIB = 1 << 20
GIB = 1 << 30
SPECIAL_TOKENS = 3  # <unk>, <s>, </s>

MODEL_SHAPE: dict[str, int] = dict(
    hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
    num_key_value_heads=4, head_dim=128,
)


@dataclass(frozen=True)
class Workload:
    prefixes: int
    per_prefix: int
    prefix_tokens: int
    max_new_tokens: int
    rounds: int
    idle_s: float

    def prompts(self, vocab: int) -> list[list[int]]:
        rng = random.Random(7)
        prompts = []
        for _ in range(self.prefixes):
            prefix = [rng.randrange(SPECIAL_TOKENS, vocab) for _ in range(self.prefix_tokens)]
            for _ in range(self.per_prefix):
                tail = [rng.randrange(SPECIAL_TOKENS, vocab) for _ in range(rng.randint(16, 64))]
                prompts.append(prefix + tail)
        return prompts


# ------------------------------------------------------------------------------- model


def write_model(out: Path, vocab_words: int, seed: int = 0) -> None:
    """A random-weight bf16 Llama (MODEL_SHAPE) and a word-level tokenizer, written offline."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i + SPECIAL_TOKENS for i in range(vocab_words)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(out)
    config = LlamaConfig(vocab_size=len(vocab), max_position_embeddings=4096, bos_token_id=1,
                         eos_token_id=2, tie_word_embeddings=False, **MODEL_SHAPE)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # The default init (std 0.02) gives near-flat logits whose argmax is often decided by
    # rounding noise; a wider output head gives greedy decoding clearer winners, so a token
    # difference between engines points at the engines rather than at a near-tie.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() < 2:
                continue
            if "embed" in name:
                param.normal_(0.0, 1.0)
            else:
                scale = 4.0 if "lm_head" in name else 0.5
                param.normal_(0.0, scale / param.shape[-1] ** 0.5)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    # Only `dtype` of the config matters to SGLang; transformers releases spell it differently.
    config_path = out / "config.json"
    config_json = json.loads(config_path.read_text())
    config_json["torch_dtype"] = "bfloat16"
    config_path.write_text(json.dumps(config_json, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1,
                                                           "eos_token_id": 2}))


def kv_bytes_per_token(model_dir: Path, dtype_bytes: int = 2) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    return int(config["num_hidden_layers"]) * kv_heads * head_dim * 2 * dtype_bytes


# ------------------------------------------------------------------------------- child


class DeviceMemory:
    """Bytes in use on one device, all processes: NVML, else `nvidia-smi` (coarser, slower).

    Read from outside CUDA so that measuring creates no context of its own.
    """

    def __init__(self, index: int) -> None:
        self.index = index
        self._handle: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.source = "nvml"
        except Exception:  # no NVML binding: fall back to the CLI
            self.source = "nvidia-smi"

    def used(self) -> float | None:
        if self._handle is not None:
            return float(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)
        try:
            out = subprocess.run(
                ["nvidia-smi", f"--id={self.index}", "--query-gpu=memory.used",
                 "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
            return float(out.stdout.strip().splitlines()[0]) * MIB
        except (OSError, ValueError, IndexError, subprocess.SubprocessError):
            return None


def kv_mapped(shm_dir: str | None) -> tuple[float, float] | None:
    """(bytes in use, bytes mapped in all) over the engine's elastic pools, from their limit
    records; None when there are none (stock, or not started)."""
    if not shm_dir:
        return None
    try:
        from kvcached_core.limits import list_records
    except ImportError:
        return None
    records = [r for r in list_records(shm_dir) if r.pool.startswith("sglang-")]
    if not records:
        return None
    used = float(sum(r.used_bytes for r in records))
    return used, used + float(sum(r.reserved_bytes for r in records))


class Sampler:
    """Calls `read` every `period_s` in a thread while the block runs."""

    def __init__(self, read: Any, period_s: float) -> None:
        self.read = read
        self.period_s = period_s
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.read())
            self._stop.wait(self.period_s)

    def peak(self, key: str) -> float | None:
        values = [s[key] for s in self.samples if s.get(key) is not None]
        return max(values) if values else None


def run_child(args: argparse.Namespace) -> int:
    result: dict[str, Any] = {"engine": args.child, "ok": False}

    def emit() -> None:
        print("RESULT_JSON " + json.dumps(result), flush=True)

    memory = DeviceMemory(args.gpu)
    shm_dir = os.environ.get("KVCACHED_SHM_DIR")

    def read() -> dict[str, float]:
        sample: dict[str, float] = {"t": time.monotonic()}
        used = memory.used()
        if used is not None:
            sample["device_used"] = used
        kv = kv_mapped(shm_dir)
        if kv is not None:
            sample["kv_in_use"], sample["kv_mapped"] = kv
        return sample

    result["memory_source"] = memory.source
    result["before"] = read()
    t0 = time.perf_counter()
    import sglang

    result["import_s"] = round(time.perf_counter() - t0, 2)
    result["sglang"] = sglang.__version__
    result["sglang_file"] = os.path.dirname(sglang.__file__)
    try:
        from sglang import _kvcached_build  # noqa: F401  (only the patched build has it)

        result["patched_build"] = True
    except ImportError:
        result["patched_build"] = False
    kwargs: dict[str, Any] = dict(
        model_path=args.model, dtype="bfloat16", attention_backend=args.attention_backend,
        sampling_backend="pytorch", mem_fraction_static=args.mem_fraction_static,
        random_seed=0, log_level=args.log_level, skip_server_warmup=True,
        disable_flashinfer_autotune=True,
    )
    if args.cuda_graph_max_bs > 0:
        # 0.5.16 splits CUDA-graph settings by phase (no plain `cuda_graph_max_bs`).
        kwargs["cuda_graph_max_bs_decode"] = args.cuda_graph_max_bs
    else:
        kwargs["disable_cuda_graph"] = True
    kwargs.update(json.loads(args.engine_kwargs))
    result["engine_kwargs"] = kwargs
    t0 = time.perf_counter()
    engine = sglang.Engine(**kwargs)
    result["engine_start_s"] = round(time.perf_counter() - t0, 2)
    result["after_start"] = read()
    try:
        info = engine.get_server_info()
        result["max_total_num_tokens"] = info.get("max_total_num_tokens")
    except Exception as exc:  # only informative
        result["max_total_num_tokens"] = None
        result["server_info_error"] = repr(exc)
    emit()

    work = Workload(args.prefixes, args.per_prefix, args.prefix_tokens, args.max_new_tokens,
                    args.rounds, args.idle_s)
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    prompts = work.prompts(int(vocab))
    params = {"temperature": 0.0, "max_new_tokens": work.max_new_tokens, "ignore_eos": True}
    # Warm-up on two short requests that share no prefix with the workload (kernels compile,
    # allocator caches fill), then idle: the engine's resting footprint.
    rng = random.Random(11)
    warm = [[rng.randrange(SPECIAL_TOKENS, int(vocab)) for _ in range(32)] for _ in range(2)]
    t0 = time.perf_counter()
    engine.generate(input_ids=warm, sampling_params={"temperature": 0.0, "max_new_tokens": 8,
                                                     "ignore_eos": True})
    result["warmup_s"] = round(time.perf_counter() - t0, 2)
    time.sleep(work.idle_s)
    result["idle_before"] = read()
    emit()
    rounds: list[dict[str, Any]] = []
    for _ in range(work.rounds):
        with Sampler(read, args.sample_period_s) as sampler:
            t0 = time.perf_counter()
            outputs = engine.generate(input_ids=prompts, sampling_params=params)
            seconds = time.perf_counter() - t0
        time.sleep(work.idle_s)
        idle = read()
        ids = [list(o["output_ids"]) for o in outputs]
        rounds.append({
            "seconds": round(seconds, 3),
            "tokens": sum(len(o) for o in ids),
            "full_length": all(len(o) == work.max_new_tokens for o in ids),
            "cached_tokens": sum(int(o["meta_info"].get("cached_tokens", 0)) for o in outputs),
            "peak_device_used": sampler.peak("device_used"),
            "peak_kv_mapped": sampler.peak("kv_mapped"),
            "peak_kv_in_use": sampler.peak("kv_in_use"),
            "idle_after": idle,
            "samples": len(sampler.samples),
            "outputs": ids,
        })
        result["rounds"] = rounds
        emit()
    result["ok"] = True
    emit()
    try:
        engine.shutdown()
    except Exception as exc:  # reported; the measurements are already out
        print(f"engine shutdown failed: {exc!r}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(0)


# ------------------------------------------------------------------------------ parent


def _child_env(args: argparse.Namespace, engine: str, path: str, shm_dir: str
               ) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH", "")) if p)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1",
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1")
    if engine == "stock":
        env["KVCACHED_ENABLE"] = "0"
    else:
        env.update(KVCACHED_ENABLE="1", KVCACHED_SHM_DIR=shm_dir,
                   KVCACHED_MAX_CACHED_TOKENS=str(args.max_cached_tokens))
    for item in args.env:
        key, _, value = item.partition("=")
        env[key] = value
    return env


def _child_command(args: argparse.Namespace, engine: str) -> list[str]:
    command = [sys.executable, os.path.abspath(__file__), "--child", engine,
               "--model", args.model, "--gpu", str(args.gpu)]
    for name in ("prefixes", "per_prefix", "prefix_tokens", "max_new_tokens", "rounds",
                 "idle_s", "mem_fraction_static", "cuda_graph_max_bs", "attention_backend",
                 "log_level", "sample_period_s", "engine_kwargs"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return command


def run_engine(args: argparse.Namespace, engine: str, path: str) -> dict[str, Any]:
    out = Path(args.out)
    shm_dir = tempfile.mkdtemp(prefix=f"kvcached-{engine}-")
    log_path = out / f"{engine}.log"
    print(f"== {engine}: starting", flush=True)
    started = time.perf_counter()
    result: dict[str, Any] = {"engine": engine, "ok": False}
    try:
        with log_path.open("w") as log:
            child = subprocess.Popen(_child_command(args, engine), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     env=_child_env(args, engine, path, shm_dir),
                                     start_new_session=True)
            # The engine's scheduler and detokenizer are in the child's session: killing the
            # group leaves no process holding device memory for the next engine.
            timer = threading.Timer(args.timeout, _kill_group, (child.pid,))
            timer.start()
            grace: threading.Timer | None = None
            try:
                assert child.stdout is not None
                for line in child.stdout:
                    log.write(line)
                    log.flush()
                    if line.startswith("RESULT_JSON "):
                        result = json.loads(line[len("RESULT_JSON "):])
                        print(f"   {engine}: {_progress(result)}", flush=True)
                        if result.get("ok") and grace is None:
                            # Everything is measured by now: a shutdown that hangs (a
                            # process left holding the pipe) must not cost the timeout.
                            grace = threading.Timer(30.0, _kill_group, (child.pid,))
                            grace.start()
            finally:
                rc = child.wait()
                timer.cancel()
                if grace is not None:
                    grace.cancel()
                _kill_group(child.pid)
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
    result["rc"] = rc
    result["wall_s"] = round(time.perf_counter() - started, 1)
    if rc != 0 or not result.get("ok"):
        result["log_tail"] = log_path.read_text(errors="replace").splitlines()[-60:]
        print(f"   {engine}: FAILED rc={rc}\n      " + "\n      ".join(result["log_tail"]),
              flush=True)
    return result


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _progress(result: dict[str, Any]) -> str:
    rounds = result.get("rounds") or []
    if not rounds:
        return (f"import {result.get('import_s')} s, engine up in "
                f"{result.get('engine_start_s')} s, device "
                f"{_gib(result.get('after_start', {}).get('device_used'))} GiB")
    last = rounds[-1]
    return (f"round {len(rounds)}: {last['tokens'] / last['seconds']:.0f} tok/s, peak device "
            f"{_gib(last['peak_device_used'])} GiB, peak kv {_mib(last['peak_kv_mapped'])} MiB")


def _gib(value: float | None) -> float | None:
    return None if value is None else round(value / GIB, 2)


def _mib(value: float | None) -> float | None:
    return None if value is None else round(value / MIB, 1)


def summarize(results: dict[str, dict[str, Any]], args: argparse.Namespace
              ) -> tuple[dict[str, Any], list[str]]:
    failures: list[str] = []
    summary: dict[str, Any] = {
        "workload": {"requests": args.prefixes * args.per_prefix,
                     "prefix_tokens": args.prefix_tokens, "max_new_tokens": args.max_new_tokens,
                     "rounds": args.rounds, "idle_s": args.idle_s},
        "kv_bytes_per_token": kv_bytes_per_token(Path(args.model)),
    }
    for name, result in results.items():
        if not result.get("ok"):
            failures.append(f"{name}: did not finish (rc {result.get('rc')})")
            summary[name] = {"ok": False, "rc": result.get("rc")}
            continue
        rounds = result["rounds"]
        entry: dict[str, Any] = {
            "import_s": result["import_s"],
            "engine_start_s": result["engine_start_s"],
            "warmup_s": result["warmup_s"],
            "max_total_num_tokens": result.get("max_total_num_tokens"),
            "device_used_before_gib": _gib(result["before"].get("device_used")),
            "device_used_after_start_gib": _gib(result["after_start"].get("device_used")),
            "device_used_idle_before_gib": _gib(result["idle_before"].get("device_used")),
            "device_used_peak_gib": [_gib(r["peak_device_used"]) for r in rounds],
            "device_used_idle_after_gib": [_gib(r["idle_after"].get("device_used"))
                                           for r in rounds],
            "throughput_tok_s": [round(r["tokens"] / r["seconds"], 1) for r in rounds],
            "cached_tokens": [r["cached_tokens"] for r in rounds],
            "rounds_repeating_round_1": sum(r["outputs"] == rounds[0]["outputs"]
                                            for r in rounds),
        }
        if not all(r["full_length"] for r in rounds):
            failures.append(f"{name}: a request ended short")
        if name == "patched":
            before = result["idle_before"].get("kv_mapped")
            entry.update(
                kv_mapped_after_start_mib=_mib(result["after_start"].get("kv_mapped")),
                kv_mapped_idle_before_mib=_mib(before),
                kv_mapped_peak_mib=[_mib(r["peak_kv_mapped"]) for r in rounds],
                kv_in_use_peak_mib=[_mib(r["peak_kv_in_use"]) for r in rounds],
                kv_mapped_idle_after_mib=[_mib(r["idle_after"].get("kv_mapped"))
                                          for r in rounds],
            )
            if before is None or any(r["peak_kv_mapped"] is None for r in rounds):
                failures.append("patched: no kvcached pool record was found (not elastic?)")
            else:
                for index, r in enumerate(rounds):
                    grew = r["peak_kv_mapped"] - before
                    after = r["idle_after"].get("kv_mapped", before)
                    if grew <= 0:
                        failures.append(f"patched: round {index + 1}: kvcached mapped bytes did "
                                        "not grow in the burst")
                    elif r["peak_kv_mapped"] - after < 0.5 * grew:
                        failures.append(
                            f"patched: round {index + 1} kept {_mib(after)} MiB of a "
                            f"{_mib(r['peak_kv_mapped'])} MiB peak after {args.idle_s} s idle")
        summary[name] = entry
    stock, patched = results.get("stock"), results.get("patched")
    if stock and patched and stock.get("ok") and patched.get("ok"):
        a, b = stock["rounds"][0]["outputs"], patched["rounds"][0]["outputs"]
        same = sum(x == y for x, y in zip(a, b, strict=True))
        first_diff = [next((i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q), None)
                      for x, y in zip(a, b, strict=True) if x != y]
        summary["identical_round_1"] = f"{same}/{len(a)}"
        summary["first_divergence_positions"] = first_diff
        if same != len(a):
            failures.append(f"patched: {len(a) - same} of {len(a)} round-1 outputs differ "
                            "from stock")
        later = [sum(x == y for x, y in zip(rs["outputs"], rp["outputs"], strict=True))
                 for rs, rp in zip(stock["rounds"][1:], patched["rounds"][1:], strict=True)]
        summary["identical_later_rounds"] = [f"{n}/{len(a)}" for n in later]
        start_stock = stock["after_start"].get("device_used")
        start_patched = patched["after_start"].get("device_used")
        if start_stock is not None and start_patched is not None:
            summary["device_saved_after_start_gib"] = _gib(start_stock - start_patched)
            if start_patched >= start_stock:
                failures.append("patched: device memory after start is not below stock's")
    return summary, failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (with --make-model: where to write)")
    parser.add_argument("--make-model", metavar="DIR",
                        help="write a random-weight Llama to DIR first and use it")
    parser.add_argument("--vocab-words", type=int, default=2048)
    parser.add_argument("--out", default="gpu-sglang-e2e-out")
    parser.add_argument("--engine", action="append", default=[], metavar="NAME=PATH")
    parser.add_argument("--engines", default="stock,patched", help="which to run, in order")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment for every child")
    parser.add_argument("--gpu", type=int, default=0, help="NVML index of the device")
    parser.add_argument("--prefixes", type=int, default=4)
    parser.add_argument("--per-prefix", type=int, default=32)
    parser.add_argument("--prefix-tokens", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--mem-fraction-static", type=float, default=0.3)
    parser.add_argument("--cuda-graph-max-bs", type=int, default=128,
                        help="largest captured decode batch; 0 runs without CUDA graphs")
    parser.add_argument("--attention-backend", default="triton")
    parser.add_argument("--max-cached-tokens", type=int, default=4096,
                        help="KVCACHED_MAX_CACHED_TOKENS of the patched engine (0: the prefix "
                             "cache keeps nothing once idle)")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--sample-period-s", type=float, default=0.05)
    parser.add_argument("--engine-kwargs", default="{}",
                        help="JSON object of extra sglang.Engine(...) arguments for both")
    parser.add_argument("--timeout", type=float, default=300.0, help="per engine, seconds")
    parser.add_argument("--child", choices=("stock", "patched"), help=argparse.SUPPRESS)
    parser.add_argument("--write-model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.write_model:
        write_model(Path(args.write_model), args.vocab_words)
        return 0
    if args.child:
        return run_child(args)

    engines: dict[str, str] = {}
    for item in args.engine:
        name, sep, path = item.partition("=")
        if not sep or name not in ("stock", "patched"):
            parser.error(f"--engine wants stock=PATH or patched=PATH, got {item!r}")
        engines[name] = path
    order = [e.strip() for e in args.engines.split(",") if e.strip()]
    missing = sorted(set(order) - set(engines))
    if missing:
        parser.error(f"no --engine for {missing}")
    if any("=" not in item for item in args.env):
        parser.error("--env wants KEY=VALUE")
    if args.make_model:
        args.model = args.make_model
        if not (Path(args.model) / "config.json").exists():
            writer = order[0]
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                p for p in (engines[writer], os.environ.get("PYTHONPATH", "")) if p))
            subprocess.run([sys.executable, os.path.abspath(__file__), "--write-model",
                            args.model, "--vocab-words", str(args.vocab_words)],
                           check=True, env=env)
    if not args.model:
        parser.error("--model or --make-model is required")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    for index, engine in enumerate(order):
        if index:
            # The driver frees a killed process's memory asynchronously; the next engine's
            # start-up sizing and "before" figure should not see the last one's.
            time.sleep(3.0)
        results[engine] = run_engine(args, engine, engines[engine])
        # Written after every engine: a run cut short keeps what it measured.
        (Path(args.out) / "results.json").write_text(json.dumps(results))
    summary, failures = summarize(results, args)
    summary["failures"] = failures
    (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    for line in failures:
        print(f"FAIL {line}")
    print("ok" if not failures else f"{len(failures)} check(s) failed")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
