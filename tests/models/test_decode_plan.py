"""``DecodePlan`` (models/decode_plan.py): a decode step's layers as direct kernel calls give the
modules' results bit for bit (tokens, logprobs, KV cache, ``ops.calls``) on whole random
workloads (several sequences, n = 2 sampling, beam search, preemption, multi-step decode,
speculative decoding), float32 and GGUF weights, LLaMA and Mistral's window; and it steps aside
wherever it would not run what the modules run (hooks, a kernel function or a component
replaced, weights or routines changed, the switch off)."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minipaged import SamplingParams
from minipaged.engine.llm_engine import LLMEngine
from minipaged.kernels import ops
from minipaged.lab.tiny_families import save_tiny
from minipaged.lab.tiny_gguf import save_tiny_gguf
from minipaged.models import decode_plan
from minipaged.models.attention import PagedAttention
from minipaged.worker import checkpoint
from budgets import examples
from workloads import fitted, params_of_kind, request_kinds

SETTINGS = dict(block_size=4, num_gpu_blocks=40, num_cpu_blocks=64, max_model_len=64,
                dtype="float32", seed=0)


@pytest.fixture(scope="module")
def models(tmp_path_factory, cpu_op):
    """name -> (path, extra engine settings): float32 LLaMA and Mistral (window 16), a GGUF
    LLaMA with Q4_1 layers and one with Q8_0 layers; a LLaMA with biases and a Qwen3 (query
    and key norms): no plan."""
    made = {}
    for name, family, overrides in (("llama", "llama", {}), ("mistral", "mistral", {}),
                                    ("biased", "llama", {"attention_bias": True}),
                                    ("qwen3", "qwen3", {})):
        path = tmp_path_factory.mktemp(name)
        save_tiny(family, path, seed=5, **overrides)
        made[name] = (str(path), {})
    for layers in ("Q4_1", "Q8_0"):
        folder = tmp_path_factory.mktemp(f"gguf_{layers}")
        path, _ = save_tiny_gguf(str(folder), seed=6, layers=layers)
        made[f"gguf {layers}"] = (path, {"quantization": "gguf"})
    return made


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch):
    """The tiny GGUF files' conversions in a folder of their own."""
    folder = tmp_path_factory.getbasetemp() / "gguf_cache"
    monkeypatch.setattr(checkpoint, "cache_root", lambda: folder)


def generate(engine, prompts, params, plan: bool, monkeypatch):
    """Every request's (token ids, cumulative logprob) per sequence, with the plan switched on
    or off; and how many forward passes ran the plan."""
    monkeypatch.setenv(decode_plan.SWITCH, "1" if plan else "0")
    ran = {"plan": 0}
    run = decode_plan.DecodePlan.run

    def counted(self, *args, **kwargs):
        ran["plan"] += 1
        return run(self, *args, **kwargs)

    monkeypatch.setattr(decode_plan.DecodePlan, "run", counted)
    try:
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            engine.add_request(f"{int(plan)}-{i}", None, p, prompt_token_ids=prompt)
        outs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = [(o.token_ids, o.cumulative_logprob)
                                            for o in out.outputs]
    finally:
        monkeypatch.setattr(decode_plan.DecodePlan, "run", run)
    return [outs[f"{int(plan)}-{i}"] for i in range(len(prompts))], ran


def both_ways(engine, prompts, params, monkeypatch):
    """(plan's results, modules' results, plan's counts), ``ops.calls`` compared too.

    NOTE: after a first run of the workload that is thrown away: ``cpu_matmul`` measures its
    routines on a shape's first call, and that call's result may be another routine's than the
    next calls' (a float32 LLaMA's logprob differed in its sixth digit)."""
    generate(engine, prompts, params, False, monkeypatch)
    engine.reset_prefix_cache()
    ops.calls.clear()
    with_plan, ran = generate(engine, prompts, params, True, monkeypatch)
    calls_with = dict(ops.calls)
    ops.calls.clear()
    engine.reset_prefix_cache()  # (the same prompts again: no cached prefix either way)
    without, ran_without = generate(engine, prompts, params, False, monkeypatch)
    assert ran_without["plan"] == 0
    assert calls_with == dict(ops.calls), "the plan counts its kernels as the modules do"
    return with_plan, without, ran


@pytest.mark.parametrize("name", ["llama", "mistral", "gguf Q4_1", "gguf Q8_0"])
def test_the_plan_gives_the_modules_results_bit_for_bit(models, name, monkeypatch):
    path, extra = models[name]
    engine = LLMEngine(path, **SETTINGS, **extra)
    prompts = [[5, 6, 7], list(range(10, 31)), [40] * 9, list(range(60, 66))]
    params = [params_of_kind(k, i, 12) for i, k in enumerate(
        ["greedy", "sampled", "beam", "greedy"])]
    with_plan, without, ran = both_ways(engine, prompts, params, monkeypatch)
    assert with_plan == without  # tokens and logprobs, exactly
    assert ran["plan"] >= 10, ran  # the decode steps ran the plan


@pytest.mark.parametrize("name, why", [("biased", "bias"), ("qwen3", "query/key norms")])
def test_models_it_does_not_stand_for_run_their_modules(models, name, why, monkeypatch):
    path, extra = models[name]
    engine = LLMEngine(path, **SETTINGS, **extra)
    prompts, params = [[5, 6, 7]], [params_of_kind("greedy", 0, 6)]
    with_plan, without, ran = both_ways(engine, prompts, params, monkeypatch)
    assert with_plan == without and ran["plan"] == 0
    generate(engine, prompts, params, True, monkeypatch)
    assert why in decode_plan.plan_for(engine.worker.model).why


MODES = [dict(num_gpu_blocks=16, preemption_mode="swap"),
         dict(num_gpu_blocks=16, preemption_mode="recompute"),
         dict(num_scheduler_steps=3),
         dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
         dict(enable_chunked_prefill=True, max_num_batched_tokens=8)]


@given(mode=st.integers(0, len(MODES) - 1),
       name=st.sampled_from(["llama", "mistral", "gguf Q4_1"]),
       reqs=st.lists(st.tuples(st.lists(st.integers(2, 250), min_size=1, max_size=28),
                               st.integers(1, 14), request_kinds()), min_size=1, max_size=5))
@settings(max_examples=examples(30), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_random_workloads_give_the_same_tokens_either_way(models, monkeypatch, mode, name,
                                                          reqs):
    path, extra = models[name]
    engine = LLMEngine(path, **{**SETTINGS, **extra, **MODES[mode]})
    speculative = "speculative_config" in MODES[mode]
    prompts = [r[0] for r in reqs]
    params = [fitted(engine, prompt, params_of_kind(
        "greedy" if speculative and kind == "beam" else kind, i, max_tokens))
        for i, (prompt, max_tokens, kind) in enumerate(reqs)]
    with_plan, without, _ = both_ways(engine, prompts, params, monkeypatch)
    assert with_plan == without


# -- where the plan steps aside ------------------------------------------------------------------
@pytest.fixture()
def llama_engine(models):
    path, extra = models["llama"]
    return LLMEngine(path, **SETTINGS, **extra)


def decode_once(engine, monkeypatch) -> str:
    """Run a short greedy request; why the last decode step did not use the plan ("" if it
    did)."""
    generate(engine, [[3, 4, 5]], [params_of_kind("greedy", 0, 3)], True, monkeypatch)
    return decode_plan.plan_for(engine.worker.model).why


def test_a_hook_on_the_model_runs_its_forward(llama_engine, monkeypatch):
    seen = []
    handle = llama_engine.worker.model.register_forward_hook(
        lambda module, args, out: seen.append(out.shape))
    generate(llama_engine, [[3, 4, 5]], [params_of_kind("greedy", 0, 3)], True, monkeypatch)
    handle.remove()
    assert len(seen) == 3


def test_a_forward_hook_sees_every_layer(llama_engine, monkeypatch):
    seen = []
    handle = llama_engine.worker.model.layers[1].mlp.register_forward_hook(
        lambda module, args, out: seen.append(out.shape))
    why = decode_once(llama_engine, monkeypatch)
    handle.remove()
    assert why and len(seen) == 3  # the prompt and two decode steps, all through the modules
    assert decode_once(llama_engine, monkeypatch) == ""  # the hook gone: the plan again


def test_a_replaced_kernel_function_runs(llama_engine, monkeypatch):
    original, seen = ops.silu_and_mul, []

    def spy(gate, up):
        seen.append(gate.shape)
        return original(gate, up)

    monkeypatch.setattr(ops, "silu_and_mul", spy)
    assert decode_once(llama_engine, monkeypatch) != ""
    assert len(seen) == 3 * len(llama_engine.worker.model.layers)


def test_a_learners_attention_runs(llama_engine, monkeypatch):
    class Learners(PagedAttention):
        calls = 0

        def forward(self, *args):
            Learners.calls += 1
            return super().forward(*args)

    layer = llama_engine.worker.model.layers[0]
    old = layer.self_attn.attn
    layer.self_attn.attn = Learners(old.num_heads, old.head_size, old.scale, old.num_kv_heads)
    assert "PagedAttention" in decode_once(llama_engine, monkeypatch)
    assert Learners.calls == 3


def test_new_weights_are_read(llama_engine, monkeypatch):
    """A weight replaced after the plan was made: the plan is made again and reads it."""
    prompts, params = [[3, 4, 5, 6]], [params_of_kind("greedy", 0, 8)]
    before, _ = generate(llama_engine, prompts, params, True, monkeypatch)
    down = llama_engine.worker.model.layers[1].mlp.down_proj
    down.weight = torch.nn.Parameter(torch.randn_like(down.weight) * 0.5, requires_grad=False)
    after, ran = generate(llama_engine, prompts, params, True, monkeypatch)
    modules, _ = generate(llama_engine, prompts, params, False, monkeypatch)
    assert after == modules and ran["plan"] > 0 and after != before


def test_a_changed_gguf_routine_is_followed(models, monkeypatch):
    path, extra = models["gguf Q4_1"]
    engine = LLMEngine(path, **SETTINGS, **extra)
    prompts, params = [[3, 4, 5, 6]], [params_of_kind("greedy", 0, 8)]
    mlp = engine.worker.model.layers[0].mlp
    assert mlp.gate_up.weight.routine == "cpp" or pytest.skip("cpp not chosen here")
    generate(engine, prompts, params, True, monkeypatch)
    mlp.gate_up.weight.use("dequant")
    plan, ran = generate(engine, prompts, params, True, monkeypatch)
    modules, _ = generate(engine, prompts, params, False, monkeypatch)
    assert plan == modules and ran["plan"] > 0


def test_the_switch_turns_it_off(llama_engine, monkeypatch):
    _, ran = generate(llama_engine, [[3, 4, 5]], [params_of_kind("greedy", 0, 4)], False,
                      monkeypatch)
    assert ran["plan"] == 0
    assert decode_plan.plan_for(llama_engine.worker.model).why == "MINIPAGED_DECODE_PLAN=0"
