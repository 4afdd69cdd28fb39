"""The LLMEngine: continuous batching, one ``step()`` at a time (lesson 06).

    step() = schedule -> move cache blocks -> run the model on the flattened batch -> sample
             -> append tokens, fork/free beams, check stops -> free finished groups -> observers
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from minipaged.worker import checkpoint
from minipaged.core.block_manager import BlockSpaceManager
from minipaged.worker.cache_engine import CacheEngine, cache_block_bytes
from minipaged.engine.detokenizer import detokenize_incrementally
from minipaged.worker.model_runner import ModelRunner, prepare_inputs
from minipaged.worker.model_loader import (build_model, profile_num_gpu_blocks, resolve_device,
                                   resolve_dtype)
from minipaged.outputs import RequestOutput
from minipaged.worker.mp_workers import DEFAULT_TIMEOUT_S, TensorParallelWorkers
from minipaged.worker.sampler import Sampler, SequenceOutput
from minipaged.sampling_params import SamplingParams
from minipaged.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutputs
from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus
from minipaged.validation import as_number, as_token_ids, check_settings, shown

GiB = 1 << 30
logger = logging.getLogger("minipaged")


def _derive_seed(request_seed: int | str, index: int) -> int:
    """A 64-bit seed for sequence ``index`` of a request, the same in every process."""
    digest = hashlib.sha256(f"{request_seed}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


@dataclass
class EngineStats:
    """Counters the tests and lessons read (``llm.llm_engine.stats``)."""

    num_steps: int = 0
    num_preemptions_recompute: int = 0
    num_preemptions_swap: int = 0
    num_blocks_copied: int = 0
    num_blocks_swapped_in: int = 0
    num_blocks_swapped_out: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0  # tokens run through decode steps (one per sequence)
    num_sampled_tokens: int = 0  # tokens sampled, a prompt's first one included
    num_aborted_by_engine: int = 0
    peak_gpu_blocks_used: int = 0
    # Prefix caching (lesson 07): prompt tokens whose KV came from the cache and were not
    # computed (num_prompt_tokens counts the computed ones), and cached blocks evicted.
    num_cached_prompt_tokens: int = 0
    num_evicted_blocks: int = 0
    # Where a step's time goes, in seconds, summed over all steps.
    time_schedule: float = 0.0
    time_prepare: float = 0.0
    time_model: float = 0.0
    time_sample: float = 0.0
    time_update: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class StepSnapshot:
    """What an observer sees after each step: plain data only."""

    step: int
    scheduled: list[str]
    prompt_run: list[bool]
    blocks_to_swap_in: dict[int, int]
    blocks_to_swap_out: dict[int, int]
    blocks_to_copy: dict[int, list[int]]
    preempted: list[tuple[str, str]]
    finished: list[str]
    block_manager: dict
    scheduler: dict
    stats: dict = field(default_factory=dict)
    num_batched_tokens: int = 0  # tokens the model computed in this step


class LLMEngine:
    """Owns the model, the KV cache, the scheduler and the sampler.

    Args:
        model: a Hugging Face id, a local ``save_pretrained`` directory, or None for the
            embedded SmolLM2-135M-Instruct.
        tokenizer: where to load the tokenizer from, if not from ``model``.
        dtype: "auto" (float32 on CPU, the checkpoint's half type on CUDA) or a dtype name.
        device: "auto", "cpu" or "cuda".
        block_size: tokens per KV block.
        seed: seeds requests that bring no seed of their own.
        gpu_memory_utilization: on CUDA, the fraction of GPU memory for weights, activations and
            the KV pool; the pool gets what a profiled forward pass leaves.
        kv_cache_bytes: on CPU, the byte budget of the KV pool (default 1 GiB).
        swap_space: GiB of CPU memory for swapped-out blocks.
        num_gpu_blocks, num_cpu_blocks: explicit pool sizes, overriding the budgets.
        max_num_seqs, max_num_batched_tokens, max_model_len: scheduler limits.
        preemption_mode: None (recompute single sequences, swap groups), "recompute" or "swap".
        watermark: fraction of the GPU pool kept free when admitting prompts.
        enable_chunked_prefill: each step's budget (``max_num_batched_tokens``) goes to the
            decodes first; prompts fill what is left, split over several steps when needed.
            False: a prompt runs whole in one step, so it must fit the budget.
        load_format: "auto" (read the checkpoint) or "dummy" (random weights from the config).
        tensor_parallel_size: N > 1 splits the model over N worker processes (lesson 09,
            ``parallel.py``); the pool sizes and budgets are then per rank.
        worker_timeout: seconds a tensor-parallel step may take before the engine gives up.
        enable_prefix_caching: keep computed full blocks named by their hash chain, so a prompt
            that starts like an earlier one takes its blocks instead of computing them
            (lesson 07). Outputs are the same either way.
    """

    def __init__(self, model: str | None = None, tokenizer: str | None = None,
                 dtype="auto", device: str = "auto", block_size: int = 16, seed: int = 0,
                 gpu_memory_utilization: float = 0.9, kv_cache_bytes: int | None = None,
                 swap_space: float = 1.0, num_gpu_blocks: int | None = None,
                 num_cpu_blocks: int | None = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, max_model_len: int | None = None,
                 preemption_mode: str | None = None, watermark: float = 0.01,
                 enable_chunked_prefill: bool = True,
                 load_format: str = "auto", hf_config=None, tensor_parallel_size: int = 1,
                 worker_timeout: float = DEFAULT_TIMEOUT_S,
                 enable_prefix_caching: bool = True) -> None:
        settings = check_settings(
            block_size=block_size, gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_bytes=kv_cache_bytes, swap_space=swap_space, num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_cpu_blocks, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            watermark=watermark, seed=seed, enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill, preemption_mode=preemption_mode,
            device=device, tensor_parallel_size=tensor_parallel_size,
            worker_timeout=worker_timeout)
        # numpy scalars (np.int64(16)) become Python numbers from here on.
        (block_size, gpu_memory_utilization, kv_cache_bytes, swap_space, num_gpu_blocks,
         num_cpu_blocks, max_num_seqs, max_num_batched_tokens, max_model_len, watermark, seed,
         tensor_parallel_size, worker_timeout, preemption_mode) = (settings[name] for name in (
            "block_size", "gpu_memory_utilization", "kv_cache_bytes", "swap_space",
            "num_gpu_blocks", "num_cpu_blocks", "max_num_seqs", "max_num_batched_tokens",
            "max_model_len", "watermark", "seed", "tensor_parallel_size", "worker_timeout",
            "preemption_mode"))
        self.device = resolve_device(device)
        self.block_size = block_size
        self.seed = seed

        # -- the model ---------------------------------------------------------------------------
        source = checkpoint.resolve(model) if hf_config is None else model
        self.hf_config = hf_config or checkpoint.load_config(source)
        self.dtype = resolve_dtype(dtype, self.hf_config, self.device)
        self.workers: TensorParallelWorkers | None = None
        if tensor_parallel_size != 1:
            # The driver holds no model: N workers hold a shard each (parallel.py). Its own
            # tensors (inputs, logits, sampling) stay on the CPU.
            self.workers = TensorParallelWorkers(tensor_parallel_size, self.hf_config, source,
                                                 load_format, self.dtype, self.device,
                                                 worker_timeout)
            self.model, self.device = None, torch.device("cpu")
        else:
            self.model = self._build_model(source, load_format)
        self.tokenizer = (checkpoint.load_tokenizer(source, tokenizer)
                          if source is not None else None)
        cfg = self.hf_config
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_size = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.vocab_size = cfg.vocab_size
        self.model_max_len = cfg.max_position_embeddings
        self.max_model_len = min(max_model_len or self.model_max_len, self.model_max_len)
        self.eos_token_ids = self._eos_token_ids()

        # -- the KV cache ------------------------------------------------------------------------
        self.block_bytes = cache_block_bytes(  # per rank: each holds its own kv heads
            block_size, self.num_layers, self.num_kv_heads // tensor_parallel_size,
            self.head_size, self.dtype)
        self.scheduler_config = SchedulerConfig(
            max_num_seqs, max_num_batched_tokens or max(4096, self.max_model_len),
            self.max_model_len, preemption_mode, enable_chunked_prefill)
        blocks_cap = max_num_seqs * math.ceil(self.max_model_len / block_size)
        if num_gpu_blocks is None:
            if self.workers is not None and self.workers.device.type == "cuda":
                num_gpu_blocks = self.workers.profile_num_gpu_blocks(
                    self.scheduler_config.max_num_batched_tokens, self.max_model_len,
                    gpu_memory_utilization, self.block_bytes)
            elif self.device.type == "cuda":
                num_gpu_blocks = self._profile_num_gpu_blocks(gpu_memory_utilization)
            else:
                budget = kv_cache_bytes if kv_cache_bytes is not None else GiB
                num_gpu_blocks = min(int(budget // self.block_bytes), blocks_cap)
        if num_cpu_blocks is None:
            num_cpu_blocks = min(int(swap_space * GiB // self.block_bytes), blocks_cap)
        if num_gpu_blocks < 1:
            raise ValueError(f"the KV pool has no room for a single block of "
                             f"{self.block_bytes} bytes; give more memory or num_gpu_blocks")
        self._check_one_request_fits(num_gpu_blocks, watermark,
                                     pool_sized_by_engine=settings["num_gpu_blocks"] is None,
                                     explicit_len=max_model_len is not None)
        if self.workers is not None:  # the workers stand in for the cache and the runner
            self.workers.init_cache(self.num_layers, self.num_kv_heads, self.head_size,
                                    block_size, num_gpu_blocks, num_cpu_blocks)
            self.cache_engine = self.model_runner = self.workers
        else:
            self.cache_engine = CacheEngine(self.num_layers, self.num_kv_heads, self.head_size,
                                            block_size, num_gpu_blocks, num_cpu_blocks,
                                            self.dtype, self.device)
            self.model_runner = ModelRunner(self.model, block_size, self.device)
        self.block_manager = BlockSpaceManager(block_size, num_gpu_blocks, num_cpu_blocks,
                                               watermark, enable_prefix_caching)
        self.scheduler = Scheduler(self.scheduler_config, self.block_manager)
        self.sampler = Sampler()

        self.stats = EngineStats()
        self._observers: list[Callable[[StepSnapshot], None]] = []
        self._requests: dict[str, SequenceGroup] = {}  # unfinished requests by id
        self._generators: dict[int, torch.Generator] = {}  # one per sequence id
        self._seq_counter = itertools.count()
        self._request_counter = itertools.count()

    # -- construction helpers --------------------------------------------------------------------
    def _check_one_request_fits(self, num_gpu_blocks: int, watermark: float,
                                pool_sized_by_engine: bool, explicit_len: bool) -> None:
        """Refuse a configuration that cannot run one request of ``max_model_len`` tokens.

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
        """
        cfg = self.scheduler_config
        bs = self.block_size
        watermark_blocks = int(watermark * num_gpu_blocks)  # as BlockSpaceManager counts it
        usable = num_gpu_blocks - watermark_blocks
        pool_tokens = usable * bs
        # Without chunked prefill a prompt runs whole in one step: the budget caps its length.
        budget_tokens = (pool_tokens if cfg.enable_chunked_prefill
                         else cfg.max_num_batched_tokens)
        fits = min(pool_tokens, budget_tokens)  # the longest request this engine can run
        if fits >= self.max_model_len:
            self.max_model_len_reason = ("max_model_len" if explicit_len
                                         else "the model's maximum length")
            return
        if not cfg.enable_chunked_prefill and cfg.max_num_batched_tokens < self.max_model_len:
            # (never by default: the default budget is at least max_model_len)
            raise ValueError(
                f"max_num_batched_tokens ({cfg.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({self.max_model_len}), and without chunked prefill a prompt "
                f"runs whole in one step, so a long prompt could never be scheduled; pass "
                f"max_model_len={fits}, max_num_batched_tokens={self.max_model_len} or "
                f"enable_chunked_prefill=True")
        need = math.ceil(self.max_model_len / bs)
        pool_needed = need  # the smallest pool whose usable part holds ``need`` blocks
        while pool_needed - int(watermark * pool_needed) < need:
            pool_needed += 1
        if fits >= 2 and pool_sized_by_engine and not explicit_len:
            logger.warning(
                "max_model_len lowered from %d to %d tokens: the KV pool the engine sized from "
                "its memory budget has %d blocks of %d tokens (%d usable after the "
                "watermark); pass max_model_len=, or more memory, to choose",
                self.max_model_len, fits, num_gpu_blocks, bs, usable)
            self.max_model_len = cfg.max_model_len = fits
            self.max_model_len_reason = (f"what the KV pool of {num_gpu_blocks} blocks holds, "
                                         f"sized from the memory budget")
            return
        larger = f"num_gpu_blocks >= {pool_needed}"
        if pool_sized_by_engine:
            larger = f"more kv_cache_bytes or gpu_memory_utilization, or {larger}"
        raise ValueError(
            f"the KV pool cannot hold one request of max_model_len ({self.max_model_len}) "
            f"tokens: it needs {need} blocks of {bs} tokens, the pool has {num_gpu_blocks} "
            f"blocks of which {usable} are usable (watermark {watermark} keeps "
            f"{watermark_blocks} free), {pool_tokens} tokens; "
            + (f"pass max_model_len={fits} or a larger pool ({larger})" if fits >= 2
               else f"give a larger pool ({larger})"))

    def _build_model(self, source, load_format: str) -> torch.nn.Module:
        return build_model(self.hf_config, source, load_format, self.dtype, self.device)

    def _eos_token_ids(self) -> set[int]:
        ids = set()
        for value in (getattr(self.hf_config, "eos_token_id", None),
                      getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(v for v in value if isinstance(v, int))
        return ids

    def _profile_num_gpu_blocks(self, gpu_memory_utilization: float) -> int:
        return profile_num_gpu_blocks(self.model, self.device,
                                      self.scheduler_config.max_num_batched_tokens,
                                      self.max_model_len, gpu_memory_utilization,
                                      self.block_bytes)

    # -- requests --------------------------------------------------------------------------------
    def max_blocks_needed(self, prompt_len: int, params: SamplingParams) -> int:
        """The most GPU blocks one request can ever hold at once."""
        total = min(prompt_len + params.max_tokens, self.max_model_len)
        shared = prompt_len // self.block_size if params.best_of > 1 else 0
        per_seq = math.ceil((total - shared * self.block_size) / self.block_size)
        return shared + params.best_of * per_seq

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if this request could never run; do nothing else."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params)}")
        params.verify()  # again: a field may have been changed since construction
        n = len(prompt_token_ids)
        if not isinstance(prompt_token_ids, list):
            raise ValueError(f"prompt_token_ids must be a list of integers, got "
                             f"{type(prompt_token_ids).__name__}")
        if n == 0:
            raise ValueError("prompt is empty: give at least one token")
        if n >= self.max_model_len:
            raise ValueError(f"prompt is {n} tokens long; the maximum length is "
                             f"{self.max_model_len} tokens ({self.max_model_len_reason}), "
                             f"prompt plus at least one new token")
        bad = [t for t in prompt_token_ids
               if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size}), "
                             f"got {bad[:5]}")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none: pass "
                             "tokenizer=, or stop on token ids with max_tokens")
        max_seqs = self.scheduler_config.max_num_seqs
        if not self.scheduler_config.enable_chunked_prefill:  # decodes wait for the budget too
            max_seqs = min(max_seqs, self.scheduler_config.max_num_batched_tokens)
        if params.best_of > max_seqs:
            raise ValueError(f"best_of ({params.best_of}) is more than the engine runs at once "
                             f"(max_num_seqs {self.scheduler_config.max_num_seqs}, "
                             f"max_num_batched_tokens "
                             f"{self.scheduler_config.max_num_batched_tokens})")
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise ValueError(f"logprobs must be at most the vocabulary size "
                             f"({self.vocab_size}), got {params.logprobs}")
        need = self.max_blocks_needed(n, params)
        room = self.block_manager.num_total_gpu_blocks - self.block_manager.watermark_blocks
        if need > room:
            raise ValueError(
                f"request can never fit in the KV pool: it may need {need} blocks of "
                f"{self.block_size} tokens (prompt {n} + max_tokens {params.max_tokens}, "
                f"best_of {params.best_of}) but the pool has {room} usable blocks "
                f"({self.block_manager.num_total_gpu_blocks} minus "
                f"{self.block_manager.watermark_blocks} kept free by the watermark); lower "
                f"max_tokens or best_of, or give a larger pool")

    def add_request(self, request_id: str | None, prompt: str | None,
                    sampling_params: SamplingParams,
                    prompt_token_ids: list[int] | None = None,
                    arrival_time: float | None = None) -> str:
        """Queue one request. Returns its id.

        Everything is checked first (``ValueError`` naming what is wrong); a request that is
        accepted always finishes, or is aborted by the caller.
        """
        if request_id is None:
            request_id = self.new_request_id()
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if arrival_time is not None:
            if as_number(arrival_time) is None:
                raise ValueError(f"arrival_time must be a finite number (seconds), got "
                                 f"{shown(arrival_time)}")
            arrival_time = float(as_number(arrival_time))
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("give a prompt or prompt_token_ids")
            prompt_token_ids = self.encode(prompt)
        prompt_token_ids = as_token_ids(prompt_token_ids)
        self.validate_request(prompt_token_ids, sampling_params)

        seqs = [Sequence(next(self._seq_counter), prompt, prompt_token_ids, self.block_size)
                for _ in range(sampling_params.best_of)]
        group = SequenceGroup(request_id, seqs, sampling_params,
                              arrival_time if arrival_time is not None else time.monotonic())
        request_seed = sampling_params.seed
        if request_seed is None:
            request_seed = f"engine {self.seed}, request {request_id}"
        for index, seq in enumerate(seqs):
            # One generator per sequence, seeded from the request's seed and the sequence's
            # index: its draws do not depend on the other sequences, the batch or preemption.
            generator = torch.Generator(device="cpu")
            generator.manual_seed(_derive_seed(request_seed, index))
            self._generators[seq.seq_id] = generator
        self._requests[request_id] = group
        self.scheduler.add_seq_group(group)
        return request_id

    def new_request_id(self) -> str:
        """An id no unfinished request uses."""
        while True:
            request_id = str(next(self._request_counter))
            if request_id not in self._requests:
                return request_id

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model directory has no tokenizer files: pass "
                             "prompt_token_ids, or a tokenizer=")
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        return self.tokenizer.encode(prompt)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its blocks return to the pool."""
        group = self.scheduler.abort_seq_group(request_id)
        if group is None:
            return None
        self._forget(group)
        self._detokenize_all(group)
        return RequestOutput.from_seq_group(group)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_seqs()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_seq_groups()

    def add_observer(self, fn: Callable[[StepSnapshot], None]) -> None:
        """Call ``fn(snapshot)`` after every step (the live visualizer uses this)."""
        self._observers.append(fn)

    def remove_observer(self, fn: Callable[[StepSnapshot], None]) -> None:
        self._observers.remove(fn)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (also done at ``del`` and at exit)."""
        if self.workers is not None:
            self.workers.shutdown()

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the outputs of the groups touched by it."""
        t0 = time.perf_counter()
        outs = self.scheduler.schedule()
        for _, mode in outs.preempted:
            if mode == "recompute":
                self.stats.num_preemptions_recompute += 1
            elif mode == "swap":
                self.stats.num_preemptions_swap += 1
        ended = self._collect_aborted()
        if outs.is_empty() and not outs.preempted and not self.scheduler.running:
            ended += self._break_stall()
        t1 = time.perf_counter()

        # Data moves only here, before the model reads the cache.
        if outs.blocks_to_swap_out:
            self.cache_engine.swap_out(outs.blocks_to_swap_out)
        if outs.blocks_to_swap_in:
            self.cache_engine.swap_in(outs.blocks_to_swap_in)
        if outs.blocks_to_copy:
            self.cache_engine.copy(outs.blocks_to_copy)
        self.stats.num_blocks_swapped_out += len(outs.blocks_to_swap_out)
        self.stats.num_blocks_swapped_in += len(outs.blocks_to_swap_in)
        self.stats.num_blocks_copied += sum(len(d) for d in outs.blocks_to_copy.values())
        bm = self.block_manager
        used = bm.num_total_gpu_blocks - bm.get_num_free_gpu_blocks()
        self.stats.peak_gpu_blocks_used = max(self.stats.peak_gpu_blocks_used, used)
        self.stats.num_cached_prompt_tokens = bm.num_cached_tokens
        self.stats.num_evicted_blocks = bm.num_evicted_blocks

        inputs = prepare_inputs(outs, self.block_manager, self.block_size, self.device)
        t2 = time.perf_counter()
        if inputs.computed:
            logits = self.model_runner.execute_model(inputs, self.cache_engine.gpu_cache)
            t3 = time.perf_counter()
            results = self.sampler(logits, inputs.rows, self._generators) if inputs.rows else {}
            t4 = time.perf_counter()
            self.stats.num_prompt_tokens += inputs.meta.num_prompt_tokens
            self.stats.num_generation_tokens += inputs.meta.num_generation_tokens
            for seq, num_computed in inputs.computed:  # now in the cache
                seq.num_computed_tokens = num_computed
            for group in outs.scheduled_seq_groups:
                if group.request_id in results:
                    self.stats.num_sampled_tokens += len(results[group.request_id])
                    self._process_outputs(group, results[group.request_id])
        else:
            t3 = t4 = time.perf_counter()
        finished = self.scheduler.free_finished_seq_groups()
        for group in finished:
            self._forget(group)
        t5 = time.perf_counter()

        self.stats.num_steps += 1
        self.stats.time_schedule += t1 - t0
        self.stats.time_prepare += t2 - t1
        self.stats.time_model += t3 - t2
        self.stats.time_sample += t4 - t3
        self.stats.time_update += t5 - t4
        if self._observers:
            self._notify(outs, finished + ended)
        touched = {g.request_id: g for g in outs.scheduled_seq_groups + ended}
        return [RequestOutput.from_seq_group(g) for g in touched.values()]

    def _process_outputs(self, group: SequenceGroup, outputs: dict[int, SequenceOutput]) -> None:
        # 1. Beam search: a sequence whose beam was dropped becomes a copy of its new parent.
        for seq_id, out in outputs.items():
            if out.parent_seq_id != seq_id:
                seq, parent = group.find(seq_id), group.find(out.parent_seq_id)
                self.block_manager.free(seq)
                seq.copy_state_from(parent)
                self.block_manager.fork(parent, seq)
        # 2. Append the new tokens, then check whether each sequence is done.
        params = group.sampling_params
        for seq_id, out in outputs.items():
            seq = group.find(seq_id)
            seq.append_token_id(out.token_id, out.logprobs)
            self._check_stop(seq, params)
            if seq.is_finished():
                self.block_manager.free(seq)
        if group.is_finished():
            self._detokenize_all(group)

    def _check_stop(self, seq: Sequence, params: SamplingParams) -> None:
        if self.tokenizer is not None:  # (validate_request refuses stop strings without one)
            previous = len(seq.output_text)
            detokenize_incrementally(self.tokenizer, seq)  # streamed outputs carry text too
            if params.stop_strings:
                # A stop string may straddle the old text and the new: search a little way back.
                start = max(0, previous - max(len(s) for s in params.stop_strings) + 1)
                hits = [i for s in params.stop_strings
                        if (i := seq.output_text.find(s, start)) != -1]
                if hits:
                    seq.output_text = seq.output_text[:min(hits)]  # the stop string is dropped
                    seq.status = SequenceStatus.FINISHED_STOPPED
                    return
        if not params.ignore_eos and seq.get_last_token_id() in self.eos_token_ids:
            seq.status = SequenceStatus.FINISHED_STOPPED
        elif seq.get_output_len() >= params.max_tokens or seq.get_len() >= self.max_model_len:
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED

    def _decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _detokenize_all(self, group: SequenceGroup) -> None:
        for seq in group.get_seqs():
            if not (seq.status is SequenceStatus.FINISHED_STOPPED
                    and group.sampling_params.stop_strings):
                seq.output_text = self._decode(seq.output_token_ids)
            if seq.status is not SequenceStatus.FINISHED_STOPPED:
                # Cut off by max_tokens (or an abort) inside a multi-byte character: drop the
                # half character rather than end the text with U+FFFD.
                seq.output_text = seq.output_text.rstrip("\ufffd")

    def _forget(self, group: SequenceGroup) -> None:
        self._requests.pop(group.request_id, None)
        for seq in group.get_seqs():
            self._generators.pop(seq.seq_id, None)

    def _collect_aborted(self) -> list[SequenceGroup]:
        aborted = self.scheduler.take_aborted()
        for group in aborted:
            self.stats.num_aborted_by_engine += 1
            self._forget(group)
            self._detokenize_all(group)
        return aborted

    def _break_stall(self) -> list[SequenceGroup]:
        """Nothing runs and the head of a queue can never be admitted: abort it, keep the rest.

        NOTE: a last resort that should never fire: ``validate_request`` refuses every request
        that cannot run alone, and a request that can always comes back. If it ever fires, the
        log says why, and the other requests still finish."""
        sched = self.scheduler
        queue = sched.swapped if sched.swapped else sched.waiting
        if not queue:
            return []
        group = queue[0]
        where = "swapped" if queue is sched.swapped else "waiting"
        reason = (f"request {group.request_id} can never be scheduled: it is {where} and "
                  f"needs more KV blocks than the pool of "
                  f"{self.block_manager.num_total_gpu_blocks} has free "
                  f"({self.block_manager.get_num_free_gpu_blocks()}) while nothing else runs")
        logger.warning("aborting a request the scheduler can never run (an engine bug): %s",
                       reason)
        sched.give_up(group, reason)
        return self._collect_aborted()

    def _notify(self, outs: SchedulerOutputs, finished: list[SequenceGroup]) -> None:
        snap = StepSnapshot(
            step=self.stats.num_steps,
            scheduled=[g.request_id for g in outs.scheduled_seq_groups],
            prompt_run=list(outs.prompt_run),
            blocks_to_swap_in=dict(outs.blocks_to_swap_in),
            blocks_to_swap_out=dict(outs.blocks_to_swap_out),
            blocks_to_copy={k: list(v) for k, v in outs.blocks_to_copy.items()},
            preempted=list(outs.preempted),
            finished=[g.request_id for g in finished],
            block_manager=self.block_manager.snapshot(),
            scheduler=self.scheduler.snapshot(),
            stats=self.stats.as_dict(),
            num_batched_tokens=outs.num_batched_tokens,
        )
        for fn in list(self._observers):
            fn(snap)

    def replace_block_manager(self, block_manager: BlockSpaceManager) -> None:
        """Run the next requests with another block manager (lesson 03 and the memory benchmark
        measure ``lab.no_sharing.NoSharingBlockManager`` this way).

        Args:
            block_manager: a new, empty manager with this engine's block size and pools
                (``type(m).like(engine.block_manager)``). NOTE: what the old manager's prefix
                cache knew is not carried over; the KV in the cache tensors is simply unnamed.

        Raises:
            ValueError: while a request is queued or running, or if the pools differ.
        """
        if self.scheduler.has_unfinished_seqs():
            raise ValueError("replace_block_manager: requests are still queued or running")
        old = self.block_manager
        if (block_manager.block_size, block_manager.num_total_gpu_blocks,
                block_manager.num_total_cpu_blocks) != (
                old.block_size, old.num_total_gpu_blocks, old.num_total_cpu_blocks):
            raise ValueError("replace_block_manager: the new manager's block size and pools "
                             "must match the cache engine's")
        self.block_manager = self.scheduler.block_manager = block_manager
