"""Do the GPU's reads and writes of KV blocks cost more in kvcached's VMM memory than in a
cudaMalloc'd buffer?

The same paged access runs on both, alternated, in one process: a decode step's gather (every
sequence's blocks through a block table, as paged attention reads them) and its scatter (one
token's K and V written per sequence, as the KV-cache write kernel does). Only the memory
behind the blocks differs: a `torch.empty` buffer, or an FTensor of 2 MiB physical pages
mapped by kvcached (the unmapped rest of its range on the zero page, as in an engine). The
block table is the one an engine would build: each sequence's blocks in allocation order,
sequences interleaved step by step.

    python benchmarks/gpu_kv_access.py [--seqs 64] [--blocks-per-seq 24] [--virtual-gib 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import torch

from kvcached_core import native

MiB = 1 << 20
PAGE = 2 * MiB


def block_table(seqs: int, blocks_per_seq: int, first_block: int) -> torch.Tensor:
    """Block ids handed out in order while `seqs` sequences grow together, one block each in
    turn (the order a lowest-first or FIFO free list gives a batch that decodes together)."""
    ids = torch.arange(seqs * blocks_per_seq, dtype=torch.int64) + first_block
    return ids.view(blocks_per_seq, seqs).t().contiguous()


def time_ms(fn: Any, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--blocks-per-seq", type=int, default=24)
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--virtual-gib", type=float, default=8.0)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json")
    args = parser.parse_args()

    dtype = torch.bfloat16
    token_elems = args.heads * args.head_dim
    block_bytes = args.block_tokens * token_elems * 2  # one plane (K or V)
    total = int(args.virtual_gib * (1 << 30)) // PAGE * PAGE
    num_blocks = total // block_bytes
    table = block_table(args.seqs, args.blocks_per_seq, first_block=1).cuda()
    used_bytes = (args.seqs * args.blocks_per_seq + 1) * block_bytes
    pages = -(-used_bytes // PAGE)

    backend = native.cuda_backend(0)
    allocator = native.FTensorAllocator(backend, PAGE, False)
    # One layer whose K and V planes lie apart in one range; logical page p backs the p-th
    # 2 MiB of each plane.
    (ftensor,) = allocator.create_kv_tensors(total, 1, 2)
    allocator.map_pages(list(range(pages)))
    shape = (num_blocks, args.block_tokens, args.heads, args.head_dim)
    vmm = [native.as_tensor(ftensor, dtype, shape, offset=plane * total) for plane in (0, 1)]
    plain = [torch.empty(shape, dtype=dtype, device="cuda") for _ in range(2)]
    for planes in (vmm, plain):
        for plane in planes:
            plane[: pages * PAGE // block_bytes].normal_()

    seq_lens = args.blocks_per_seq * args.block_tokens
    slots = (table[:, -1] * args.block_tokens + (seq_lens - 1) % args.block_tokens)
    new_k = torch.randn(args.seqs, args.heads, args.head_dim, dtype=dtype, device="cuda")
    query = torch.randn(args.seqs, args.heads, args.head_dim, dtype=dtype, device="cuda")

    def gather(planes: list[torch.Tensor]) -> Any:
        def run() -> None:
            # Paged attention's reads: every block of every sequence, K and V.
            k = planes[0][table].view(args.seqs, -1, args.heads, args.head_dim)
            v = planes[1][table].view(args.seqs, -1, args.heads, args.head_dim)
            scores = torch.einsum("shd,sthd->sht", query, k).softmax(-1)
            torch.einsum("sht,sthd->shd", scores, v)
        return run

    def scatter(planes: list[torch.Tensor]) -> Any:
        def run() -> None:
            # The KV-cache write of one decode step: one token per sequence, K and V.
            for plane in planes:
                plane.view(-1, args.heads, args.head_dim).index_copy_(0, slots, new_k)
        return run

    results: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.rounds):  # alternated, so drift hits both alike
        for name, planes in (("cudamalloc", plain), ("vmm", vmm)):
            for op, make in (("gather", gather), ("scatter", scatter)):
                results.setdefault(op, {}).setdefault(name, []).append(
                    time_ms(make(planes), args.iters))
    summary: dict[str, Any] = {"device": torch.cuda.get_device_name(0),
                               "mapped_pages": pages, "virtual_bytes_per_plane": total,
                               "block_bytes_per_plane": block_bytes}
    for op, by_name in results.items():
        plain_ms = statistics.median(by_name["cudamalloc"])
        vmm_ms = statistics.median(by_name["vmm"])
        ratios = [v / p for v, p in zip(by_name["vmm"], by_name["cudamalloc"], strict=True)]
        summary[op] = {"cudamalloc_ms": plain_ms, "vmm_ms": vmm_ms,
                       "ratio_median": statistics.median(ratios),
                       "ratio_min": min(ratios), "ratio_max": max(ratios)}
        print(f"{op:>8}: cudaMalloc {plain_ms * 1e3:8.1f} us, VMM {vmm_ms * 1e3:8.1f} us, "
              f"VMM / cudaMalloc {statistics.median(ratios):.3f} "
              f"[{min(ratios):.3f}, {max(ratios):.3f}] over {args.rounds} rounds")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(summary, handle, indent=1)
    del vmm
    allocator.unmap_pages(list(range(pages)))


if __name__ == "__main__":
    main()
