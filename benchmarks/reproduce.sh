#!/usr/bin/env bash
# Runs the README's benchmark table on one GPU machine (about 12 minutes on an H200, 22 with FP8), writing JSON into
# OUT_DIR.
#   benchmarks/reproduce.sh [OUT_DIR]          PRESET=llama-3-8b, PYTHON=python3, TP=2 (skipped on one GPU),
#                                              FP8=1 (0: skip the FP8 rows; 70B only with 100 GB of GPU memory),
#                                              INT4=1 (0: skip the int4 rows: AWQ and GPTQ as served; not yet timed)
set -uo pipefail
OUT=${1:-bench-results}
PRESET=${PRESET:-llama-3-8b}
PY=${PYTHON:-python3}
TP=${TP:-2}
FP8=${FP8:-1}
INT4=${INT4:-1}
mkdir -p "$OUT"
VOCAB=$($PY -c "import json; from checkpoints.presets import preset_dir; \
print(json.load(open(preset_dir('$PRESET') + '/config.json'))['vocab_size'])")
step() { echo "== $1"; shift; "$@" || echo "FAILED ($?): $*"; }

step kernels $PY -m benchmarks.kernels --check --cuda-graph --output-json "$OUT/kernels.json"
step latency $PY -m deploy.cli bench latency --preset "$PRESET" --profile-steps 8 --output-json "$OUT/latency.json"
step throughput $PY -m deploy.cli bench throughput --preset "$PRESET" --compare hf \
  --output-json "$OUT/throughput.json"
step "sampling sweep" $PY -m deploy.cli bench throughput --preset "$PRESET" --no-prefix-caching \
  --sampling-sweep greedy temperature top_p top_k repetition seed --output-json "$OUT/throughput-sampling.json"
# Through HTTP: all at once, then 4 requests/s of 1024-token prompts; as `pagoda serve` runs by default, behind
# Serve's Python proxy, and with the engine in the replica's process (a fresh server, so an empty prefix cache, each).
for mode in default proxy engine-in-replica; do
  flag=$(case $mode in proxy) echo --ingress-mode proxy;; engine-in-replica) echo --engine-in-replica;; esac)
  runs="--num-requests 256 --request-rate inf --vocab-size $VOCAB --output-json $OUT/serve-all-$mode.json"
  runs+=";--num-requests 48 --request-rate 4 --input-len-range 1024 1024 --output-len 64 --vocab-size $VOCAB"
  runs+=" --output-json $OUT/serve-poisson-$mode.json"
  step "serve ($mode)" env BENCH_ARGS="$runs" PYTHON="$PY" bash benchmarks/serve_local.sh --preset "$PRESET" $flag
done
if [ "$($PY -c 'import torch; print(torch.cuda.device_count())')" -ge "$TP" ] && [ "$TP" -gt 1 ]; then
  step "latency tp $TP" $PY -m deploy.cli bench latency --preset "$PRESET" -tp "$TP" --prompt-lens 128 \
    --output-json "$OUT/latency-tp$TP.json"
  step "step overhead" $PY benchmarks/step_overhead.py --tp 1 "$TP" --output-json "$OUT/step-overhead.json"
fi
if [ "$FP8" = 1 ]; then
  fp8="--quantization fp8 --kv-cache-dtype fp8"
  step "fp8 latency" $PY -m deploy.cli bench latency --preset "$PRESET" $fp8 --batch-sizes 1 64 256 \
    --prompt-lens 128 2048 --output-json "$OUT/latency-fp8.json"
  # Programmatic dependent launch on and off in one run (kernels/_triton.py pdl_options; Hopper only)
  for pdl in 1 0; do
    step "fp8 throughput (PAGODA_PDL=$pdl)" env PAGODA_PDL=$pdl $PY -m deploy.cli bench throughput \
      --preset "$PRESET" $fp8 --no-prefix-caching --output-json "$OUT/throughput-fp8-pdl$pdl.json"
  done
  step "fp8 quality" $PY -m deploy.cli bench quality $fp8 --dtype bfloat16 --ablations \
    --output-json "$OUT/quality-fp8.json"
  if [ "$($PY -c 'import torch; print(int(torch.cuda.get_device_properties(0).total_memory > 100e9))')" = 1 ]; then
    step "70b fp8 latency" $PY -m deploy.cli bench latency --preset llama-3-70b $fp8 --batch-sizes 1 64 \
      --prompt-lens 128 --output-json "$OUT/latency-70b-fp8.json"
    step "70b fp8 throughput" $PY -m deploy.cli bench throughput --preset llama-3-70b $fp8 --no-prefix-caching \
      --num-prompts 1024 --input-len 128 --output-len 128 --output-json "$OUT/throughput-70b-fp8.json"
  fi
fi
if [ "$INT4" = 1 ]; then  # README, Int4 checkpoints: the kernels per layout, then the preset end to end
  step "int4 kernels" $PY -m benchmarks.kernels --only int4 --int-layouts awq gptq gptq-k gptq-g32 gptq-g32-k \
    gguf-q4_k --int-rows 1 16 64 256 --cuda-graph --check --output-json "$OUT/kernels-int4.json"
  for q in awq gptq; do
    step "$q latency" $PY -m deploy.cli bench latency --preset "$PRESET" --quantization $q \
      --batch-sizes 1 16 32 64 256 --prompt-lens 128 --output-json "$OUT/latency-$q.json"
  done
  step "awq throughput" $PY -m deploy.cli bench throughput --preset "$PRESET" --quantization awq --no-prefix-caching \
    --output-json "$OUT/throughput-awq.json"
  step "70b awq latency" $PY -m deploy.cli bench latency --preset llama-3-70b --quantization awq --batch-sizes 1 64 \
    --prompt-lens 128 --output-json "$OUT/latency-70b-awq.json"
fi
ls -l "$OUT"
