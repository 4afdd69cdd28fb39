"""Lesson 16, the capstone's runs: which components each run plugs in, its settings and requests.

Run 1 is the engine: the components of lessons 02-10 and the learner's ``LLMEngine.step``, on
``capstone.default_workload``. Run 2 turns prefix caching on: the learner's allocator of lesson 11
serves the GPU pool inside the package's block manager (the learner's of lesson 03 takes no cached
blocks). Run 3 turns speculative decoding on (n-gram drafts): the package's step, which speculates,
calls the learner's verifications of lesson 12. Run 4 is short: the engine again, its decode
attention the V1 CUDA kernel with the learner's phase 3 of lesson 06, built for the CPU
(``capstone_steps.in_the_kernel``), where every CUDA thread is a host thread: a decode step of the
embedded model launches 270 CUDA blocks a sequence, about 4 s on two cores, so one request of four
tokens. Run 5 is the engine on a tiny random Mistral whose layers attend to their last 6 tokens
(the learner's ``Attention`` keeps ``sliding_window``), the package's block manager around the
learner's allocator (it frees the blocks that left the window). ``lesson16.check_capstone`` runs
them.
"""
from __future__ import annotations

from minipaged.exercises import capstone, workbench
from minipaged.exercises.capstone import Request
from minipaged.sampling_params import SamplingParams


# -- the capstone --------------------------------------------------------------------------------
# The engine's components of lessons 02-10 (run 1, with this lesson's LLMEngine.step), and the
# wider ones the other runs plug in. A name here that no lesson registers is skipped; a registered
# one the learner has not written yet is named in the verdict, and the package's runs in its place.
CAPSTONE_COMPONENTS: tuple[str, ...] = (
    "FreeListAllocator", "BlockSpaceManager", "Scheduler", "Attention", "prepare_inputs",
    "admit_waiting", "Sampler",
)
WIDER_COMPONENTS: tuple[str, ...] = ("softmax_phase_cuda", "PrefixCachingAllocator", "greedy_verify",
                                     "rejection_sample")


def capstone_names() -> list[str]:
    """The registered components the capstone counts, in lesson order, then ``LLMEngine.step``."""
    known = workbench.components()
    earlier = [n for n in CAPSTONE_COMPONENTS + WIDER_COMPONENTS
               if n in known and known[n].lesson <= "15"]
    return sorted(earlier, key=lambda n: known[n].lesson) + ["LLMEngine.step"]


def prefix_workload(encode) -> list[Request]:
    """A system prompt shared by four requests, two arriving once the first has filled the cache
    with it; one samples in parallel. Short outputs: the prompts are the point."""
    system = "You are a helpful assistant who explains how a paged KV cache works. "
    greedy = lambda n, m: SamplingParams(n=n, temperature=0, max_tokens=m, ignore_eos=True)
    return [Request(encode(system + "What is a block?"), greedy(1, 4)),
            Request(encode(system + "What is a block table?"), greedy(2, 3)),
            Request(encode(system + "Why share blocks?"), greedy(1, 4), arrive_at_step=2),
            Request(encode(system + "What is evicted first?"), greedy(1, 3), arrive_at_step=3)]


def speculative_workload(encode) -> list[Request]:
    """Prompts that repeat themselves, so that the n-gram proposer finds drafts: one greedy
    (``greedy_verify``), one sampled with a seed (``rejection_sample``)."""
    text = "one two three four five, one two three four five, one two three"
    return [Request(encode(text), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)),
            Request(encode("red green blue, red green blue, red green"),
                    SamplingParams(temperature=0.7, seed=3, max_tokens=8, ignore_eos=True))]


def window_workload(encode) -> list[Request]:
    """Prompts of token ids (the tiny model has no tokenizer) three times the window and more,
    greedy, parallel and sampled: every decode step attends past the window's edge."""
    greedy = lambda n, m: SamplingParams(n=n, temperature=0, max_tokens=m, ignore_eos=True)
    return [Request(list(range(10, 30)), greedy(1, 8)),
            Request(list(range(40, 47)), greedy(2, 10)),
            Request(list(range(60, 75)), SamplingParams(temperature=0.8, seed=2, max_tokens=8,
                                                        ignore_eos=True), arrive_at_step=2)]


def window_settings() -> dict:
    """A tiny random Mistral (seeded weights) attending to its last 6 tokens only."""
    from minipaged.lab.tiny_families import tiny_config

    return dict(model=None, hf_config=tiny_config("mistral", sliding_window=WINDOW),
                load_format="dummy", num_gpu_blocks=16, num_cpu_blocks=8, max_model_len=48,
                max_num_seqs=4, enable_chunked_prefill=False, max_num_batched_tokens=256)


WINDOW = 6  # tokens: a block and a half of 4


def kernel_workload(encode) -> list[Request]:
    """One greedy request: its prompt runs as a prompt, its three decode steps in the kernel."""
    return [Request(encode("The CUDA kernel reads the cache"),
                    SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))]


PREFIX_SETTINGS = dict(enable_prefix_caching=True, enable_chunked_prefill=False,
                       max_num_batched_tokens=64, num_gpu_blocks=24, max_model_len=40)
SPECULATIVE_SETTINGS = dict(enable_chunked_prefill=False, max_num_batched_tokens=64,
                            num_gpu_blocks=24, max_model_len=40,
                            speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                "prompt_lookup_max": 3})
# the block size and dtype of lesson 06's exercise build (kernel_exercise: float32, 16 a block)
KERNEL_SETTINGS = dict(block_size=16, enable_chunked_prefill=False, max_num_batched_tokens=64,
                       num_gpu_blocks=8, max_model_len=64, dtype="float32")


def capstone_runs(names: list[str]) -> list[capstone.Run]:
    """The capstone's five runs over ``names``: the engine; the prefix cache, with the
    package's block manager around your allocator; speculative decoding, with the package's
    step around your verifications; the engine with your phase 3 in its decode kernel; the
    engine on a sliding-window model."""
    engine = tuple(n for n in names if n in CAPSTONE_COMPONENTS or n == "LLMEngine.step")
    wider = lambda *more: tuple(n for n in more if n in names)
    return [
        capstone.Run("run 1, the engine", engine),
        capstone.Run(
            "run 2, prefix caching",
            tuple(n for n in engine if n != "BlockSpaceManager") + wider("PrefixCachingAllocator"),
            PREFIX_SETTINGS, prefix_workload,
            {"BlockSpaceManager": "yours of lesson 03, like vLLM v0.1's, takes no cached "
                                  "blocks, so the package's holds your allocator here"}),
        capstone.Run(
            "run 3, speculative decoding",
            tuple(n for n in engine if n != "LLMEngine.step")
            + wider("greedy_verify", "rejection_sample"),
            SPECULATIVE_SETTINGS, speculative_workload,
            {"LLMEngine.step": "yours leaves speculative decoding out, as this lesson asks, "
                               "so the package's step runs your verifications here"}),
        capstone.Run(
            "run 4, your CUDA phase 3 in the kernel built for the CPU",
            engine + wider("softmax_phase_cuda"), KERNEL_SETTINGS, kernel_workload,
            note="every decode step's attention in your kernel, each call within 1e-4 of the "
                 "torch reference"),
        capstone.Run(
            "run 5, a sliding-window model",
            tuple(n for n in engine if n != "BlockSpaceManager"), window_settings(),
            window_workload,
            {"BlockSpaceManager": "yours of lesson 03 keeps every block, a model whose every "
                                  "layer slides gives back those that left the window: the "
                                  "package's holds your allocator here"},
            note=f"a tiny random Mistral whose layers attend to their last {WINDOW} tokens"),
    ]


