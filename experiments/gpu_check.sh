#!/usr/bin/env bash
# The GPU paths in one short run, for a lent GPU machine:
#
#   bash experiments/gpu_check.sh            # from the repository root; about 8 minutes
#
# 1. the environment: nvidia-smi, torch's CUDA and NCCL versions;
# 2. the `gpu`-marked tests (tests/e2e/gpu/test_gpu.py: digits on NCCL, the backend tag, the model);
# 3. both fault-tolerance modes on NCCL: `restart` and `per_step` (torchft), one worker per
#    GPU, and, with one GPU, also two workers packed on it (scaling.gpus_per_worker=0.5),
#    which NCCL may refuse (two ranks of one process group on one device): the line says
#    which (PACKED=0 leaves the packed runs out);
# 4. the gpt preset's tokens/s on one GPU (bf16 autocast) and its model FLOPs utilization,
#    MFU = 6 x parameters x tokens/s / peak FLOP/s (Kaplan et al. 2020, "Scaling Laws for
#    Neural Language Models", C = 6N per token; the attention term is left out, as in
#    PaLM's appendix B for short contexts). PEAK_TFLOPS overrides the peak (default: the
#    bf16 dense peak of the GPU named by nvidia-smi, H100/H200 989, A100 312).
#
# 5. a sharded asynchronous checkpoint of a 1.0B-parameter model (CKPT_SIZE): blocked
#    seconds against the step, beside plain DCP async_save.
#
# Every step has its own time limit and writes its whole output to $OUT (default
# /tmp/gpu_check); a step that fails prints its tail and the script goes on. The exit
# status is the number of failed steps among 2-5 (the packed two-worker runs of step 3
# are reported, never counted: NCCL refusing them is an answer, not a defect).
# Python: $PYTHON, else .venv/bin/python, else python3; it must have this package, torch
# with CUDA, ray[train], mlflow and torchft installed (the machine may have no network).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
[[ -z "$PY" && -x .venv/bin/python ]] && PY=.venv/bin/python
PY=${PY:-python3}
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export RAY_USAGE_STATS_ENABLED=0
unset RAY_ADDRESS MLFLOW_TRACKING_URI || true
failed=0
T0=$SECONDS

step() {  # step NAME LIMIT_S COUNTS(1|0) CMD...: run, log, report
    local name=$1 limit=$2 counts=$3 rc
    shift 3
    echo "=== $name (limit ${limit}s, at $((SECONDS - T0))s)"
    timeout --kill-after=15 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    if [[ $rc -eq 0 ]]; then
        echo "$name: ok"
    else
        echo "$name: FAILED (exit $rc; 124 = over its time limit); tail of $OUT/$name.log:"
        tail -n 15 "$OUT/$name.log" | sed 's/^/  | /'
        [[ "$counts" == 1 ]] && failed=$((failed + 1))
    fi
    return $rc
}

echo "=== env"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "no nvidia-smi"
"$PY" - <<'EOF' || { echo "torch/CUDA not usable with $PY"; exit 99; }
import torch
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
print(f"torch {torch.__version__} cuda {torch.version.cuda} nccl {torch.cuda.nccl.version()} "
      f"gpus {torch.cuda.device_count()} ({torch.cuda.get_device_name(0)}) "
      f"bf16 {torch.cuda.is_bf16_supported()}")
EOF
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
CLI=("$PY" -m elastic_ddp)

step prepare 120 1 bash -c "${CLI[*]} prepare digits $OUT/digits >/dev/null && \
    ${CLI[*]} prepare pycode $OUT/pycode --num-files 2 --max-bytes 2000000 >/dev/null"

step gpu_tests 150 1 "$PY" -m pytest -m gpu -q -p no:cacheprovider tests/e2e/gpu/test_gpu.py

DIGITS=(--set "data.train_path=$OUT/digits/train" --set "data.val_path=$OUT/digits/val"
        --set scaling.use_gpu=true --set train.epochs=2 --set "run.storage_path=$OUT/ray_results"
        --set "run.tracking_uri=sqlite:///$OUT/mlflow.db" --no-progress)
WS=$(( NGPU >= 2 ? 2 : 1 ))
for mode in restart per_step; do
    step "ft_${mode}_ws${WS}" 120 1 "${CLI[@]}" train experiments/configs/digits_cnn.yaml "${DIGITS[@]}" \
        --set scaling.fault_tolerance=$mode --set scaling.min_workers=1 --set scaling.max_workers=$WS \
        --set "run.name=gpu-$mode-ws$WS" --set scaling.max_failures=0
    if [[ "$NGPU" -eq 1 && "${PACKED:-1}" != 0 ]]; then
        step "ft_${mode}_2_on_1_gpu" 90 0 "${CLI[@]}" train experiments/configs/digits_cnn.yaml "${DIGITS[@]}" \
            --set scaling.fault_tolerance=$mode --set scaling.min_workers=2 --set scaling.max_workers=2 \
            --set scaling.gpus_per_worker=0.5 --set "run.name=gpu-$mode-packed" --set scaling.max_failures=0
    fi
done

if step gpt_1gpu 150 1 "${CLI[@]}" train experiments/configs/pycode_gpt.yaml --json --no-progress \
        --set "data.train_path=$OUT/pycode/train" --set "data.val_path=$OUT/pycode/val" \
        --set scaling.use_gpu=true --set scaling.min_workers=1 --set scaling.max_workers=1 \
        --set parallel.bf16=true --set train.max_steps=300 --set "run.name=gpu-gpt" \
        --set "run.storage_path=$OUT/ray_results" --set "run.tracking_uri=sqlite:///$OUT/mlflow.db"; then
    "$PY" - "$OUT" <<'EOF'
import json, os, subprocess, sys
from mlflow.tracking import MlflowClient
out = sys.argv[1]
text = open(f"{out}/gpt_1gpu.log").read()
summary = json.loads(text[text.index("\n{") + 1:] if not text.startswith("{") else text)
c = MlflowClient(f"sqlite:///{out}/mlflow.db")
run = c.get_run(summary["run_id"])
n = int(run.data.params["model.parameters"])
tps = [m.value for m in c.get_metric_history(run.info.run_id, "tokens_per_s")]
steady = sorted(tps[len(tps) // 2:])  # the second half: past compilation and warm-up
tok_s = steady[len(steady) // 2]
name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                      capture_output=True, text=True).stdout.splitlines()[0]
peak = float(os.environ.get("PEAK_TFLOPS") or
             next((v for k, v in (("H200", 989), ("H100", 989), ("A100", 312), ("L4", 121),
                                  ("A10", 125)) if k in name), 0)) * 1e12
mfu = 6 * n * tok_s / peak if peak else float("nan")
print(f"gpt preset on 1 GPU ({name}): {n} parameters, {tok_s:,.0f} tokens/s (median of the "
      f"second half of the log steps), MFU {mfu:.2%} of {peak / 1e12:.0f} TFLOP/s bf16")
EOF
fi
# 5. A sharded asynchronous checkpoint of a large model (CKPT_SIZE, n_layer x n_embd of the
#    widened gpt; 20x2048 is 1.0B parameters: 12 GB of fp32 model and AdamW state staged,
#    16 GB on the GPU with the gradients): blocked seconds (staging into pinned host memory)
#    against one training step, beside plain DCP async_save, one GPU per rank (at most 2). Each path writes 2 checkpoints of the state
#    into /tmp, so the disk needs twice the state free.
CKPT_SIZE=${CKPT_SIZE:-20x2048}
step ckpt_sharded_async 420 1 "$PY" experiments/bench_checkpoint.py --device cuda --nproc "$WS" \
    --sizes "$CKPT_SIZE" --strategies fsdp --paths sharded_async,dcp_async --repeat 1 \
    && cat "$OUT/ckpt_sharded_async.log"
echo "=== done in $((SECONDS - T0))s; failed steps: $failed; logs in $OUT"
exit "$failed"
