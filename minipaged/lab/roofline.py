"""Performance on the machine in front of you: bandwidth, matmul peak, roofline (lesson 15).

A step of the engine does two things that take time: it *moves bytes* (every weight matrix is
read once per step, and every sequence's KV cache once per layer) and it *does arithmetic*
(two FLOPs per weight per token, plus attention). A machine does at most ``peak_flops``
FLOP/s and moves at most ``bandwidth`` bytes/s, so a step takes at least

    max(flops / peak_flops, bytes / bandwidth)

Which term wins depends on the step's *arithmetic intensity*, FLOPs per byte moved. The
roofline is the best FLOP/s a step of intensity I can reach: ``min(peak_flops, bandwidth * I)``;
the *ridge* ``peak_flops / bandwidth`` separates memory-bound steps (left) from compute-bound ones
(right). A decode step of B sequences reads all the weights to produce B tokens: its intensity
grows with B, so tokens/s grows with B until the step reaches the ridge, or until the KV pool
has no room for more sequences (``max_batch_size``).

Counted here (activations, norms and the embedding lookup are left out: they are small):
    weights   the matrices of the linear layers and the LM head, read once per step
    FLOPs     2 per weight per row of the step; attention 4 x head_size x heads per (query, key)
              pair and layer (q.k and p.V)
    KV bytes  a decode step reads the KV of every context token of every sequence
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from minipaged.model_shape import ModelShape

# The model's numbers: ``ModelShape`` (``minipaged/model_shape.py``: ``weight_params``,
# ``kv_bytes_per_token``); real models' shapes in ``kv_memory.MODEL_SHAPES``.


@dataclass(frozen=True)
class StepCost:
    """The work of one step: FLOPs done and bytes moved between memory and the cores."""

    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        """Arithmetic intensity: FLOPs per byte moved."""
        return self.flops / self.bytes


def decode_step(dims: ModelShape, batch_size: int, context_len: int, dtype_bytes: int) -> StepCost:
    """One decode step: ``batch_size`` sequences, each attending to ``context_len`` tokens.

    FLOPs: 2 per weight per sequence, and attention's 4 x head_size per head, context token,
    layer and sequence. Bytes: the weights once (shared by the whole batch) and each sequence's
    KV cache (``context_len`` tokens)."""
    _check_positive(batch_size=batch_size, context_len=context_len, dtype_bytes=dtype_bytes)
    attention = 4 * dims.num_layers * dims.num_heads * dims.head_size * context_len
    flops = batch_size * (2 * dims.weight_params + attention)
    moved = (dims.weight_params * dtype_bytes
             + batch_size * context_len * dims.kv_bytes_per_token(dtype_bytes))
    return StepCost(float(flops), float(moved))


def prefill_step(dims: ModelShape, prompt_lens: list[int], dtype_bytes: int) -> StepCost:
    """One prompt step: every token of every prompt goes through every weight, and attends to
    itself and the tokens before it (n(n+1)/2 pairs for a prompt of n). Bytes: the weights once
    and the KV written. Logits are computed for each prompt's last token only."""
    if not prompt_lens:
        raise ValueError("prompt_lens must name at least one prompt")
    _check_positive(dtype_bytes=dtype_bytes, **{f"prompt_lens[{i}]": n
                                                for i, n in enumerate(prompt_lens)})
    head = dims.vocab_size * dims.hidden_size
    body = dims.weight_params - head
    pairs = sum(n * (n + 1) // 2 for n in prompt_lens)
    tokens = sum(prompt_lens)
    flops = (2 * body * tokens + 2 * head * len(prompt_lens)
             + 4 * dims.num_layers * dims.num_heads * dims.head_size * pairs)
    moved = dims.weight_params * dtype_bytes + tokens * dims.kv_bytes_per_token(dtype_bytes)
    return StepCost(float(flops), float(moved))


def _check_positive(**values) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


# ----------------------------------------------------------------------------------------------
# The machine's numbers and the roofline
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Machine:
    name: str
    peak_flops: float  # FLOP/s of large matmuls
    bandwidth: float  # bytes/s between memory and the cores
    source: str = ""

    @property
    def ridge(self) -> float:
        """The intensity (FLOP/byte) where the two ceilings meet."""
        return self.peak_flops / self.bandwidth

    def attainable(self, intensity: float) -> float:
        """The roofline: the most FLOP/s a step of this intensity can reach."""
        return min(self.peak_flops, self.bandwidth * intensity)

    def step_seconds(self, cost: StepCost) -> float:
        """The least time a step can take: its bytes or its FLOPs, whichever is slower."""
        return max(cost.flops / self.peak_flops, cost.bytes / self.bandwidth)


# Published numbers of an H100 SXM (NVIDIA's H100 datasheet): HBM3 bandwidth, and dense BF16
# tensor-core throughput, i.e. without 2:4 structured sparsity (the datasheet's larger figure).
H100_SXM = Machine("H100 SXM", peak_flops=989e12, bandwidth=3.35e12,
                   source="NVIDIA H100 datasheet: 3.35 TB/s HBM3, 989 TFLOP/s dense BF16")


def _best_seconds(fn, repeats: int, device: torch.device = torch.device("cpu")) -> float:
    cuda = device.type == "cuda"
    best = float("inf")
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()  # the GPU ran what was launched
        best = min(best, time.perf_counter() - t0)
    return best


def measure_bandwidth(mib: int = 128, repeats: int = 5) -> float:
    """Bytes/s of reading one ``mib`` MiB fp32 matrix in a matrix-vector product: what a decode
    step of one sequence does with each weight matrix. The best of ``repeats`` runs (the others
    were slowed by something else on the machine). Larger than any CPU cache, so it measures
    main memory."""
    cols = 4096
    weight = torch.randn(mib * 2 ** 20 // (4 * cols), cols)  # (rows, cols) fp32
    x = torch.randn(cols)  # (cols,)
    seconds = _best_seconds(lambda: weight @ x, repeats)  # (rows,)
    return weight.numel() * weight.element_size() / seconds


def measure_matmul_peak(n: int = 1536, dtype: torch.dtype = torch.float32, repeats: int = 3,
                        device: torch.device = torch.device("cpu")) -> float:
    """FLOP/s of one (n x n) @ (n x n) matmul in ``dtype`` on ``device``, the best of
    ``repeats`` runs."""
    a = torch.randn(n, n, device=device).to(dtype)  # (n, n)
    b = torch.randn(n, n, device=device).to(dtype)  # (n, n)
    return 2 * n ** 3 / _best_seconds(lambda: a @ b, repeats, device)


def measure_machine(name: str = "this CPU (measured)") -> Machine:
    """Both ceilings of this machine, measured now, in fp32 with torch's threads."""
    return Machine(name, measure_matmul_peak(), measure_bandwidth(),
                   source=f"measured: fp32 matmul peak, matrix-vector read bandwidth, "
                          f"{torch.get_num_threads()} threads")


# ----------------------------------------------------------------------------------------------
# Memory: how many sequences fit
# ----------------------------------------------------------------------------------------------


def max_batch_size(kv_budget_bytes: int, kv_bytes_per_token: int, block_size: int,
                   seq_len: int) -> int:
    """The most sequences of ``seq_len`` tokens whose KV fits a pool of ``kv_budget_bytes``.

    The pool holds whole blocks of ``block_size`` tokens (as the engine sizes it,
    ``config.kv_pool_blocks``), and each sequence needs ceil(seq_len / block_size) of them."""
    _check_positive(kv_bytes_per_token=kv_bytes_per_token, block_size=block_size, seq_len=seq_len)
    if kv_budget_bytes < 0:
        raise ValueError(f"kv_budget_bytes must be >= 0, got {kv_budget_bytes!r}")
    num_blocks = kv_budget_bytes // (block_size * kv_bytes_per_token)
    return int(num_blocks // math.ceil(seq_len / block_size))


def gpu_kv_budget(available_bytes: float, gpu_memory_utilization: float,
                  profiled_peak_bytes: float) -> float:
    """What a GPU leaves for the KV pool: the share the engine may use of the memory this
    process could take when the engine started (all of an empty card's), less the peak its
    weights and a profiled forward pass of the largest step reached, as
    ``worker/model_loader.profile_num_gpu_blocks`` computes it (``gpu_memory.kv_pool_bytes``)."""
    from minipaged.worker.gpu_memory import kv_pool_bytes

    return float(kv_pool_bytes(available_bytes, gpu_memory_utilization, profiled_peak_bytes))


# ----------------------------------------------------------------------------------------------
# Measuring the engine
# ----------------------------------------------------------------------------------------------


def prefill_step_seconds(llm, prompt_len: int, repeats: int = 2) -> float:
    """Seconds of the step that computes one prompt of ``prompt_len`` tokens (best of a few)."""
    from minipaged.sampling_params import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    best = float("inf")
    for r in range(repeats + 1):  # the first run warms up
        engine.add_request(f"prefill-{r}", None, params,
                           prompt_token_ids=[(7 * i + r) % 1000 + 10 for i in range(prompt_len)])
        t0 = time.perf_counter()
        engine.step()
        if r:
            best = min(best, time.perf_counter() - t0)
        while engine.has_unfinished_requests():
            engine.step()
    return best


def decode_sweep(llm, batch_sizes: list[int], prompt_len: int = 4,
                 num_steps: int = 3) -> list[dict]:
    """Seconds of one decode step at each batch size, and the tokens/s that gives.

    For each B: B requests of ``prompt_len`` tokens are computed, then ``num_steps`` decode
    steps are timed one by one and the fastest counts (the slower ones were disturbed by
    whatever else the machine was doing). Context length at the timed steps: about
    ``prompt_len + num_steps``."""
    from minipaged.sampling_params import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=num_steps + 2, ignore_eos=True)
    results = []
    for b in batch_sizes:
        for i in range(b):
            engine.add_request(f"sweep-{b}-{i}", None, params,
                               prompt_token_ids=[(31 * i + k) % 997 + 3 for k in range(prompt_len)])
        while engine.scheduler.waiting:
            engine.step()  # the prompts
        engine.step()  # one decode to warm up
        best = float("inf")
        for _ in range(num_steps):
            t0 = time.perf_counter()
            engine.step()
            best = min(best, time.perf_counter() - t0)
        while engine.has_unfinished_requests():
            engine.step()
        results.append({"batch_size": b, "step_seconds": best, "tokens_per_s": b / best,
                        "context_len": prompt_len + 2})
    return results


def weight_bytes_read(model) -> int:
    """Bytes of weights one decode step of ``model`` (a LLaMA-family model) reads: every linear
    layer's weight and the LM head (a tied embedding once), as the model holds them: float32
    (4 bytes a weight) or GGUF blocks (``models/gguf_linear.py``; torch's packed 4-bit copy where
    that routine runs). An embedding only looked up (a few rows a step) and norms are left out."""
    from minipaged.models.gguf_linear import GGUFWeight
    from minipaged.models.parallel_layers import ParallelLMHead, VocabParallelEmbedding

    tied = getattr(model, "tie_word_embeddings", False)
    storages = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, torch.nn.Embedding) or (
                isinstance(module, VocabParallelEmbedding)
                and not isinstance(module, ParallelLMHead) and not tied):
            continue  # (looked up, not read whole)
        if isinstance(weight, GGUFWeight):
            tensors = weight.tensors()[1:] if weight.routine == "int4pack" else [weight.blocks]
        elif isinstance(weight, torch.Tensor) and weight.dim() == 2:
            tensors = [weight]
        else:
            continue
        for t in tensors:  # (fused and tied weights share storage: counted once)
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def single_stream_decode(llm, new_tokens: int = 9, repeats: int = 2) -> dict:
    """One sequence's decode on ``llm``: its weights' bytes read per token, seconds per token
    (the best of ``repeats`` runs of ``decode_run``), FLOPs per token (2 per weight) and what
    they make: intensity (FLOP/byte) and reached FLOP/s and bytes/s."""
    moved = weight_bytes_read(llm.llm_engine.worker.model)
    flops = 2 * llm.llm_engine.model_shape.weight_params
    seconds = min(decode_run(llm, 1, new_tokens)["step_s"] for _ in range(repeats))
    return {"bytes": moved, "flops": flops, "step_s": seconds, "intensity": flops / moved,
            "flops_per_s": flops / seconds, "bytes_per_s": moved / seconds}


def saturation_batch(batch_sizes: list[int], tokens_per_s: list[float],
                     fraction: float = 0.9) -> int:
    """The smallest batch size whose tokens/s reached ``fraction`` of the best measured: where
    more sequences per step stopped paying (robust to a noisy point after it)."""
    best = max(tokens_per_s)
    return next(b for b, t in zip(batch_sizes, tokens_per_s) if t >= fraction * best)


def count_torch_ops(fn) -> int:
    """How many tensor operations (ATen ops) ``fn()`` runs: on a GPU, each is about one kernel
    launch, with its fixed cost of a few microseconds however small the work."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counter.count += 1
            return func(*args, **(kwargs or {}))

    with Counter():
        fn()
    return Counter.count


def decode_run(llm, batch_size: int, new_tokens: int, prompt_len: int = 4) -> dict:
    """Greedy decode of ``batch_size`` sequences, ``new_tokens`` tokens each, timed after their
    prompts (lesson 15's multi-step section).

    Returns a dict: "steps" decode steps per sequence and the engine's "schedules" for them;
    per decode step, "step_s" seconds of the whole engine and "outside_s" of the engine outside
    the model (``engine.stats``: schedule, prepare, sample, update; a multi-step run's model
    section holds its k steps and their greedy choices, made on the device); and each
    request's "tokens", to compare two engines.
    """
    from minipaged.sampling_params import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch_size):
        engine.add_request(f"run-{i}", None, params,
                           prompt_token_ids=[(31 * i + k) % 997 + 3 for k in range(prompt_len)])
    while engine.scheduler.waiting:
        engine.step()  # the prompts, and each sequence's first token
    engine.stats.reset()
    tokens = {}
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    seconds = time.perf_counter() - t0
    stats, steps = engine.stats, new_tokens - 1
    outside = seconds - stats.time_model
    return {"steps": steps, "schedules": stats.num_steps, "step_s": seconds / steps,
            "outside_s": outside / steps, "tokens": tokens}


def dummy_gpt2(n_embd: int = 512, n_layer: int = 6, n_head: int = 8, vocab_size: int = 8192,
               **llm_kwargs):
    """An ``LLM`` with a GPT-2-shaped model of random weights (no checkpoint, no tokenizer: feed
    it ``prompt_token_ids``). The default shape has ~23 M weights, 92 MB in fp32: a few times a
    CPU's last-level cache, so a step reads its weights from main memory, as a real model does."""
    from transformers import GPT2Config

    from minipaged.entrypoints.llm import LLM

    config = GPT2Config(n_embd=n_embd, n_layer=n_layer, n_head=n_head, vocab_size=vocab_size,
                        n_positions=1024, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LLM(None, hf_config=config, load_format="dummy", **llm_kwargs)
