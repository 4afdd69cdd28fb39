"""The LLMEngine: continuous batching, one ``step()`` at a time (lesson 08).

    step() = schedule -> move cache blocks -> run the model on the flattened batch -> sample
             -> append tokens, fork/free beams, check stops -> free finished groups -> observers

Around it: the settings (``minipaged/config.py``), the worker that holds the model and the KV
cache (``worker/worker.py``), request checks (``validation.py``), the output processing
(``output_processor.py``) and the counters and snapshots (``stats.py``) of this folder.
"""
from __future__ import annotations

import itertools
import logging
import time
from typing import Callable

import torch

from minipaged.config import EngineConfig, fit_max_model_len, kv_pool_blocks
from minipaged.core.block_manager import BlockSpaceManager
from minipaged.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutputs
from minipaged.engine.output_processor import OutputProcessor, eos_token_ids
from minipaged.engine.stats import EngineStats, StepSnapshot
from minipaged.engine.validation import (RequestLimits, as_arrival_time, check_request_id,
                                         max_blocks_needed, validate_request)
from minipaged.model_shape import ModelShape
from minipaged.outputs import RequestOutput
from minipaged.sampling_params import SamplingParams
from minipaged.sequence import Sequence, SequenceGroup
from minipaged.spec_decode.speculator import Speculator
from minipaged.validation import as_token_ids
from minipaged.worker import checkpoint
from minipaged.worker.gpu_memory import naming_memory_holders
from minipaged.worker.model_loader import resolve_device, resolve_dtype
from minipaged.worker.model_runner import prepare_inputs
from minipaged.worker.mp_workers import TensorParallelWorkers
from minipaged.worker.sampler import Sampler, sequence_generators
from minipaged.worker.worker import LocalWorker, Worker

logger = logging.getLogger("minipaged")


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
        resolved_device = resolve_device(cfg.device)

        # -- the model ---------------------------------------------------------------------------
        source = checkpoint.resolve(cfg.model) if cfg.hf_config is None else cfg.model
        self.hf_config = cfg.hf_config or checkpoint.load_config(source)
        self.dtype = resolve_dtype(cfg.dtype, self.hf_config, resolved_device)
        self.worker: Worker
        backend = cfg.distributed_executor_backend or "mp"
        if cfg.tensor_parallel_size == 1 and backend == "mp":
            self.worker = LocalWorker(self.hf_config, source, cfg.load_format, self.dtype,
                                      resolved_device)
        else:  # the driver holds no model: N ranks hold a shard each (lesson 14)
            workers_class = TensorParallelWorkers
            if backend == "ray":  # (imported only when asked for: it imports Ray)
                from minipaged.worker.ray_workers import RayTensorParallelWorkers as workers_class
            self.worker = workers_class(cfg.tensor_parallel_size, self.hf_config, source,
                                        cfg.load_format, self.dtype, resolved_device,
                                        cfg.worker_timeout)
        self.tokenizer = (checkpoint.load_tokenizer(source, cfg.tokenizer)
                          if source is not None else None)
        self.model_shape = shape = ModelShape.from_hf(self.hf_config)

        # -- the KV cache, the scheduler, the limits requests are checked against ---------------
        reason = self._init_kv_cache()
        self.limits = RequestLimits(shape.vocab_size, cfg.block_size, self.tokenizer is not None,
                                    reason, self.scheduler_config)
        eos = eos_token_ids(self.hf_config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer, eos, self.max_model_len)
        self.sampler = Sampler()
        spec = cfg.speculative_config  # speculative decoding (lesson 12), or None
        self.speculator = None if spec is None else Speculator(
            spec, shape.vocab_size, cfg.block_size, self.block_manager.num_total_gpu_blocks,
            self.dtype, resolved_device)

        self.stats = EngineStats()
        self._observers: list[Callable[[StepSnapshot], None]] = []
        self._requests: dict[str, SequenceGroup] = {}  # unfinished requests by id
        self._generators: dict[int, torch.Generator] = {}  # one per sequence id
        self._seq_counter = itertools.count()
        self._request_counter = itertools.count()

    def _init_kv_cache(self) -> str:
        """Size the pools, fit max_model_len to them, allocate them; returns why the length
        is what it is (for error messages)."""
        cfg = self.config
        shape = self.model_shape
        model_max_len = shape.max_positions
        max_len = min(cfg.max_model_len or model_max_len, model_max_len)  # before fitting
        budget = cfg.batch_budget(max_len)
        self.block_bytes = cfg.block_size * shape.kv_bytes_per_token(  # per rank: each rank
            self.dtype.itemsize, cfg.tensor_parallel_size)  # holds its share of the kv heads
        profiled = (None if cfg.num_gpu_blocks is not None else self.worker.profile_num_gpu_blocks(
            budget, max_len, cfg.gpu_memory_utilization, self.block_bytes))
        with naming_memory_holders(self.worker):  # on a GPU, a refusal says who holds memory
            num_gpu_blocks, num_cpu_blocks = kv_pool_blocks(cfg, self.block_bytes, max_len,
                                                            profiled)
            max_len, reason = fit_max_model_len(cfg, model_max_len, num_gpu_blocks, budget)
        self.scheduler_config = SchedulerConfig(cfg.max_num_seqs, budget, max_len,
                                                cfg.preemption_mode, cfg.enable_chunked_prefill)
        self.worker.init_cache(shape.num_layers, shape.num_kv_heads, shape.head_size,
                               cfg.block_size, num_gpu_blocks, num_cpu_blocks)
        if (not cfg.enforce_eager and isinstance(self.worker, LocalWorker)
                and self.worker.device.type == "cuda"):  # decode steps from CUDA graphs (lesson 15)
            self.worker.enable_cuda_graphs(cfg.max_num_seqs, max_len, cfg.block_size)
        self.block_manager = BlockSpaceManager(cfg.block_size, num_gpu_blocks, num_cpu_blocks,
                                               cfg.watermark, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.scheduler_config, self.block_manager)
        return reason

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

    # -- requests --------------------------------------------------------------------------------
    def max_blocks_needed(self, prompt_len: int, params: SamplingParams) -> int:
        """The most GPU blocks one request can ever hold at once.

        Args:
            prompt_len: the prompt's length in tokens.
            params: the request's sampling parameters.
        """
        return max_blocks_needed(prompt_len, params, self.limits)

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if this request could never run; do nothing else.

        Args:
            prompt_token_ids: the prompt, a list of Python ints.
            params: the request's sampling parameters.
        """
        validate_request(prompt_token_ids, params, self.limits, self.block_manager)
        if self.speculator is not None and params.use_beam_search:
            raise ValueError("use_beam_search: beam search does not run with speculative "
                             "decoding (speculative_config is set)")

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
        group = SequenceGroup(request_id, seqs, sampling_params,
                              arrival_time if arrival_time is not None else time.monotonic())
        request_seed = sampling_params.seed
        if request_seed is None:
            request_seed = f"engine {self.seed}, request {request_id}"
        self._generators.update(sequence_generators(request_seed, [s.seq_id for s in seqs]))
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
        """The prompt's token ids (ValueError without a tokenizer)."""
        if self.tokenizer is None:
            raise ValueError("this model directory has no tokenizer files: pass "
                             "prompt_token_ids, or a tokenizer=")
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        return self.tokenizer.encode(prompt)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its blocks return to the pool.

        Args:
            request_id: the request; an unknown or finished one is ignored (returns None).
        """
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

    is_shut_down = False  # (shutdown sets it on the instance)

    def shutdown(self) -> None:
        """Give back the model, KV and swap pools, CUDA graphs, worker processes, a draft model
        and on CUDA torch's cached blocks (also at collection). Twice is fine; steps then raise."""
        self.is_shut_down = True
        self.speculator = None  # (a draft model's weights and cache, if any)
        self.worker.shutdown()

    def _check_running(self) -> None:
        if self.is_shut_down:
            raise RuntimeError("this engine was shut down; build a new one to generate again")

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the outputs of the groups touched by it."""
        self._check_running()
        t = [time.perf_counter()]
        if self.speculator is not None:
            self.speculator.plan(self.scheduler.running, self.max_model_len)
        outs = self.scheduler.schedule()
        ended = self._collect_aborted()
        if outs.is_empty() and not outs.preempted and not self.scheduler.running:
            ended += self._break_stall()
        t.append(time.perf_counter())

        # Data moves only here, before the model reads the cache.
        if outs.blocks_to_swap_out:
            self.worker.swap_out(outs.blocks_to_swap_out)
        if outs.blocks_to_swap_in:
            self.worker.swap_in(outs.blocks_to_swap_in)
        if outs.blocks_to_copy:
            self.worker.copy(outs.blocks_to_copy)
        self.stats.count_schedule(outs, self.block_manager)

        drafts = None
        if self.speculator is not None:
            for request_id, _ in outs.preempted:  # their blocks (and the draft's KV) are gone
                self.speculator.forget(self._requests[request_id].get_seqs())
            drafts = self.speculator.propose(outs, self.block_manager, self._generators)
        inputs = prepare_inputs(outs, self.block_manager, self.block_size, self.device, drafts)
        t.append(time.perf_counter())
        if inputs.computed or inputs.spec_rows:
            logits = self.worker.execute_model(inputs)
            t.append(time.perf_counter())
            num_rows = len(inputs.rows)
            results = (self.sampler(logits[:num_rows], inputs.rows, self._generators)
                       if inputs.rows else {})
            t.append(time.perf_counter())
            num_verified = sum(1 + len(r.draft_token_ids) for r in inputs.spec_rows)
            self.stats.num_prompt_tokens += inputs.meta.num_prompt_tokens - num_verified
            self.stats.num_generation_tokens += inputs.meta.num_generation_tokens + num_verified
            for seq, num_computed in inputs.computed:  # now in the cache
                seq.num_computed_tokens = num_computed
            for group in outs.scheduled_seq_groups:
                if group.request_id in results:
                    self.stats.num_sampled_tokens += len(results[group.request_id])
                    self.output_processor.process(group, results[group.request_id],
                                                  self.block_manager)
            if inputs.spec_rows:  # verify the drafts, append what is kept, roll back the rest
                self.speculator.apply(logits[num_rows:], inputs.spec_rows, self._generators,
                                      self.output_processor, self.block_manager, self.stats)
        else:
            t += [time.perf_counter()] * 2
        if self.speculator is not None:
            self.speculator.end_step()
        finished = self.scheduler.free_finished_seq_groups()
        for group in finished:
            self._forget(group)
        t.append(time.perf_counter())

        self.stats.count_times(t)
        if self._observers:
            self._notify(outs, finished + ended)
        touched = {g.request_id: g for g in outs.scheduled_seq_groups + ended}
        return [RequestOutput.from_seq_group(g) for g in touched.values()]

    def _detokenize_all(self, group: SequenceGroup) -> None:
        self.output_processor.detokenize_all(group)

    def _forget(self, group: SequenceGroup) -> None:
        self._requests.pop(group.request_id, None)
        if self.speculator is not None:
            self.speculator.forget(group.get_seqs())
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
        snap = StepSnapshot.of_step(
            outs, finished, self.block_manager, self.scheduler, self.stats,
            self.speculator.last_step if self.speculator is not None else None)
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
