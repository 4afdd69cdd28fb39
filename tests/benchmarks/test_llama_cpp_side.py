"""benchmarks/gguf_decode.py's llama.cpp side: run by another environment's python, its answer
read back, its failures said as "not measured"; the CPU's vector instructions read from its
flags. (A stand-in "python" here: llama-cpp-python is never installed with minipaged.)"""
import os
import stat
import sys

import pytest

from repo_paths import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from gguf_decode import llama_cpp_rounds  # noqa: E402
from machine import cpu_features  # noqa: E402


def _fake_python(tmp_path, body: str) -> str:
    path = tmp_path / "python"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_llama_cpp_rounds_reads_the_other_processs_answer(tmp_path):
    python = _fake_python(tmp_path, 'echo "$@" > "$(dirname "$0")/args"\n'
                                    'echo \'{"version": "0.3.36", "tokens_per_s": [120.0, 125.5],'
                                    ' "tokens": [5, 6, 7]}\'\n')
    rates, tokens, version = llama_cpp_rounds(python, "/m.gguf", [1, 2, 3], 128, 2, 2)
    assert rates == [120.0, 125.5] and tokens == [5, 6, 7]
    assert version == "llama-cpp-python 0.3.36"
    args = (tmp_path / "args").read_text().split()
    assert args[0].endswith("benchmarks/llama_cpp_decode.py") and args[1] == "/m.gguf"
    assert args[2:] == ["--prompt-ids", "1,2,3", "--tokens", "128", "--repeats", "2",
                        "--threads", "2"]


def test_llama_cpp_rounds_says_why_it_was_not_measured(tmp_path):
    with pytest.raises(ValueError, match="not measured: no llama-cpp-python environment"):
        llama_cpp_rounds(None, "/m.gguf", [1], 8, 1, 2)
    with pytest.raises(ValueError, match="is not a file"):
        llama_cpp_rounds(str(tmp_path / "nothing"), "/m.gguf", [1], 8, 1, 2)
    failing = _fake_python(tmp_path, 'echo "No module named llama_cpp" >&2\nexit 1\n')
    with pytest.raises(ValueError, match="failed: No module named llama_cpp"):
        llama_cpp_rounds(failing, "/m.gguf", [1], 8, 1, 2)


def test_cpu_features_come_from_the_flags_only():
    info = "model name\t: Some CPU\nflags\t\t: fpu sse2 avx2 fma f16c avx512f avx512_bf16\n"
    assert cpu_features(info) == ["AVX2", "FMA", "F16C", "AVX-512F", "AVX-512 BF16"]
    assert cpu_features("flags\t\t: fpu sse2 avx\n") == []  # (AVX without AVX2: nothing we name)
    assert cpu_features("Features\t: fp asimd\n") == ["NEON"]
    assert cpu_features("") == []
