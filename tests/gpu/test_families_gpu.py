"""The new families on a GPU (issue 43): Qwen2, Qwen3, Mistral and Gemma 3 in float16 and
bfloat16 give transformers' greedy tokens with our CUDA kernels, windows included, and the
windowed decode kernels (V1, V2, version 3) agree with the torch reference on the GPU.

These run only where CUDA is present (scripts/gpu_check.sh, `make gpu-check`); on the CPU the
same kernels are tested built for the CPU (tests/kernels/test_window_cuda_on_cpu.py) and the
families in float32 (tests/models/test_families_vs_hf.py).
"""
import pytest

torch = pytest.importorskip("torch")

from tiny_models import (WINDOW, greedy_whole_sequence, pick_prompts,  # noqa: E402
                         save_tiny_model)

pytestmark = pytest.mark.lesson20

# head size 64: a size the CUDA kernels are built for (the tiny models' 16 would go to the
# reference); the prompts are longer than the window (8) so that it matters
HEAD_64 = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
               num_key_value_heads=2)
MAX_NEW = 16
CASES = [("qwen2_window", "float16"), ("qwen3", "bfloat16"), ("mistral", "float16"),
         ("gemma3", "bfloat16")]  # (few: gpu-check's stage 2 has about 20 s to spare)
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """kind -> (path, prompts with a clear float64 greedy path), made once per kind."""
    made = {}

    def get(kind):
        if kind not in made:
            path = tmp_path_factory.mktemp(kind)
            shape = dict(HEAD_64, head_dim=64) if kind.startswith(("qwen3", "gemma3")) \
                else HEAD_64
            model = save_tiny_model(kind, path, seed=11, **shape)
            prompts = pick_prompts(model, [5, 3 * WINDOW + 5], MAX_NEW, seed=1, min_gap=0.1,
                                   tries=200)
            made[kind] = str(path), model, prompts
        return made[kind]

    return get


def hf_greedy(model, prompts, dtype) -> list[list[int]]:
    """transformers in ``dtype`` on the GPU, each prompt alone, the whole sequence each step."""
    return greedy_whole_sequence(model, prompts, MAX_NEW, dtype)


@pytest.mark.parametrize("kind, dtype", CASES)
def test_a_family_in_half_precision_gives_transformers_greedy_tokens(saved, kind, dtype):
    from minipaged import LLM, SamplingParams
    from minipaged.kernels import ops

    path, model, prompts = saved(kind)
    want = hf_greedy(model, prompts, DTYPES[dtype])
    before = ops.calls["paged_attention", "cuda"]
    llm = LLM(path, dtype=dtype, device="cuda", gpu_memory_utilization=0.2, block_size=16)
    outs = llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                        sampling_params=SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                       ignore_eos=True))
    llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == want
    assert ops.calls["paged_attention", "cuda"] > before  # our kernels decoded, windows too


def _cpu_window_tests():
    """tests/kernels/test_window_cuda_on_cpu.py, for its inputs and its check (the same test)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "kernels" / "test_window_cuda_on_cpu.py"
    spec = importlib.util.spec_from_file_location("window_cuda_on_cpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("version", [1, 2, 3])
@pytest.mark.parametrize("window", [37])  # (the CPU build's tests take every window)
def test_windowed_decode_kernels_match_the_reference_on_the_gpu(kernels, dtype, version,
                                                                window):
    """N(0,1) inputs, blocks shuffled; the blocks a window hides hold NaN (never read)."""
    check, windowed_batch = _cpu_window_tests().check, _cpu_window_tests().windowed_batch
    inputs, ref = windowed_batch([1, 17, 100, 700], window, num_heads=8, num_kv_heads=2,
                                 head_size=128, dtype=dtype, seed=version)
    on_gpu = [t.cuda() if isinstance(t, torch.Tensor) else t for t in inputs]
    out = torch.full(on_gpu[0].shape, float("nan"), dtype=dtype, device="cuda")
    kernels.paged_attention(*on_gpu, out=out, version=version, window=window)
    check(out.cpu(), ref, dtype, f"GPU V{version}")
