"""The GPU pool sizing and memory return, on the CPU with a fake CUDA device (lesson 15).

A learner on a GPU builds several engines in one kernel: two compared side by side, or one cell
run twice (the new engine is built while the old one is still bound to the name). Each engine's
pool must come from what the process may still take, a deleted or shut-down engine must give its
memory back, and when memory runs out the error must name who holds it.

``FakeGPU`` stands in for ``torch.cuda``'s memory functions. It counts the model's weights and
the GPU KV pool as "on the device" (weak references to the real CPU tensors, so freeing them
frees fake device memory), models torch's caching allocator (reserved memory grows to the
high-water mark and shrinks only at ``empty_cache``) and refuses allocations past the card's
size, as a real device would with an out-of-memory error. The worker is told it is on a GPU
(``LocalWorker._on_gpu``); everything else runs as on CUDA.
"""
import gc
import logging
import weakref

import pytest
import torch

MiB = 1 << 20


class FakeGPU:
    def __init__(self, total=8 * MiB, other_processes=2 * MiB, activations=256 * 1024):
        self.total = total
        self.other_processes = other_processes
        self.activations = activations  # what a profiled step allocates and frees again
        self.tensors: list[weakref.ref] = []
        self.reserved = 0
        self.peak = 0
        self.empty_cache_calls = 0

    def hold(self, tensors):
        self.tensors += [weakref.ref(t) for t in tensors]
        allocated = self.memory_allocated()
        if self.other_processes + allocated > self.total:
            raise torch.OutOfMemoryError(f"fake GPU: {allocated} bytes allocated, the card "
                                         f"has {self.total - self.other_processes} left")
        self.reserved = max(self.reserved, allocated)
        self.peak = max(self.peak, allocated)

    # -- the torch.cuda functions the engine reads ----------------------------------------------
    def memory_allocated(self, device=None):
        live = [r() for r in self.tensors]
        self.tensors = [r for r, t in zip(self.tensors, live) if t is not None]
        return sum(t.numel() * t.element_size() for t in live if t is not None)

    def memory_reserved(self, device=None):
        self.reserved = max(self.reserved, self.memory_allocated())
        return self.reserved

    def mem_get_info(self, device=None):
        return self.total - self.other_processes - self.memory_reserved(), self.total

    def reset_peak_memory_stats(self, device=None):
        self.peak = self.memory_allocated()

    def max_memory_allocated(self, device=None):
        top = self.memory_allocated() + self.activations  # the step's activations came and went
        self.reserved = max(self.reserved, top)
        return max(self.peak, top)

    def empty_cache(self):
        self.empty_cache_calls += 1
        self.reserved = self.memory_allocated()

    def synchronize(self, device=None):
        pass


@pytest.fixture
def gpu(monkeypatch):
    from minipaged.worker import cache_engine, worker

    gc.collect()  # engines of earlier tests are gone before this fake device starts counting
    fake = FakeGPU()
    for name in ("mem_get_info", "memory_reserved", "memory_allocated", "reset_peak_memory_stats",
                 "max_memory_allocated", "empty_cache", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(worker.LocalWorker, "_on_gpu", lambda self: True)

    build_model = worker.build_model

    def build_on_fake(*args, **kwargs):
        model = build_model(*args, **kwargs)
        fake.hold(list(model.parameters()))
        return model

    allocate = cache_engine.CacheEngine._allocate

    def allocate_on_fake(self, num_blocks, device, pin, zero):
        cache = allocate(self, num_blocks, device, pin, zero)
        if zero:  # the pool attention reads (the swap pool stays in host memory)
            fake.hold([t for kv in cache for t in kv])
        return cache

    monkeypatch.setattr(worker, "build_model", build_on_fake)
    monkeypatch.setattr(cache_engine.CacheEngine, "_allocate", allocate_on_fake)
    yield fake
    gc.collect()


def build(path, **kw):
    from minipaged import LLM

    kw = {"device": "cpu", "dtype": "float32", "max_num_seqs": 256, "num_cpu_blocks": 0,
          "max_model_len": 128, **kw}
    return LLM(path, **kw)


def pool_blocks(llm) -> int:
    return llm.llm_engine.block_manager.num_total_gpu_blocks


def expected_blocks(llm, available, utilization=0.9, activations=256 * 1024) -> int:
    """The pool sizing rule, worked by hand from the fake device's numbers."""
    engine = llm.llm_engine
    weights = engine.worker.memory_per_rank()[0]["weights"]
    return int(available * utilization - (weights + activations)) // engine.block_bytes


def test_one_engine_takes_its_share_of_what_the_process_may_take(gpu, tiny_llama):
    llm = build(tiny_llama[0])
    assert pool_blocks(llm) == expected_blocks(llm, 6 * MiB)  # 8 MiB less 2 of other processes
    assert pool_blocks(llm) > 16  # (more than one max_model_len request)


def test_two_engines_alive_the_second_gets_a_share_of_what_the_first_left(gpu, tiny_llama,
                                                                          caplog):
    first = build(tiny_llama[0])
    held_by_first = gpu.memory_allocated()
    with caplog.at_level(logging.WARNING, logger="minipaged"):
        second = build(tiny_llama[0])
    assert pool_blocks(second) == expected_blocks(second, 6 * MiB - held_by_first)
    assert 0 < pool_blocks(second) < pool_blocks(first)
    assert "1 other engine(s) alive in this process" in caplog.text
    assert gpu.other_processes + gpu.memory_allocated() <= gpu.total
    from minipaged import SamplingParams  # both still run

    params = SamplingParams(temperature=0, max_tokens=3)
    for llm in (first, second):
        assert len(llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=params,
                                use_tqdm=False)[0].outputs[0].token_ids) == 3


def test_no_room_left_names_the_other_engine_its_size_and_the_settings(gpu, tiny_llama):
    first = build(tiny_llama[0], gpu_memory_utilization=0.95)  # room for weights, not a pool
    first_bytes = sum(first.llm_engine.worker.memory_per_rank()[0].values())
    with pytest.raises(ValueError) as caught:
        build(tiny_llama[0])
    message = str(caught.value)
    assert "no room for a single block" in message
    assert "1 other engine(s) alive in this process" in message
    assert f"{first_bytes / (1 << 30):.2f} GiB" in message
    assert "gpu_memory_utilization" in message and "num_gpu_blocks" in message
    assert "llm.shutdown()" in message
    first.shutdown()  # ... and once it is shut down the same engine fits
    assert pool_blocks(build(tiny_llama[0])) > 16


def test_weights_that_do_not_fit_name_the_engine_that_holds_the_memory(gpu, tiny_llama):
    first = build(tiny_llama[0], gpu_memory_utilization=1.0)
    with pytest.raises(torch.OutOfMemoryError, match=r"1 other engine\(s\) alive in this "
                                                      r"process hold"):
        build(tiny_llama[0])
    del first


def test_an_explicit_pool_too_big_for_the_device_is_refused_by_name(gpu, tiny_llama):
    with pytest.raises(ValueError, match=r"num_gpu_blocks=100000: the KV pool needs .* this "
                                         r"process cannot get it"):
        build(tiny_llama[0], num_gpu_blocks=100_000)


def test_a_deleted_engine_gives_its_memory_back(gpu, tiny_llama):
    llm = build(tiny_llama[0])
    first_pool = pool_blocks(llm)
    worker = weakref.ref(llm.llm_engine.worker)
    calls = gpu.empty_cache_calls
    del llm
    gc.collect()
    assert worker() is None
    assert gpu.memory_allocated() == 0
    assert gpu.reserved == 0, "torch's cached blocks were not handed back (empty_cache)"
    assert gpu.empty_cache_calls > calls
    assert pool_blocks(build(tiny_llama[0])) == first_pool


def test_a_rerun_cell_builds_beside_the_old_engine_then_the_old_one_is_freed(gpu, tiny_llama):
    llm = build(tiny_llama[0])  # the cell's first run
    first = weakref.ref(llm.llm_engine.worker)
    held_by_first = gpu.memory_allocated()
    llm = build(tiny_llama[0])  # run again: built while the first is still bound to `llm`
    assert pool_blocks(llm) == expected_blocks(llm, 6 * MiB - held_by_first)
    gc.collect()
    assert first() is None
    assert gpu.memory_allocated() == sum(llm.llm_engine.worker.memory_per_rank()[0].values())
    again = pool_blocks(llm)
    llm = build(tiny_llama[0])  # a third run finds only the second engine alive
    assert pool_blocks(llm) > again


def test_shutdown_and_with_give_everything_back_and_the_engine_refuses_work(gpu, tiny_llama):
    from minipaged import SamplingParams

    with build(tiny_llama[0]) as llm:
        assert gpu.memory_allocated() > 0
    assert gpu.memory_allocated() == 0 and gpu.reserved == 0
    llm.shutdown()  # twice: nothing happens
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(prompt_token_ids=[[5, 6]], sampling_params=SamplingParams(max_tokens=2),
                     use_tqdm=False)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.llm_engine.step()


def test_a_small_engine_on_a_big_gpu_takes_only_what_its_sequences_can_use(gpu, tiny_llama):
    """tests/gpu/test_cuda_graphs_gpu.py's shape: an engine kept alive (in ``_``) while a second
    one is built; neither takes more than max_num_seqs sequences of max_model_len can use."""
    gpu.total = 1 << 30
    _ = build(tiny_llama[0], max_num_seqs=12, max_model_len=160)
    second = build(tiny_llama[0], max_num_seqs=12, max_model_len=160)
    assert pool_blocks(_) == pool_blocks(second) == 12 * 10  # 160 tokens: 10 blocks of 16
