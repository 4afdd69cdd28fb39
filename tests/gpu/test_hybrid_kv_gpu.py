"""KV cache groups on a GPU (issue 57): a tiny Gemma 3 in bfloat16 with our CUDA kernels gives
the same greedy tokens with groups (the sliding layers' blocks given back as they leave the
window) as without them, and as transformers; and the sliding group really held fewer blocks.
Groups are off on CUDA until this has passed there (``engine/cache_setup.GROUPS_ON_CUDA``): the
test turns them on, eagerly and with CUDA graphs.

Runs only where CUDA is present (`make gpu-check`, its tests-gpu stage); on the CPU the same
property is tested over random workloads (tests/core/test_hybrid_kv_groups_properties.py).
"""
import pytest

torch = pytest.importorskip("torch")

from tiny_models import (WINDOW, greedy_whole_sequence, pick_prompts,  # noqa: E402
                         save_tiny_model)

pytestmark = pytest.mark.lesson20

MAX_NEW = 24  # with the prompts below, every sequence ends well past the window (8)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3_groups")
    model = save_tiny_model("gemma3", path, seed=11, hidden_size=256, intermediate_size=512,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    prompts = pick_prompts(model, [5, 3 * WINDOW + 5, 6 * WINDOW + 1], MAX_NEW, seed=2,
                           min_gap=0.1, tries=200)
    return str(path), model, prompts


def _ours(path, prompts, groups: bool, eager: bool = False):
    from minipaged import LLM, SamplingParams

    llm = LLM(path, dtype="bfloat16", device="cuda", gpu_memory_utilization=0.2, block_size=4,
              kv_cache_groups=groups, enforce_eager=eager)
    most_held = []
    engine = llm.llm_engine
    engine.add_observer(lambda snap: most_held.append(
        engine.scheduler.block_manager.get_num_free_gpu_blocks()))
    outs = llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                        sampling_params=SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                       ignore_eos=True))
    bm = engine.scheduler.block_manager
    groups = len(getattr(bm, "windows", (None,)))
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], bm.num_total_gpu_blocks - min(most_held), \
        groups


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cuda-graphs"])
def test_groups_give_the_every_block_engine_s_and_transformers_tokens_on_cuda(gemma, eager,
                                                                             monkeypatch):
    from minipaged.engine import cache_setup

    monkeypatch.setattr(cache_setup, "GROUPS_ON_CUDA", True)
    path, model, prompts = gemma
    grouped, held_grouped, num_groups = _ours(path, prompts, groups=True, eager=eager)
    every, held_every, _ = _ours(path, prompts, groups=False)
    assert grouped == every == greedy_whole_sequence(model, prompts, MAX_NEW, torch.bfloat16)
    # a grouped pool block holds one group's layers: every group keeping every block would
    # hold num_groups times the every-block engine's blocks at its fullest step
    assert num_groups > 1 and held_grouped < num_groups * held_every
