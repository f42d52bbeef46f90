"""The patched paged allocator's extend and decode: the new pages come from the kvcached ledger,
SGLang's own location kernels place the tokens in them.

On this CPU host the kernels run only where the release has a torch path besides its Triton
one (SGLang 0.5.22 and later); a cell lists this file in its proof.l1_tests only then.
"""

from __future__ import annotations

import torch


def test_paged_alloc_extend_and_decode(paged_setup) -> None:
    _, allocator = paged_setup
    ps = 4
    assert allocator.available_size() == 1020
    prefix = allocator.alloc(2 * ps)
    assert prefix.tolist()[:ps] == list(range(prefix[0].item(), prefix[0].item() + ps))
    # Two requests: one extends a 6-token prefix (last slot mid-page) by 5, one starts fresh.
    prefix_lens = torch.tensor([6, 0])
    seq_lens = torch.tensor([11, 3])
    last_loc = torch.tensor([prefix[5].item(), -1])
    out = allocator.alloc_extend(prefix_lens, prefix_lens, seq_lens, seq_lens, last_loc, 8)
    assert out is not None and out.shape == (8,)
    first = out[:5].tolist()
    assert first[:2] == [prefix[6].item(), prefix[7].item()]  # fills the prefix's page
    assert first[2] % ps == 0 and first[3:] == [first[2] + 1, first[2] + 2]
    assert out[5].item() % ps == 0 and out[6:].tolist() == [out[5].item() + 1,
                                                            out[5].item() + 2]
    assert allocator.available_size() == 1020 - 4 * ps
    # Decode: request 0 is at 11 tokens (next slot inside its page), request 1 at 4 (page full).
    seq = torch.tensor([12, 5])
    dec = allocator.alloc_decode(seq, seq, torch.tensor([first[-1], out[-1].item()]))
    assert dec[0].item() == first[-1] + 1 and dec[1].item() % ps == 0
    assert allocator.available_size() == 1020 - 5 * ps
