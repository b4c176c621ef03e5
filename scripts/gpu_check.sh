#!/usr/bin/env bash
# The prepared GPU check: one run on a lent GPU machine, within a 9-minute budget (a step past it is skipped
# and reported; the steps that bring results back come first).
# It needs no .venv and no network: the machine's python3 with torch, and qklab from this checkout
# (PYTHONPATH=src), so nothing the image has travels with it.
#
#   scripts/gpu_check.sh                    # on the GPU machine: logs and JSON under $OUT (gpu_check_out/)
#   GPU_CHECK_DRY=1 scripts/gpu_check.sh    # every step on this CPU with tiny shapes (CI runs this)
#
# 1. the environment (GPUs, torch, CUDA, the packages qklab imports);
# 2. the CUDA-only tests (FlexAttention max scores, the device's own sync check);
# 3. the two off-CPU fixes: QuacK on MLA without a query latent trains on CUDA, and its CUDA checkpoint
#    resumes on the CPU;
# 4. the test of the registered predictions (studies/gpu_scale.toml): scale_english's ladder one width further
#    (1024, 50.6M non-embedding parameters) in its regime, every method on its rate grid, one seed, from the
#    English corpus's token pack (carried: TOKEN_PACK, default .cache/qklab/pack-english, written here by
#    `qklab tokens --config small --set data.source=english --out .cache/qklab/pack-english`); its result.json
#    files land under $OUT/gpu_scale/ for docs/results/gpu_scale; then the latest registered predictions file
#    (docs/results/predictions/) checked against it in the fits' regime, hit or miss per value and order
#    (scripts/predictions.py check --payload gpu_scale; a file written before gpu_scale existed has no target
#    it measures, and says so). The cells finish a method at a time; a method whose grid did not finish reads
#    "not tested";
#    then the science payload (studies/gpu_payload.toml): a 38M-parameter GPT under Muon at a constant high
#    rate for none, qknorm, quack, qkclip and qkmap, one seed; each cell's result.json lands under
#    $OUT/gpu_payload/ for docs/results/gpu_payload and `qklab report`; the predictions' 38M target checked
#    against it as an observation (another regime);
# 5. compiled bf16 train steps of the GPT-2 small shape (124M parameters: the byte tokenizer with a
#    50257-token embedding, so no tokenizer is trained) for none / qknorm / qkmap / quack / qkclip, their
#    ratios to none, and MFU (eager and compiled) against the measured bf16 matmul peak (a method's MFU is
#    none's times its step-time ratio);
# 6. with 2 or more GPUs: DDP and FSDP2 over NCCL (2 processes) against one GPU at the same global batch;
# 7. the whole test suite, in what time is left.
# The dry run uses the same commands and code paths with train.device=cpu, fp32, tiny shapes and a few
# steps; on one CPU it runs step 6 with 2 processes over gloo and skips step 7 (CI runs the suite).
# Each step has its own time limit (x4 in the dry run), cut to what is left of BUDGET_S (540 s; dry 2400 s);
# a failed step is reported and the script goes on. The steps that bring results back come first.
# Exit code: the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # qklab from this checkout, installed or not
export PYTHONUNBUFFERED=1
DRY=${GPU_CHECK_DRY:-0}
OUT=${OUT:-gpu_check_out}
SCRATCH=${SCRATCH:-$(mktemp -d)}  # run folders and checkpoints: not brought back
mkdir -p "$OUT"
FAILED=()
T_START=$SECONDS

BUDGET_S=${BUDGET_S:-540}  # the whole run: 9 minutes of the lent machine's 10 a call, a margin for the copy back
LIMIT_SCALE=1  # each step's limit times this (the dry run: a shared CPU is slower, and only the paths count)

step() {  # step NAME LIMIT_S COMMAND...: run it within its limit and what is left of BUDGET_S, keep its log
  local name=$1 limit=$(($2 * LIMIT_SCALE))
  shift 2
  local left=$((BUDGET_S - (SECONDS - T_START)))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 10 ]; then
    echo "== $name: SKIPPED, ${left} s of the ${BUDGET_S} s budget left"
    FAILED+=("$name(no time)")
    return
  fi
  echo "== $name ($(date -u +%H:%M:%S), limit ${limit} s)"
  local t0=$SECONDS
  if timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; then
    tail -n "${TAIL:-6}" "$OUT/$name.log"
    echo "-- $name: ok in $((SECONDS - t0)) s"
  else
    local rc=$?
    tail -n 25 "$OUT/$name.log"
    echo "-- $name: FAILED (exit $rc) after $((SECONDS - t0)) s; log: $OUT/$name.log"
    FAILED+=("$name")
  fi
}

if [ "$DRY" = 1 ]; then
  echo "== dry run: every step on the CPU, tiny shapes"
  DEV=cpu; DTYPE=fp32; NGPU=2
  BIG=(--config tiny --set model.vocab_size=512 --set train.batch_size=2 --set train.seq_len=32)
  ROUNDS=(--rounds 1 --warmup 1); PEAK_N=256; BUDGET_S=${GPU_CHECK_DRY_BUDGET_S:-2400}
  LIMIT_SCALE=${GPU_CHECK_DRY_SCALE:-4}  # CI's machine may be busy: a dry step that is slow has not failed
  PAYLOAD=(--set model.d_model=64 --set model.n_layers=2 --set model.n_heads=1 --set train.batch_size=2
           --set train.seq_len=64 --set train.steps=30 --set train.warmup_steps=5 --set train.eval_every=15
           --set train.diag_every=15 --set train.ckpt_every=30 --set train.eval_batches=2 --set data.max_files=40
           --set train.lr=1e-2 --set train.device=cpu --set train.dtype=fp32)
  # gpu_scale's paths: two methods on the whole grid, tiny, from a pack of the Python standard library (CI has
  # no English corpus), checked against a predictions file written here from the committed ladder_english
  SCALE=(--methods none,qknorm --workers 2 --set data.source=pystdlib --set data.max_files=40
         --set model.d_model=64 --set model.n_heads=1 --set model.n_layers=2 --set train.steps=20
         --set train.warmup_steps=5 --set train.eval_every=10 --set train.diag_every=10 --set train.ckpt_every=20
         --set train.eval_batches=2 --set train.seq_len=64 --set train.device=cpu)
  TOKEN_PACK=$SCRATCH/pack
else
  DEV=cuda; DTYPE=bf16
  step env 60 bash -c "nvidia-smi -L"
  NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
  BIG=(--config gpt124m --set data.tokenizer=bytes --set model.vocab_size=50257 --set train.batch_size=16)
  ROUNDS=(--rounds 6 --warmup 3); PEAK_N=8192
  PAYLOAD=()
  SCALE=()
  TOKEN_PACK=${TOKEN_PACK:-.cache/qklab/pack-english}
fi

step versions 60 "$PY" - <<'PY'
import importlib, platform
import torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| devices", torch.cuda.device_count(), *([torch.cuda.get_device_name(0)] if torch.cuda.is_available() else []))
for name in ("numpy", "tokenizers", "safetensors", "scipy", "matplotlib", "tqdm", "triton", "transformers"):
    try:
        print(f"{name} {importlib.import_module(name).__version__}")
    except ImportError:
        print(f"{name}: not installed")
import qklab, qklab.train.trainer, qklab.parallel.muon, qklab.model.flex  # everything qklab imports at start
from torch.nn.attention.flex_attention import AuxRequest  # noqa: F401  (FlexAttention's max scores)
print(qklab.__file__)
PY

# the tests that only run on CUDA (on the CPU they skip: the dry run checks that they collect and start)
step tests_cuda 90 "$PY" -m pytest tests/model/test_flex.py tests/train/test_host_sync.py -q -p no:cacheprovider

RUN="train.out_dir='$SCRATCH/runs'"
MLA=(--config tiny --set model.attention=mla --set qk.controller=quack --set train.name=mla-quack --set "$RUN"
     --set train.progress=false)
step mla_quack_device 60 "$PY" -m qklab train "${MLA[@]}" --set train.device=$DEV --set train.steps=10 --overwrite
step device_ckpt_on_cpu 60 "$PY" -m qklab train "${MLA[@]}" --set train.device=cpu --set train.steps=12 --resume

# the test of the registered predictions: gpu_scale's cells (ordinary study cells) from the token pack, their
# result.json files (and study.json) brought back under $OUT/gpu_scale, then checked in the fits' regime
export PY PRED_REC=docs/results/scale_english/study.json SCRATCH
PRED=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["predictions"][-1]["file"])' "$PRED_REC")
export PRED  # the latest registered predictions file
if [ "$DRY" = 1 ]; then
  step scale_pack 120 "$PY" -m qklab tokens --config small --set data.source=pystdlib --set data.max_files=40 \
    --out "$TOKEN_PACK"
  PRED_SCALE=$SCRATCH/predictions_dry.json  # a throwaway file with a gpu_scale target, not a registered one
  step scale_predictions_write 120 "$PY" scripts/predictions.py write docs/results/ladder_english "$PRED_SCALE" \
    --regime "the dry run's throwaway"
  SCALE_REC=()
else
  PRED_SCALE=$PRED
  SCALE_REC=(--study-json "$PRED_REC")
fi
if [ -f "$TOKEN_PACK/pack.json" ]; then
  step scale_payload 300 "$PY" -m qklab demo --study gpu_scale --out "$SCRATCH/scale" \
    --set "data.token_pack=$(cd "$TOKEN_PACK" && pwd)" "${SCALE[@]}"
else
  echo "== scale_payload: FAILED, no token pack at $TOKEN_PACK (write it with qklab tokens and carry it)"
  FAILED+=("scale_payload(no pack)")
fi
mkdir -p "$OUT/gpu_scale" && cp -r "$SCRATCH/scale/results/." "$OUT/gpu_scale/" 2>/dev/null
echo "   gpu_scale results: $(find "$OUT/gpu_scale" -name result.json | wc -l) result.json under $OUT/gpu_scale"
TAIL=40 step scale_predictions 120 "$PY" scripts/predictions.py check "$PRED_SCALE" "$OUT/gpu_scale" \
  --payload gpu_scale "${SCALE_REC[@]}"

# the science payload: ordinary study cells, their result.json files brought back under $OUT
step payload 240 "$PY" -m qklab demo --study gpu_payload --workers 1 --out "$SCRATCH/payload" "${PAYLOAD[@]}"
mkdir -p "$OUT/gpu_payload" && cp -r "$SCRATCH/payload/results/." "$OUT/gpu_payload/" 2>/dev/null
echo "   payload results: $(find "$OUT/gpu_payload" -name result.json | wc -l) result.json under $OUT/gpu_payload"

# the scale study's predictions for larger models (docs/results/predictions/, each file's sha256 recorded in
# docs/results/scale_english/study.json), checked against the payload: hit, miss or not tested per prediction
# (the payload runs another regime than the fits, so its values read "not tested" and the orders are checked);
# the dry run also checks the checker on numbers planted from the predictions (one planted miss, the rest hits)
step predictions 60 "$PY" scripts/predictions.py check "$PRED" "$OUT/gpu_payload" --payload gpu_payload \
  --study-json "$PRED_REC"
planted_predictions() {
  "$PY" scripts/predictions.py plant "$PRED" "$SCRATCH/planted" &&
    "$PY" scripts/predictions.py check "$PRED" "$SCRATCH/planted" --same-regime --study-json "$PRED_REC" \
      > "$SCRATCH/planted.txt" && cat "$SCRATCH/planted.txt" &&
    [ "$(grep -c '^MISS' "$SCRATCH/planted.txt")" = 1 ] && [ "$(grep -c '^HIT' "$SCRATCH/planted.txt")" -ge 3 ]
}
export -f planted_predictions
[ "$DRY" = 1 ] && TAIL=12 step predictions_planted 60 bash -c planted_predictions

B=("${BIG[@]}" --set train.device=$DEV --set train.dtype=$DTYPE)
TAIL=40 step methods_step_time 200 "$PY" benchmarks/step_time.py "${B[@]}" --set train.compile=true "${ROUNDS[@]}" \
  --variant none: --variant qknorm:qk.method=qknorm --variant qkmap:qk.method=qkmap \
  --variant quack:qk.controller=quack --variant qkclip:qk.controller=qkclip
cp "$OUT/methods_step_time.log" "$OUT/methods_step_time.json" 2>/dev/null
TAIL=30 step mfu 120 "$PY" benchmarks/mfu.py "${B[@]}" --device $DEV --dtype $DTYPE "${ROUNDS[@]}" --peak-n $PEAK_N
cp "$OUT/mfu.log" "$OUT/mfu.json" 2>/dev/null

if [ "$NGPU" -ge 2 ]; then
  D=(--config tiny --set train.device=$DEV --set train.steps=20 --set train.progress=false --set "$RUN" --overwrite)
  step one_device 90 "$PY" -m qklab train "${D[@]}" --set train.name=one --set train.batch_size=8
  for P in ddp fsdp; do
    step "parallel_$P" 120 "$PY" -m torch.distributed.run --nproc-per-node 2 -m qklab train "${D[@]}" \
      --set train.name="$P" --set train.batch_size=4 --set train.parallel=$P
  done
  step parallel_compare 30 "$PY" - "$SCRATCH/runs" <<'PY'
import json, sys
from pathlib import Path
runs = Path(sys.argv[1])
def curve(name):
    return [r["loss"] for r in map(json.loads, (runs / name / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
one = curve("one")
for p in ("ddp", "fsdp"):
    got = curve(p)
    assert len(got) == len(one), (p, len(got), len(one))
    rel = max(abs(a - b) / abs(a) for a, b in zip(one, got))
    print(f"{p}: {len(got)} logged steps, max relative loss difference to one device {rel:.2e}")
    assert rel < 1e-2, f"{p} departs from one device"
PY
else
  echo "== fewer than 2 GPUs: the NCCL checks are skipped"
fi

if [ "$DRY" = 1 ]; then
  echo "== dry run: the whole suite is CI's own step, not run here"
else
  step tests "${TESTS_LIMIT_S:-600}" "$PY" -m pytest tests -x -q -p no:cacheprovider  # in what time is left
fi

echo "== summary: ${#FAILED[@]} failed step(s) ${FAILED[*]:-} in $((SECONDS - T_START)) s"
exit "${#FAILED[@]}"
