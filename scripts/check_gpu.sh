#!/usr/bin/env bash
# One command on one CUDA GPU (make check-gpu), under 9 minutes: the CUDA tests, the attention-level methods at 32k
# (Llama-2-7B shape) and LoRA fine-tuning from 16k up to the longest length that fits (Llama-3-8B shape), random
# weights (the embedded model is not needed). Then one table, and every result with the machine in one JSON file:
# runs/check_gpu/<UTC time>.json (the logs of each stage next to it, in runs/check_gpu/<UTC time>/).
#
# The GPU machine needs torch (CUDA), transformers, accelerate and peft; rope_patch goes on PYTHONPATH (not
# installed) and the other packages come as wheels from GPU_WHEELS (default gpu-wheels/, made here by
# `make gpu-wheels`), installed without an index into the run's folder, only those the machine lacks.
# Each stage has its own timeout, all within CHECK_GPU_BUDGET seconds; a failed or timed-out stage is a row of the
# table, not the end of the run. docs/gpu-check.md has the details.
#
#   bash scripts/check_gpu.sh                      # on the GPU machine
#   CHECK_GPU_DRY=1 bash scripts/check_gpu.sh      # here: the same stages on CPU, tiny shapes (a rehearsal)
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
DRY=${CHECK_GPU_DRY:-0}
BUDGET=${CHECK_GPU_BUDGET:-500}  # seconds for all stages: 9 minutes less the report and the kill grace of a hang
STAMP=$(date -u +%Y-%m-%dT%H-%M-%SZ)
RUNS=${CHECK_GPU_RUNS:-runs/check_gpu}
OUT=$RUNS/$STAMP
WHEELS=${GPU_WHEELS:-gpu-wheels}
mkdir -p "$OUT"
export PYTHONPATH="$ROOT/$OUT/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
START=$(date +%s)

if [ "$DRY" = 1 ]; then  # CPU, tiny shapes, short stages: every step of the real run, in a minute or two
  DEVICE=cpu
  EVAL_ARGS=(--device cpu --preset llama2-7b --smoke --repeats 1)
  FINETUNE_ARGS=(--device cpu --preset llama3-8b --smoke --lengths 1k --until-oom --variants ours --warmup 0)
  T_TESTS=${T_TESTS:-240} T_EVAL=${T_EVAL:-120} T_FINETUNE=${T_FINETUNE:-120}
  BUDGET=${CHECK_GPU_BUDGET:-900}
else
  DEVICE=cuda
  EVAL_ARGS=(--device cuda --preset llama2-7b --length 32768 --repeats 1)
  FINETUNE_ARGS=(--device cuda --preset llama3-8b --lengths 16k --until-oom
                 --variants "${FINETUNE_VARIANTS:-ours,ours+liger}")
  T_TESTS=${T_TESTS:-130} T_EVAL=${T_EVAL:-55} T_FINETUNE=${T_FINETUNE:-215}
fi

# stage NAME SECONDS COMMAND...: runs COMMAND with its output in $OUT/NAME.log, killed (with its children) after
# SECONDS or when the budget runs out; one JSON line per stage in $OUT/stages.jsonl
stage() {
  local name=$1 limit=$2 rc status began seconds left
  shift 2
  left=$((BUDGET - ($(date +%s) - START)))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 10 ]; then
    rc=-1; status="skipped: no time left in the ${BUDGET} s budget"; seconds=0
  else
    echo "== $name (at most ${limit} s): $*"
    began=$(date +%s)
    timeout -k 15 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    seconds=$(($(date +%s) - began))
    case $rc in
      0) status=ok ;;
      124|137) status="timeout after ${limit} s" ;;
      *) status="failed (exit $rc)" ;;
    esac
    tail -n 3 "$OUT/$name.log"
  fi
  "$PY" - "$OUT/stages.jsonl" "$name" "$rc" "$status" "$seconds" "$limit" "$*" <<'EOF'
import json, sys
path, name, rc, status, seconds, limit, command = sys.argv[1:]
with open(path, "a") as f:
    f.write(json.dumps({"stage": name, "rc": int(rc), "status": status, "seconds": int(seconds),
                        "timeout": int(limit), "command": command}) + "\n")
EOF
}

# set-up: the carried wheels the machine lacks, then the imports every stage needs
if [ "$DRY" = 1 ]; then
  SETUP=("$PY" -c "print('dry run: wheels not installed; the environment is used as it is')")
elif [ -d "$WHEELS" ]; then
  SETUP=("$PY" scripts/gpu_wheels.py install "$WHEELS" "$OUT/site")
else
  SETUP=("$PY" -c "print('no wheel folder $WHEELS (make gpu-wheels): the environment is used as it is')")
fi
IMPORTS='import torch, rope_patch.jobs, pytest; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
stage setup 120 bash -c "$(printf '%q ' "${SETUP[@]}") && $(printf '%q ' "$PY" -c "$IMPORTS")"

# the CUDA tests: every file with a cuda mark
mapfile -t CUDA_FILES < <(grep -rl --include='*.py' 'pytest.mark.cuda' tests | sort)
stage tests "$T_TESTS" "$PY" -m pytest -q -m cuda -p no:cacheprovider --junitxml "$OUT/tests.xml" "${CUDA_FILES[@]}"

# evaluation at 32k: no method, Self-Extend and DCA (their fused far bands)
stage eval_none "$T_EVAL" "$PY" scripts/bench_eval.py "${EVAL_ARGS[@]}" --json "$OUT/eval_none.json"
stage eval_self_extend "$T_EVAL" "$PY" scripts/bench_eval.py "${EVAL_ARGS[@]}" \
  --method "self_extend:group=8,window=1024" --json "$OUT/eval_self_extend.json"
stage eval_dca "$T_EVAL" "$PY" scripts/bench_eval.py "${EVAL_ARGS[@]}" \
  --method "dca:chunk=3584,local=512" --json "$OUT/eval_dca.json"

# LoRA fine-tuning from 16k, doubling until out of memory (the rows come as each length ends: a timeout keeps them)
stage finetune "$T_FINETUNE" "$PY" scripts/bench_finetune.py "${FINETUNE_ARGS[@]}" --json "$OUT/finetune.json"

"$PY" scripts/gpu_report.py "$OUT" --device "$DEVICE" --dry "$DRY"
