"""The LLMEngine: continuous batching, one ``step()`` at a time (lesson 08).

    step() = schedule -> move cache blocks -> run the model on the flattened batch -> sample
             -> append tokens, fork/free beams, check stops -> free finished groups -> observers

Around it: the settings (``minipaged/config.py``) and request checks (``minipaged/validation.py``),
the scheduler that alone holds the block manager (``core/scheduler.py``), the worker that holds
the model and the KV cache (``worker/worker.py``), and in this folder the pools' set-up
(``cache_setup.py``), the output processing (``output_processor.py``) and the counters and
snapshots (``stats.py``).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import fields
from typing import Callable

import torch

from minipaged.config import EngineConfig
from minipaged.core.block_manager import BlockSpaceManager
from minipaged.core.scheduler_outputs import SchedulerOutputs
from minipaged.engine.cache_setup import init_kv_cache
from minipaged.engine.multi_step import MultiStep
from minipaged.engine.output_processor import OutputProcessor, eos_token_ids
from minipaged.engine.stats import EngineStats, StepSnapshot
from minipaged.engine.step_trace import StepTrace
from minipaged.model_shape import ModelShape
from minipaged.outputs import RequestOutput
from minipaged.sampling_params import SamplingParams
from minipaged.sequence import Sequence, SequenceGroup
from minipaged.spec_decode.speculator import NoSpeculator, make_speculator
from minipaged.validation import (RequestLimits, as_arrival_time, as_token_ids, check_request_id,
                                  encode_prompt, validate_request)
from minipaged.worker import checkpoint
from minipaged.worker.create_worker import create_worker, start_building_ops
from minipaged.worker.model_loader import resolve_device, resolve_dtype
from minipaged.worker.model_runner import PreparedInputs, prepare_inputs
from minipaged.worker.sampler import Sampler, sequence_generators
from minipaged.worker.worker import Worker


class LLMEngine:
    """Owns the scheduler, the sampler and a ``Worker`` that holds the model and the KV cache.

    Args:
        model: a Hugging Face id, a local ``save_pretrained`` directory, or None for the
            embedded SmolLM2-135M-Instruct.
        settings: any field of ``EngineConfig`` (``minipaged/config.py``), which declares its
            default and meaning and checks it; an unknown name raises TypeError.
    """

    def __init__(self, model: str | None = None, **settings) -> None:
        self.config = cfg = EngineConfig.from_settings(model, **settings)
        # the steps as a Chrome trace-event file, for Perfetto (``engine/step_trace.py``); opened
        # first, so that a path that cannot be written is refused before the model loads
        self.trace = StepTrace(cfg.trace_path) if cfg.trace_path is not None else None
        resolved_device = resolve_device(cfg.device)
        start_building_ops(resolved_device)  # a first run's compile overlaps the model's loading

        # -- the model ---------------------------------------------------------------------------
        # (the config keeps what was asked; ``quantization`` is what the engine chose)
        self.quantization = held_weights(cfg, resolved_device)
        if self.quantization == "gguf":  # the file's blocks as stored
            source, weights = checkpoint.resolve_quantized(cfg.model)
            load_format = "gguf"
        else:
            source = checkpoint.resolve(cfg.model) if cfg.hf_config is None else cfg.model
            weights, load_format = source, cfg.load_format
        self.hf_config = cfg.hf_config or checkpoint.load_config(source)
        self.dtype = resolve_dtype(cfg.dtype, self.hf_config, resolved_device)
        self.worker: Worker = create_worker(
            self.hf_config, weights, load_format, self.dtype, resolved_device,
            cfg.tensor_parallel_size, cfg.distributed_executor_backend, cfg.worker_timeout,
            cfg.cpu_threads)
        self.tokenizer = (checkpoint.load_tokenizer(source, cfg.tokenizer)
                          if source is not None else None)
        self.model_shape = shape = ModelShape.from_hf(self.hf_config)

        # -- the KV pools, the scheduler, the limits requests are checked against ---------------
        cache = init_kv_cache(cfg, self.worker, shape, self.dtype)
        self.block_bytes, self.scheduler = cache.block_bytes, cache.scheduler
        self.scheduler_config = sc = self.scheduler.config
        self.limits = RequestLimits(
            shape.vocab_size, cfg.block_size, self.tokenizer is not None, sc.max_model_len,
            cache.max_model_len_reason, sc.max_num_seqs, sc.max_num_batched_tokens,
            # (a hybrid model's pool in blocks of every KV cache group: one per block of tokens)
            sc.enable_chunked_prefill, cache.num_gpu_blocks // cache.num_kv_groups,
            self.scheduler.pool_counts().watermark_blocks // cache.num_kv_groups,
            cfg.speculative_config is not None)
        eos = eos_token_ids(self.hf_config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer, eos, self.max_model_len)
        self.sampler = Sampler()
        # speculative decoding (lesson 12); without it, an object whose every call does nothing
        self.speculator = make_speculator(cfg.speculative_config, shape.vocab_size,
                                          cfg.block_size, cache.num_gpu_blocks, self.dtype,
                                          resolved_device)
        # multi-step decode (lesson 15): greedy decode batches run k steps per schedule
        self.multi_step = MultiStep(cfg.num_scheduler_steps, cfg.block_size)

        self.stats = EngineStats()
        self._observers: list[Callable[[StepSnapshot], None]] = []
        self._requests: dict[str, SequenceGroup] = {}  # unfinished requests by id
        self._generators: dict[int, torch.Generator] = {}  # one per sequence id
        self._seq_counter = itertools.count()
        self._request_counter = itertools.count()
        if self.trace is not None:
            self.add_observer(self.trace)

    # -- facts kept in one place -----------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def seed(self) -> int:
        return self.config.seed

    @property
    def device(self) -> torch.device:
        """Where each step's inputs are built: the model's device, or the CPU under TP."""
        return self.worker.device

    @property
    def max_model_len(self) -> int:
        """The longest request (prompt and output) the engine accepts."""
        return self.scheduler_config.max_model_len

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.output_processor.eos_token_ids

    @property
    def block_manager(self) -> BlockSpaceManager:
        """The scheduler's block manager, to look at (lessons); the engine goes through the
        scheduler."""
        return self.scheduler.block_manager

    @classmethod
    def from_engine_args(cls, engine_args: EngineConfig) -> LLMEngine:
        """vLLM's way to build an engine from its arguments object: here an ``EngineConfig``
        (``EngineConfig.from_settings(model, **settings)``), the same as
        ``LLMEngine(model, **settings)``."""
        if not isinstance(engine_args, EngineConfig):
            raise TypeError(f"engine_args must be an EngineConfig, got "
                            f"{type(engine_args).__name__}")
        return cls(engine_args.model, **{f.name: getattr(engine_args, f.name)
                                         for f in fields(engine_args) if f.name != "model"})

    # -- requests --------------------------------------------------------------------------------
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if this request could never run; do nothing else.

        Args:
            prompt_token_ids: the prompt, a list of Python ints.
            params: the request's sampling parameters.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params)}")
        validate_request(prompt_token_ids, params, self.limits)

    def add_request(self, request_id: str | None, prompt: str | None,
                    sampling_params: SamplingParams,
                    prompt_token_ids: list[int] | None = None,
                    arrival_time: float | None = None) -> str:
        """Queue one request. Returns its id.

        Everything is checked first (``ValueError`` naming what is wrong); a request that is
        accepted always finishes, or is aborted by the caller.

        Args:
            request_id: a new id, or None for one the engine picks.
            prompt: the prompt's text (kept for the output; encoded when no token ids).
            sampling_params: how to sample.
            prompt_token_ids: the prompt's tokens, if already encoded.
            arrival_time: when the request arrived (``time.monotonic()`` seconds; default now).
        """
        self._check_running()
        if request_id is None:
            request_id = self.new_request_id()
        check_request_id(request_id, self._requests)
        arrival_time = as_arrival_time(arrival_time)
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("give a prompt or prompt_token_ids")
            prompt_token_ids = self.encode(prompt)
        prompt_token_ids = as_token_ids(prompt_token_ids)
        self.validate_request(prompt_token_ids, sampling_params)

        seqs = [Sequence(next(self._seq_counter), prompt, prompt_token_ids, self.block_size)
                for _ in range(sampling_params.best_of)]
        seq_group = SequenceGroup(request_id, seqs, sampling_params, arrival_time)
        seed = (sampling_params.seed if sampling_params.seed is not None
                else f"engine {self.seed}, request {request_id}")
        self._generators.update(sequence_generators(seed, [s.seq_id for s in seqs]))
        self._requests[request_id] = seq_group
        self.scheduler.add_seq_group(seq_group)
        return request_id

    def new_request_id(self) -> str:
        """An id no unfinished request uses."""
        while True:
            request_id = str(next(self._request_counter))
            if request_id not in self._requests:
                return request_id

    def encode(self, prompt: str) -> list[int]:
        """The prompt's token ids (ValueError without a tokenizer)."""
        return encode_prompt(self.tokenizer, prompt)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its blocks return to the pool.

        Args:
            request_id: the request; an unknown or finished one is ignored (returns None).
        """
        seq_group = self.scheduler.abort_seq_group(request_id)
        if seq_group is None:
            return None
        self._forget(seq_group, aborted=True)
        return RequestOutput.from_seq_group(seq_group)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_seqs()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_seq_groups()

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache's blocks (vLLM's name); False, and nothing forgotten, while
        a request holds blocks. True without prefix caching (nothing to forget)."""
        reset = getattr(self.block_manager.gpu_allocator, "reset_prefix_cache", None)
        return True if reset is None else reset()

    def add_observer(self, fn: Callable[[StepSnapshot], None]) -> None:
        """Call ``fn(snapshot)`` after every step (the live visualizer uses this)."""
        self._observers.append(fn)

    def remove_observer(self, fn: Callable[[StepSnapshot], None]) -> None:
        self._observers.remove(fn)

    is_shut_down = False  # (shutdown sets it on the instance)
    trace: StepTrace | None = None

    def shutdown(self) -> None:
        """Give back the model, KV and swap pools, CUDA graphs, worker processes, a draft model
        and on CUDA torch's cached blocks (also at collection). Twice is fine; steps then raise."""
        self.is_shut_down = True
        if self.trace is not None:
            self.trace.close()
        self.speculator = NoSpeculator()  # (drops a draft model's weights and cache, if any)
        self.worker.shutdown()

    def _check_running(self) -> None:
        if self.is_shut_down:
            raise RuntimeError("this engine was shut down; build a new one to generate again")

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the outputs of the groups touched by it."""
        self._check_running()
        t = [time.perf_counter()]
        self.speculator.plan(self.scheduler.running, self.max_model_len)
        self.multi_step.plan(self.scheduler.running, self.max_model_len)
        outs = self.scheduler.schedule()
        ended = self._collect_aborted()
        if outs.is_empty() and not outs.preempted and not self.scheduler.running:
            self.scheduler.break_stall()  # a last resort that should never fire
            ended += self._collect_aborted()
        t.append(time.perf_counter())

        # Data moves only here, before the model reads the cache.
        self.worker.cache_swap(outs.blocks_to_swap_in, outs.blocks_to_swap_out,
                               outs.blocks_to_copy)
        self.stats.count_schedule(outs, self.scheduler.pool_counts())
        # Preempted: their blocks (and a draft model's KV in them) are gone.
        preempted = [self._requests[r] for r, _ in outs.preempted if r in self._requests]
        self.speculator.forget([s for seq_group in preempted for s in seq_group.get_seqs()])
        drafts = self.speculator.propose(outs, self._generators)
        inputs = prepare_inputs(outs.seq_runs, self.block_size, self.device, drafts)
        t.append(time.perf_counter())
        num_steps = self.multi_step.steps(outs)
        if num_steps > 1:
            self.multi_step.run(num_steps, inputs, outs, self.worker, self.device,
                                self.output_processor, self.scheduler, self.stats, t)
        elif inputs.computed or inputs.spec_rows:
            self._run_model(inputs, outs, t)
        else:
            t += [time.perf_counter()] * 2
        self.speculator.end_step()
        self.multi_step.end_step(self.scheduler)
        finished = self.scheduler.free_finished_seq_groups()
        for seq_group in finished:
            self._forget(seq_group)
        t.append(time.perf_counter())

        self.stats.count_times(t)
        if self._observers:
            snap = StepSnapshot.of_step(outs, finished + ended, self.scheduler, self.stats,
                                        self.speculator.last_step, t)
            for fn in list(self._observers):
                fn(snap)
        touched = {g.request_id: g for g in outs.scheduled_seq_groups + ended}
        return [RequestOutput.from_seq_group(g) for g in touched.values()]

    def _run_model(self, inputs: PreparedInputs, outs: SchedulerOutputs, t: list[float]) -> None:
        """Run the model, sample, and apply the new tokens (appending a clock reading to ``t``
        after the model and after the sampler)."""
        logits = self.worker.execute_model(inputs)  # (rows + verification rows, vocab)
        t.append(time.perf_counter())
        num_rows = len(inputs.rows)
        results = (self.sampler(logits[:num_rows], inputs.rows, self._generators)
                   if inputs.rows else {})
        t.append(time.perf_counter())
        self.stats.count_tokens(inputs.meta.num_prompt_tokens, inputs.meta.num_generation_tokens,
                                sum(1 + len(r.draft_token_ids) for r in inputs.spec_rows))
        for seq, num_computed in inputs.computed:  # now in the cache
            seq.num_computed_tokens = num_computed
        for seq_group in outs.scheduled_seq_groups:
            sampled = results.get(seq_group.request_id)
            if sampled is not None:
                self.stats.num_sampled_tokens += len(sampled)
                self.output_processor.process(seq_group, sampled, self.scheduler)
        # verify the drafts, append what is kept, roll back the rest (lesson 12)
        self.speculator.apply(logits[num_rows:], inputs.spec_rows, self._generators,
                              self.output_processor, self.scheduler, self.stats)

    def _forget(self, seq_group: SequenceGroup, aborted: bool = False) -> None:
        self._requests.pop(seq_group.request_id, None)
        self.speculator.forget(seq_group.get_seqs())
        for seq in seq_group.get_seqs():
            self._generators.pop(seq.seq_id, None)
        if aborted:
            self.output_processor.detokenize_all(seq_group)

    def _collect_aborted(self) -> list[SequenceGroup]:
        aborted = self.scheduler.take_aborted()
        for seq_group in aborted:
            self.stats.num_aborted_by_engine += 1
            self._forget(seq_group, aborted=True)
        return aborted


def held_weights(cfg: EngineConfig, device: torch.device) -> str:
    """How the engine holds the weights: ``cfg.quantization`` where given ("gguf" or "none"); not
    given, "gguf" for the embedded model on one CPU process in float32 (its Q4_1 blocks as the
    file stores them: single-stream decode 2.3x and the 64-request trace 1.06x float32's on a
    2-core CPU, the same greedy tokens; benchmarks/RESULTS.md), else "none" (the weights
    converted to ``cfg.dtype``). ``quantization="none"`` keeps float32 weights to read, as the
    lessons that read them do."""
    if cfg.quantization is not None:
        return cfg.quantization
    float32 = cfg.dtype in ("auto", "float32", "float", torch.float32)
    one_cpu_process = device.type == "cpu" and cfg.tensor_parallel_size == 1
    plain_load = cfg.load_format == "auto" and cfg.hf_config is None
    if checkpoint.is_embedded(cfg.model) and float32 and one_cpu_process and plain_load:
        return "gguf"
    return "none"
