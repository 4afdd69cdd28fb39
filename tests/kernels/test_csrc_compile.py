"""Lesson 05: the CUDA sources compile for Ampere (sm_80) and Hopper (sm_90), no GPU needed.

Every csrc/*.cu is built with nvcc into a temporary directory, with the macros torch's extension
builder adds (they switch off implicit half/bfloat16 conversions, which the kernels must not rely
on). The torch binding needs a CUDA build of torch to compile, so here it is only checked as text:
csrc/kernels.h, which it includes, must declare every extern "C" launcher with exactly the
parameter types the .cu files define (the .cu files include it too, so nvcc also checks), and the
binding must call every one of them.

Slow (left out of `make test`): the two nvcc builds, minutes where nvcc is installed (skipped
elsewhere); not measured this session.
"""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from repo_paths import ROOT

pytestmark = pytest.mark.lesson05

CSRC = ROOT / "csrc"
CU_FILES = sorted(CSRC.glob("*.cu"))
BINDING = CSRC / "torch_bindings.cpp"
DECLARATIONS = CSRC / "kernels.h"  # the extern "C" interface, included by the binding


def find_nvcc():
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


NVCC = find_nvcc()
TORCH_LIKE_MACROS = [
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
]


def test_there_are_kernels_to_compile():
    names = {p.name for p in CU_FILES}
    assert {"paged_attention.cu", "cache_kernels.cu"} <= names


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="nvcc not found (PATH or /usr/local/cuda/bin)")
@pytest.mark.parametrize("source", CU_FILES, ids=lambda p: p.name)
def test_cu_file_compiles_for_sm80_and_sm90(source, tmp_path):
    compile_for_gpus(source, tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="nvcc not found (PATH or /usr/local/cuda/bin)")
def test_vllms_key_load_compiles_for_the_gpu_too(tmp_path):
    """MINIPAGED_SHARED_GROUP_LOAD (lesson 05's comparison) is off in every GPU build, but its
    code must stay valid CUDA: compiled here for sm_90 with the switch on (head size 64 and
    block size 16 only, to keep it short)."""
    compile_for_gpus(CSRC / "paged_attention.cu", tmp_path, archs=("90",),
                     macros=["-DMINIPAGED_SHARED_GROUP_LOAD", "-DMINIPAGED_FEW_INSTANCES"])


def compile_for_gpus(source, tmp_path, archs=("80", "90"), macros=()):
    cmd = [
        NVCC, "-c", str(source), "-o", str(tmp_path / (source.stem + ".o")),
        "-std=c++17", "-O2",
        *(f for a in archs for f in ("-gencode", f"arch=compute_{a},code=sm_{a}")),
        "-Xcompiler", "-fPIC",
        "--threads", "0",  # the two architectures in parallel
        *TORCH_LIKE_MACROS, *macros,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "LC_ALL": "C"})
    assert result.returncode == 0, f"nvcc failed:\n{result.stderr}"
    ours = [line for line in result.stderr.splitlines()
            if source.name in line and "warning" in line.lower()]
    assert not ours, "compiler warnings in our code:\n" + "\n".join(ours)
    assert (tmp_path / (source.stem + ".o")).stat().st_size > 0


def test_cu_files_are_plain_cuda_without_torch():
    for source in CU_FILES:
        includes = re.findall(r"#include\s*[<\"]([^>\"]+)[>\"]", source.read_text())
        assert not [i for i in includes if "torch" in i or "ATen" in i or "c10" in i], source.name


# ----------------------------------------------------------------------------------------------
# The binding, as text
# ----------------------------------------------------------------------------------------------
def _strip_comments(text):
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _param_types(params):
    """'const void* key, int n' -> ('const void*', 'int'): drop each parameter's name."""
    types = []
    for param in params.split(","):
        param = " ".join(param.split())
        if not param or param == "void":
            continue
        param = re.sub(r"\s*\*\s*", "* ", param).strip()
        types.append(re.sub(r"\s+\w+$", "", param).replace("* ", "*").strip())
    return tuple(types)


def launcher_definitions():
    """{name: parameter types} of every extern "C" function defined in csrc/*.cu and the
    kernel parts they include (csrc/*.cuh)."""
    found = {}
    for source in [*CU_FILES, *sorted(CSRC.glob("*.cuh"))]:
        text = _strip_comments(source.read_text())
        for name, params in re.findall(r'extern\s+"C"\s+int\s+(\w+)\s*\(([^)]*)\)\s*\{', text):
            found[name] = _param_types(params)
    return found


def binding_declarations():
    assert '#include "kernels.h"' in BINDING.read_text()
    text = _strip_comments(DECLARATIONS.read_text())
    block = re.search(r'extern\s+"C"\s*\{(.*?)\n\}', text, flags=re.S)
    assert block, 'kernels.h must declare the launchers in an extern "C" { } block'
    return {name: _param_types(params)
            for name, params in re.findall(r"int\s+(\w+)\s*\(([^)]*)\)\s*;", block.group(1))}


def test_binding_declares_every_launcher_with_matching_types():
    defined = launcher_definitions()
    declared = binding_declarations()
    assert {"minipaged_paged_attention", "minipaged_reshape_and_cache", "minipaged_copy_blocks",
            "minipaged_swap_blocks"} <= set(defined)
    assert set(declared) == set(defined)
    for name, types in defined.items():
        assert declared[name] == types, f"{name}: binding {declared[name]} != kernel {types}"


def test_binding_calls_every_launcher_and_exports_the_ops():
    text = _strip_comments(BINDING.read_text())
    body = text[text.index("namespace {"):]
    for name in launcher_definitions():
        assert re.search(rf"\b{name}\s*\(", body), f"{name} is declared but never called"
    cpu_only = text[text.index("#ifdef MINIPAGED_CUDA_ON_CPU", text.index("PYBIND11_MODULE")):]
    exported = set(re.findall(r'm\.def\(\s*"(\w+)"', text.replace(cpu_only, "")))
    assert exported == {"paged_attention", "paged_attention_plan", "paged_attention_v1_limits",
                        "force_partition_size", "set_v2_reduce", "reshape_and_cache",
                        "copy_blocks", "swap_blocks",
                        "paged_attention_8bit", "reshape_and_cache_8bit",  # (lesson 18)
                        "rms_norm", "rotary", "silu_and_mul",  # (layer_kernels.cu)
                        "gguf_linear"}  # (gguf_matmul.cu)
    # the CPU build (minipaged.kernels.cuda_on_cpu) adds the emulated device's controls only: the device
    # number, the switch that skips the host-data checks as a GPU must, the launch counters, the
    # one-warp shuffle trace and the MP_TRACE event record that lesson 06 draws, and the order
    # of the blocks (the fused reduce's tests)
    assert set(re.findall(r'm\.def\(\s*"(\w+)"', cpu_only)) == {
        "set_device", "set_host_checks", "counters", "trace_warp", "take_warp_trace",
        "trace_events", "take_events", "set_block_order"}
    assert "getCurrentCUDAStream" in text and "CUDAGuard" in text
