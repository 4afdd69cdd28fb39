"""The engine's settings, checked once, and the two decisions they lead to (lesson 08).

``EngineConfig`` declares every setting of ``LLMEngine`` and ``LLM`` once, with its default and
what it means (the command line's flags and help are made from it); building it checks each one
(a ValueError names the setting and what is allowed; numpy scalars become Python numbers). Two steps
come later, once the model and the worker are known, because they need the model's size:

- ``kv_pool_blocks``: how many KV blocks the GPU and CPU pools get;
- ``fit_max_model_len``: the longest request the engine accepts; it refuses a pool or budget that
  cannot run one request of that length, or lowers the length (with a warning) when the engine
  sized the pool itself.
"""
from __future__ import annotations

import difflib
import logging
import math
from dataclasses import dataclass, field, fields

from minipaged.speculative_config import SpeculativeConfig
from minipaged.validation import as_int, as_number, shown

GiB = 1 << 30
KV_CACHE_DTYPES = ("auto", "fp8", "int8")  # what the KV cache holds (lesson 18)
# How the weights are held: "gguf" (the file's own blocks) or "none" (converted to dtype); not
# given (None), the engine decides (engine/llm_engine.py's held_weights)
QUANTIZATIONS = ("gguf", "none")
DEFAULT_KV_CACHE_BYTES = GiB  # the CPU pool's budget when no kv_cache_bytes is given
logger = logging.getLogger("minipaged")


PREEMPTION_MODES = ("recompute", "swap")


def _mode(v):  # a PreemptionMode member counts as its name
    v = getattr(v, "value", v)
    return v if isinstance(v, str) and v in PREEMPTION_MODES else None


def _device(v):
    import torch  # NOTE: imported here: only this one check needs torch

    if v == "auto":
        return v
    try:
        d = torch.device(v)
    except (RuntimeError, TypeError):
        return None
    return v if d.type in ("cpu", "cuda") else None


def _flag(v):
    return v if isinstance(v, bool) else None


# -- the tensor-parallel back-end (lesson 14) --
BACKENDS = ("mp", "ray")
RAY_MISSING = ("distributed_executor_backend='ray' needs Ray, which is not installed here: "
               "pip install 'minipaged[ray]'")


def _backend(v):
    return v if v in BACKENDS else None


def _ray_installed() -> bool:
    import importlib.util  # NOTE: finds Ray without importing it (an import takes seconds)

    try:
        return importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):
        return False


MAX_SCHEDULER_STEPS = 64  # num_scheduler_steps: more only holds blocks longer, for less gain


# name: (convert -> None when bad, check on the converted value, what is allowed)
_RULES = {
    "block_size": (as_int, lambda v: v in (1, 2, 4, 8, 16, 32, 64, 128),
                   "a power of two from 1 to 128"),
    "gpu_memory_utilization": (as_number, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "kv_cache_bytes": (as_number, lambda v: v > 0, "None or a number of bytes > 0"),
    "swap_space": (as_number, lambda v: v >= 0, "a finite number of GiB >= 0"),
    "num_gpu_blocks": (as_int, lambda v: v >= 1, "None or an integer >= 1"),
    "num_cpu_blocks": (as_int, lambda v: v >= 0, "None or an integer >= 0"),
    "max_num_seqs": (as_int, lambda v: v >= 1, "an integer >= 1"),
    "max_num_batched_tokens": (as_int, lambda v: v >= 1, "None or an integer >= 1"),
    "max_model_len": (as_int, lambda v: v >= 2, "None or an integer >= 2"),
    "watermark": (as_number, lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "seed": (as_int, lambda v: True, "an integer"),
    "tensor_parallel_size": (as_int, lambda v: v >= 1, "an integer >= 1"),
    "worker_timeout": (as_number, lambda v: v > 0, "a number of seconds > 0"),
    "distributed_executor_backend": (_backend, lambda v: True, "None, 'mp' or 'ray'"),
    "enable_prefix_caching": (_flag, lambda v: True, "True or False"),
    "enable_chunked_prefill": (_flag, lambda v: True, "True or False"),
    "enforce_eager": (_flag, lambda v: True, "True or False"),
    "kv_cache_groups": (_flag, lambda v: True, "True or False"),
    "cpu_threads": (as_int, lambda v: v >= 1, "None (chosen per step) or an integer >= 1"),
    "num_scheduler_steps": (as_int, lambda v: 1 <= v <= MAX_SCHEDULER_STEPS,
                            f"an integer from 1 to {MAX_SCHEDULER_STEPS}"),
    "preemption_mode": (_mode, lambda v: True, "None, 'recompute' or 'swap'"),
    "device": (_device, lambda v: True, "'auto', 'cpu', 'cuda' or 'cuda:N'"),
    "trace_path": (lambda v: v if isinstance(v, str) and v.strip() else None, lambda v: True,
                   "None or a file path"),
    "kv_cache_dtype": (lambda v: v if v in KV_CACHE_DTYPES else None, lambda v: True,
                       "one of " + ", ".join(map(repr, KV_CACHE_DTYPES))),
    "quantization": (lambda v: v if v in QUANTIZATIONS else None, lambda v: True,
                     "None, 'gguf' or 'none'"),
}

# -- the settings ------------------------------------------------------------------------------
DEFAULT_TIMEOUT_S = 120.0  # seconds for one tensor-parallel step (worker_timeout)


def setting(default, help_text: str, **metadata):
    """A field of ``EngineConfig``: its default and what it means (the CLI's help reads it).

    Args:
        default: the value when the setting is not given.
        help_text: one line for ``--help`` and for readers of this file.
        metadata: more facts the CLI reads, e.g. ``choices=("a", "b")``.
    """
    return field(default=default, metadata={"help": help_text, **metadata})


@dataclass
class EngineConfig:
    """Every setting of ``LLMEngine`` and ``LLM``, declared once: its default and its meaning.

    ``LLMEngine(model, **settings)`` and ``LLM(model, **settings)`` build one with
    ``EngineConfig.from_settings``, and the command line makes a flag of each field
    (``entrypoints/cli.py``). Building one checks the settings in ``_RULES`` (the model,
    tokenizer, dtype and load format are checked where they are loaded); a bad value raises
    ValueError naming it and what is allowed. Numbers come out as Python ints and floats,
    ``preemption_mode`` as its name.
    """

    model: str | None = setting(
        None, "a Hugging Face id, a local save_pretrained directory, or None for the embedded "
              "SmolLM2-135M-Instruct")
    tokenizer: str | None = setting(
        None, "where to load the tokenizer from, if not from the model")
    dtype: object = setting(
        "auto", "weights and KV cache type: auto (float32 on CPU, the checkpoint's half type "
                "on CUDA), float32, float16 or bfloat16")
    device: str = setting("auto", "auto, cpu or cuda")
    block_size: int = setting(16, "tokens per KV cache block")
    seed: int = setting(0, "seeds every request that brings no seed of its own")
    gpu_memory_utilization: float = setting(
        0.9, "on CUDA: fraction of the GPU memory this process could still take when the "
             "engine started (free memory and torch's unused cache) for weights, activations "
             "and the KV pool (the pool gets what a profiled forward pass leaves)")
    kv_cache_bytes: int | None = setting(
        None, "without CUDA: bytes for the KV pool (1 GiB when not given)")
    swap_space: float = setting(1.0, "GiB of CPU memory for swapped-out KV blocks")
    num_gpu_blocks: int | None = setting(
        None, "blocks in the KV pool (GPU, or the CPU when it runs the model); overrides the "
              "memory budgets")
    num_cpu_blocks: int | None = setting(
        None, "blocks in the CPU swap pool; overrides swap_space")
    max_num_seqs: int = setting(256, "most sequences in one step's batch")
    max_num_batched_tokens: int | None = setting(
        None, "most tokens in one step: prompt chunks plus one per decode (when not given: "
              "max(4096, max_model_len))")
    max_model_len: int | None = setting(
        None, "longest sequence, prompt plus output (when not given: the model's)")
    preemption_mode: str | None = setting(
        None, "recompute or swap (when not given: recompute single sequences, swap groups)",
        choices=PREEMPTION_MODES)
    watermark: float = setting(0.01, "fraction of the KV pool kept free when admitting prompts")
    enable_chunked_prefill: bool = setting(
        True, "split long prompts over several steps, decodes first (off: a prompt runs whole "
              "in one step, so it must fit max_num_batched_tokens)")
    load_format: str = setting(
        "auto", "auto (read the checkpoint) or dummy (random weights from the config)",
        choices=("auto", "dummy"))
    hf_config: object = setting(
        None, "a transformers config to use instead of the model's own")
    tensor_parallel_size: int = setting(
        1, "split the model over N worker processes (lesson 14); pool sizes and budgets are "
           "then per rank")
    worker_timeout: float = setting(
        DEFAULT_TIMEOUT_S, "seconds a tensor-parallel step may take before the engine gives up")
    enable_prefix_caching: bool = setting(
        True, "reuse the cached KV blocks a prompt starts with (lesson 11); outputs are the "
              "same either way")
    kv_cache_groups: bool = setting(
        True, "a model with sliding and full layers (Gemma 3, lesson 20): one block table per "
              "group of layers from one pool, the sliding groups keeping only their window "
              "(engine/cache_setup.py says the settings that keep every block instead); a "
              "model of one kind of layer has one group either way")
    enforce_eager: bool = setting(
        False, "on CUDA: run decode steps eagerly instead of replaying CUDA graphs")
    num_scheduler_steps: int = setting(
        1, "multi-step decode (lesson 15): schedule once, then run up to this many greedy "
           "decode steps back to back, each feeding its tokens to the next on the device and "
           "read back while the next runs; 1 = a schedule per step. Batches with sampling, "
           "penalties, beams or prompts step one at a time")
    cpu_threads: int | None = setting(
        None, "on the CPU: torch's threads for the model; when not given, chosen per step from "
              "the step's size and the cores other programs leave free (worker/cpu_threads.py)")
    distributed_executor_backend: str | None = setting(
        None, "who starts the tensor-parallel ranks: mp (processes on this machine, when not "
              "given) or ray (actors on a Ray cluster; pip install 'minipaged[ray]')",
        choices=BACKENDS)
    speculative_config: object = setting(
        None, "None, or vLLM's dict turning on speculative decoding (lesson 12; "
              "speculative_config.py says what it holds)")

    kv_cache_dtype: str = setting(
        "auto", "what the KV cache holds: auto (the model's dtype), fp8 (float8 e4m3) or int8, "
                "each 8-bit number with a float32 scale per token and kv head (lesson 18); the "
                "pool then holds more blocks per byte", choices=KV_CACHE_DTYPES)
    trace_path: str | None = setting(
        None, "write every step to this file as Chrome trace-event JSON, for Perfetto or "
              "chrome://tracing: a track per request, a slice per step phase, counters of "
              "the KV pool, the queues and the batched tokens (engine/step_trace.py); a path "
              "ending in .perfetto-trace or .pftrace gets Perfetto's protobuf format")

    quantization: str | None = setting(
        None, "gguf: the linear layers and the embedding hold the GGUF file's blocks as stored "
              "(Q8_0, Q4_1, Q5_0, Q4_K, Q6_K), dequantized inside each matmul "
              "(models/gguf_linear.py), for the embedded model, gemma-3-270m or a path to a "
              ".gguf file, on one CPU process; none: the weights converted to dtype; not given: "
              "gguf for the embedded model on one CPU process in float32 (measured faster, the "
              "same tokens: benchmarks/RESULTS.md), else none", choices=QUANTIZATIONS)

    @classmethod
    def from_settings(cls, model: str | None = None, **settings) -> EngineConfig:
        """The config of ``LLMEngine(model, **settings)``; an unknown setting is refused by name.

        Args:
            model: the model (see the field).
            settings: any other fields, by name; those not given keep their defaults.
        """
        names = [f.name for f in fields(cls)]
        for name in settings:
            if name not in names:
                close = difflib.get_close_matches(name, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise TypeError(f"unknown engine setting {name!r}{hint} (the settings are the "
                                f"fields of EngineConfig in minipaged/config.py)")
        return cls(model=model, **settings)

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.of(self.speculative_config)
        for f in fields(self):
            if f.name not in _RULES:
                continue
            value = getattr(self, f.name)
            if value is None and f.default is None:  # None means "not given": the engine decides
                continue
            convert, check, allowed = _RULES[f.name]
            converted = convert(value)
            if converted is None or not check(converted):
                raise ValueError(f"{f.name} must be {allowed}, got {shown(value)}")
            setattr(self, f.name, converted)
        if self.distributed_executor_backend == "ray" and not _ray_installed():
            raise ValueError(RAY_MISSING)
        if self.quantization == "gguf" and (self.tensor_parallel_size > 1
                                            or self.load_format != "auto"):
            raise ValueError("quantization='gguf' reads the GGUF file's weights in one process: "
                             "it needs tensor_parallel_size=1 and load_format='auto'")
        if self.num_scheduler_steps > 1 and self.speculative_config is not None:
            raise ValueError("num_scheduler_steps > 1 and speculative_config cannot be used "
                             "together: both reserve the lookahead slots of a step; pick one")

    def batch_budget(self, max_model_len: int) -> int:
        """``max_num_batched_tokens``, or by default enough for one whole prompt (and 4096)."""
        return self.max_num_batched_tokens or max(4096, max_model_len)


def kv_pool_blocks(config: EngineConfig, block_bytes: int, max_model_len: int,
                   profiled_gpu_blocks: int | None) -> tuple[int, int]:
    """(GPU blocks, CPU blocks) of the KV pools.

    Args:
        config: the settings; explicit ``num_gpu_blocks``/``num_cpu_blocks`` win.
        block_bytes: bytes of one block (all layers, K and V; per rank under tensor parallel).
        max_model_len: the length before fitting; caps a pool the engine sizes (on the CPU or
            on a GPU) at what ``max_num_seqs`` sequences of that length could ever use, so a
            small engine on a big GPU takes a small pool.
        profiled_gpu_blocks: what profiling found free on a GPU, or None on the CPU (the pool
            then gets ``kv_cache_bytes``).
    """
    blocks_cap = config.max_num_seqs * math.ceil(max_model_len / config.block_size)
    num_gpu_blocks = config.num_gpu_blocks
    if num_gpu_blocks is None and profiled_gpu_blocks is not None:
        num_gpu_blocks = min(profiled_gpu_blocks, blocks_cap)
    if num_gpu_blocks is None:
        budget = (config.kv_cache_bytes if config.kv_cache_bytes is not None
                  else DEFAULT_KV_CACHE_BYTES)
        num_gpu_blocks = min(int(budget // block_bytes), blocks_cap)
    num_cpu_blocks = config.num_cpu_blocks
    if num_cpu_blocks is None:
        num_cpu_blocks = min(int(config.swap_space * GiB // block_bytes), blocks_cap)
    if num_gpu_blocks < 1:
        raise ValueError(f"the KV pool has no room for a single block of "
                         f"{block_bytes} bytes; give more memory or num_gpu_blocks")
    return num_gpu_blocks, num_cpu_blocks


def fit_max_model_len(config: EngineConfig, model_max_len: int, num_gpu_blocks: int,
                      max_num_batched_tokens: int) -> tuple[int, str]:
    """The engine's max_model_len, and why: refuse, or LOWER it, when one request cannot fit.

    Two things must hold (vLLM refuses both too): the pool, less the blocks the watermark
    keeps free, holds ``max_model_len`` tokens; and without chunked prefill, where a prompt
    runs whole in one step, ``max_num_batched_tokens >= max_model_len``. Otherwise a
    ValueError names the numbers and what to pass instead.

    NOTE: one exception. When the engine sized the pool itself (from ``kv_cache_bytes`` on
    the CPU, from ``gpu_memory_utilization`` on CUDA) and no ``max_model_len`` was given,
    the model's own limit is lowered to what the pool holds, with a warning: ``LLM(model)``
    with no settings should run on a laptop even when the model allows 8k-128k positions,
    and the user asked for no particular length or pool. Given explicitly, a pool
    (``num_gpu_blocks``), a budget (``max_num_batched_tokens``) or a ``max_model_len``
    that cannot run the model's length is a mistake, and is refused.

    Args:
        config: the settings (``max_model_len``, ``block_size``, ``watermark``, ...).
        model_max_len: the model's own limit (its position embeddings).
        num_gpu_blocks: the GPU pool's size.
        max_num_batched_tokens: the scheduler's budget per step.

    Returns:
        (max_model_len, the reason an error message gives for it).
    """
    explicit_len = config.max_model_len is not None
    pool_sized_by_engine = config.num_gpu_blocks is None
    max_model_len = min(config.max_model_len or model_max_len, model_max_len)
    bs, watermark = config.block_size, config.watermark
    watermark_blocks = int(watermark * num_gpu_blocks)  # as BlockSpaceManager counts it
    usable = num_gpu_blocks - watermark_blocks
    pool_tokens = usable * bs
    # Without chunked prefill a prompt runs whole in one step: the budget caps its length.
    chunked = config.enable_chunked_prefill
    budget_tokens = pool_tokens if chunked else max_num_batched_tokens
    fits = min(pool_tokens, budget_tokens)  # the longest request this engine can run
    if fits >= max_model_len:
        return max_model_len, ("max_model_len" if explicit_len else "the model's maximum length")
    if not chunked and max_num_batched_tokens < max_model_len:
        # (never by default: the default budget is at least max_model_len)
        raise ValueError(
            f"max_num_batched_tokens ({max_num_batched_tokens}) is smaller than "
            f"max_model_len ({max_model_len}), and without chunked prefill a prompt "
            f"runs whole in one step, so a long prompt could never be scheduled; pass "
            f"max_model_len={fits}, max_num_batched_tokens={max_model_len} or "
            f"enable_chunked_prefill=True")
    need = math.ceil(max_model_len / bs)
    pool_needed = need  # the smallest pool whose usable part holds ``need`` blocks
    while pool_needed - int(watermark * pool_needed) < need:
        pool_needed += 1
    if fits >= 2 and pool_sized_by_engine and not explicit_len:
        logger.warning(
            "max_model_len lowered from %d to %d tokens: the KV pool the engine sized from "
            "its memory budget has %d blocks of %d tokens (%d usable after the "
            "watermark); pass max_model_len=, or more memory, to choose",
            max_model_len, fits, num_gpu_blocks, bs, usable)
        return fits, (f"what the KV pool of {num_gpu_blocks} blocks holds, "
                      f"sized from the memory budget")
    larger = f"num_gpu_blocks >= {pool_needed}"
    if pool_sized_by_engine:
        larger = f"more kv_cache_bytes or gpu_memory_utilization, or {larger}"
    raise ValueError(
        f"the KV pool cannot hold one request of max_model_len ({max_model_len}) "
        f"tokens: it needs {need} blocks of {bs} tokens, the pool has {num_gpu_blocks} "
        f"blocks of which {usable} are usable (watermark {watermark} keeps "
        f"{watermark_blocks} free), {pool_tokens} tokens; "
        + (f"pass max_model_len={fits} or a larger pool ({larger})" if fits >= 2
           else f"give a larger pool ({larger})"))
