"""Lesson 08 on a GPU: the whole engine, running our CUDA kernels, gives transformers' tokens.

Tiny random GPT-2 and LLaMA models (head size 64, so the CUDA kernel is used rather than the
fallback) are saved with save_pretrained; prompts are picked so that the float64 greedy path has
a clear gap between the top two logits at every step (tests/helpers/tiny_models.py), so any correct
float32 implementation must produce the same tokens.
"""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_models import pick_prompts, save_tiny_model  # noqa: E402  (tests/ is on sys.path)

pytestmark = pytest.mark.lesson08

BLOCK = 16
LENGTHS = [1, BLOCK, BLOCK + 1, 3 * BLOCK + 5, 70]  # one token, one block, a block + 1, many
MAX_NEW = 40
HEAD_64 = {  # the kernel is built for head sizes 64, 80, 96, 128
    "gpt2": dict(n_embd=128, n_head=2),
    "llama": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  num_key_value_heads=2),  # grouped-query attention: 2 heads per kv head
}


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def case(request, tmp_path_factory):
    """(model directory, prompts, transformers' greedy tokens on CUDA) for one architecture."""
    kind = request.param
    path = tmp_path_factory.mktemp(f"tiny_{kind}_cuda")
    model = save_tiny_model(kind, path, seed=3, **HEAD_64[kind])
    prompts = pick_prompts(model, LENGTHS, MAX_NEW, seed=5)
    model = model.to("cuda").float()
    refs = [cuda_greedy(model, p, MAX_NEW) for p in prompts]
    return str(path), prompts, refs


@torch.no_grad()
def cuda_greedy(model, prompt, max_new_tokens):
    """Greedy decoding with transformers on the GPU, recomputing the whole prefix each step."""
    ids = torch.tensor([prompt], device="cuda")
    for _ in range(max_new_tokens):
        next_id = model(ids).logits[0, -1].argmax()
        ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


@pytest.fixture
def kernel_calls(kernels, monkeypatch):
    """Counts calls of the compiled paged-attention kernel (proof that the engine used it)."""
    calls = []
    original = kernels.paged_attention

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(kernels, "paged_attention", counting)
    return calls


def generate(path, prompts, **engine_kwargs):
    from minipaged import LLM, SamplingParams

    llm = LLM(model=path, dtype="float32", device="cuda", block_size=BLOCK, **engine_kwargs)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def test_engine_on_cuda_matches_transformers(case, kernel_calls):
    path, prompts, refs = case
    _, tokens = generate(path, prompts, num_gpu_blocks=None)
    assert tokens == refs
    assert kernel_calls, "the engine never called the CUDA paged-attention kernel"


def test_engine_on_cuda_with_a_tiny_pool_preempts_and_matches(case, kernel_calls):
    path, prompts, refs = case
    # The longest request needs ceil((70 + 40) / 16) = 7 blocks; 10 cannot hold them all.
    # (10 blocks hold 160 tokens, less than the model's 256: max_model_len must say so.)
    llm, tokens = generate(path, prompts, num_gpu_blocks=10, watermark=0.0, max_model_len=160)
    assert tokens == refs
    stats = llm.llm_engine.stats
    assert stats.num_preemptions_recompute + stats.num_preemptions_swap > 0
    assert kernel_calls


def test_engine_on_cuda_with_chunks_and_cached_prefixes_matches(case, kernel_calls):
    """Chunked prefill with a 16-token budget (longer prompts take several steps, each chunk
    attending to the KV already in the paged cache) and prefix caching (the same prompts again:
    their full blocks come from the cache) on CUDA: the same tokens as transformers."""
    from minipaged import SamplingParams

    path, prompts, refs = case
    llm, tokens = generate(path, prompts, max_num_batched_tokens=16,
                           enable_chunked_prefill=True, enable_prefix_caching=True)
    assert tokens == refs
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    again = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == refs
    assert llm.llm_engine.stats.num_cached_prompt_tokens > 0
    assert kernel_calls


def test_a_steps_inputs_reach_the_gpu_in_one_copy_unchanged():
    """prepare_inputs packs a step's nine tensors into one pinned buffer and one copy
    (model_runner.to_device_at_once): on the GPU they equal the host's, dtype and shape."""
    from minipaged.worker.model_runner import to_device_at_once

    host = [torch.arange(5), torch.tensor([7, -1, 3], dtype=torch.int32),
            torch.zeros(0, 0, dtype=torch.int32),
            torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32), torch.empty(0).long()]
    on_gpu = to_device_at_once(host, torch.device("cuda"))
    torch.cuda.synchronize()
    for h, g in zip(host, on_gpu):
        assert g.is_cuda and g.dtype == h.dtype and g.shape == h.shape
        assert torch.equal(g.cpu(), h)
