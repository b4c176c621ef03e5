#!/usr/bin/env bash
# The prepared GPU check (under 8 minutes on one H200). Run from anywhere, on a CUDA machine with the
# venv set up (README: GPU setup):
#
#   scripts/gpu_check.sh                # logs and JSON under gpu_check_out/, a summary at the end
#
# 1. the environment (GPUs, torch, CUDA);
# 2. the CUDA-only tests (the whole suite runs last, TESTS_LIMIT_S, default 240 s; train.device=auto
#    picks the GPU where a test does not pin it);
# 3. the two off-CPU fixes: QuacK on MLA without a query latent trains on CUDA, and its CUDA checkpoint
#    resumes on the CPU;
# 4. compiled bf16 train steps of the GPT-2 small shape (124M parameters: the byte tokenizer with a
#    50257-token embedding, so no tokenizer is trained here) for none / qknorm / qkmap / quack / qkclip,
#    their ratios to none, and MFU (eager and compiled) against the measured bf16 matmul peak;
# 5. with 2 or more GPUs: DDP and FSDP2 over NCCL (torchrun, 2 processes) against one GPU at the same
#    global batch.
# Each step has its own time limit; a failed step is reported and the script goes on. Exit code: the
# number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
FAILED=()

step() {  # step NAME LIMIT_S COMMAND...: run it, keep its log, show its tail
  local name=$1 limit=$2
  shift 2
  echo "== $name ($(date -u +%H:%M:%S))"
  local t0=$SECONDS
  if timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; then
    tail -n "${TAIL:-6}" "$OUT/$name.log"
    echo "-- $name: ok in $((SECONDS - t0)) s"
  else
    tail -n 25 "$OUT/$name.log"
    echo "-- $name: FAILED (exit $?) after $((SECONDS - t0)) s; log: $OUT/$name.log"
    FAILED+=("$name")
  fi
}

step env 60 bash -c "nvidia-smi -L; $PY -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.device_count(), torch.cuda.get_device_name(0))'"
NGPU=$($PY -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)

# the tests that only run on CUDA first (FlexAttention max scores, the device's own sync check); the whole
# suite (9 minutes on the 2-core CPU) runs last, so a timeout there costs no other step
step tests_cuda 150 "$PY" -m pytest tests/model/test_flex.py tests/train/test_host_sync.py -q -p no:cacheprovider

RUN="train.out_dir='$OUT/runs'"
step mla_quack_cuda 90 "$PY" -m qklab train --config tiny --set model.attention=mla --set qk.controller=quack \
  --set train.device=cuda --set train.steps=10 --set train.name=mla-quack --set "$RUN" --set train.progress=false --overwrite
step cuda_ckpt_on_cpu 90 "$PY" -m qklab train --config tiny --set model.attention=mla --set qk.controller=quack \
  --set train.device=cpu --set train.steps=12 --set train.name=mla-quack --set "$RUN" --set train.progress=false --resume

G124=(--config gpt124m --set data.tokenizer=bytes --set model.vocab_size=50257 --set train.device=cuda
      --set train.dtype=bf16 --set train.batch_size=16)
TAIL=40 step methods_124m 300 "$PY" benchmarks/step_time.py "${G124[@]}" --set train.compile=true --rounds 6 --warmup 3 \
  --variant none: --variant qknorm:qk.method=qknorm --variant qkmap:qk.method=qkmap \
  --variant quack:qk.controller=quack --variant qkclip:qk.controller=qkclip
cp "$OUT/methods_124m.log" "$OUT/methods_124m.json" 2>/dev/null
TAIL=30 step mfu_124m 180 "$PY" benchmarks/mfu.py "${G124[@]}" --device cuda --dtype bf16 --rounds 6 --peak-n 8192
cp "$OUT/mfu_124m.log" "$OUT/mfu_124m.json" 2>/dev/null

if [ "$NGPU" -ge 2 ]; then
  D=(--config tiny --set train.device=cuda --set train.steps=20 --set train.progress=false --set "$RUN" --overwrite)
  step one_gpu 90 "$PY" -m qklab train "${D[@]}" --set train.name=one --set train.batch_size=8
  for P in ddp fsdp; do
    step "nccl_$P" 120 "$(dirname "$PY")/torchrun" --nproc-per-node 2 -m qklab train "${D[@]}" \
      --set train.name="$P" --set train.batch_size=4 --set train.parallel=$P
  done
  step nccl_compare 30 "$PY" - "$OUT/runs" <<'PY'
import json, sys
from pathlib import Path
runs = Path(sys.argv[1])
def curve(name):
    return [r["loss"] for r in map(json.loads, (runs / name / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
one = curve("one")
for p in ("ddp", "fsdp"):
    got = curve(p)
    rel = max(abs(a - b) / abs(a) for a, b in zip(one, got))
    print(f"{p}: {len(got)} logged steps, max relative loss difference to one GPU {rel:.2e}")
PY
else
  echo "== fewer than 2 GPUs: the NCCL checks are skipped"
fi

step tests "${TESTS_LIMIT_S:-240}" "$PY" -m pytest tests -x -q -p no:cacheprovider

echo "== summary: ${#FAILED[@]} failed step(s) ${FAILED[*]:-}"
exit "${#FAILED[@]}"
