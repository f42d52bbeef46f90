"""The decisions of the GPU benchmarks (benchmarks/gpu_colocation.py, gpu_throughput.py),
checked on synthetic bursts: what a GPU run is judged by must be right before one is spent."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gpu_colocation  # noqa: E402
import gpu_throughput  # noqa: E402
import make_random_llama  # noqa: E402
from gpu_engine_server import PromptSet, output_digest, percentile  # noqa: E402


def burst(tokens: int, seconds: float, ttft: float | None = 0.01, **extra: object) -> dict:
    return {"event": "burst", "tokens": tokens, "seconds": seconds, "ttft_p50": ttft,
            "failed": 0, **extra}


def test_abba_order_runs_each_engine_equally_and_alternates_neighbours() -> None:
    order = gpu_throughput.abba_order(["stock", "per-layer", "contiguous"], 4)
    assert order == ["stock", "per-layer", "contiguous", "contiguous", "per-layer", "stock",
                     "stock", "per-layer", "contiguous", "contiguous", "per-layer", "stock"]
    assert {name: order.count(name) for name in set(order)} == {
        "stock": 4, "per-layer": 4, "contiguous": 4}


def test_bootstrap_interval_holds_the_median_and_shrinks_with_more_bursts() -> None:
    few = [0.95, 1.0, 1.05, 0.97, 1.02]
    many = few * 8
    median, low, high = gpu_throughput.bootstrap_median_ci(few)
    assert median == 1.0 and low <= median <= high
    _, low_many, high_many = gpu_throughput.bootstrap_median_ci(many)
    assert high_many - low_many < high - low


def test_summary_pairs_each_patched_burst_with_stock_and_drops_warmup() -> None:
    bursts = {
        "stock": [burst(1000, 10.0), burst(1000, 1.0), burst(1000, 2.0)],
        "per-layer": [burst(1000, 99.0, reserve_hits=0, reserve_misses=5),
                      burst(1000, 1.25, ttft=0.02, reserve_hits=99, reserve_misses=1,
                            map_calls=4, map_ns=8_000_000),
                      burst(1000, 2.5, ttft=0.02, reserve_hits=100, reserve_misses=0)],
    }
    summary = gpu_throughput.summarize(bursts, warmup=1)
    patched = summary["per-layer"]
    assert patched["bursts"] == 2
    assert patched["throughput_ratio"] == 0.8          # 800/1000 and 400/500
    assert patched["ttft_p50_ratio"] == 2.0
    assert patched["reserve_hit_rate"] == 0.995         # the warm-up burst's misses left out
    assert patched["mean_map_us_per_page"] == 2000.0
    assert summary["stock"]["throughput_median_tok_s"] == 750.0


def test_physical_limit_holds_the_working_set_and_the_reserve(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "num_attention_heads": 16, "hidden_size": 2048, "num_key_value_heads": 8,
        "num_hidden_layers": 16}))
    args = gpu_throughput.argparse.Namespace(model=str(tmp_path), prompts=64,
                                             max_prompt_len=128, max_tokens=256,
                                             max_reserved_pages=10)
    page = 2 * (1 << 20) * 2 * 16                        # one 2 MiB page per layer and plane
    per_token = 8 * 128 * 2 * 2 * 16
    working_set = 64 * (128 + 256) * per_token
    limit = gpu_throughput.physical_limit(args)
    assert limit % page == 0
    assert working_set + 10 * page <= limit <= working_set + 13 * page


def test_the_wide_model_is_a_17b_llama_with_80_kib_of_kv_per_token(tmp_path: Path) -> None:
    source = tmp_path / "tiny"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"vocab_size": 1024, "hidden_size": 256}))
    (source / "tokenizer.json").write_text("{}")
    (source / "model.safetensors").write_bytes(b"weights")
    config = make_random_llama.make(source, tmp_path / "wide", "17b-wide")
    assert sorted(p.name for p in (tmp_path / "wide").iterdir()) == ["config.json",
                                                                      "tokenizer.json"]
    assert 17.0e9 < make_random_llama.parameters(config) < 17.2e9
    assert gpu_throughput.kv_bytes_per_token(tmp_path / "wide") == 80 * 1024


def test_colocation_counts_failed_requests_and_outputs_unlike_the_solo_run() -> None:
    solo = {"a": ["x", "y"], "b": ["p", "q"]}
    bursts = [("a", {"event": "burst", "failed": 0, "digests": ["x", "y"]}),
              ("b", {"event": "burst", "failed": 1, "digests": ["p", "z"]}),
              ("a", {"event": "timeout"})]
    assert gpu_colocation.compare_with_solo(solo, bursts) == (2, 1, 4)


def test_colocation_verdict_names_every_broken_promise() -> None:
    good = gpu_colocation.Verdict(started=4, engines=4, failed_requests=0, differing_outputs=0,
                                  compared_outputs=100, peak_charged=3.0, capacity=4.0)
    assert good.failures() == []
    bad = gpu_colocation.Verdict(started=3, engines=4, failed_requests=2, differing_outputs=1,
                                 compared_outputs=100, peak_charged=5.0, capacity=4.0)
    assert len(bad.failures()) == 4
    assert "1 of 4 engines did not start" in bad.failures()[0]


@pytest.mark.parametrize(("text", "expected"), [("3GiB", 3 << 30), ("512MiB", 512 << 20),
                                                ("64M", 64 << 20), ("4096", 4096)])
def test_sizes_parse(text: str, expected: int) -> None:
    assert gpu_colocation.parse_size(text) == expected


def test_prompt_sets_repeat_and_digests_tell_outputs_apart() -> None:
    prompts = PromptSet(8, 4, 9).token_ids(1024)
    assert prompts == PromptSet(8, 4, 9).token_ids(1024)
    assert all(4 <= len(p) <= 9 and min(p) >= 4 for p in prompts)
    assert output_digest([1, 2, 3]) != output_digest([1, 2, 4])
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and percentile([], 0.5) is None


def test_settle_time_is_when_the_series_stays_at_or_below_the_bound() -> None:
    rows = [{"t": 0.0, "kv": 900.0}, {"t": 0.5, "kv": 300.0}, {"t": 1.0, "kv": 500.0},
            {"t": 1.5, "kv": 320.0}, {"t": 2.0, "kv": 64.0}]
    # Dipping below the bound and rising again does not count as settled.
    assert gpu_throughput.settle_time(rows, "kv", 320.0) == 1.5
    assert gpu_throughput.settle_time(rows, "kv", 64.0) == 2.0
    assert gpu_throughput.settle_time(rows, "kv", 10.0) is None


def test_idle_follow_reports_an_engine_that_keeps_its_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from kvcached_core.limits import LimitRecord, record_path

    monkeypatch.setattr(gpu_throughput, "device_used_bytes", lambda: None)
    mib = 1 << 20
    record = LimitRecord("idle-pool", 1 << 30, 800 * mib, 100 * mib, 1, os.getpid(), 1 << 30)
    record_path("idle-pool", tmp_path).write_bytes(record.pack())
    report = gpu_throughput.follow_idle({"auto": "idle-pool"}, seconds=0.2, period_s=0.05,
                                        reserve_bytes=320 * mib, shm_dir=str(tmp_path))
    assert report["auto"]["kv_mapped_mib_last"] == 900.0
    assert report["auto"]["seconds_to_reserve_bound"] is None
    assert len(report["samples"]) >= 3


def test_profile_diff_matches_a_function_across_trees_whatever_its_line(tmp_path: Path) -> None:
    """Stock and patched trees live in different folders and a patched file's lines move:
    the same function is one row, its calls and time on both sides."""
    import cProfile

    def profile(tree: str, blank_lines: int, calls: int) -> Path:
        source = "\n" * blank_lines + "def step(n):\n    return sum(range(n))\n"
        namespace: dict[str, Any] = {}
        exec(compile(source, f"/{tree}/site/vllm/v1/core/sched.py", "exec"), namespace)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            namespace["step"](2000)
        profiler.disable()
        path = tmp_path / f"{tree}.prof"
        profiler.dump_stats(path)
        return path

    text = gpu_throughput.profile_diff({"stock": profile("stock", 0, 10),
                                        "patched": profile("patched", 7, 30)}, top=5)
    rows = [line for line in text.splitlines() if line.endswith("vllm/v1/core/sched.py(step)")]
    assert len(rows) == 2  # own time, and time with callees
    assert all(row.split()[3:5] == ["30", "10"] for row in rows)
    assert text.splitlines()[0].startswith("== patched - stock: own time")
