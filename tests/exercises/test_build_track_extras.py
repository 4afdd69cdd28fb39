"""The build track's components of lessons 11, 12 and 06: reference answers pass, wrong ones are
caught with their case and hint, stubs say "not done", and the engine runs on them."""
from __future__ import annotations

import pytest

from minipaged import LLM, SamplingParams
from minipaged.exercises import lesson11, workbench
from minipaged.exercises.answers import lesson11 as answers11


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
