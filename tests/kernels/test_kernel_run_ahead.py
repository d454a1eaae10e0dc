"""The bookkeeping kernels of steps launched ahead (kernels/run_ahead.py) against their torch references, exactly:
the input fix-up after a verify step in flight, and the token histories' append."""

import numpy as np
import pytest
import torch

from kernels.run_ahead import append_tokens_ref, append_tokens_triton, fix_up_inputs_ref, fix_up_inputs_triton


def _fix_up_case(rng, device, block_size=4):
    """Input buffers of a step of `rows` rows, and a fix-up of each kind: fed tokens, device drafts, positions
    moved back (with their slots) and sequence lengths."""
    rows, tokens, prev_rows = int(rng.integers(1, 9)), int(rng.integers(8, 300)), int(rng.integers(1, 9))
    max_blocks = 16
    buffers = {"input_ids": torch.tensor(rng.integers(0, 1000, tokens)),
               "positions": torch.tensor(rng.integers(8, max_blocks * block_size, tokens)),
               "slot_mapping": torch.tensor(rng.integers(0, 4096, tokens)),
               "seq_lens": torch.tensor(rng.integers(8, 64, rows + 1), dtype=torch.int32),
               "block_tables": torch.tensor(rng.integers(0, 512, (rows + 1, max_blocks)), dtype=torch.int32)}
    flat = rng.permutation(tokens)
    n, d = int(rng.integers(0, min(rows, 4) + 1)), int(rng.integers(0, 5))
    t = int(rng.integers(0, min(tokens - n - d, 200) + 1))
    m = int(rng.integers(0, rows + 1)) if t else 0
    index = np.concatenate([flat[:n], rng.integers(0, prev_rows, n), flat[n:n + d], flat[n + d:n + d + t],
                            rng.integers(0, rows, t), rng.integers(0, prev_rows, t), rng.permutation(rows)[:m],
                            rng.integers(0, prev_rows, m)])
    args = (torch.tensor(rng.integers(0, 1000, prev_rows)), torch.tensor(rng.integers(0, 5, prev_rows)),
            torch.tensor(index, dtype=torch.long), (n, d, t, m), torch.tensor(rng.integers(0, 1000, d)))
    return ({k: v.to(device) for k, v in buffers.items()}, tuple(a.to(device) if isinstance(a, torch.Tensor) else a
                                                                for a in args))


@pytest.mark.parametrize("block", [8, 128])
def test_fix_up_kernel_writes_what_the_reference_writes(device, block):
    rng = np.random.default_rng(block)
    kinds = np.zeros(4)
    for _ in range(40):
        buffers, (prev, rejected, index, counts, draft_ids) = _fix_up_case(rng, device)
        expected = {k: v.clone() for k, v in buffers.items()}
        names = ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables")
        fix_up_inputs_ref(*(expected[k] for k in names), 4, prev, rejected, index, counts, draft_ids)
        fix_up_inputs_triton(*(buffers[k] for k in names), 4, prev, rejected, index, counts, draft_ids, block=block)
        for k in names:
            assert torch.equal(buffers[k].cpu(), expected[k].cpu()), (k, counts)
        kinds += np.asarray(counts) > 0
    assert (kinds > 5).all()  # every kind of entry was written, in many cases


def test_fix_up_kernel_needs_what_it_reads(device):
    buffers, (prev, rejected, index, counts, draft_ids) = _fix_up_case(np.random.default_rng(0), device)
    with pytest.raises(ValueError, match="rejected"):
        fix_up_inputs_triton(*buffers.values(), 4, prev, None, index, (0, 0, 1, 0), draft_ids)


@pytest.mark.parametrize("with_rows", [False, True])
def test_append_kernel_writes_what_the_reference_writes(device, with_rows):
    """Rows of kept tokens then -1 (verify steps' rows, a plain step's single column), some histories near their
    end (tokens past max_len dropped), slots picked out of order, rows of `new` picked by `rows`."""
    rng = np.random.default_rng(3 + with_rows)
    max_len, slots_total = 24, 8
    for _ in range(40):
        width = int(rng.integers(1, 7))
        tokens = torch.tensor(rng.integers(0, 500, (slots_total, max_len + 1)), dtype=torch.int32)
        num_tokens = torch.tensor(rng.integers(1, max_len + 1, slots_total))
        p = int(rng.integers(1, slots_total + 1))
        slots = torch.tensor(rng.permutation(slots_total)[:p])
        r = p + int(rng.integers(0, 3)) if with_rows else p
        kept = rng.integers(1, width + 1, r)
        new = torch.tensor(np.where(np.arange(width)[None, :] < kept[:, None], rng.integers(0, 500, (r, width)), -1))
        rows = torch.tensor(rng.permutation(r)[:p]) if with_rows else None
        expected, expected_n = tokens.clone(), num_tokens.clone()
        append_tokens_ref(expected, expected_n, slots, new, rows)
        on = [x.to(device) for x in (tokens, num_tokens, slots, new)]
        append_tokens_triton(*on, None if rows is None else rows.to(device))
        assert torch.equal(on[1].cpu(), expected_n)
        assert torch.equal(on[0][:, :max_len].cpu(), expected[:, :max_len])  # (the padding column: anything)
