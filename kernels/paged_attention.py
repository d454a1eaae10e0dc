"""Attention over a paged KV cache: decode (one query per sequence) and prefill (packed variable-length chunks).

K and V of one layer live in blocks, `[num_blocks, block_size, num_kv_heads, head_dim]`; a sequence's block table
lists its blocks in order, so its token j sits at block `block_tables[s, j // block_size]`, offset
`j % block_size`. Each key tile of BLOCK_N tokens looks up its BLOCK_N block ids in one vector load (any
block_size works; several KV blocks per tile when block_size < BLOCK_N).

GQA: the QUERIES_PER_KV query heads that share a KV head are rows of one tile, so K/V are loaded once per group:

    decode   rows = the group's query heads (padded to 16 for tl.dot)        grid (seqs, kv_heads, splits)
    prefill  rows = BLOCK_Q queries x QUERIES_PER_KV heads, row r -> query r // QUERIES_PER_KV,
                    head r % QUERIES_PER_KV                grid (query blocks x kv_heads), heaviest first

Softmax is online (FlashAttention), in base 2: scores are scaled by scale * log2(e) and exponentiated with
exp2. Prefill skips key tiles past a query block's last position and masks only the tiles on its diagonal.
Decode splits long contexts into NUM_SPLITS partitions computed in parallel (flash-decoding), whose partial
outputs are merged by their log-sum-exp: by a second small kernel, or (FUSED_MERGE) by the last partition of each
(sequence, KV head) to finish, which an arrival counter picks, so a decode step is one kernel.
"""

import torch

from kernels._triton import (
    FLOAT_DTYPES,
    cdiv,
    check_dtype,
    check_last_dim_contiguous,
    check_launchable,
    dot_precision,
    is_power_of_2,
    next_power_of_2,
    num_sms,
    pdl_options,
    shared_memory_per_sm,
    tl,
    triton,
    upcast_dot_operands,
    use_triton,
    wait_for_prior,
)
from kernels.fp8 import FP8_DTYPE, dequantize
from kernels.kv_cache import check_kv_scales

LOG2E = 1.4426950408889634
MIN_SPLIT_TOKENS = 256  # decode: fewer tokens per split would cost more in the merge than it gains
MAX_SPLITS = 64
PROGRAMS_PER_SM = 2  # decode: programs per SM the split count aims at


@triton.jit
def _load(ptrs, mask, MASKED: tl.constexpr):
    """Zeros where `mask` is false; a tile known to be whole is loaded without a mask."""
    if MASKED:
        x = tl.load(ptrs, mask=mask, other=0.0)  # a float zero: the interpreter casts it to e4m3 too, not an int
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table_ptr, n0, kv_end, q_pos, kv_head,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SCORE_MASK: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    window=0, WINDOWED: tl.constexpr = False,
):
    """One BLOCK_N-token key tile of online softmax. SCORE_MASK: 0 none (every token of the tile is in range: loads
    unmasked), 1 tokens < kv_end, 2 causal (q_pos). WINDOWED: also tokens > q_pos - window (per row), the row's
    sliding window. A row that sees no key of a tile must not have a running max of -inf then (exp2(-inf - -inf)
    is NaN): prefill starts windowed rows at -1e30 instead; decode's splits never begin with such a tile."""
    tokens = n0 + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    in_range = tokens < kv_end
    masked: tl.constexpr = SCORE_MASK != 0
    blocks = _load(block_table_ptr + tokens // BLOCK_SIZE, in_range, masked).to(tl.int64)
    offsets = tokens % BLOCK_SIZE
    k_rows = blocks * stride_kb + offsets * stride_kt + kv_head * stride_kh
    k = _load(k_cache_ptr + k_rows[:, None] + dims[None, :], in_range[:, None], masked)
    k = k.to(q.dtype)  # a no-op, or float32 (UPCAST), or e4m3 -> q's dtype (exact; its scale is in qk_scale)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N], unscaled
    if SCORE_MASK == 1:
        qk = tl.where(in_range[None, :], qk, float("-inf"))
    elif SCORE_MASK == 2:
        qk = tl.where(tokens[None, :] <= q_pos[:, None], qk, float("-inf"))
    if WINDOWED:
        qk = tl.where(tokens[None, :] > q_pos[:, None] - window, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # qk_scale > 0: max commutes with the scale
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk * qk_scale - m_new[:, None])  # one FMA per score
    l_i = l_i * alpha + tl.sum(p, 1)
    v_rows = blocks * stride_vb + offsets * stride_vt + kv_head * stride_vh
    v = _load(v_cache_ptr + v_rows[:, None] + dims[None, :], in_range[:, None], masked)
    v = v.to(q.dtype)  # e4m3: its scale multiplies the output
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _merge_if_last(
    counters_ptr, part_out_ptr, part_lse_ptr, out_ptr, seq, kv_head, num_heads, stride_os, stride_oh,
    active, QUERIES_PER_KV: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """Fused merge: the last of a (sequence, KV head)'s `active` programs to arrive merges its QUERIES_PER_KV heads
    (the programs past `active` had no tokens and have returned).

    Memory ordering (the PTX model; CUTLASS's semaphores do the same): every thread stored partials, but one thread
    does the atomic, so a CTA barrier first puts all the CTA's stores before that thread's release. The last
    program's acquire, then a CTA barrier, put all its threads' loads after every other program's release. The
    loads are .cg (at L2, past this SM's L1) so that correctness does not also rest on the acquire dropping L1
    lines that other warps might hold; it costs nothing, as only L2 holds lines that other SMs wrote.
    The last program sets the counter back to 0 (no other program of this launch touches it again), so the next
    launch, or CUDA graph replay, finds it zeroed.
    """
    tl.debug_barrier()
    counter = counters_ptr + seq * tl.num_programs(1) + kv_head
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == active - 1:
        tl.debug_barrier()
        rows = tl.arange(0, HEADS_PAD)
        dims = tl.arange(0, HEAD_DIM)
        row_mask = rows < QUERIES_PER_KV
        heads = kv_head * QUERIES_PER_KV + rows
        part = (seq.to(tl.int64) * num_heads + heads) * NUM_SPLITS  # each head's first split
        # One pass, unrolled over the splits, with a running max (online softmax over the partials) and elementwise
        # math only: no reduction across threads, so no barrier stands between the loads, and every split's lse and
        # partial are loaded once and can be in flight at once (a reduction over a [splits, HEAD_DIM] tile crosses
        # warps: barriers, and a head at a time, cost 3 us more at 8k tokens on an H200).
        m = tl.full([HEADS_PAD], float("-inf"), tl.float32)
        acc = tl.zeros([HEADS_PAD, HEAD_DIM], tl.float32)
        total = tl.zeros([HEADS_PAD], tl.float32)
        for s in tl.static_range(NUM_SPLITS):
            used = row_mask & (tl.full([HEADS_PAD], s, tl.int32) < active)  # masked-off loads: no memory traffic
            lse = tl.load(part_lse_ptr + part + s, mask=used, other=float("-inf"), cache_modifier=".cg")
            partial = tl.load(part_out_ptr + (part + s)[:, None] * HEAD_DIM + dims[None, :], mask=used[:, None],
                              other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m, lse)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no split with tokens yet (seq_len 0: zeros)
            alpha = tl.exp2(m - m_safe)  # the running sums' rescale; 0 while they are empty
            weight = tl.exp2(lse - m_safe)  # empty splits (lse -inf, output 0) weigh 0
            acc = acc * alpha[:, None] + weight[:, None] * partial
            total = total * alpha + weight
            m = m_new
        out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
        tl.store(out_ptr + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
        tl.store(counter, 0)


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    counters_ptr, qk_scale, num_heads, k_scale_ptr, v_scale_ptr,
    stride_qs, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bts, stride_os, stride_oh,
    QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, HEADS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    MIN_SPLIT_TILES: tl.constexpr, FUSED_MERGE: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    window=0, WINDOWED: tl.constexpr = False, KV_FP8: tl.constexpr = False, F16_DOTS: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    wait_for_prior(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    if KV_FP8:  # e4m3 K/V: k_scale folds into the score scale, v_scale multiplies the output (per KV head)
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Split this sequence's own length (no host sync on seq_lens) into BLOCK_N-aligned partitions whose tile counts
    # differ by at most one: with any NUM_SPLITS (33, say) every split has work once there are enough tiles.
    # NUM_SPLITS is sized for the block table's width, in a CUDA graph the longest context: a shorter sequence uses
    # `active` splits of at least MIN_SPLIT_TILES tiles, as if its table were only as wide as it is long; the
    # other programs return at once (fused merge) or report an empty split (for the merge kernel).
    # A sliding window: only the tiles from the one holding the window's first key are split and read.
    kv_lo = 0
    if WINDOWED:
        kv_lo = tl.maximum(seq_len - window, 0)
    first_tile = kv_lo // BLOCK_N
    num_tiles = tl.cdiv(seq_len, BLOCK_N) - first_tile
    active = tl.maximum(tl.minimum(tl.cdiv(num_tiles, MIN_SPLIT_TILES), NUM_SPLITS), 1)
    # With the fused merge, the programs past `active` have nothing to do (the merge reads only active splits);
    # the merge kernel instead reads every split, so there every program writes its (maybe empty) partial.
    if FUSED_MERGE:
        has_work = split < active
    else:
        has_work = split < NUM_SPLITS
    if has_work:
        start = (first_tile + split * num_tiles // active) * BLOCK_N
        end = tl.minimum((first_tile + (split + 1) * num_tiles // active) * BLOCK_N, seq_len)

        rows = tl.arange(0, BLOCK_H)
        heads = kv_head * QUERIES_PER_KV + rows
        row_mask = rows < QUERIES_PER_KV
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + dims[None, :],
                    mask=row_mask[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        elif F16_DOTS:
            # e4m3 K/V: both dots in float16, so each e4m3 value takes one conversion (to bfloat16 it takes three,
            # through float16 and float32) and the probabilities keep 3 more bits; e4m3 is exact in float16, and q
            # is held to float16's range (past it, the softmax is one-hot either way)
            q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
        block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bts
        q_pos = tl.zeros([BLOCK_H], tl.int32) + (seq_len - 1)  # every row is the sequence's last token
        for n0 in range(start, end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table_ptr, n0, end, q_pos, kv_head,
                stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, qk_scale,
                HEAD_DIM, BLOCK_SIZE, BLOCK_N, 1, UPCAST, DOT_PRECISION, window, WINDOWED)

        if KV_FP8:
            acc = acc * tl.load(v_scale_ptr + kv_head)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # l_i == 0: an empty split or seq_len 0 -> zeros
        out_ptrs = out_ptr + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + dims[None, :]
        if NUM_SPLITS == 1:
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
        else:
            # One active split (a short sequence) with the fused merge: its result is the output, no partials.
            direct = False
            if FUSED_MERGE:
                direct = active == 1
            if direct:
                tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
            else:
                # part_out [num_seqs, num_heads, NUM_SPLITS, HEAD_DIM] float32, part_lse [num_seqs, num_heads,
                # NUM_SPLITS]
                part = (seq.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split
                tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], out, mask=row_mask[:, None])
                lse = m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i))  # log2 domain; -inf (m_i) if the split is empty
                tl.store(part_lse_ptr + part, lse, mask=row_mask)
                if FUSED_MERGE:
                    _merge_if_last(counters_ptr, part_out_ptr, part_lse_ptr, out_ptr, seq, kv_head, num_heads,
                                   stride_os, stride_oh, active, QUERIES_PER_KV, HEADS_PAD, HEAD_DIM, NUM_SPLITS)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_heads, stride_os, stride_oh,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_prior(PDL)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM)
    part = (seq * num_heads + head) * NUM_SPLITS + splits
    lse = tl.load(part_lse_ptr + part, mask=splits < NUM_SPLITS, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    weights = tl.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))  # empty splits weigh 0
    total = tl.sum(weights, 0)
    # Empty splits (a short sequence in a batch sized for long ones) are not read at all.
    parts = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=(weights > 0.0)[:, None],
                    other=0.0)
    out = tl.sum(parts * weights[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


# num_seqs and num_q_blocks change with every step's batch: specializing on them (Triton specializes integers
# that are multiples of 16) would compile new variants while requests wait, seconds each.
@triton.jit
def find_query_block(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """The packed prefill's query block `q_block`: (its sequence, the sequence's first query, its query count, the
    block's index within the sequence). Sequence s owns query blocks [qsl[s] // BLOCK_Q + s, qsl[s+1] // BLOCK_Q + s
    + 1): a binary search over query_start_loc finds it."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    return seq, q_start, q_len, q_block - (q_start // BLOCK_Q + seq)


@triton.jit(do_not_specialize=["num_seqs", "num_q_blocks"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    qk_scale, num_seqs, num_q_blocks, num_kv_heads, k_scale_ptr, v_scale_ptr,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bts, stride_ot, stride_oh,
    QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, window=0, WINDOWED: tl.constexpr = False,
    KV_FP8: tl.constexpr = False, PDL: tl.constexpr = False,
):
    wait_for_prior(PDL)
    # One flat grid, heaviest query blocks first (the last of a sequence sees the most keys), every KV head of
    # a block side by side: longest-first scheduling keeps the causal grid's tail short.
    pid = tl.program_id(0)
    q_block = num_q_blocks - 1 - pid // num_kv_heads
    kv_head = pid % num_kv_heads
    seq, q_start, q_len, q_block_local = find_query_block(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q)
    if q_block_local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # keys already in the cache before this chunk

    rows = tl.arange(0, BLOCK_M)
    q_local = q_block_local * BLOCK_Q + rows // QUERIES_PER_KV
    heads = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_mask = (rows // QUERIES_PER_KV < BLOCK_Q) & (q_local < q_len)
    q_pos = context_len + q_local
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
    dims = tl.arange(0, HEAD_DIM)
    q_offs = (q_start + q_local).to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_mask[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    if WINDOWED:  # finite: a row's first tiles may all be outside its window (see _attend_tile)
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bts

    first_pos = context_len + q_block_local * BLOCK_Q
    kv_end = tl.minimum(first_pos + BLOCK_Q, seq_len)  # keys past the block's last query are never loaded
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N  # tiles every row of the block sees entirely: no mask
    # A sliding window (row r sees keys q_pos[r] - window + 1 .. q_pos[r]): the tiles before the block's first
    # window are skipped and every tile is masked (a separate unmasked loop for the tiles all rows see whole was
    # tried: the third copy of the tile code made the 256-row bf16 tile spill 160 bytes a thread on sm_90).
    window_start = 0
    if WINDOWED:
        window_start = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
    for n0 in range(window_start, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table_ptr, n0, kv_end, q_pos, kv_head,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, qk_scale,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, 0, UPCAST, DOT_PRECISION, window, WINDOWED)
    for n0 in range(full_end, kv_end, BLOCK_N):  # the diagonal: causal mask
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table_ptr, n0, kv_end, q_pos, kv_head,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, qk_scale,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, 2, UPCAST, DOT_PRECISION, window, WINDOWED)

    if KV_FP8:  # e4m3 V: its per-head scale multiplies the output
        acc = acc * tl.load(v_scale_ptr + kv_head)
    if WINDOWED:  # rows past the sequence's queries may see no key in their window (never stored)
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]  # every valid row saw at least one key (itself)
    o_offs = (q_start + q_local).to(tl.int64)[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def _check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens, num_seqs, k_scale=None, v_scale=None) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, num_heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache and v_cache must be [num_blocks, block_size, num_kv_heads, head_dim] of one shape, "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"cache head_dim {k_cache.shape[3]} != q head_dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    check_dtype("q", q, FLOAT_DTYPES)
    if k_cache.dtype not in (q.dtype, FP8_DTYPE) or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"cache dtypes {k_cache.dtype}/{v_cache.dtype} must equal q dtype {q.dtype} or be "
                         "float8_e4m3fn")
    check_kv_scales(k_cache, k_scale, v_scale)
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [num_seqs={num_seqs}, max_blocks], got {tuple(block_tables.shape)}")
    if seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens must be [num_seqs={num_seqs}], got {tuple(seq_lens.shape)}")
    check_dtype("block_tables", block_tables, (torch.int32,))
    check_dtype("seq_lens", seq_lens, (torch.int32,))


def _check_window(sliding_window) -> None:
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")


def _check_triton_layout(q, k_cache, v_cache, block_tables) -> None:
    head_dim = q.shape[2]
    if not (is_power_of_2(head_dim) and head_dim >= 16):
        raise ValueError(f"the Triton kernels take head_dim a power of two >= 16, got {head_dim}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables)):
        check_last_dim_contiguous(name, t)


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """How many partitions each sequence's context is split into, decided on the host without a sync.

    Enough (sequence, kv head, split) programs for about two per SM, but no split shorter than MIN_SPLIT_TOKENS
    of the longest possible context (`max_context`, from the block table's width). A power of two, so few
    variants compile. Measured on an H200 (`python -m benchmarks.kernels --tune --only decode --cuda-graph`,
    Llama-3-8B heads, batch 1): 32 splits beat 16 and 64 at 8k, 16k and 32k tokens (13.3-14.1 us against
    16.1 us at 8k, K/V in L2); more programs than that only add merge work. Again with cold K/V, against 48 split
    and tile variants (benchmarks/results/h200-decode-breakdown.md).
    """
    programs = num_seqs * num_kv_heads
    wanted = cdiv(PROGRAMS_PER_SM * num_sms(device), max(programs, 1))
    splits = min(wanted, cdiv(max_context, MIN_SPLIT_TOKENS), MAX_SPLITS)
    return 1 << (max(splits, 1).bit_length() - 1)  # rounded down to a power of two


# float32 tensors take IEEE float32 dots (FMA loops, no tensor cores): smaller tiles, or registers spill.


def decode_config(head_dim: int, dtype: torch.dtype, num_programs: int, device: torch.device,
                  kv_fp8: bool = False, windowed: bool = False) -> dict:
    """Tile sizes and launch options of the decode kernel (BLOCK_N keys per tile).

    With at most PROGRAMS_PER_SM programs per SM (few sequences, split contexts) each program must keep more of
    its SM's loads in flight: 5 stages double-buffer the K and V tiles (3 stages give one tile in flight; the
    block-table loads take a stage). With many programs, the SMs' other programs do that, and 3 stages are faster
    (H200, batch 64 at 8k: 492 us against 607 us with 5 stages; batch 1 at 32k: 39.7 us against 47.1 us).
    fused_merge: split contexts are merged inside the decode kernel (`_merge_if_last`), not by a second kernel.
    H200 (`--tune --only decode --cuda-graph`): batch 1 at 8k 12.8 us against 13.5, at 32k 38.6 against 39.4;
    batch 8 at 8k 68.2 against 69.6.
    An e4m3 cache (kv_fp8) takes float16 dots (f16_dots, see _decode_kernel) and, past PROGRAMS_PER_SM programs an
    SM, 128-key tiles. H200, Llama-3-8B heads, 2k tokens, the kernel alone (`h200-fp8-kv-decode-tiles.json`):
    float16 dots took batch 256 / 64 from 498 / 151 us (bfloat16 dots) to 441 / 144 us with 64-key tiles and to
    387 / 103 us with 128 (the bf16 pool: 495 / 126 us); in the engine (8B FP8 decode at 2k) 128-key tiles took
    batch 256 from 20.25 to 18.97 ms/token and batch 64 from 9.32 to 7.96. With few programs (batch 8 at 8k)
    64-key tiles and 5 stages are as fast (65.0 us against 65.6). With a sliding window over an e4m3 cache, 32-key
    tiles instead: at 64 keys and 3 stages the e4m3 -> bf16 conversions and the window's bounds spilled a register
    on sm_90 (ptxas keeps 128 registers for 4 programs an SM); 32 keys fit in 127 without a spill
    (tests/kernels/compile_sm90.py).
    """
    if dtype == torch.float32:
        return dict(block_n=32, num_warps=8, num_stages=2, fused_merge=True, f16_dots=False)  # IEEE fp32 dots
    block_n = 64 if head_dim <= 128 else 32
    few = num_programs <= PROGRAMS_PER_SM * num_sms(device)
    if kv_fp8 and not few:
        block_n = 32 if windowed else 128 if head_dim <= 128 else block_n
    deep = few and shared_memory_per_sm(device) >= 160 * 1024  # 5 stages of 64 x 128 K and V tiles: 72 KiB
    return dict(block_n=block_n, num_warps=4, num_stages=5 if deep else 3, fused_merge=True, f16_dots=kv_fp8)


def prefill_config(max_query_len: int, queries_per_kv: int, head_dim: int, dtype: torch.dtype,
                   smem_bytes: int = 228 * 1024, windowed: bool = False) -> dict:
    """Tile sizes and launch options of the prefill kernel: BLOCK_M rows = BLOCK_Q queries x the GQA group.

    Measured on an H200 (`python -m benchmarks.kernels --tune`, Llama-3-8B heads, 8k tokens): 256 x 64 tiles with
    16 warps and 3 stages (160 KiB of shared memory) reach 54% of bf16 peak, against 47% for 128 x 64 with 8 warps
    and 5 stages (46% and 38% at 2k tokens). Under 1k queries per sequence, 256-row tiles leave SMs idle (512
    tokens: 25 us against 17.5 us with 128 rows), so they are kept for long chunks. The K/V loads depend on
    block-table loads, so the pipeliner spends stages on that chain. With less shared memory, smaller tiles and
    fewer stages. A sliding window masks every tile: its masks spill 152 bytes a thread of the 256-row tile on
    sm_90, so windowed prefill keeps 128 rows.
    """
    big_smem = smem_bytes >= 200 * 1024
    if dtype == torch.float32:
        largest = 32
    elif head_dim <= 128 and big_smem and max_query_len >= 1024 and not windowed:
        largest = 256
    else:
        largest = 128 if head_dim <= 128 and smem_bytes >= 140 * 1024 else 64
    block_m = min(next_power_of_2(max(max_query_len * queries_per_kv, 16)), largest)
    block_m = max(block_m, next_power_of_2(queries_per_kv))
    if dtype == torch.float32:
        return dict(block_m=block_m, block_n=16, num_warps=8, num_stages=2)
    if block_m >= 256:
        return dict(block_m=block_m, block_n=64, num_warps=16, num_stages=3)
    deep = block_m >= 64 and head_dim <= 128 and big_smem
    return dict(block_m=block_m, block_n=64 if head_dim <= 128 else 32,
                num_warps=8 if block_m >= 128 or head_dim > 128 else 4,
                num_stages=5 if deep else 3 if block_m >= 64 else 2)


# The fused merge's arrival counters, per device: zeroed int32, one per (sequence, KV head), left zeroed by every
# launch. One set serves every launch on a device, so decode launches on one device must not run concurrently (the
# engine runs one stream per device). Replaced ones stay referenced: CUDA graphs captured with them still use them.
_MERGE_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED_MERGE_COUNTERS: list[torch.Tensor] = []
MIN_MERGE_COUNTERS = 4096  # 16 KiB: batch 512 x 8 KV heads without growing


def _merge_counters(device: torch.device, num_slots: int) -> torch.Tensor:
    """The device's counters, grown (never during CUDA graph capture: its allocations belong to the graph) to hold
    num_slots."""
    counters = _MERGE_COUNTERS.get(device)
    if counters is not None and counters.numel() >= num_slots:
        return counters
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"the fused decode merge needs {num_slots} arrival counters, more than exist, during CUDA graph capture: "
            "run the same launch once before capturing (the engine's warm-up does), or pass fused_merge=False"
        )
    if counters is not None:
        _RETIRED_MERGE_COUNTERS.append(counters)
    counters = torch.zeros(max(next_power_of_2(num_slots), MIN_MERGE_COUNTERS), dtype=torch.int32, device=device)
    _MERGE_COUNTERS[device] = counters
    return counters


def paged_attention_decode_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits=None, config=None,
                                  fused_merge=None, sliding_window=None, k_scale=None, v_scale=None):
    """Triton launcher of `paged_attention_decode`.

    num_splits=None picks it with `decode_num_splits`; any count >= 1 works (the tuner tries others). config overrides
    keys of `decode_config` (tuning); fused_merge, when not None, overrides its "fused_merge": True merges the splits
    inside the decode kernel (`_merge_if_last`; one such launch at a time per device), False in a second kernel.
    """
    num_seqs, num_heads, head_dim = q.shape
    _check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens, num_seqs, k_scale, v_scale)
    check_launchable(q, k_cache, v_cache, block_tables, seq_lens)
    _check_triton_layout(q, k_cache, v_cache, block_tables)
    _check_window(sliding_window)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    block_size, num_kv_heads = k_cache.shape[1:3]
    if num_seqs == 0:
        return out
    # Chosen here, splits also shrink in the kernel for sequences shorter than the table (MIN_SPLIT_TOKENS each);
    # a count given by the caller (tuning) is kept down to one tile per split.
    min_split_tokens = MIN_SPLIT_TOKENS if num_splits is None else 1
    if num_splits is None:
        max_context = block_tables.shape[1] * block_size
        num_splits = decode_num_splits(num_seqs, num_kv_heads, min(max_context, sliding_window or max_context),
                                       q.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    cfg = decode_config(head_dim, q.dtype, num_seqs * num_kv_heads * num_splits, q.device,
                        kv_fp8=k_cache.dtype == FP8_DTYPE, windowed=sliding_window is not None) | (config or {})
    fused = num_splits > 1 and bool(cfg["fused_merge"] if fused_merge is None else fused_merge)
    queries_per_kv = num_heads // num_kv_heads
    part_out = part_lse = counters = out  # placeholders, unused with one split
    if num_splits > 1:
        part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    if fused:
        counters = _merge_counters(q.device, num_seqs * num_kv_heads)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse, counters,
        scale * LOG2E, num_heads, k_scale if k_scale is not None else q, v_scale if v_scale is not None else q,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1),
        QUERIES_PER_KV=queries_per_kv, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_H=max(16, next_power_of_2(queries_per_kv)), HEADS_PAD=next_power_of_2(queries_per_kv),
        BLOCK_N=cfg["block_n"], NUM_SPLITS=num_splits, MIN_SPLIT_TILES=cdiv(min_split_tokens, cfg["block_n"]),
        FUSED_MERGE=fused,
        UPCAST=upcast_dot_operands(q.dtype, q.device), DOT_PRECISION=dot_precision(q.dtype),
        window=sliding_window or 0, WINDOWED=sliding_window is not None, KV_FP8=k_cache.dtype == FP8_DTYPE,
        F16_DOTS=k_cache.dtype == FP8_DTYPE and bool(cfg["f16_dots"]),  # a config override: e4m3 caches only
        **pdl_options(q.device), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if num_splits > 1 and not fused:
        _decode_merge_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, num_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits, SPLITS_PAD=max(2, next_power_of_2(num_splits)),
            **pdl_options(q.device), num_warps=4 if head_dim * num_splits <= 4096 else 8,
        )
    return out


def paged_attention_prefill_triton(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                   max_query_len=None, config=None, sliding_window=None, k_scale=None, v_scale=None):
    """Triton launcher of `paged_attention_prefill`.

    max_query_len (optional, no host sync needed) only sizes the query tiles: absent or wrong, results are the
    same. config overrides keys of `prefill_config` (tuning).
    """
    num_tokens, num_heads, head_dim = q.shape
    if seq_lens.dim() != 1:
        raise ValueError(f"seq_lens must be [num_seqs], got shape {tuple(seq_lens.shape)}")
    num_seqs = seq_lens.shape[0]
    _check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens, num_seqs, k_scale, v_scale)
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must be [num_seqs + 1 = {num_seqs + 1}], got {tuple(query_start_loc.shape)}")
    check_dtype("query_start_loc", query_start_loc, (torch.int32,))
    check_launchable(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    _check_triton_layout(q, k_cache, v_cache, block_tables)
    _check_window(sliding_window)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_size, num_kv_heads = k_cache.shape[1:3]
    queries_per_kv = num_heads // num_kv_heads
    cfg = prefill_config(max_query_len or num_tokens, queries_per_kv, head_dim, q.dtype,
                         shared_memory_per_sm(q.device), windowed=sliding_window is not None) | (config or {})
    block_q = cfg["block_m"] // queries_per_kv
    if block_q < 1:
        raise ValueError(f"block_m {cfg['block_m']} must hold the {queries_per_kv} query heads of a KV head")
    num_q_blocks = num_tokens // block_q + num_seqs  # an upper bound; the spare programs return at once
    _prefill_kernel[(num_q_blocks * num_kv_heads,)](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        scale * LOG2E, num_seqs, num_q_blocks, num_kv_heads, k_scale if k_scale is not None else q,
        v_scale if v_scale is not None else q, q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1),
        QUERIES_PER_KV=queries_per_kv, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=cfg["block_m"], BLOCK_Q=block_q, BLOCK_N=cfg["block_n"],
        UPCAST=upcast_dot_operands(q.dtype, q.device), DOT_PRECISION=dot_precision(q.dtype),
        window=sliding_window or 0, WINDOWED=sliding_window is not None, KV_FP8=k_cache.dtype == FP8_DTYPE,
        **pdl_options(q.device), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, scale=None) -> torch.Tensor:
    """One sequence's first seq_len tokens of a paged cache, contiguous: [seq_len, num_kv_heads, head_dim]; a
    float8 cache's dequantized (float32, times its per-head `scale`)."""
    block_size = cache.shape[1]
    blocks = block_table[: cdiv(seq_len, block_size)].long()
    tokens = cache[blocks].flatten(0, 1)[:seq_len]
    return tokens if scale is None else dequantize(tokens, scale[None, :, None])


def _attend_ref(q, k, v, q_pos, scale, sliding_window=None) -> torch.Tensor:
    """q [Lq, H, D] at positions q_pos [Lq]; k, v [Lk, Hkv, D]; causal by position (within the last sliding_window
    positions when given); float32 softmax."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    qf = q.float().unflatten(1, (num_kv_heads, group))  # [Lq, Hkv, G, D]
    scores = torch.einsum("qhgd,khd->hgqk", qf, k.float()) * scale
    key_pos = torch.arange(k.shape[0], device=q.device)[None, :]
    visible = key_pos <= q_pos[:, None]  # [Lq, Lk]
    if sliding_window is not None:
        visible &= key_pos > q_pos[:, None] - sliding_window
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    out = torch.einsum("hgqk,khd->qhgd", probs, v.float())
    return out.flatten(1, 2).to(q.dtype)


def paged_attention_decode_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window=None, k_scale=None,
                               v_scale=None):
    """Torch reference of `paged_attention_decode` (and its CPU implementation); seq_len 0 gives zeros."""
    _check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens, q.shape[0], k_scale, v_scale)
    _check_window(sliding_window)
    out = torch.zeros_like(q)
    for s, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        k = _gather_kv(k_cache, block_tables[s], seq_len, k_scale)
        v = _gather_kv(v_cache, block_tables[s], seq_len, v_scale)
        q_pos = torch.tensor([seq_len - 1], device=q.device)
        out[s] = _attend_ref(q[s : s + 1], k, v, q_pos, scale, sliding_window)[0]
    return out


def paged_attention_prefill_ref(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                max_query_len=None, sliding_window=None, k_scale=None, v_scale=None):
    """Torch reference of `paged_attention_prefill` (and its CPU implementation)."""
    num_seqs = seq_lens.shape[0]
    _check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens, num_seqs, k_scale, v_scale)
    _check_window(sliding_window)
    starts = query_start_loc.tolist()
    if len(starts) != num_seqs + 1 or starts[0] != 0 or starts[-1] != q.shape[0]:
        raise ValueError(f"query_start_loc must run from 0 to T={q.shape[0]} over {num_seqs} sequences: {starts}")
    out = torch.empty_like(q)
    for s, seq_len in enumerate(seq_lens.tolist()):
        q_len = starts[s + 1] - starts[s]
        if q_len == 0:
            continue
        assert 0 < q_len <= seq_len, f"sequence {s}: query length {q_len} exceeds its KV length {seq_len}"
        k = _gather_kv(k_cache, block_tables[s], seq_len, k_scale)
        v = _gather_kv(v_cache, block_tables[s], seq_len, v_scale)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        out[starts[s] : starts[s + 1]] = _attend_ref(q[starts[s] : starts[s + 1]], k, v, q_pos, scale, sliding_window)
    return out


def paged_attention_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window=None, k_scale=None,
                           v_scale=None):
    """Attention of one new query per sequence over its paged context.

    q [num_seqs, num_heads, head_dim]; k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim];
    block_tables int32 [num_seqs, max_blocks]; seq_lens int32 [num_seqs], tokens in the cache including the
    current one (already written). Returns [num_seqs, num_heads, head_dim] in q's dtype; a seq_len of 0 (a
    padding row) gives zeros. sliding_window W: the query sees only the last W keys (itself included), as
    transformers' sliding-window mask; the kernel reads no tile before them. A float8_e4m3fn cache takes its
    float32 [num_kv_heads] k_scale, v_scale.
    """
    if use_triton(q):
        return paged_attention_decode_triton(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                             sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale)
    return paged_attention_decode_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, k_scale,
                                      v_scale)


def paged_attention_prefill(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                            max_query_len=None, sliding_window=None, k_scale=None, v_scale=None):
    """Causal attention of packed variable-length query chunks over their paged KV.

    q [T, num_heads, head_dim] holds sequence b's queries at rows query_start_loc[b] : query_start_loc[b+1]
    (int32 [B+1], from 0 to T). seq_lens int32 [B] is each sequence's KV length including this chunk, whose
    K/V are already in the cache; query i of sequence b sits at position seq_lens[b] - q_len_b + i and sees
    keys 0..that position (with sliding_window W, only the last W of them). Chunked prefill, prefix-cache hits and
    decode rows (q_len 1) mix in one batch.
    """
    if use_triton(q):
        return paged_attention_prefill_triton(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                              max_query_len, sliding_window=sliding_window, k_scale=k_scale,
                                              v_scale=v_scale)
    return paged_attention_prefill_ref(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                       sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale)
