#!/usr/bin/env bash
# `make cuda-ext-check`: on a machine without a GPU, build the real CUDA extension (csrc/*.cu +
# csrc/torch_bindings.cpp) with nvcc against a CUDA build of torch, check the library, and call
# every error path reachable without a GPU (each must raise a RuntimeError with its message).
# The CUDA build of torch (about 5.5 GB) goes into a separate environment, never into .venv:
#   $1 or $CUDA_TORCH_ENV (default /tmp/minipaged-cuda-torch), made on first use.
set -euo pipefail
cd "$(dirname "$0")/.."
env_dir=${1:-${CUDA_TORCH_ENV:-/tmp/minipaged-cuda-torch}}
torch_version=${CUDA_TORCH_VERSION:-2.14.1}

command -v nvcc >/dev/null || { echo "cuda-ext-check: nvcc is not on PATH" >&2; exit 1; }
if [ -z "${CUDA_HOME:-}" ]; then
  # the toolkit nvcc really runs from (/usr/local/bin/nvcc may be a wrapper script)
  top=$(nvcc -v --dryrun -x cu /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n 1)
  CUDA_HOME=$(cd "${top:-/usr/local/cuda}" && pwd -P)
  export CUDA_HOME
fi
if ! "$env_dir/bin/python" -c 'import sys, torch, tqdm, transformers; sys.exit(torch.version.cuda is None)' 2>/dev/null; then
  echo "cuda-ext-check: installing torch==$torch_version (CUDA build) into $env_dir (once, ~5.5 GB)"
  python3 -m venv "$env_dir"
  "$env_dir/bin/pip" install -q "torch==$torch_version" ninja numpy tqdm transformers
fi
echo "cuda-ext-check: CUDA_HOME=$CUDA_HOME, $("$env_dir/bin/python" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)')"
PYTHONPATH="$PWD" "$env_dir/bin/python" scripts/check_compiled_ops.py --backends cuda
