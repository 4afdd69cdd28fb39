#!/usr/bin/env bash
# Writes the tested resolutions that `make demo`, `make test` and CI install (README, "The
# lock"): requirements/lock-cpu.txt for these machines (torch's CPU build from the local wheel
# folder, $PIP_FIND_LINKS) and requirements/lock-cuda.txt for a CUDA machine that reaches PyPI
# (its torch is PyPI's CUDA build of the same version). pyproject.toml keeps the ranges the
# package supports; the locks pin one resolution of them, for CPython 3.11 on x86-64 Linux.
# After this, `make test-all` with the new locks, then commit them.
set -euo pipefail
cd "$(dirname "$0")/.."
UV=${UV:-.venv/bin/uv}
TORCH=$(sed -n 's/.*torch==\([0-9.]*\).*/\1/p' Makefile | head -1)
common=(pyproject.toml --extra test --extra lessons --extra ray --python-version 3.11
        --python-platform x86_64-manylinux_2_28 --no-header --quiet)
links=${PIP_FIND_LINKS:+--find-links $PIP_FIND_LINKS}
"$UV" pip compile "${common[@]}" $links -c <(echo "torch==$TORCH") -o requirements/lock-cpu.txt
"$UV" pip compile "${common[@]}" -c <(echo "torch==$TORCH") -o requirements/lock-cuda.txt
grep -q "^torch==$TORCH+cpu" requirements/lock-cpu.txt \
  || { echo "lock-cpu.txt did not take torch's CPU build (is \$PIP_FIND_LINKS set?)" >&2; exit 1; }
echo "wrote requirements/lock-cpu.txt ($(grep -c '^[a-z]' requirements/lock-cpu.txt) pins) and" \
     "requirements/lock-cuda.txt ($(grep -c '^[a-z]' requirements/lock-cuda.txt) pins), torch $TORCH"
