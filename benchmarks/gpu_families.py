"""Model families on a GPU: stock, an oracle stock engine and the elastic engine, one at a time.

For every `--family NAME=MODEL_DIR` (a random-weight model of that architecture; only
config.json and the tokenizer are read, `load_format="dummy"`) three engines run in turn, each
in its own child process with the engine core in-process:

- `stock`: the stock wheel as a user starts it (`gpu_memory_utilization`, defaults);
- `elastic`: the patched wheel, same arguments;
- `oracle`: the stock wheel with `num_gpu_blocks_override` set to the most blocks the stock
  engine held at once (plus the null block): the least a static reservation could be for this
  workload, known only after the fact;
- `ancestor` (when `--ancestor-site` names a directory holding kvcached 0.1.6, the
  runtime-patching system this project descends from, installed there with `pip --target`):
  the stock wheel with that package's import hooks registered before vLLM is imported and
  `ENABLE_KVCACHED=true`, as its own `.pth` file would do in a site-packages directory. It
  runs only with vLLM's V1 model runner: pass `--env VLLM_USE_V2_MODEL_RUNNER=0` to compare
  every engine on that runner.

Workload (the same for all three): a burst of `--prompts` random prompts x `--max-tokens` greedy
tokens, `--idle-s` idle, the same burst again (prefix-cache hits), `--idle-s` idle, then one
long request (`--long-prompt` tokens, `--long-tokens` generated) and `--idle-s` idle.

Reported per engine: device memory in use (NVML, else the driver's free-memory figure) after
start, at the peak and after the idle gaps; the most distinct blocks each KV cache group held
at once in the bursts and in the long request (a sliding-window group must stay near its
window while a full-attention group grows with the sequence); the elastic pool's mapped bytes
along the same points. Checked (exit status 1 if any fails): every engine finishes, the elastic
engine's first-burst tokens equal stock's, its mapped KV grows in a burst and returns when
idle, and a sliding-window group of the long request holds no more than its window's blocks.

    python benchmarks/gpu_families.py --family sliding-window=DIR --family mla=DIR \\
        --stock-site DIR --patched-site DIR [--ancestor-site DIR] --out DIR [--gpu-mem-util 0.3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_engine_server import engine_environment, engine_pool  # noqa: E402

from tests.e2e.vllm_cpu_family_run import held_blocks  # noqa: E402

MIB = 1 << 20
RESULT = "RESULT_JSON "
ENGINES = ("stock", "elastic", "oracle", "ancestor")


# ---------------------------------------------------------------------------------- child


class DeviceMemory:
    """GPU 0's memory in use: NVML when pynvml is importable, else the CUDA driver's figure
    (total - free) read through torch; None on a machine without a GPU."""

    def __init__(self) -> None:
        self.source = "none"
        self._handle: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self._nvml = pynvml
            self.source = "nvml"
            return
        except Exception:
            pass
        import torch

        if torch.cuda.is_available():
            self.source = "driver"

    def used(self) -> float | None:
        if self.source == "nvml":
            return float(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)
        if self.source == "driver":
            import torch

            free, total = torch.cuda.mem_get_info()
            return float(total - free)
        return None


class Watch:
    """Samples, every `period_s` until stopped: the distinct non-null blocks each KV cache
    group holds (from vLLM's own per-group managers), the blocks of vLLM's block pool in use,
    the elastic pool's mapped bytes and device memory. Keeps the peaks."""

    def __init__(self, llm: Any, pool: Any, device: DeviceMemory, period_s: float = 0.005):
        manager = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager
        self._groups = manager.coordinator.single_type_managers
        self._block_pool = manager.block_pool
        self._pool = pool
        self._device = device
        self._period_s = period_s
        self.kinds = [type(m.kv_cache_spec).__name__ for m in self._groups]
        self.group_peak = [0] * len(self._groups)
        self.blocks_in_use_peak = 0
        self.mapped_peak = 0.0
        self.device_peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def group_blocks(self) -> list[int]:
        return held_blocks(self._groups)

    def _run(self) -> None:
        last_device = 0.0
        while not self._stop.is_set():
            # A dict that changed size under the read is read again next time.
            with contextlib.suppress(RuntimeError):
                self.group_peak = [max(a, b) for a, b in
                                   zip(self.group_peak, self.group_blocks(), strict=True)]
            in_use = self._block_pool.num_gpu_blocks - self._block_pool.get_num_free_blocks()
            self.blocks_in_use_peak = max(self.blocks_in_use_peak, in_use)
            if self._pool is not None:
                self.mapped_peak = max(self.mapped_peak, float(self._pool.mapped_bytes()))
            now = time.monotonic()
            if now - last_device >= 0.02:
                last_device = now
                self.device_peak = max(self.device_peak, self._device.used() or 0.0)
            self._stop.wait(self._period_s)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run_child(args: argparse.Namespace) -> int:
    if args.child == "ancestor":
        # Registers the ancestor's when-imported hooks for vLLM (its .pth file does this at
        # interpreter start when installed in site-packages).
        import kvcached.autopatch  # noqa: F401

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    result: dict[str, Any] = {"engine": args.child, "ok": False}

    def emit() -> None:
        print(RESULT + json.dumps(result), flush=True)

    device = DeviceMemory()
    result["device_source"] = device.source
    result["device_used_before"] = device.used()
    kwargs: dict[str, Any] = dict(model=args.model, seed=0, disable_log_stats=False,
                                  enable_prefix_caching=True, load_format="dummy",
                                  max_model_len=args.max_model_len, enforce_eager=args.eager)
    if args.device_kind == "cuda":
        kwargs["gpu_memory_utilization"] = args.gpu_mem_util
    else:
        kwargs["kv_cache_memory_bytes"] = args.cpu_kv_bytes
    if args.blocks:
        kwargs["num_gpu_blocks_override"] = args.blocks
    kwargs.update(json.loads(args.llm_kwargs))
    started = time.perf_counter()
    llm = LLM(**kwargs)
    result["start_s"] = round(time.perf_counter() - started, 1)
    result["after_start"] = device.used()
    pool = engine_pool()
    result["elastic"] = pool is not None
    if (args.child == "elastic") != (pool is not None):
        result["error"] = f"the {args.child} engine {'built' if pool else 'built no'} pool"
        emit()
        return 3
    result["mapped_after_start"] = float(pool.mapped_bytes()) if pool is not None else None
    cache = llm.llm_engine.vllm_config.cache_config
    result["num_gpu_blocks"] = cache.num_gpu_blocks
    result["block_size"] = cache.block_size
    emit()

    def mapped() -> float | None:
        return float(pool.mapped_bytes()) if pool is not None else None

    vocab = int(llm.llm_engine.vllm_config.model_config.get_vocab_size())
    rng = random.Random(7)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(4, vocab) for _ in range(
        rng.randint(args.min_prompt_len, args.max_prompt_len))]) for _ in range(args.prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                            detokenize=False)
    phases: list[dict[str, Any]] = []
    first_outputs: list[list[int]] = []
    group_blocks_max = 0
    for phase in ("burst", "burst", "long"):
        if phase == "long":
            batch = [TokensPrompt(prompt_token_ids=[rng.randrange(4, vocab)
                                                    for _ in range(args.long_prompt)])]
            phase_params = SamplingParams(temperature=0.0, max_tokens=args.long_tokens,
                                          ignore_eos=True, detokenize=False)
        else:
            batch, phase_params = prompts, params
        with Watch(llm, pool, device) as watch:
            t0 = time.perf_counter()
            outputs = llm.generate(batch, phase_params, use_tqdm=False)
            seconds = time.perf_counter() - t0
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        if not first_outputs:
            first_outputs = tokens
        time.sleep(args.idle_s)
        group_blocks_max = max(group_blocks_max, watch.blocks_in_use_peak)
        phases.append({
            "phase": phase, "seconds": round(seconds, 3),
            "full_length": all(len(t) == phase_params.max_tokens for t in tokens),
            "group_kinds": watch.kinds, "group_peak_blocks": watch.group_peak,
            "blocks_in_use_peak": watch.blocks_in_use_peak,
            "device_peak": watch.device_peak, "mapped_peak": watch.mapped_peak,
            "device_idle": device.used(), "mapped_idle": mapped(),
            "group_idle_blocks": watch.group_blocks()})
        result["phases"] = phases
        emit()
    result["outputs"] = first_outputs
    result["ok"] = True
    emit()
    with contextlib.suppress(Exception):  # the measurements are already out
        llm.llm_engine.engine_core.shutdown()
    sys.stdout.flush()
    os._exit(0)


# ---------------------------------------------------------------------------------- parent


def _child(args: argparse.Namespace, family: str, model: str, engine: str, site: str,
           blocks: int, overrides: dict[str, Any], out: Path) -> dict[str, Any]:
    command = [sys.executable, os.path.abspath(__file__), "--child", engine, "--model", model,
               "--blocks", str(blocks), "--device-kind", args.device_kind]
    for name in ("gpu_mem_util", "cpu_kv_bytes", "prompts", "min_prompt_len",
                 "max_prompt_len", "max_tokens", "idle_s", "long_prompt", "long_tokens",
                 "max_model_len"):
        command += [f"--{name.replace('_', '-')}", str(overrides.get(name, getattr(args, name)))]
    command += ["--llm-kwargs", args.llm_kwargs]
    if args.eager:
        command.append("--eager")
    env = engine_environment(dict(item.split("=", 1) for item in args.env))
    if engine == "ancestor":
        env.update(ENABLE_KVCACHED="true", KVCACHED_AUTOPATCH="1")
    if engine != "elastic":
        env["KVCACHED_ENABLE"] = "0"
    else:
        env.setdefault("KVCACHED_POOL_NAME", f"families-{family}-{os.getpid()}")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH", "")) if p)
    log_path = out / f"{family}.{engine}.log"
    result: dict[str, Any] = {"engine": engine, "ok": False}
    started = time.monotonic()
    print(f"== {family} / {engine}", flush=True)
    with log_path.open("w") as log:
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, env=env, start_new_session=True)
        timer = threading.Timer(args.timeout, lambda: os.killpg(child.pid, signal.SIGKILL))
        timer.start()
        try:
            assert child.stdout is not None
            for line in child.stdout:
                log.write(line)
                if line.startswith(RESULT):
                    result = json.loads(line[len(RESULT):])
                    done = [p["phase"] for p in result.get("phases", [])]
                    print(f"   {family} / {engine}: up in {result.get('start_s')} s; "
                          f"done {done}", flush=True)
        finally:
            rc = child.wait()
            timer.cancel()
    result["rc"] = rc
    result["wall_s"] = round(time.monotonic() - started, 1)
    if rc != 0 or not result.get("ok"):
        result["log_tail"] = log_path.read_text().splitlines()[-25:]
        tail = "\n      ".join(result["log_tail"])
        print(f"   FAILED rc={rc}\n      {tail}", flush=True)
    return result


def _gib(value: float | None) -> float | None:
    return None if value is None else round(value / (1 << 30), 3)


def memory_row(result: dict[str, Any]) -> dict[str, Any]:
    phases = result.get("phases") or []
    row = {"after_start_gib": _gib(result.get("after_start")),
           "peak_gib": _gib(max((p["device_peak"] for p in phases), default=None)),
           "idle_gib": _gib(phases[-1]["device_idle"] if phases else None),
           "num_gpu_blocks": result.get("num_gpu_blocks"),
           "block_size": result.get("block_size")}
    if result.get("elastic") and phases:
        row.update(mapped_peak_mib=round(max(p["mapped_peak"] for p in phases) / MIB, 1),
                   mapped_idle_mib=[round((p["mapped_idle"] or 0) / MIB, 1) for p in phases])
    return row


def window_blocks(model: str, block_size: int) -> int | None:
    """The most blocks a sliding-window group may hold for one request (None: no window)."""
    config = json.loads((Path(model) / "config.json").read_text())
    window = config.get("sliding_window")
    if not window:
        return None
    return -(-int(window) // block_size) + 1


def judge(family: str, model: str, results: dict[str, dict[str, Any]]) -> list[str]:
    failures = [f"{family} / {name}: did not finish (rc {r.get('rc')})"
                for name, r in results.items() if not r.get("ok")]
    stock, elastic = results.get("stock"), results.get("elastic")
    ancestor = results.get("ancestor")
    if stock and ancestor and stock.get("ok") and ancestor.get("ok"):
        same = sum(a == b for a, b in zip(stock["outputs"], ancestor["outputs"], strict=True))
        if same != len(stock["outputs"]):
            failures.append(f"{family} / ancestor: {len(stock['outputs']) - same} of "
                            f"{len(stock['outputs'])} first-burst outputs differ from stock")
    for name, result in results.items():
        if result.get("ok") and not all(p["full_length"] for p in result["phases"]):
            failures.append(f"{family} / {name}: a request ended short")
    if stock and elastic and stock.get("ok") and elastic.get("ok"):
        same = sum(a == b for a, b in zip(stock["outputs"], elastic["outputs"], strict=True))
        if same != len(stock["outputs"]):
            failures.append(f"{family}: {len(stock['outputs']) - same} of "
                            f"{len(stock['outputs'])} first-burst outputs differ from stock")
        phases = elastic["phases"]
        if phases[0]["mapped_peak"] <= 0:
            failures.append(f"{family}: the elastic pool mapped nothing in the burst")
        floor = elastic.get("mapped_after_start") or 0.0
        for index, phase in enumerate(phases):
            # The long request's few pages are reported; the bursts must give back at least
            # half of what they mapped above the engine's resting floor.
            grown = phase["mapped_peak"] - floor
            if phase["phase"] == "burst" and (phase["mapped_idle"] or 0) - floor > 0.5 * grown:
                failures.append(f"{family}: phase {index + 1} kept {phase['mapped_idle']} of "
                                f"{phase['mapped_peak']} mapped bytes after idle (floor "
                                f"{floor})")
        limit = window_blocks(model, int(elastic["block_size"]))
        long_phase = phases[-1]
        for kind, peak in zip(long_phase["group_kinds"], long_phase["group_peak_blocks"],
                              strict=True):
            if limit is not None and kind.startswith("SlidingWindow") and peak > limit:
                failures.append(f"{family}: a {kind} group held {peak} blocks of the long "
                                f"request, more than its window's {limit}")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", choices=ENGINES)
    parser.add_argument("--model")
    parser.add_argument("--blocks", type=int, default=0)
    parser.add_argument("--family", action="append", default=[], metavar="NAME=MODEL_DIR")
    parser.add_argument("--stock-site", default="")
    parser.add_argument("--patched-site", default="")
    parser.add_argument("--ancestor-site", default="",
                        help="kvcached 0.1.6 installed with pip --target; joined before "
                             "--stock-site")
    parser.add_argument("--engines", default="stock,elastic,oracle",
                        help=f"a comma-separated subset of {','.join(ENGINES)}")
    parser.add_argument("--out", default="gpu-families-out")
    parser.add_argument("--device-kind", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--gpu-mem-util", type=float, default=0.3)
    parser.add_argument("--cpu-kv-bytes", type=int, default=256 * MIB)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--min-prompt-len", type=int, default=64)
    parser.add_argument("--max-prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--long-prompt", type=int, default=64)
    parser.add_argument("--long-tokens", type=int, default=1536)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--llm-kwargs", default="{}", help="JSON, added to every engine's LLM()")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per engine")
    args = parser.parse_args(argv)
    if args.child:
        return run_child(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sites = {"stock": args.stock_site, "elastic": args.patched_site, "oracle": args.stock_site,
             "ancestor": os.pathsep.join(p for p in (args.ancestor_site, args.stock_site) if p)}
    report: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items()
                                           if k not in ("child", "model", "blocks")}}
    failures: list[str] = []
    for item in args.family:
        family, _, model = item.partition("=")
        results: dict[str, dict[str, Any]] = {}
        for engine in args.engines.split(","):
            blocks, overrides = 0, {}
            if engine == "oracle":
                stock = results.get("stock")
                if not stock or not stock.get("ok"):
                    failures.append(f"{family} / oracle: needs a finished stock run")
                    continue
                blocks = max(p["blocks_in_use_peak"] for p in stock["phases"]) + 1
                # Sized to this workload: its longest request, its most blocks at once.
                overrides = {"max_model_len": args.long_prompt + args.long_tokens}
            results[engine] = _child(args, family, model, engine, sites[engine], blocks,
                                     overrides, out)
        failures += judge(family, model, results)
        report[family] = {name: {**memory_row(r),
                                 "phases": r.get("phases", []),
                                 **{k: r[k] for k in ("start_s", "device_source", "rc",
                                                      "error", "log_tail") if k in r}}
                          for name, r in results.items()}
        (out / "families.json").write_text(json.dumps(report, indent=1))
    report["failures"] = failures
    (out / "families.json").write_text(json.dumps(report, indent=1))
    for family in (item.partition("=")[0] for item in args.family):
        for name, row in report.get(family, {}).items():
            print(f"{family:16s} {name:8s} start {row['after_start_gib']} GiB, peak "
                  f"{row['peak_gib']} GiB, idle {row['idle_gib']} GiB, blocks "
                  f"{row['num_gpu_blocks']}" + (f", mapped peak {row['mapped_peak_mib']} MiB"
                                                f" idle {row['mapped_idle_mib']} MiB"
                                                if "mapped_peak_mib" in row else ""))
    print("\n".join(["FAILED: " + f for f in failures]) or "all checks passed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
