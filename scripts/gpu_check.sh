#!/usr/bin/env bash
# On a CUDA machine: build the kernels, run tests/gpu, then the decode-kernel benchmark.
# Uses the machine's own python3 with torch, transformers, numpy and pytest; installs nothing.
# The lead wires it into `make gpu-check`.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu-check: python3's torch sees no CUDA GPU; run this on a GPU machine" >&2
  exit 1
fi
python3 -c 'import torch; print("gpu-check:", torch.cuda.get_device_name(),
                               "| torch", torch.__version__, "| CUDA", torch.version.cuda)'

python3 -m pytest tests/gpu -q -p no:cacheprovider
python3 benchmarks/kernel.py
# The engine at scale (issue 6): LLaMA-7B-shaped and GPT-2-shaped dummy models, ShareGPT-like trace.
python3 benchmarks/throughput.py --device cuda --dtype float16 --dummy gpt2 --trace sharegpt \
  --num-requests 1000 --prompt-len 4 1024 --output-len 4 1024 --max-total 1024 --static-batch 64
python3 benchmarks/throughput.py --device cuda --dtype float16 --dummy llama-7b --trace sharegpt \
  --num-requests 1000 --prompt-len 4 1024 --output-len 4 1024 --max-total 2048 --static-batch 32
# The same engine without CUDA graphs (decode steps launched eagerly), minipaged only.
python3 benchmarks/throughput.py --device cuda --dtype float16 --dummy gpt2 --trace sharegpt \
  --num-requests 1000 --prompt-len 4 1024 --output-len 4 1024 --max-total 1024 --enforce-eager \
  --skip static,continuous
