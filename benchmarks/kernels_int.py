"""`python -m benchmarks.kernels --only int4`: the int4 linear's paths (kernels/linear_int.py) against bf16 cuBLAS,
on Llama-3-8B's and 70B's linears (qkv, o, gate_up + silu, down), at 1-2048 rows.

    bf16 cuBLAS      torch.matmul (F.linear) on the bf16 weight, then silu_and_mul for gate_up: the baseline
    stream           up to STREAM_MAX_ROWS rows, layouts without act-order: the streaming decode kernel
                     (kernels/int_decode.py; past MAX_ROWS in row tiles), what `linear_int` runs for these rows
    decode tiles     the Triton kernel with `decode_config` (one row tile; up to DECODE_TILES_UP_TO rows); and
                     up to MAX_ROWS "decode tiles, once": the same loading each packed word once (UNPACK_ONCE)
    gemm tiles       the Triton kernel with `gemm_config` (row tiles of 32-128 in grouped order), W dequantized in
                     float32 and rounded to x's dtype; past MAX_ROWS, where `pair_tiles` allows (4-bit AWQ order,
                     a K tile in one group), "gemm tiles, pairs": its PAIRS path with `pair_gemm_config` (and,
                     not gated, "gemm tiles, pairs, 2 stages": the same tiles, two programs an SM)
    dequant+cuBLAS   `linear_int_dequantized`: W dequantized by one kernel into a bf16 scratch, then cuBLAS

Each row gives the time of one layer's call, GB/s of the weight bytes that path reads (the packed int32s, scales
and zero points; bf16 cuBLAS its bf16 weight) against the 4.3 TB/s copy ceiling, and TFLOP/s (2 x rows x N x K)
against 790 dense bf16. A timed call runs COLD_CHAIN_BYTES of packed weights' copies of the layer (each read from
memory, as in a model: the L2 holds 50 MB), so a decode-sized call is not a launch's latency alone; --cuda-graph
also takes the host's launch cost out, as the engine's decode graphs do. The summary prints, for each layer, from
how many rows dequant+cuBLAS beats the GEMM tiles: kernels/linear_int.py's DEQUANTIZE_MIN_ROWS should be there
(1: it beat the tiles at every size in the first run, h200-kernels-int4-first.txt).
Meant to take about 2 minutes on an H200, compiles included (not yet run there); `--int-layouts awq gptq-act`
doubles it. `gptq-g32` and `gguf-q4_k` (groups of 32: GPTQ's, and a Q4_K file's as served, float32 scales and mins)
time the stream kernel over several groups a K tile against dequant+cuBLAS, what such layers ran before.
"""

from __future__ import annotations

import functools

import torch

from kernels._triton import dot_precision, upcast_dot_operands
from kernels.int_decode import can_stream, linear_int_stream, stream_config
from kernels.linear import MAX_ROWS, linear_cublas
from kernels.linear_int import (
    AWQ_GEMM,
    STREAM_MAX_ROWS,
    _check_packed_launchable,
    along_n,
    decode_config,
    dequantize_ref,
    dequantize_triton,
    gemm_config,
    gptq_v1,
    layer_pair_config,
    linear_int_dequantized,
    linear_int_ref,
    linear_int_triton,
    offset_binary,
)

INT_ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 2048]
DECODE_TILES_UP_TO = 64  # rows: one row tile of next_power_of_2(rows) beyond this would not fit shared memory
COLD_CHAIN_BYTES = 64 * 2**20  # packed weight bytes per timed call (at most 8 copies of a layer)
GROUP_SIZE = 128
INT_MODELS = {"8b": dict(hidden=4096, num_heads=32, num_kv_heads=8, head_dim=128, inter=14336),
              "70b": dict(hidden=8192, num_heads=64, num_kv_heads=8, head_dim=128, inter=28672)}
SMOKE_INT_MODELS = {"toy": dict(hidden=128, num_heads=8, num_kv_heads=2, head_dim=16, inter=128)}  # K: 128s
# layout -> (packing, zero points drawn at random (AWQ) or mid-range (GPTQ sym), act-order g_idx, group size,
# GGUF's float32 scales and mins in place of zero points (Q4_K as an int layer holds it: checkpoints/gguf_types.py));
# groups of 32 along K stream with a word row's scales a row of the K tile (kernels/int_decode.py ROW_SCALES).
# "gptq" and "gptq-g32" are timed as a served layer holds them, repacked along N in AWQ's order at load
# (`ALONG_N_AT_LOAD`: workers/layers/quantization_int.py finish_int_weights); "-k": as the checkpoint packs them
INT_LAYOUTS = {"awq": (AWQ_GEMM, True, False, GROUP_SIZE, False), "gptq": (gptq_v1(4), False, False, GROUP_SIZE, False),
               "gptq-act": (gptq_v1(4), False, True, GROUP_SIZE, False),
               "gptq-g32": (gptq_v1(4), False, False, 32, False),
               "gguf-q4_k": (offset_binary(4), False, False, 32, True)}
ALONG_N_AT_LOAD = {"gptq", "gptq-g32"}
INT_LAYOUTS |= {f"{name}-k": INT_LAYOUTS[name] for name in sorted(ALONG_N_AT_LOAD)}


def packed_layer(out_features: int, in_features: int, layout: str, device) -> dict:
    """A random int4 layer drawn packed (no float weight): linear_int's keyword arguments."""
    packing, random_zeros, act_order, group_size, has_mins = INT_LAYOUTS[layout]
    p, groups = packing.pack_factor, in_features // group_size

    def words(*shape):
        return torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32, device=device)

    qweight = words(in_features // p, out_features) if packing.is_packed_along_k else words(in_features,
                                                                                          out_features // p)
    if random_zeros:
        qzeros = words(groups, out_features // p)
    else:  # every field 8 (GPTQ stores 7: its v1 off-by-one)
        stored = 8 - packing.zero_offset
        word = sum(stored << (4 * i) for i in range(8))
        qzeros = torch.full((groups, out_features // p), word - (1 << 32) if word >= 1 << 31 else word,
                            dtype=torch.int32, device=device)
    # scales giving W a standard deviation near in_features ** -0.5 (uniform integers: 4.6 steps)
    scales = (torch.rand(groups, out_features, device=device) + 0.5) * (in_features ** -0.5 / 4.6)
    g_idx = (torch.randperm(in_features, device=device) // group_size).int() if act_order else None
    if has_mins:  # w = q * scale + min, centred as a zero point of 8 would centre it
        return dict(qweight=qweight, qzeros=None, scales=scales, g_idx=None, group_size=group_size, packing=packing,
                    mins=-8 * scales)
    if layout in ALONG_N_AT_LOAD:
        qweight, qzeros, packing = along_n(qweight, qzeros, packing)
    return dict(qweight=qweight, qzeros=qzeros, scales=scales.half(), g_idx=g_idx, group_size=group_size,
                packing=packing)


def packed_bytes(layer: dict) -> int:
    return sum(t.numel() * t.element_size() for t in (layer["qweight"], layer["qzeros"], layer["scales"],
                                                     layer["g_idx"], layer.get("mins")) if t is not None)


def linears(model: dict) -> dict:
    from benchmarks.kernels import llama_linears

    return llama_linears(model)


def _impls(rows: int, copies: list[dict], bf16: list[torch.Tensor], x: torch.Tensor, gated: bool,
           use_triton: bool) -> dict:
    """name -> fn(copy index) -> output, for the paths this many rows can take."""
    impls = {"bf16 cuBLAS": lambda i: linear_cublas(x, bf16[i], gated=gated)}
    if not use_triton:  # CPU smoke: the torch reference stands in for the kernels
        impls["torch ref"] = lambda i: linear_int_ref(x, **copies[i], gated=gated)
        return impls
    n = bf16[0].shape[0] // (2 if gated else 1)
    if rows <= DECODE_TILES_UP_TO:
        impls["decode tiles"] = lambda i: linear_int_triton(x, **copies[i], gated=gated, config=decode_config(rows))
    c = copies[0]
    if can_stream(c["packing"], c["g_idx"], c["group_size"], x.shape[1], n, rows, STREAM_MAX_ROWS):
        impls["stream"] = lambda i: linear_int_triton(x, **copies[i], gated=gated)  # no config: it streams
    if rows <= MAX_ROWS:  # the decode tiles loading each packed word once, as the GEMM tiles do
        once = decode_config(rows) | {"UNPACK_ONCE": True}
        impls["decode tiles, once"] = lambda i: linear_int_triton(x, **copies[i], gated=gated, config=once)
    gemm = gemm_config(rows, n, gated, x.dtype, x.device) | {"PAIRS": False}  # the float path, as first measured
    impls["gemm tiles"] = lambda i: linear_int_triton(x, **copies[i], gated=gated, config=gemm)
    pairs = layer_pair_config(rows, n, gated, c["group_size"] or x.shape[1], c["packing"], c["g_idx"], x.dtype,
                              c.get("mins"), x.device)
    if rows > MAX_ROWS and pairs is not None:
        impls["gemm tiles, pairs"] = lambda i: linear_int_triton(x, **copies[i], gated=gated, config=pairs)
        if not gated:  # 2 stages: two programs an SM (sm_90, 128 x 64 x 128: 226 registers, 86 KB; no spills)
            two = pairs | {"num_stages": 2}
            impls["gemm tiles, pairs, 2 stages"] = lambda i: linear_int_triton(x, **copies[i], config=two)
    impls["dequant+cuBLAS"] = lambda i: linear_int_dequantized(x, **copies[i], gated=gated)
    return impls


def int_layer_cases(runner, name: str, out_features: int, in_features: int, gated: bool, layout: str,
                    rows_list: list[int]):
    """One layer at each row count: its copies drawn once, each impl timed over all of them in a call."""
    from benchmarks.kernels import max_error

    device = runner.device
    copies = [packed_layer(out_features, in_features, layout, device)]
    while len(copies) < 8 and len(copies) * packed_bytes(copies[0]) < COLD_CHAIN_BYTES and device.type == "cuda":
        copies.append(packed_layer(out_features, in_features, layout, device))
    dequantize = dequantize_triton if runner.use_triton else dequantize_ref
    bf16 = [dequantize(**c, dtype=torch.bfloat16) for c in copies]
    int_bytes, bf16_bytes = packed_bytes(copies[0]) * len(copies), bf16[0].numel() * 2 * len(copies)
    for rows in rows_list:

        def build(rows=rows):
            x = torch.randn(rows, in_features, dtype=torch.bfloat16, device=device)
            impls = _impls(rows, copies, bf16, x, gated, runner.use_triton)
            timed = {impl: _chain(fn, len(copies)) for impl, fn in impls.items()}

            def check():
                """The largest error of the impls; one that fails to launch (an H100's Triton 3.6 found the decode
                or GEMM tiles of gated GGUF Q4_K / GPTQ g32 layers over its shared memory) is timed as that failure,
                recorded, and the others are still checked and timed. A wrong result fails the case."""
                ref = linear_int_ref(x, **copies[0], gated=gated).float()
                errors = []
                for impl, fn in impls.items():
                    try:
                        out = fn(0)
                    except Exception as exc:  # noqa: BLE001 - recorded by the runner when it times this impl
                        timed[impl] = functools.partial(_raise, exc)
                        continue
                    errors.append(max_error(out, ref, 2e-2 * ref.abs().max().item()))
                return max(errors)

            work = dict(bytes=int_bytes, flops=2 * rows * out_features * in_features * len(copies),
                        impl_bytes={"bf16 cuBLAS": bf16_bytes}, copies=len(copies))
            return timed, work, check

        runner.case(f"int4 {name}", f"rows {rows}", build)


def _raise(exc: Exception):
    raise exc


def _chain(fn, copies: int):
    def run():
        for i in range(copies):
            fn(i)
    return run


def bench_int4(runner, models: dict, layouts: list[str], rows_list: list[int] | None = None):
    for layout in layouts:
        for model_name, model in models.items():
            for op, (out_features, in_features, gated) in linears(model).items():
                name = f"{layout} {model_name} {op.split('+')[0]}"
                int_layer_cases(runner, name, out_features, in_features, gated, layout, rows_list or INT_ROWS)
    print_crossings(runner.results)


def print_crossings(results: list[dict]) -> None:
    """For each layer: the fewest rows from which dequant+cuBLAS is faster than the GEMM tiles at every larger
    count measured, and the best int4 path against bf16 cuBLAS at 1 and 2048 rows."""
    times: dict[str, dict[int, dict[str, float]]] = {}
    for r in results:
        if r["kernel"].startswith("int4 "):
            times.setdefault(r["kernel"], {}).setdefault(int(r["case"].split()[1]), {})[r["impl"]] = r["ms"]
    for kernel, by_rows in times.items():
        counts = sorted(m for m, t in by_rows.items() if "gemm tiles" in t and "dequant+cuBLAS" in t)
        if not counts:
            continue
        crossing = next((m for i, m in enumerate(counts)
                         if all(by_rows[n]["dequant+cuBLAS"] < by_rows[n]["gemm tiles"] for n in counts[i:])), None)
        speedups = []
        for m in (counts[0], counts[-1]):
            best = min((ms, impl) for impl, ms in by_rows[m].items() if impl != "bf16 cuBLAS")
            speedups.append(f"{m} rows: {best[1]} {by_rows[m]['bf16 cuBLAS'] / best[0]:.2f}x bf16 cuBLAS")
        where = f"from {crossing} rows" if crossing is not None else "never, up to the rows measured"
        print(f"{kernel}: dequant+cuBLAS beats the GEMM tiles {where}; " + "; ".join(speedups))


# The first sweep (h200-kernels-tune-int4-tiles.json) found the default tiles (256 x 128 along N, 4 warps) best or
# near it, and the split of K the lever: a layer with few column tiles ran 1.1-1.4x faster at twice the default's
# split. So: the default tiles, each split here, 2-4 stages, and 8 warps. An SM runs as many programs as registers and
# shared memory allow: 4 stages hold 211 registers a thread (two 4-warp programs), 2 stages 167 (three), in sm_90
# code compiled here (Triton 3.9).
STREAM_TUNE_SPLITS = [4, 8, 12, 16]
# BIASED=False: the q - z path beside the default B + q unpacking in 16-bit pairs (int_decode.PAIR_UNPACK, the
# default since an H100 measured it faster on every layer here); num_stages=3 alone (1-4% faster there on 7 of 8)
STREAM_TUNE_CONFIGS = [dict(SPLIT_K=split, num_stages=st) for split in STREAM_TUNE_SPLITS for st in (3, 4)] + [
    dict(num_warps=8), dict(BLOCK_K=64, num_stages=6), dict(num_stages=3), dict(BIASED=False),
    dict(BIASED=False, num_stages=3)]
STREAM_TUNE_ROWS = [1]
# Past MAX_ROWS (--int-rows 32 64 ...): the stream in row tiles of 16-64 rows (`stream_config`'s row_tile, its split
# of K over all the tiles) and 4 / 8 warps, beside dequant+cuBLAS (what `linear_int` runs past STREAM_MAX_ROWS). The
# first sweep (h100-kernels-tune-int4-row-tiles-unsplit.json: tiles of 32-128, K unsplit past one tile) lost to
# dequant+cuBLAS at 256 rows everywhere and at 64 rows on small layers.
ROW_TILE_TUNE_CONFIGS = [(16, {}), (16, dict(num_warps=8)), (32, {}), (32, dict(num_warps=8)), (64, {}),
                         (64, dict(num_warps=4))]


def bench_tune_int4(runner, models: dict, layouts: list[str], rows_list: list[int] | None = None):
    """The stream kernel's launch settings (STREAM_TUNE_CONFIGS over `int_decode.stream_config`'s) on each layer
    (rows: one compile serves 1-16, M is not specialized; past MAX_ROWS, ROW_TILE_TUNE_CONFIGS beside
    dequant+cuBLAS). The default should be the best row or near it; bf16 cuBLAS and the default are the first two."""
    for layout in layouts:
        for model_name, model in models.items():
            for op, (out_features, in_features, gated) in linears(model).items():
                _tune_layer(runner, f"tune {layout} {model_name} {op.split('+')[0]}", out_features, in_features,
                            gated, layout, rows_list or STREAM_TUNE_ROWS)


def _tune_layer(runner, name, out_features, in_features, gated, layout, rows_list):
    device = runner.device
    copies = [packed_layer(out_features, in_features, layout, device)]
    while len(copies) < 8 and len(copies) * packed_bytes(copies[0]) < COLD_CHAIN_BYTES:
        copies.append(packed_layer(out_features, in_features, layout, device))
    bf16 = [dequantize_triton(**c, dtype=torch.bfloat16) for c in copies]
    n = out_features // (2 if gated else 1)
    c0 = copies[0]
    if not can_stream(c0["packing"], None, c0["group_size"], in_features, n, 1, MAX_ROWS):
        return
    zero_terms = [_check_packed_launchable(c["qweight"], c["qzeros"], c["scales"], None, c.get("mins"))
                  for c in copies]
    has_mins = c0.get("mins") is not None
    for rows in rows_list:
        base = stream_config(rows, n, in_features, c0["group_size"], c0["packing"].is_packed_along_k, gated, 2, device,
                             c0["packing"].pack_factor)
        configs = {"default": {}}
        if rows <= MAX_ROWS:
            configs |= {" ".join(f"{k}={v}" for k, v in c.items()): c for c in STREAM_TUNE_CONFIGS}
        for row_tile, overrides in ([] if rows <= MAX_ROWS else ROW_TILE_TUNE_CONFIGS):
            cfg = stream_config(rows, n, in_features, c0["group_size"], c0["packing"].is_packed_along_k, gated, 2,
                                device, c0["packing"].pack_factor, row_tile) | overrides
            configs[" ".join(f"{k}={v}" for k, v in cfg.items() if k in ("BLOCK_M", "SPLIT_K", "num_warps"))] = cfg

        def build(rows=rows, configs=configs, base=base):
            x = torch.randn(rows, in_features, dtype=torch.bfloat16, device=device)

            def call(i, cfg):
                c = copies[i]
                return linear_int_stream(x, c["qweight"], zero_terms[i], c["scales"], c["group_size"], c["packing"],
                                         None, gated, has_mins, upcast_dot_operands(x.dtype, device),
                                         dot_precision(x.dtype), cfg)

            impls = {"bf16 cuBLAS": _chain(lambda i: linear_cublas(x, bf16[i], gated=gated), len(copies))}
            if rows > MAX_ROWS:  # what linear_int ran past 16 rows before the row tiles, and runs past 64
                impls["dequant+cuBLAS"] = _chain(lambda i: linear_int_dequantized(x, **copies[i], gated=gated),
                                                 len(copies))
            impls.update({label: _chain(functools.partial(call, cfg=cfg), len(copies))
                          for label, cfg in configs.items()})

            def check():
                from benchmarks.kernels import max_error

                ref = linear_int_ref(x, **copies[0], gated=gated).float()
                return max(max_error(call(0, cfg), ref, 2e-2 * ref.abs().max().item()) for cfg in configs.values())

            work = dict(bytes=packed_bytes(c0) * len(copies), copies=len(copies), default_config=base,
                        impl_bytes={"bf16 cuBLAS": bf16[0].numel() * 2 * len(copies)})
            return impls, work, check

        runner.case(name, f"rows {rows}", build)
