"""Grammar masks on the logits: tokens a row's packed bitmask does not allow become -inf, in place.

The bitmask is xgrammar's layout: one int32 word per 32 tokens, token t allowed when bit t % 32 of word t // 32 is 1.
It may be narrower than the vocabulary (a model's vocabulary can be larger than its tokenizer's): tokens past its
last word are never allowed.

    bitmask [R, W]                          rows [R]: which logits row each bitmask row masks
    logits  [N, V]  rows[i] <- -inf where bit t of bitmask[i] is 0, or t >= 32 W (only those R rows are touched)

Only the disallowed entries are written and the logits are never read: the kernel moves V / 8 bytes of bitmask and
at most 4 V bytes of -inf per masked row, and rows without a constraint cost nothing.
"""

import torch

from kernels._triton import (
    FLOAT_DTYPES,
    cdiv,
    check_dtype,
    check_last_dim_contiguous,
    check_launchable,
    pdl_options,
    tl,
    triton,
    use_triton,
    wait_for_prior,
)

_BLOCK = 2048  # tokens per program


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr, bitmask_ptr, rows_ptr, stride_logits, stride_bitmask, vocab_size, num_words, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_prior(PDL)
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < vocab_size
    # Each word is loaded by the 32 lanes of its tokens: one cache line serves them all. Past the bitmask: 0.
    words = tl.load(bitmask_ptr + i * stride_bitmask + tokens // 32, mask=in_vocab & (tokens // 32 < num_words),
                    other=0)
    allowed = (words >> (tokens % 32)) & 1
    tl.store(logits_ptr + row * stride_logits + tokens, float("-inf"), mask=in_vocab & (allowed == 0))


def _check_inputs(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
    if bitmask.dim() != 2 or bitmask.shape[1] < 1:
        raise ValueError(f"bitmask must be [R, words], got {tuple(bitmask.shape)}")
    if rows.shape != (bitmask.shape[0],):
        raise ValueError(f"rows must be [{bitmask.shape[0]}] (one per bitmask row), got {tuple(rows.shape)}")
    check_dtype("logits", logits, FLOAT_DTYPES)
    check_dtype("bitmask", bitmask, (torch.int32,))
    check_dtype("rows", rows, (torch.int32, torch.int64))


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Triton launcher of `apply_token_bitmask_`: a program per (bitmask row, block of tokens)."""
    _check_inputs(logits, bitmask, rows)
    check_launchable(logits, bitmask, rows)
    check_last_dim_contiguous("logits", logits)
    check_last_dim_contiguous("bitmask", bitmask)
    if bitmask.shape[0] == 0:
        return
    vocab = logits.shape[1]
    _apply_token_bitmask_kernel[(bitmask.shape[0], cdiv(vocab, _BLOCK))](
        logits, bitmask, rows, logits.stride(0), bitmask.stride(0), vocab, bitmask.shape[1], BLOCK=_BLOCK,
        **pdl_options(logits.device), num_warps=4)


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Torch reference of `apply_token_bitmask_` (and its CPU implementation): unpack the bits, masked_fill."""
    _check_inputs(logits, bitmask, rows)
    if bitmask.shape[0] == 0:
        return
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().reshape(bitmask.shape[0], -1)[:, :vocab]  # [R, <= V]
    if allowed.shape[1] < vocab:  # past the bitmask: never allowed
        allowed = torch.cat([allowed, allowed.new_zeros(allowed.shape[0], vocab - allowed.shape[1])], dim=1)
    index = rows.long()
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits [N, V] float, bitmask int32 [R, W], rows [R] distinct row indices of logits: sets
    logits[rows[i], t] = -inf wherever bit t of bitmask[i] is 0 or t >= 32 W. In place; other rows and allowed
    entries keep their values."""
    if use_triton(logits):
        apply_token_bitmask_triton(logits, bitmask, rows)
    else:
        apply_token_bitmask_ref(logits, bitmask, rows)
