#!/usr/bin/env bash
# The GPU checks and figures in one run, for a lent GPU machine whose python3 already holds torch,
# triton and transformers (the rest of Stoker's dependencies travel as wheels in .whl/).
# Stages (STAGES, space-separated, in this order; default "tests doctor figures"):
#   tests    make test-gpu's tests (tests/gpu, compiled Triton), four pytest workers
#   doctor   `stoker doctor` on the real GPU (NVML, copy rate, GEMM, a short soak)
#   figures  benchmarks/gpu_figures.py --parts all on a Llama-3-8B-shaped random bf16 checkpoint
#   profile  gpu_figures.py --parts profile: each decode kernel's device time at B = 1 and 64
#   quick    gpu_figures.py: offline 1000 x 128 -> 128 (no HF), the graph decode sweep, profile
#   fp8      gpu_figures.py --parts prefill,decode with FP8 weights and an FP8 KV cache
#   int4     gpu_figures.py --parts prefill,decode with online int4 weights (group 128; the tinygemm form)
#   w4a16    benchmarks/w4a16_gpu.py (the Triton W4A16 GEMM beside its peers)
#   moe      benchmarks/moe_gpu.py (the fused-MoE kernel beside the per-expert loop)
#   fleet    `stoker top --once` and `stoker telemetry`'s /metrics on real NVML
#   offline  gpu_figures.py --parts offline,decode: 1000 x 128 -> 128 and 1000 x 1000 -> 1000, then HF
#            transformers' generate (static batches) and continuous batching on 128 -> 128; the
#            graph decode rows at B = 1, 8, 32, 64, 256 (the int4 stage's peer)
#   server   `stoker serve` with the offline engine's settings, then `stoker bench serve`: 1000
#            requests 128 -> 128 sent at once (the offline workload through HTTP)
#   sweep    benchmarks/w4a16_gpu.py --sweep: the 4-bit / 8-bit decode GEMVs' launch configurations
#   mla      benchmarks/mla_gpu.py (the MLA decode kernel at DeepSeek-V3's latent shape)
#   pooling  benchmarks/pooling_gpu.py (embeddings: Stoker's pooling runner beside sentence-transformers)
#   lora     benchmarks/lora_gpu.py (4 LoRA adapters against the base model: kernel and engine)
#   spec     benchmarks/spec_decode_gpu.py (speculative decoding at batch 1)
# OFFLINE_WORKLOADS replaces the offline stage's workloads (default "1000:128:128 1000:1000:1000");
# OFFLINE_ARGS adds gpu_figures.py flags to it (e.g. "--max-num-seqs 512 --hf-cb-prompts 64").
# W4A16_ARGS narrows the w4a16 stage (e.g. "--rows 1 16 64 2048 --projections qkv gate_up").
# Everything also lands in $OUT/results.tgz after each stage (the logs and the JSON results).
# The checkpoint is written while the tests run, so timed stages have the GPU to themselves.
# Each stage has its own time cap so a slow one cannot starve the next. Logs go to $OUT
# (default ./gpu-out).
#   STAGES="tests profile fp8" bash benchmarks/gpu_check.sh [TEST_CAP_S] [FIGURES_CAP_S]
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
TEST_CAP=${1:-200}
FIG_CAP=${2:-290}
STAGES=" ${STAGES:-tests doctor figures} "
has() { [[ "$STAGES" == *" $1 "* ]]; }
if [ -d .whl ]; then
  [ -d /tmp/site/pydantic ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  TOKENIZERS_PARALLELISM=false TRITON_INTERPRET=0
FIG=/tmp/gpu-figures
CKPT=$FIG/ckpt-llama3-8b
mkdir -p $FIG
{
  date -u; nvidia-smi; nproc; free -g | head -2
  python3 -c "import torch, triton, transformers, sys; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__); p = torch.cuda.get_device_properties(0); print(p.name, p.multi_processor_count, 'SMs', p.total_memory >> 20, 'MiB')"
} > "$OUT/env.txt" 2>&1
tail -4 "$OUT/env.txt"

# the 8B checkpoint, written beside the tests (disk and a little GPU; nothing timed yet), unless an
# earlier call on the same machine wrote it (generation_config.json is its last file)
if [ -f $CKPT/generation_config.json ]; then
  echo "# checkpoint $CKPT already written" > $FIG/checkpoint.log; CKPT_PID=
else
  (timeout 200 python3 benchmarks/gpu_figures.py --out $FIG --parts checkpoint > $FIG/checkpoint.log 2>&1) &
  CKPT_PID=$!
fi

if has tests; then
  t0=$SECONDS
  timeout -k 10 "$TEST_CAP" python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider -n 4 --dist loadfile \
    --timeout 180 -rfE > "$OUT/test_gpu.log" 2>&1
  echo "tests/gpu: rc=$? in $((SECONDS - t0)) s"; tail -15 "$OUT/test_gpu.log"
fi
[ -n "$CKPT_PID" ] && wait $CKPT_PID; tail -2 $FIG/checkpoint.log
if has doctor; then
  timeout 60 python3 -m stoker doctor --device cuda --soak-minutes 0.1 --out "$OUT/doctor.json" > $FIG/doctor.log 2>&1
  echo "doctor rc=$?"; tail -12 $FIG/doctor.log
fi
run_figures() {  # NAME CAP ARGS...
  local name=$1 cap=$2 t0=$SECONDS
  shift 2
  timeout -k 10 "$cap" python3 benchmarks/gpu_figures.py --out $FIG --checkpoint $CKPT "$@" > "$OUT/$name.log" 2>&1
  echo "$name: rc=$? in $((SECONDS - t0)) s"
  grep -v "it/s\]" "$OUT/$name.log" | tail -40
}
if has figures; then
  run_figures figures "$FIG_CAP" --parts all
  cp $FIG/serve_startup.log "$OUT"/ 2>/dev/null
fi
pack() { mkdir -p $FIG/res; cp $FIG/*.json "$OUT"/*.log $FIG/res/ 2>/dev/null; tar czf "$OUT/results.tgz" -C $FIG res; }
pack
has profile && run_figures profile 90 --parts profile && pack
has quick && run_figures quick 150 --parts offline,decode,profile --no-eager --no-hf --workloads 1000:128:128 && pack
has fp8 && run_figures fp8 120 --parts prefill,decode --quantization fp8 --kv-cache-dtype fp8 --batch-sizes 1 64 256 \
  ${FP8_ARGS:-} && pack
has int4 && run_figures int4 150 --parts prefill,decode --quantization int4 --batch-sizes 1 8 32 64 --no-eager && pack
if has w4a16; then
  timeout 120 python3 benchmarks/w4a16_gpu.py ${W4A16_ARGS:-} > "$OUT/w4a16.log" 2>&1
  echo "w4a16 rc=$?"; grep -v "^ *$" "$OUT/w4a16.log" | tail -40; pack
fi
if has moe; then
  timeout 90 python3 benchmarks/moe_gpu.py --weights bf16 fp8 > "$OUT/moe.log" 2>&1
  echo "moe rc=$?"; tail -20 "$OUT/moe.log"; pack
fi
if has fleet; then
  { timeout 20 python3 -m stoker top --once
    (timeout 25 python3 -m stoker telemetry --port 9400 > $FIG/telemetry.log 2>&1 &)
    sleep 8; python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9400/metrics', timeout=5).read().decode())" | grep -E "^DCGM_|^# HELP DCGM" | head -40
  } > "$OUT/fleet.log" 2>&1
  echo "fleet:"; tail -45 "$OUT/fleet.log"; pack
fi
has offline && run_figures offline 280 --parts offline,decode --batch-sizes 1 8 32 64 256 --no-eager \
  --workloads ${OFFLINE_WORKLOADS:-1000:128:128 1000:1000:1000} ${OFFLINE_ARGS:-} && pack
if has server; then  # the offline engine's settings (gpu_figures.py's LLM(...)), 1000 requests at once
  t0=$SECONDS
  python3 -m stoker serve $CKPT --port 8312 --max-model-len 2240 --max-num-seqs 256 --max-num-batched-tokens 16384 \
    --kv-cache-memory-bytes $((40 * 1024 ** 3)) > $FIG/server.log 2>&1 &
  SERVER_PID=$!
  python3 - <<'PY'
import time, urllib.request
for _ in range(240):
    try:
        if urllib.request.urlopen("http://127.0.0.1:8312/health", timeout=1).status == 200:
            break
    except OSError:
        time.sleep(0.5)
PY
  echo "server ready after $((SECONDS - t0)) s"
  timeout 150 python3 -m stoker bench serve --base-url http://127.0.0.1:8312 --endpoint completions --dataset random \
    --num-prompts 1000 --random-input-len 128 --random-output-len 128 --ignore-eos --tokenizer $CKPT \
    --request-rate inf --disable-tqdm --save-result $FIG/server_bench.json > "$OUT/server.log" 2>&1
  echo "server bench rc=$? in $((SECONDS - t0)) s"; grep -E "throughput|Successful|duration|Failed|Mean|Median" "$OUT/server.log"
  kill $SERVER_PID; wait $SERVER_PID 2>/dev/null; tail -5 $FIG/server.log > "$OUT/server_process_tail.log"; pack
fi
run_script() {  # NAME CAP SCRIPT ARGS...
  local name=$1 cap=$2 t0=$SECONDS
  shift 2
  timeout -k 10 "$cap" python3 "$@" --json $FIG/$name.json > "$OUT/$name.log" 2>&1
  echo "$name: rc=$? in $((SECONDS - t0)) s"; grep -v "^ *$" "$OUT/$name.log" | tail -40; pack
}
has mla && run_script mla 60 benchmarks/mla_gpu.py
has pooling && run_script pooling 75 benchmarks/pooling_gpu.py
has lora && run_script lora 100 benchmarks/lora_gpu.py --checkpoint $CKPT
has spec && run_script spec 100 benchmarks/spec_decode_gpu.py --checkpoint $CKPT
has sweep && run_script sweep 90 benchmarks/w4a16_gpu.py --sweep
