"""One vLLM engine in its own process, driven line by line: what the GPU benchmarks share.

The child (`python gpu_engine_server.py --child ...`) starts `vllm.LLM` with the engine core in
its own process (so kvcached's pool counters are readable), prints `MSG {...}` lines and then
answers commands read from stdin: `burst`, `stats`, `quit`. The parent side (`EngineProcess`)
starts children, waits for their messages with deadlines and never lets one hang a run.

A burst generates greedy tokens for a fixed prompt set (the same every burst, so outputs can
be compared across bursts and with the engine's solo run) and reports tokens, seconds, TTFT p50,
requests that failed or ended short, a digest per output, and the pool's counter deltas.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import hashlib
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MSG = "MSG "


@dataclass(frozen=True)
class PromptSet:
    """`count` prompts of random token ids, lengths in [min_len, max_len], from `seed`."""

    count: int
    min_len: int
    max_len: int
    seed: int = 7

    def token_ids(self, vocab: int) -> list[list[int]]:
        rng = random.Random(self.seed)
        return [[rng.randrange(4, vocab) for _ in range(rng.randint(self.min_len, self.max_len))]
                for _ in range(self.count)]


def output_digest(token_ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(token_ids).encode()).hexdigest()[:16]


def percentile(values: list[float], fraction: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


# ---------------------------------------------------------------------------------- child


def _driver_op_stats(pool: Any) -> dict[str, tuple[int, int]]:
    """{driver call: (calls, ns)} of the backend behind `pool` ({} on the host backend).
    The pool's own backend: each `cuda_backend()` call makes a new one, with counts of its own."""
    return dict(pool.backend.op_stats())


def _op_stats_delta(before: dict[str, tuple[int, int]],
                    after: dict[str, tuple[int, int]]) -> dict[str, list[int]]:
    """Per driver call, the calls and nanoseconds between two `_driver_op_stats` readings."""
    return {name: [calls - before.get(name, (0, 0))[0], ns - before.get(name, (0, 0))[1]]
            for name, (calls, ns) in after.items()}


def _emit(message: Mapping[str, Any]) -> None:
    print(MSG + json.dumps(message), flush=True)


def _device_used() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return float(total - free)


def engine_pool() -> Any:
    """The patched engine's kvcached pool in this process, or None (stock wheel, elastic off)."""
    try:
        from kvcached_core.integration.vllm import engine_pools
    except ImportError:
        return None
    pools = engine_pools()
    return pools[0].pool if pools else None


def serve(args: argparse.Namespace) -> int:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # Stats on: without them vLLM leaves RequestOutput.metrics (and so TTFT) empty.
    kwargs: dict[str, Any] = dict(model=args.model, seed=0, disable_log_stats=False)
    kwargs.update(json.loads(args.llm_kwargs))
    started = time.perf_counter()
    try:
        llm = LLM(**kwargs)
    except Exception as exc:  # the parent counts engines that did not start, and why
        _emit({"event": "start_failed", "error": f"{type(exc).__name__}: {exc}"[:2000]})
        return 3
    pool = engine_pool()
    vocab = int(llm.llm_engine.vllm_config.model_config.get_vocab_size())
    prompt_set = PromptSet(args.prompts, args.min_prompt_len, args.max_prompt_len)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_set.token_ids(vocab)]
    # Token ids only: detokenizing every sequence each step is CPU work both engines share,
    # and it adds noise to a comparison of what differs (the KV cache).
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                            detokenize=args.detokenize)
    geometry = getattr(pool, "geometry", None)
    _emit({"event": "ready", "start_s": round(time.perf_counter() - started, 2),
           "elastic": pool is not None, "device_used": _device_used(),
           "num_gpu_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
           # The layout the pool took (KVCACHED_LAYOUT=auto decides from the KV layout).
           "contiguous": getattr(geometry, "contiguous", None),
           "page_bytes_all_layers": getattr(geometry, "page_bytes_all_layers", None)})
    for line in sys.stdin:
        command = line.split()
        if not command:
            continue
        if command[0] == "quit":
            break
        if command[0] == "stats":
            _emit({"event": "stats", "device_used": _device_used(),
                   "kv_mapped": pool.mapped_bytes() if pool is not None else None})
            continue
        if command[0] not in ("burst", "profile"):
            _emit({"event": "error", "error": f"unknown command {line.strip()!r}"})
            continue
        # `profile PATH`: the same burst under cProfile (the in-process engine core's
        # scheduler and model runner included), its statistics written to PATH.
        profiler = cProfile.Profile() if command[0] == "profile" else None
        before = pool.snapshot() if pool is not None else None
        ops_before = _driver_op_stats(pool) if pool is not None else {}
        t0 = time.perf_counter()
        try:
            if profiler is not None:
                profiler.enable()
            results = llm.generate(prompts, params, use_tqdm=False)
            error = None
        except Exception as exc:  # every request of the burst failed
            results, error = [], f"{type(exc).__name__}: {exc}"[:2000]
        finally:
            if profiler is not None:
                profiler.disable()
        seconds = time.perf_counter() - t0
        if profiler is not None:
            profiler.dump_stats(command[1])
        after = pool.snapshot() if pool is not None else None
        outputs = [list(r.outputs[0].token_ids) for r in results]
        ttfts = [float(r.metrics.first_token_latency) for r in results
                 if getattr(r, "metrics", None) is not None
                 and getattr(r.metrics, "first_token_latency", None) is not None]
        burst: dict[str, Any] = {
            "event": command[0], "tag": command[1] if len(command) > 1 else "",
            "seconds": seconds, "tokens": sum(len(o) for o in outputs),
            "failed": len(prompts) - sum(len(o) == args.max_tokens for o in outputs),
            "error": error, "ttft_p50": percentile(ttfts, 0.5),
            "digests": [output_digest(o) for o in outputs],
        }
        if before is not None and after is not None:
            burst.update(
                reserve_hits=after.reserve_hits - before.reserve_hits,
                reserve_misses=after.reserve_misses - before.reserve_misses,
                map_calls=after.map_calls - before.map_calls,
                map_ns=after.map_ns_total - before.map_ns_total,
                unmap_calls=after.unmap_calls - before.unmap_calls,
                unmap_ns=after.unmap_ns_total - before.unmap_ns_total,
                mapped_pages_after=after.mapped_pages,
                driver_ops=_op_stats_delta(ops_before, _driver_op_stats(pool)),
            )
        _emit(burst)
    try:  # the patched engine releases its pages and removes its pool record
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:
        print(f"engine shutdown failed: {exc!r}", file=sys.stderr, flush=True)
    _emit({"event": "bye"})
    sys.stdout.flush()
    os._exit(0)


# ---------------------------------------------------------------------------------- parent


@dataclass
class EngineSpec:
    name: str
    site: str                      # prepended to PYTHONPATH: where that vLLM is installed
    llm_kwargs: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)
    prompts: int = 64
    min_prompt_len: int = 32
    max_prompt_len: int = 96
    max_tokens: int = 128


class EngineProcess:
    """A child engine: its messages arrive on a queue; every wait has a deadline."""

    def __init__(self, spec: EngineSpec, model: str, log_dir: Path,
                 base_env: Mapping[str, str]) -> None:
        self.spec = spec
        env = dict(base_env)
        env.update(spec.env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (spec.site, env.get("PYTHONPATH", ""))
                                            if p)
        command = [sys.executable, os.path.abspath(__file__), "--child", "--model", model,
                   "--llm-kwargs", json.dumps(spec.llm_kwargs),
                   "--prompts", str(spec.prompts), "--min-prompt-len", str(spec.min_prompt_len),
                   "--max-prompt-len", str(spec.max_prompt_len),
                   "--max-tokens", str(spec.max_tokens)]
        self.log_path = log_dir / f"{spec.name}.log"
        self._log = self.log_path.open("w")
        self.messages: queue.Queue[dict[str, Any]] = queue.Queue()
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._log.write(line)
            self._log.flush()
            if line.startswith(MSG):
                self.messages.put(json.loads(line[len(MSG):]))
        self.messages.put({"event": "exit", "rc": self.proc.wait()})

    def wait_for(self, events: tuple[str, ...], timeout: float) -> dict[str, Any]:
        """The next message whose event is one of `events` (or the child's exit/failure)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return {"event": "timeout"}
            try:
                message = self.messages.get(timeout=left)
            except queue.Empty:
                return {"event": "timeout"}
            if message["event"] in (*events, "exit", "start_failed"):
                return message

    def send(self, command: str) -> bool:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError):
            return False

    def burst(self, tag: str, timeout: float) -> dict[str, Any]:
        if not self.send(f"burst {tag}"):
            return {"event": "exit"}
        return self.wait_for(("burst",), timeout)

    def profile(self, path: Path, timeout: float) -> dict[str, Any]:
        """One burst under cProfile, its statistics written to `path` (pstats format)."""
        if not self.send(f"profile {path}"):
            return {"event": "exit"}
        return self.wait_for(("profile",), timeout)

    def close(self, timeout: float = 60.0) -> None:
        if self.proc.poll() is None:
            self.send("quit")
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def engine_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment every child starts from: in-process engine core, offline, quiet."""
    env = dict(os.environ)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    if extra:
        env.update(extra)
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--llm-kwargs", default="{}")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--min-prompt-len", type=int, default=32)
    parser.add_argument("--max-prompt-len", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--detokenize", action=argparse.BooleanOptionalAction, default=False)
    return serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
