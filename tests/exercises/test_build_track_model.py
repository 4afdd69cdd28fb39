"""The build track's components of lessons 07, 08 and 10: Attention, prepare_inputs, Sampler.

The reference answers pass their checks and, plugged into the real engine, give the tokens the
package gives; wrong components are caught at their first failing case with the hint that
names the idea; an unanswered stub says "not done"; a saved answer comes back from ``collect``.
"""
import pytest
import torch

from minipaged import LLM, SamplingParams
from minipaged.exercises import lesson07, lesson08, lesson10, workbench
from minipaged.exercises.answers import lesson07 as answer07
from minipaged.exercises.answers import lesson08 as answer08
from minipaged.exercises.answers import lesson10 as answer10
from minipaged.kernels import ops

ANSWERS = {"Attention": answer07.Attention, "prepare_inputs": answer08.prepare_inputs,
           "Sampler": answer10.ReferenceSampler}
STUBS = {"Attention": lesson07.MyAttention, "prepare_inputs": lesson08.my_prepare_inputs,
         "Sampler": lesson10.MySampler}


@pytest.fixture(autouse=True)
def _learner_dir(tmp_path, monkeypatch):
    """Saved components go to a folder of this test, never to the learner's."""
    monkeypatch.setenv(workbench.LEARNER_DIR_VARIABLE, str(tmp_path / "learner"))


def check(name, candidate, num_cases=40):
    return workbench.check_component(name, candidate, num_cases=num_cases, save=False)


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_the_reference_answer_passes_its_check(name):
    result = check(name, ANSWERS[name])
    assert result.status == "passed", result


@pytest.mark.parametrize("name", sorted(STUBS))
def test_the_unanswered_stub_says_not_done(name):
    result = check(name, STUBS[name])
    assert result.status == "not done" and "not done yet" in result


@pytest.mark.parametrize("name", sorted(STUBS))
def test_with_solutions_on_the_unanswered_stub_uses_the_reference_answer(name, monkeypatch):
    monkeypatch.setenv("MINIPAGED_SOLUTIONS", "1")
    result = check(name, STUBS[name], num_cases=10)
    assert result.status == "solution used", result


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_a_saved_answer_is_collected_and_passes_again(name):
    path = workbench.save_component(name, ANSWERS[name])
    assert path is not None and path.exists()
    found, missing = workbench.collect([name])
    assert not missing and found[name].__name__ == ANSWERS[name].__name__
    assert found[name] is not ANSWERS[name]  # run again from its saved source
    assert check(name, found[name], num_cases=10).status == "passed"


# -- wrong components: each caught at a case, with the hint that names its idea ------------------
class WritesTheCacheAfterAttention(answer07.Attention):
    """Runs the three paths on the cache as it was, and writes this step's keys only then
    (``write=False``: never)."""

    write = True

    def forward(self, query, key, value, kv_cache, meta):
        stale = tuple(c.clone() for c in kv_cache)
        out = super().forward(query, key, value, stale, meta)  # writes into the copy
        key_cache, value_cache = kv_cache
        # redo the chunk and decode paths on the cache without this step's keys
        n = query.shape[0]
        q = query.view(n, self.num_heads, self.head_size)
        out = out.view(n, self.num_heads, self.head_size)
        start = meta.num_prompt_tokens
        if n > start:
            out[start:] = ops.paged_attention(q[start:], key_cache, value_cache,
                                              meta.block_tables, meta.context_lens, self.scale,
                                              meta.max_context_len)
        if self.write:
            ops.reshape_and_cache(key.view(n, self.num_kv_heads, self.head_size),
                                  value.view(n, self.num_kv_heads, self.head_size), key_cache,
                                  value_cache, meta.slot_mapping)
        return out.view(n, -1)


class NeverWritesTheCache(WritesTheCacheAfterAttention):
    write = False


def test_attention_that_never_writes_the_cache_is_caught_at_the_cache():
    result = check("Attention", NeverWritesTheCache)
    assert result.status == "failed"
    assert "Attention: case 0 fails" in result and "cache at slot" in result
    assert "decode" in result or "prompt" in result  # the case's runs are named
    assert "reshape_and_cache" in result and "before any path reads the cache" in result


def test_attention_that_writes_after_decoding_is_caught_at_a_decode_row():
    result = check("Attention", WritesTheCacheAfterAttention)
    assert result.status == "failed" and "Attention: case" in result
    assert "(decode part of the batch)" in result
    assert "its own new key included: written before it is read" in result


def positions_off_by_one_for_decodes(seq_runs, block_size, device, drafts=None):
    prepared = answer08.prepare_inputs(seq_runs, block_size, device)
    num_decodes = prepared.meta.context_lens.shape[0]
    if num_decodes:
        prepared.positions[-num_decodes:] += 1
    return prepared


def slot_mapping_without_the_block_table(seq_runs, block_size, device, drafts=None):
    prepared = answer08.prepare_inputs(seq_runs, block_size, device)
    prepared.meta.slot_mapping = prepared.positions.clone()  # as if block i were block i
    return prepared


def test_prepare_inputs_with_decode_positions_off_by_one_is_caught_at_positions():
    result = check("prepare_inputs", positions_off_by_one_for_decodes)
    assert result.status == "failed" and "prepare_inputs: case" in result
    assert "field positions" in result and "decode [" in result
    assert "a decode's one token at run.start" in result


def test_prepare_inputs_with_a_slot_mapping_that_ignores_the_block_table_is_caught():
    result = check("prepare_inputs", slot_mapping_without_the_block_table)
    assert result.status == "failed" and "field meta.slot_mapping" in result
    assert "block_table[position // block_size]" in result


class TopPKeepsOneTokenTooMany(answer10.ReferenceSampler):
    @staticmethod
    def filtered(logits, top_k, top_p):
        kept = answer10.ReferenceSampler.filtered(logits, top_k, 1.0)
        if top_p < 1.0:
            ranked, order = torch.sort(kept, descending=True)
            probs = torch.softmax(ranked, dim=-1)
            drop = torch.cumsum(probs, dim=-1) - probs >= top_p
            drop = torch.roll(drop, 1)  # the token after the crossing one is kept too
            drop[0] = False
            kept = kept.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), -torch.inf)
        return kept


class DrawsFromTheGlobalGenerator(answer10.ReferenceSampler):
    def __call__(self, logits, rows, generators):
        return super().__call__(logits, rows, {s: torch.default_generator for s in generators})


def test_a_top_p_that_keeps_tokens_after_the_threshold_is_caught():
    result = check("Sampler", TopPKeepsOneTokenTooMany, num_cases=150)
    assert result.status == "failed" and "Sampler: case" in result
    assert "(parent, token)" in result and "outside the nucleus" in result


def test_a_seeded_sequence_drawing_from_the_global_generator_is_caught():
    result = check("Sampler", DrawsFromTheGlobalGenerator)
    assert result.status == "failed" and "Sampler: case" in result
    assert "generators[seq_id]" in result and "never torch's global one" in result


# -- plugged into the real engine ------------------------------------------------------------------
def _generate(path):
    prompts = [[3, 17, 5, 9, 41, 2, 8, 19, 33, 7, 12, 4, 6], [5, 6], [30, 31, 32, 33, 34]]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.8, top_k=20, seed=7, max_tokens=12,
                             presence_penalty=0.4, frequency_penalty=0.2, ignore_eos=True,
                             logprobs=2),
              SamplingParams(n=2, temperature=1.2, seed=11, max_tokens=12, ignore_eos=True)]
    # small blocks and a small token budget: chunked prefill, decodes and prompts in one step
    llm = LLM(path, block_size=4, num_gpu_blocks=64, max_num_batched_tokens=8)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [[(o.token_ids, [sorted(lp) for lp in o.logprobs or []]) for o in out.outputs]
            for out in outputs]


def test_the_engine_on_the_reference_answers_gives_the_package_tokens(tiny_model):
    _, path, _ = tiny_model
    package = _generate(path)
    with workbench.plugged_in(objects=dict(ANSWERS), quiet=True) as plugged:
        from minipaged.engine import llm_engine
        from minipaged.models import gpt2, llama
        assert llm_engine.prepare_inputs is answer08.prepare_inputs
        assert llm_engine.Sampler is answer10.ReferenceSampler
        assert gpt2.PagedAttention is llama.PagedAttention is answer07.Attention
        mine = _generate(path)
    assert sorted(plugged) == sorted(ANSWERS)
    assert mine == package
