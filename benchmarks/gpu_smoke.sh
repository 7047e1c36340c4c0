#!/usr/bin/env bash
# The paper's path on one GPU, in under 10 minutes and without the model hub: one PASS/FAIL line
# per check. Two modes:
#
#   benchmarks/gpu_smoke.sh [WORK_DIR]
#
# A GPU machine that reaches a package index. It installs bird-rl[train,vllm] as a GPU user does
# (a fresh virtual environment in WORK_DIR), builds a random-weight Qwen2 model from a config with
# the project's offline tokenizer and two EOS ids (benchmarks/gpu_smoke.py build), then checks
# `birdtrain plan`, stages 3 and 4 for two steps each with vLLM colocated, LoRA, bfloat16 and
# gradient checkpointing, that the weight sync leaves the frozen base untouched, `birdtrain eval
# --engine vllm`, and the peak GPU memory of each stage against `birdtrain plan`'s figure for the
# same shapes. Every log stays in WORK_DIR (a new temporary folder when none is given; its path is
# printed first and last).
#
#   benchmarks/gpu_smoke.sh --device [--dry-run] [OUT_DIR]
#
# A GPU machine with no network whose Python already holds CUDA's torch and transformers: the
# wheels `make device-wheels` put in .whl/ are installed beside them, and a model of
# Qwen2.5-Coder-7B-Instruct's exact shape trains without vLLM; logs and summary.json go to OUT_DIR
# (default $OUT). benchmarks/gpu_smoke_device.py says what it checks; --dry-run runs the same on a
# CPU with a tiny model.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --device ]; then
    shift
    exec "${PYTHON:-python3}" benchmarks/gpu_smoke_device.py run "$@"
fi
WORK=$(realpath -m "${1:-$(mktemp -d)}")
mkdir -p "$WORK"
VENV="$WORK/venv"
PY="$VENV/bin/python"
export HF_HUB_OFFLINE=1 BIRDENV_HOME="$WORK/home" PYTHONUNBUFFERED=1
MODEL="$WORK/qwen2-random"
failed=0
echo "logs: $WORK"
trap 'echo "logs: $WORK"' EXIT

say() { # NAME STATUS DETAIL
    echo "$2 $1${3:+: $3}"
    [ "$2" = PASS ] || failed=1
}

result() { # LOG: the JSON line a gpu_smoke.py command printed
    grep '^RESULT ' "$1" | tail -n 1 | cut -d' ' -f2-
}

field() { # JSON EXPRESSION: a Python expression over the parsed JSON `r`
    "$PY" -c 'import json, sys; r = json.loads(sys.argv[1]); print(eval(sys.argv[2]))' "$1" "$2"
}

# install
if python3 -m venv "$VENV" >"$WORK/install.log" 2>&1 &&
    "$PY" -m pip install --quiet --upgrade pip >>"$WORK/install.log" 2>&1 &&
    "$PY" -m pip install --quiet -e ".[train,vllm]" >>"$WORK/install.log" 2>&1 &&
    "$PY" -c 'import torch, vllm; assert torch.cuda.device_count() == 1, "one GPU"' \
        >>"$WORK/install.log" 2>&1; then
    say install PASS "$("$PY" -c 'import torch, transformers, trl, vllm; print(f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, vllm {vllm.__version__}, {torch.cuda.get_device_name()}")')"
else
    say install FAIL "see $WORK/install.log"
    exit 1
fi
GPU_GB=$("$PY" -c 'import torch; print(torch.cuda.get_device_properties(0).total_memory / 1e9)')

# birdtrain plan: the paper's preset on this card, and the check's own model
if "$VENV/bin/birdtrain" plan --preset paper-7b --gpu-gb "$GPU_GB" >"$WORK/plan.log" 2>&1 &&
    "$PY" benchmarks/gpu_smoke.py build "$MODEL" >"$WORK/build.log" 2>&1 &&
    "$PY" benchmarks/gpu_smoke.py plan "$MODEL" "$GPU_GB" >>"$WORK/plan.log" 2>&1; then
    PLAN=$(result "$WORK/plan.log")
    say "birdtrain plan" PASS "paper-7b fits this card; check model: $PLAN"
else
    say "birdtrain plan" FAIL "see $WORK/plan.log (paper-7b does not fit, or the build failed)"
    PLAN=""
fi

# stage 3 (two steps), then the weight sync's checks on what it left
if timeout 240 "$PY" benchmarks/gpu_smoke.py stage3 "$MODEL" "$WORK/stage3" >"$WORK/stage3.log" 2>&1; then
    S3=$(result "$WORK/stage3.log")
    if [ "$(field "$S3" 'r["steps"] == 2 and r["adapters_trained"]')" = True ]; then
        say "stage 3, 2 steps, vLLM colocate + LoRA + bf16 + checkpointing" PASS \
            "sampling logp gap per token $(field "$S3" 'r["logp_difference"]')"
    else
        say "stage 3, 2 steps, vLLM colocate + LoRA + bf16 + checkpointing" FAIL "$S3"
    fi
    if [ "$(field "$S3" 'not r["base_changed"] and r["reference_kept"] and r["synced"] == r["from_merged_checkpoint"]')" = True ]; then
        say "weight sync leaves the base untouched, vLLM holds the merged weights" PASS
    else
        say "weight sync leaves the base untouched, vLLM holds the merged weights" FAIL \
            "changed: $(field "$S3" 'r["base_changed"][:5]')"
    fi
else
    S3=""
    say "stage 3, 2 steps, vLLM colocate + LoRA + bf16 + checkpointing" FAIL "see $WORK/stage3.log"
    say "weight sync leaves the base untouched, vLLM holds the merged weights" FAIL "stage 3 failed"
fi

# stage 4 (two steps)
if timeout 240 "$PY" benchmarks/gpu_smoke.py stage4 "$MODEL" "$WORK/stage4" >"$WORK/stage4.log" 2>&1; then
    S4=$(result "$WORK/stage4.log")
    say "stage 4, 2 steps, vLLM colocate + LoRA + bf16 + checkpointing" PASS \
        "steps $(field "$S4" '[x["step"] for x in r["records"] if "loss" in x]')"
else
    S4=""
    say "stage 4, 2 steps, vLLM colocate + LoRA + bf16 + checkpointing" FAIL "see $WORK/stage4.log"
fi

# birdtrain eval --engine vllm
if timeout 180 "$VENV/bin/birdtrain" eval --policy "$MODEL" --engine vllm --suite critic-mini \
    --limit 4 --mode agent --max-turns 2 --max-new-tokens 64 --num-envs 4 --max-context 8192 \
    --gpu-memory-utilization 0.5 --out "$WORK/eval" >"$WORK/eval.log" 2>&1 &&
    [ -f "$WORK/eval/summary.json" ]; then
    say "birdtrain eval --engine vllm" PASS "$(grep -m1 '^\[eval' "$WORK/eval.log")"
else
    say "birdtrain eval --engine vllm" FAIL "see $WORK/eval.log"
fi

# peak GPU memory against the plan's figure for the same shapes
for stage in 3 4; do
    json=$([ "$stage" = 3 ] && echo "$S3" || echo "$S4")
    if [ -n "$json" ] && [ -n "$PLAN" ]; then
        measured=$(field "$json" 'round(r["peak_gb"], 2)')
        planned=$(field "$PLAN" "round(r['stage$stage']['peak_gb'], 2)")
        if [ "$("$PY" -c "print($measured <= $planned)")" = True ]; then
            say "stage $stage peak GPU memory within the plan" PASS "$measured GB measured, $planned GB planned"
        else
            say "stage $stage peak GPU memory within the plan" FAIL "$measured GB measured, $planned GB planned"
        fi
    else
        say "stage $stage peak GPU memory within the plan" FAIL "no figure (stage or plan failed)"
    fi
done
exit "$failed"
