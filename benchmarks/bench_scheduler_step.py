"""CPU time of vLLM's scheduler step, stock against patched (elastic block pool), same run.

    python benchmarks/bench_scheduler_step.py [--cell vllm-0.25] [--requests 128] \
        [--steps 400] [--rounds 6] [--window-groups 6 --window 1024] \
        [--bursts 3 --num-blocks 300000]

The GPU throughput benchmark sees the patched engine a few percent behind stock; this one
isolates what the patched scheduler adds per step on the host, where nothing else differs.
Both trees are the cell's pinned sdist (stock, and with the cell's transforms), run in the
cell's contract venv (tests/contract) with a scheduler and no model: `--requests` requests of
96-token prompts are admitted, then every step schedules them, hands back one sampled token
each (as the model runner would) and, on the patched tree, ends the step as EngineCore's
wrapper does (`on_step_end`: page release, retire markers). Rounds alternate stock and patched
(ABBA); each reports the median step time over its decode steps and the time of its first 4
steps (admission). Prints the per-round figures and the ratios patched / stock of their medians.
`--window-groups N` gives the scheduler a hybrid model's KV cache groups instead of one: a
full-attention group and N sliding-window groups (`--window` tokens) on one block pool, as
vLLM's hybrid manager makes them for Gemma 3. `--bursts N` ends each burst (its requests
finished, one idle step in which the patched pool gives its pages back) and admits the same
requests again, as an engine serving bursts with idle gaps does; `--num-blocks` sizes the KV
space like an engine's virtual one (most of its blocks never used).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = r"""
import json, statistics, sys, time
from types import SimpleNamespace
sys.path.insert(0, "tests/v1/core")
from utils import create_requests, create_scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import RequestStatus

requests_n, steps, elastic = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
window_groups, window = int(sys.argv[5]), int(sys.argv[6])
bursts, num_blocks = int(sys.argv[7]), int(sys.argv[8])
num_blocks = num_blocks or (requests_n * 64 + 64) * (1 + window_groups)
scheduler = create_scheduler(max_num_seqs=requests_n, max_num_batched_tokens=16384,
                             num_blocks=num_blocks, block_size=16, max_model_len=2048)
if window_groups:
    # A hybrid model's groups (Gemma 3: one full-attention group beside sliding-window ones),
    # every group's blocks drawn from the one block pool, as vLLM's hybrid manager does.
    import torch
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,
                                            KVCacheGroupSpec, SlidingWindowSpec)
    shape = dict(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["full"], FullAttentionSpec(**shape))]
    groups += [KVCacheGroupSpec([f"window.{g}"], SlidingWindowSpec(sliding_window=window,
                                                                    **shape))
               for g in range(window_groups)]
    scheduler = type(scheduler)(
        vllm_config=scheduler.vllm_config,
        kv_cache_config=KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                      kv_cache_groups=groups),
        block_size=16, log_stats=True,
        structured_output_manager=scheduler.structured_output_manager)
pool = scheduler.kv_cache_manager.block_pool
core = SimpleNamespace(scheduler=scheduler, batch_queue=None)
end_step = None
if elastic:
    from kvcached_core.integration.vllm import engine
    assert type(pool).__name__.startswith("Elastic"), type(pool)
    end_step = lambda: engine.on_step_end(core, pool, 0)

def step():
    out = scheduler.schedule()
    ids = list(out.num_scheduled_tokens)
    result = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                               sampled_token_ids=[[7] for _ in ids], logprobs=None,
                               prompt_logprobs_dict={}, pooler_output=[])
    scheduler.update_from_output(out, result)
    if end_step is not None:
        end_step()

profile = None
if sys.argv[4]:  # where the first burst's decode steps' profile goes
    import cProfile
    profile = cProfile.Profile()
admissions, decode = [], []
for burst in range(bursts):
    # Each burst: the requests arrive together, decode `steps` steps, then go away (as a
    # client's burst ends) and one idle step lets the patched engine give its pages back.
    requests = create_requests(requests_n, num_tokens=96, max_tokens=steps + 8)
    for request in requests:
        request.request_id = f"{burst}-{request.request_id}"
        scheduler.add_request(request)
    times = []
    for index in range(steps):
        if profile is not None and burst == 0 and index == 4:
            profile.enable()
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    if profile is not None and burst == 0:
        profile.disable()
        profile.dump_stats(sys.argv[4])
    admissions.append(sum(times[:4]) * 1e6)
    if burst == 0:
        decode = times[4:]  # the prefill steps left out
    scheduler.finish_requests([r.request_id for r in requests], RequestStatus.FINISHED_ABORTED)
    step()
print(json.dumps({"median_us": statistics.median(decode) * 1e6, "steps": len(decode),
                  "admission_us": admissions[0], "readmission_us": admissions[1:]}))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cell", default="vllm-0.25")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--window-groups", type=int, default=0,
                        help="sliding-window KV cache groups beside the full-attention one "
                             "(a hybrid model such as Gemma 3)")
    parser.add_argument("--window", type=int, default=1024,
                        help="their window in tokens")
    parser.add_argument("--bursts", type=int, default=1,
                        help="bursts of --requests requests, each ended by finishing them "
                             "and one idle step; later bursts report their admission time")
    parser.add_argument("--num-blocks", type=int, default=0,
                        help="vLLM blocks of the KV space (0: just enough for the requests; "
                             "an engine's virtual space holds hundreds of thousands)")
    parser.add_argument("--profile", action="store_true",
                        help="profile each tree's decode steps (cProfile) and print the "
                             "functions whose time differs most between them")
    args = parser.parse_args(argv)

    from forge.matrix import load_matrix
    from tests.contract.fake_hf import build_fake_hf_home
    from tests.contract.vllm_contract import contract_venv, tree_workspace, unpacked_sdist

    cell = load_matrix(ROOT / "matrix.toml").get_cell(args.cell)
    python = contract_venv(cell)
    work = Path(tempfile.mkdtemp(prefix="bench-scheduler-"))
    try:
        sdist = unpacked_sdist(cell, work / "sdist")
        hf_home = build_fake_hf_home(work / "hf")
        trees = {}
        for flavour in ("stock", "patched"):
            tree = work / flavour
            shutil.copytree(sdist, tree)
            tree_workspace(tree, patched=flavour == "patched", cell=cell)
            trees[flavour] = tree
        imports = work / "imports"
        imports.mkdir()
        (imports / "kvcached_core").symlink_to(ROOT / "kvcached_core")
        medians: dict[str, list[float]] = {"stock": [], "patched": []}
        admissions: dict[str, list[float]] = {"stock": [], "patched": []}
        readmissions: dict[str, list[float]] = {"stock": [], "patched": []}
        for index in range(args.rounds):
            order = ("stock", "patched") if index % 2 == 0 else ("patched", "stock")
            for flavour in order:
                env = {k: v for k, v in os.environ.items()
                       if not k.startswith(("KVCACHED_", "VLLM_"))}
                env.update({"PYTHONPATH": f"{trees[flavour]}{os.pathsep}{imports}",
                            "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1",
                            "TRANSFORMERS_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu",
                            "KVCACHED_ENABLE": "1" if flavour == "patched" else "0",
                            "KVCACHED_SCHEDULER_ONLY": "1"})
                done = subprocess.run(
                    [str(python), "-c", CHILD, str(args.requests), str(args.steps),
                     "1" if flavour == "patched" else "0",
                     str(work / f"{flavour}-{index}.prof") if args.profile else "",
                     str(args.window_groups), str(args.window), str(args.bursts),
                     str(args.num_blocks)],
                    cwd=trees[flavour], env=env, capture_output=True, text=True, check=False)
                if done.returncode != 0:
                    print(done.stderr[-3000:], file=sys.stderr)
                    return 1
                result = json.loads(done.stdout.strip().splitlines()[-1])
                medians[flavour].append(result["median_us"])
                admissions[flavour].append(result["admission_us"])
                readmissions[flavour].extend(result["readmission_us"])
                again = "".join(f", {us:.0f}" for us in result["readmission_us"])
                print(f"round {index} {flavour}: {result['median_us']:.0f} us per step "
                      f"({result['steps']} decode steps, {args.requests} requests), "
                      f"{result['admission_us']:.0f}{again} us for the first 4 (admission"
                      f"{' of each burst' if again else ''})", flush=True)
        if args.profile:  # the last round's two trees, function by function
            from gpu_throughput import profile_diff

            last = args.rounds - 1
            print(profile_diff({flavour: work / f"{flavour}-{last}.prof"
                                for flavour in ("stock", "patched")}, top=25))
        stock, patched = statistics.median(medians["stock"]), statistics.median(medians["patched"])
        print(json.dumps({"cell": cell.name, "requests": args.requests,
                          "window_groups": args.window_groups,
                          "stock_us_per_step": round(stock, 1),
                          "patched_us_per_step": round(patched, 1),
                          "ratio": round(patched / stock, 3),
                          "added_us_per_step": round(patched - stock, 1),
                          "admission_ratio": round(statistics.median(admissions["patched"])
                                                   / statistics.median(admissions["stock"]), 3),
                          **({"readmission_ratio": round(
                              statistics.median(readmissions["patched"])
                              / statistics.median(readmissions["stock"]), 3)}
                             if readmissions["stock"] else {}),
                          }))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
