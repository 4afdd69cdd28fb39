"""The build track's components of lessons 11, 12 and 06: reference answers pass, wrong ones are
caught with their case and hint, stubs say "not done", and the engine runs on them."""
from __future__ import annotations

import random

import pytest
import torch

from minipaged import LLM, SamplingParams
from minipaged.exercises import lesson11, lesson12, workbench
from minipaged.exercises.answers import lesson11 as answers11
from minipaged.exercises.answers import lesson12 as answers12
from minipaged.worker.sampler import draw


def check(name: str, candidate, num_cases: int | None = None):
    return workbench.check_component(name, candidate, num_cases=num_cases, save=False)


def round_trip(name: str, obj, tmp_path, monkeypatch):
    """Save ``obj`` as the learner's, collect it back by name, and check what came back."""
    monkeypatch.setenv(workbench.LEARNER_DIR_VARIABLE, str(tmp_path))
    assert workbench.save_component(name, obj) == tmp_path / f"{name}.py"
    found, missing = workbench.collect([name])
    assert not missing, missing
    assert check(name, found[name]).passed
    return found[name]


# -- lesson 11: PrefixCachingAllocator --------------------------------------------------------------
class EvictsMostRecentlyUsed(answers11.MyPrefixCachingAllocator):
    """Wrong: the evictable list is used as a stack (the block freed last is evicted first)."""

    def allocate(self):
        if not self.free_blocks and self.evictable:
            self._evict(next(reversed(self.evictable.values())))
        return super().allocate()


class NamesIgnoreTheParent(answers11.MyPrefixCachingAllocator):
    """Wrong: a block's name hashes its own tokens only, not its parent's name."""

    def _name_block(self, block, parent, token_ids):
        keep = self.hash_fn
        self.hash_fn = lambda parent_hash, tokens: keep(None, tokens)
        try:
            super()._name_block(block, parent, token_ids)
        finally:
            self.hash_fn = keep

    def lookup(self, parent, token_ids):
        block = self.by_hash.get(self.hash_fn(None, token_ids))
        return block if block is not None and self._same_contents(block, parent, token_ids) \
            else None


class TrustsEveryHashHit(answers11.MyPrefixCachingAllocator):
    """Wrong: a hash hit is taken without comparing the tokens and the parent."""

    def lookup(self, parent, token_ids):
        parent_hash = None if parent is None else self.block_hash_of(parent)
        return self.by_hash.get(self.hash_fn(parent_hash, token_ids))


def test_the_reference_allocator_passes():
    assert check("PrefixCachingAllocator", answers11.MyPrefixCachingAllocator).passed


def test_the_unanswered_allocator_stub_is_not_done():
    result = check("PrefixCachingAllocator", lesson11.MyPrefixCachingAllocator)
    assert result.status == "not done" and "not done yet" in result


@pytest.mark.parametrize("wrong, what, hint", [
    (EvictsMostRecentlyUsed, ": allocate()", "evicts the least recently used evictable block"),
    (NamesIgnoreTheParent, ": names", "hash_fn(its parent's name, its own tokens)"),
    (TrustsEveryHashHit, "longest_cached_prefix", "a hash hit is only a hint"),
])
def test_a_wrong_allocator_is_caught_with_its_case_and_hint(wrong, what, hint):
    result = check("PrefixCachingAllocator", wrong)
    assert result.status == "failed"
    assert "✗ PrefixCachingAllocator: case " in result and "block_size=" in result
    assert what in result and hint in result


def test_the_saved_allocator_is_collected_and_passes(tmp_path, monkeypatch):
    found = round_trip("PrefixCachingAllocator", answers11.MyPrefixCachingAllocator, tmp_path,
                       monkeypatch)
    assert found.__name__ == "MyPrefixCachingAllocator"


def test_the_engine_on_the_reference_allocator_gives_the_same_tokens(tiny_llama):
    system = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    prompts = [system + [20 + i, 30 + i] for i in range(6)] + [list(range(40, 70))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def run():
        llm = LLM(tiny_llama[0], block_size=4, num_gpu_blocks=16, num_cpu_blocks=0,
                  watermark=0.0, max_model_len=64, enable_prefix_caching=True)
        outs = [llm.generate(prompt_token_ids=[p], sampling_params=params, use_tqdm=False)[0].outputs[0].token_ids
                for p in prompts]
        return llm.llm_engine, outs

    _, plain = run()
    with workbench.plugged_in(objects={"PrefixCachingAllocator":
                                       answers11.MyPrefixCachingAllocator}):
        engine, mine = run()
    assert type(engine.block_manager.gpu_allocator) is answers11.MyPrefixCachingAllocator
    assert mine == plain
    assert engine.stats.num_cached_prompt_tokens > 0 and engine.stats.num_evicted_blocks > 0


# -- lesson 12: greedy_verify and rejection_sample ------------------------------------------------
def _sampled_verification(correction):
    """A rejection sampler right in everything but where the correction comes from."""

    def verify(target_probs, draft_token_ids, draft_probs, generator):
        emitted = []
        for i, token in enumerate(draft_token_ids):
            p = target_probs[i].double()  # (V,)
            if draft_probs is None:
                q = torch.zeros_like(p)
                q[token] = 1.0
            else:
                q = draft_probs[i].double()  # (V,)
            u = torch.rand((), generator=generator, dtype=torch.float64).item()
            if u * q[token].item() < p[token].item():
                emitted.append(token)
                continue
            emitted.append(correction(p, q, generator))
            return emitted
        return emitted + [draw(target_probs[-1].double(), generator)]

    return verify


def _from_q(p, q, generator):
    return draw(q, generator)  # wrong: q is where the rejected guess came from


def _unnormalised_residual(p, q, generator):
    residual = torch.clamp(p - q, min=0)  # wrong: never divided by its sum
    cdf = torch.cumsum(residual, dim=0)
    u = torch.rand((), generator=generator, dtype=torch.float64)
    return int(torch.searchsorted(cdf, u, right=True).clamp(max=len(cdf) - 1))


def test_the_reference_verifications_pass():
    assert check("greedy_verify", answers12.greedy_verify).passed
    assert check("rejection_sample", answers12.rejection_sample).passed


@pytest.mark.parametrize("name", ["greedy_verify", "rejection_sample"])
def test_the_unanswered_verification_stubs_are_not_done(name):
    result = check(name, getattr(lesson12, name))
    assert result.status == "not done" and "not done yet" in result


RESIDUAL_HINT = "after a rejection the correction is drawn from the residual"


@pytest.mark.parametrize("correction", [_from_q, _unnormalised_residual])
def test_a_wrong_correction_is_caught_by_the_seeded_cases(correction):
    result = check("rejection_sample", _sampled_verification(correction))
    assert result.status == "failed" and "✗ rejection_sample: case " in result
    assert "generator seeded" in result and RESIDUAL_HINT in result


@pytest.mark.parametrize("correction", [_from_q, _unnormalised_residual])
def test_a_wrong_correction_fails_the_statistical_check_too(correction):
    with pytest.raises(Exception) as caught:  # only the distribution check: no seeded cases
        lesson12._check_rejection_sample(_sampled_verification(correction), random.Random(0), 0)
    assert "how often each token comes out first" in str(caught.value)
    assert "the first token must follow p" in str(caught.value)


def test_a_sampler_that_uses_more_random_numbers_is_caught():
    def wasteful(target_probs, draft_token_ids, draft_probs, generator):
        torch.rand((), generator=generator)  # an extra draw: seeded outputs would drift
        return answers12.rejection_sample(target_probs, draft_token_ids, draft_probs, generator)

    result = check("rejection_sample", wasteful)
    assert result.status == "failed" and "case 0" in result


def test_a_greedy_verification_without_the_bonus_token_is_caught():
    def no_bonus(target_argmax_ids, draft_token_ids):
        return answers12.greedy_verify(target_argmax_ids, draft_token_ids)[:-1]

    result = check("greedy_verify", no_bonus)
    assert result.status == "failed" and "one token more than it accepts" in result


@pytest.mark.parametrize("name", ["greedy_verify", "rejection_sample"])
def test_the_saved_verification_is_collected_and_passes(name, tmp_path, monkeypatch):
    found = round_trip(name, getattr(answers12, name), tmp_path, monkeypatch)
    assert found.__name__ == name


def test_the_engine_on_the_reference_verifications_gives_the_same_tokens(tiny_llama):
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [3, 4, 3, 4, 3, 4, 3]]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)]

    def run():
        llm = LLM(tiny_llama[0], block_size=4, num_gpu_blocks=64, max_model_len=64,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                      "prompt_lookup_max": 2})
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        return llm.llm_engine.stats, [o.outputs[0].token_ids for o in outs]

    _, plain = run()
    used = []

    def counted(name):
        def call(*args):
            used.append(name)
            return getattr(answers12, name)(*args)
        return call

    with workbench.plugged_in(objects={"greedy_verify": counted("greedy_verify"),
                                       "rejection_sample": counted("rejection_sample")}):
        stats, mine = run()
    assert mine == plain
    assert {"greedy_verify", "rejection_sample"} <= set(used)
    assert stats.num_spec_verifications > 0


# -- lesson 06: softmax_phase_cuda (C++ compiled for the CPU) ---------------------------------------
def _cuda_variant(old: str, new: str) -> str:
    from minipaged.exercises.answers.lesson06 import SOFTMAX_PHASE

    assert old in SOFTMAX_PHASE
    return SOFTMAX_PHASE.replace(old, new)


@pytest.mark.slow
def test_the_reference_softmax_phase_passes_and_round_trips(tmp_path, monkeypatch):
    from minipaged.exercises import lesson06
    from minipaged.exercises.answers.lesson06 import SOFTMAX_PHASE

    monkeypatch.setenv(workbench.LEARNER_DIR_VARIABLE, str(tmp_path))
    result = lesson06.check_softmax_phase(SOFTMAX_PHASE)
    assert result.passed
    found, missing = workbench.collect(["softmax_phase_cuda"])
    assert not missing and found["softmax_phase_cuda"] == SOFTMAX_PHASE
    assert check("softmax_phase_cuda", found["softmax_phase_cuda"]).passed


def test_the_unanswered_softmax_phase_is_not_done():
    from minipaged.exercises import lesson06

    result = check("softmax_phase_cuda", lesson06.SOFTMAX_PHASE_STUB)
    assert result.status == "not done"


@pytest.mark.slow
def test_a_shfl_down_reduction_without_a_broadcast_is_caught():
    wrong = _cuda_variant("m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, mask));",
                          "m = fmaxf(m, __shfl_down_sync(FULL_MASK, m, mask));")
    wrong = wrong.replace("const float max_logit = __shfl_sync(FULL_MASK, m, 0);",
                          "const float max_logit = m;")
    result = check("softmax_phase_cuda", wrong)
    assert result.status == "failed" and "case 0 fails" in result
    assert "the threads end phase 3 with different max_logit" in result
    assert "__shfl_down_sync reduction leaves it in lane 0 only" in result


@pytest.mark.slow
def test_a_missing_barrier_between_the_warps_is_reported_as_a_race():
    wrong = _cuda_variant("  __syncthreads();  // every warp's maximum (and every logit of "
                          "phase 2) is written\n", "")
    result = check("softmax_phase_cuda", wrong)
    assert result.status == "failed" and "ThreadSanitizer reports a data race" in result
    assert "line 7: if (lane == 0) red_smem[warp] = m;" in result  # the write of the race
    assert "a barrier (__syncthreads()) must separate" in result


@pytest.mark.slow
def test_a_compile_error_names_the_learners_line():
    wrong = _cuda_variant("float m = qk_max;", "float m = qk_max")
    result = check("softmax_phase_cuda", wrong)
    assert result.status == "failed" and "does not compile" in result
    assert "line 4:" in result and "error" in result


@pytest.mark.slow
def test_the_exercise_build_with_the_package_phase3_matches_the_reference_and_traces_a_warp():
    from minipaged.kernels import cuda_on_cpu
    from minipaged.lab import kernel_exercise

    case = kernel_exercise.random_case(0)
    result = kernel_exercise.run(kernel_exercise.build(), case, trace=(0, 3, 0))
    assert result.report == "" and float((result.out - case.reference()).abs().max()) < 1e-5
    runs = cuda_on_cpu.butterfly_runs(result.shuffles, "max", first_mask=16)
    assert [step["mask"] for step in runs[0]] == [16, 8, 4, 2]  # G = 2 for blocks of 16
