"""One long-lived SGLang CPU engine, driven over stdin: the SGLang side of the soak.

Run inside an SGLang test venv (`tests/sglang/conftest.py`'s `engine_env`):

    python serve_engine.py MODEL_DIR

It speaks the line protocol of `tests/e2e/vllm_colocation_run.py` (one JSON command per line on
stdin, one reply per line on stdout starting with `REPLY_MARK`), so the host drives it with the
same `EngineProcess`:

    {"cmd": "burst", "prompts": [[token ids], ...], "max_tokens": N}
        -> {"outputs": [[ids], ...], "failed": k, "errors": [...], "seconds": s,
            "generated_tokens": t, "preemptions": None}
    {"cmd": "state"} -> {"mapped_bytes": b, "limit_bytes": l, "pools": [names], "pid": pid,
                         "owner": the scheduler's pid, "page_bytes": the floor,
                         "workers": [pids]}
    {"cmd": "quit"}  -> {"bye": true}

`sglang.Engine` runs its scheduler and detokenizer in child processes (`workers`); the
scheduler owns the elastic pools, so what they map is read from their limit records (the
records whose owner is one of this process's children). `page_bytes` is what the pools map
before the first request (the padding page): the floor an idle engine returns to.
`preemptions` is None: SGLang's retractions are not counted here.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from run_engine import engine_kwargs

REPLY_MARK = "@@colocation "  # the line protocol of tests/e2e/vllm_colocation_run.py


def reply(payload: dict[str, Any]) -> None:
    sys.stdout.write(REPLY_MARK + json.dumps(payload) + "\n")
    sys.stdout.flush()


def children() -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process().children(recursive=True)]


def pool_records(owners: list[int]) -> list[Any]:
    from kvcached_core.limits import list_records

    return [r for r in list_records() if r.owner_pid in owners]


def burst(engine: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    params = {"temperature": 0.0, "max_new_tokens": max_tokens, "ignore_eos": True}
    started = time.perf_counter()
    errors: list[str] = []
    outputs: list[list[int]] = []
    try:
        for out in engine.generate(input_ids=prompts, sampling_params=params):
            generated = out["meta_info"]["completion_tokens"]
            outputs.append(list(out["output_ids"][len(out["output_ids"]) - generated:]))
            finish = out["meta_info"].get("finish_reason") or {}
            if finish.get("type") == "abort":
                errors.append(f"aborted: {finish.get('message')}")
    except Exception as exc:  # a failed request is what the caller counts, not a crash
        traceback.print_exc()
        errors.append(f"{type(exc).__name__}: {exc}")
    return {
        "outputs": outputs,
        "failed": len(prompts) - sum(1 for out in outputs if len(out) == max_tokens),
        "errors": errors,
        "seconds": time.perf_counter() - started,
        "generated_tokens": sum(len(out) for out in outputs),
        "preemptions": None,
    }


def state(workers: list[int], floor: int) -> dict[str, Any]:
    records = pool_records(workers)
    return {"mapped_bytes": sum(r.used_bytes + r.reserved_bytes for r in records),
            "limit_bytes": sum(r.limit_bytes for r in records),
            "pools": sorted(r.pool for r in records), "pid": os.getpid(),
            "owner": records[0].owner_pid if records else None,
            "page_bytes": floor, "workers": workers}


def serve(model: Path) -> None:
    import sglang

    engine = sglang.Engine(**engine_kwargs(str(model)))
    workers = children()
    first = state(workers, 0)
    if not first["pools"]:
        raise SystemExit(f"no elastic pool record is owned by the engine's processes {workers}")
    reply({"ready": True, **state(workers, first["mapped_bytes"])})
    try:
        for line in sys.stdin:
            command = json.loads(line)
            if command["cmd"] == "burst":
                reply(burst(engine, command["prompts"], int(command["max_tokens"])))
            elif command["cmd"] == "state":
                reply(state(workers, first["mapped_bytes"]))
            elif command["cmd"] == "quit":
                reply({"bye": True})
                return
            else:
                reply({"error": f"unknown command {command['cmd']!r}"})
    finally:
        engine.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    serve(Path(sys.argv[1]))
