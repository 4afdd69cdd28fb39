"""A whole engine in one small class, assembled from plug-in functions (lesson 16, the capstone).

``AssembledEngine.step()`` does what ``LLMEngine.step()`` does (lesson 08) for a restricted set
of settings, with its own bookkeeping: a waiting and a running queue, a free list with ref
counts, and a block table per sequence. Every decision goes through a *plug-in*, a function the
learner wrote in an earlier exercise (or its answer in ``exercises/solutions.py``):

    pick_victims       which running groups decode, which are preempted (lesson 16)
    slot_of            the cache slot of a token at a position (lesson 02)
    grow_block_table   a table takes one more block when a token opens one (lesson 02)
    fork               the sequences of a request share its prompt's blocks (lesson 03)
    append_action      "new block" | "copy" | "in place" before a write (lesson 03)
    flat_batch         the step's token ids and positions, prompts first (lesson 08)
    sample_indices     which rows of the flat batch are sampled (lesson 08)
    step_slot_mapping  where each token of the flat batch writes its K/V (lesson 16)
    top_p_filter       the nucleus of a sampled request's logits (lesson 10)

The heavy lifting is the package's: the model and its paged attention kernels, the
``CacheEngine`` (``copy`` runs the copy-on-write copies), ``draw`` and ``sequence_generators``.

It makes the same choices as ``LLMEngine`` with ``preemption_mode="recompute"``, no prefix
caching and no chunked prefill: the same free-list order (a stack: the block freed last is
handed out first), the same victims (the newest running group), the same batch order. So on the
same requests it must produce the same tokens and the same block tables at every step;
``exercises/lesson16.check_engine`` holds it to that.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from minipaged.block import Device
from minipaged.core.scheduler_outputs import queue_badge
from minipaged.engine.output_processor import OutputProcessor
from minipaged.engine.stats import StepSnapshot
from minipaged.models.input_metadata import InputMetadata
from minipaged.sampling_params import SamplingParams
from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus
from minipaged.worker.cache_engine import CacheEngine
from minipaged.worker.sampler import draw, sequence_generators

PLUGINS = ("pick_victims", "slot_of", "grow_block_table", "fork", "append_action",
           "flat_batch", "sample_indices", "step_slot_mapping", "top_p_filter")


class RunningGroup(NamedTuple):
    """A running group as ``pick_victims`` sees it (oldest first)."""

    request_id: str
    blocks_held: int  # distinct blocks its sequences hold: what preempting it frees
    blocks_needed: int  # blocks its sequences' next tokens take (new blocks and copies)


class SeqView(NamedTuple):
    """A scheduled sequence as the flat-batch plug-ins see it (lesson 08's ``SeqView``)."""

    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]


class PluginError(RuntimeError):
    """A plug-in raised, or returned something the engine cannot use."""

    def __init__(self, step: int, plugin: str, message: str) -> None:
        super().__init__(f"step {step}: plug-in {plugin}: {message}")
        self.step, self.plugin, self.detail = step, plugin, message


class AssembledEngine:
    """One ``step()`` built from plug-ins over the package's model, kernels and cache.

    Args:
        model: the package's model (``llm.llm_engine.worker.model``); read only.
        plugins: {name: function} for every name in ``PLUGINS``.
        block_size, num_gpu_blocks: the pool, as the engine compared against has it.
        cache_shape: (num_layers, num_kv_heads, head_size) of the KV cache.
        max_model_len, max_num_seqs, max_num_batched_tokens, watermark_blocks, eos_token_ids,
            seed: the engine's limits, as ``LLMEngine`` has them.
    """

    def __init__(self, model: torch.nn.Module, plugins: dict[str, Callable], block_size: int,
                 num_gpu_blocks: int, cache_shape: tuple[int, int, int], max_model_len: int,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 4096,
                 watermark_blocks: int = 0, eos_token_ids=(), seed: int = 0) -> None:
        missing = [name for name in PLUGINS if name not in plugins]
        if missing:
            raise ValueError(f"plugins: missing {missing}")
        self.model, self.plugins, self.block_size = model, plugins, block_size
        dtype = next(model.parameters()).dtype
        device = next(model.parameters()).device
        self.cache = CacheEngine(*cache_shape, block_size, num_gpu_blocks, 0, dtype, device)
        self.device = device
        self.num_gpu_blocks = num_gpu_blocks
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        self.budget, self.watermark_blocks = max_num_batched_tokens, watermark_blocks
        self.eos_token_ids, self.seed = frozenset(eos_token_ids), seed
        self._stops = OutputProcessor(None, self.eos_token_ids, max_model_len)  # (no tokenizer)
        # NOTE: a stack, as FreeListAllocator keeps it: block 0 is on top at first, and the
        # block freed last is handed out first. Another order would run just as well, but
        # its block tables would differ from the engine's.
        self.free: list[int] = list(reversed(range(num_gpu_blocks)))
        self.ref_counts = [0] * num_gpu_blocks
        self.tables: dict[int, list[int]] = {}  # seq_id -> physical block numbers
        self.waiting: list[SequenceGroup] = []
        self.running: list[SequenceGroup] = []
        self.generators: dict[int, torch.Generator] = {}
        self.num_steps, self._next_seq_id = 0, 0
        self.touched: dict[int, list[str]] = {}  # seq_id -> plug-ins that changed its table
        self.observers: list[Callable[[StepSnapshot], None]] = []

    # -- requests --------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float) -> SequenceGroup:
        if params.use_beam_search or params.top_k != -1 or params.presence_penalty \
                or params.frequency_penalty or params.stop_strings:
            raise ValueError("params: the assembled engine does greedy and top-p sampling only")
        seqs = [Sequence(self._next_seq_id + i, None, list(prompt_token_ids), self.block_size)
                for i in range(params.best_of)]
        self._next_seq_id += len(seqs)
        seq_group = SequenceGroup(request_id, seqs, params, arrival_time)
        seed = (params.seed if params.seed is not None
                else f"engine {self.seed}, request {request_id}")  # as LLMEngine seeds it
        self.generators.update(sequence_generators(seed, [s.seq_id for s in seqs]))
        self.waiting.append(seq_group)
        return seq_group

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the pool --------------------------------------------------------------------------------
    def _allocate(self) -> int:
        if not self.free:
            raise RuntimeError("out of GPU blocks")
        block = self.free.pop()
        self.ref_counts[block] = 1
        return block

    def _free_block(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free.append(block)

    def _free_seq(self, seq: Sequence) -> None:
        for block in reversed(self.tables.pop(seq.seq_id, [])):  # last block first, as the engine
            self._free_block(block)

    def _call(self, name: str, *args):
        try:
            return self.plugins[name](*args)
        except Exception as exc:  # the learner's code: say which plug-in, at which step
            raise PluginError(self.num_steps, name, f"raised {exc!r}") from exc

    def _touch(self, seq_id: int, name: str) -> None:
        self.touched.setdefault(seq_id, []).append(name)

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> None:
        """One iteration: schedule (plug-ins decide), copy, run the model, sample, observe."""
        self.num_steps += 1
        self.touched = {}
        copies: dict[int, list[int]] = {}
        preempted = self._schedule_running(copies)
        budget = self.budget - sum(g.num_seqs(SequenceStatus.RUNNING) for g in self.running)
        prompts = [] if preempted else self._admit(budget)
        decodes = [g for g in self.running if g not in prompts]
        if copies:
            self.cache.copy(copies)  # copy-on-write: before the model writes the new token
        if prompts or decodes:
            self._run_model(prompts, decodes)
        finished = [g for g in self.running if g.is_finished()]
        self.running = [g for g in self.running if not g.is_finished()]
        snap = StepSnapshot(
            step=self.num_steps, scheduled=[g.request_id for g in prompts + decodes],
            prompt_run=[True] * len(prompts) + [False] * len(decodes), blocks_to_swap_in={},
            blocks_to_swap_out={}, blocks_to_copy=copies,
            preempted=[(r, "recompute") for r in preempted],
            finished=[g.request_id for g in finished], block_manager=self.snapshot(),
            scheduler=self.scheduler_snapshot())
        for fn in list(self.observers):
            fn(snap)

    def _schedule_running(self, copies: dict[int, list[int]]) -> list[str]:
        """Step 1 of ``Scheduler.schedule``: the running groups decode, oldest first; the
        plug-in picks who is preempted (by recompute) when their blocks do not fit."""
        self.running.sort(key=lambda g: g.arrival_time)
        views = [RunningGroup(g.request_id, len({b for s in g.get_seqs(SequenceStatus.RUNNING)
                                                 for b in self.tables[s.seq_id]}),
                              self._blocks_needed(g)) for g in self.running]
        answer = self._call("pick_victims", views, len(self.free))
        kept, preempted = list(answer[0]), list(answer[1])
        by_id = {g.request_id: g for g in self.running}
        if sorted(kept + preempted) != sorted(by_id):
            raise PluginError(self.num_steps, "pick_victims", f"kept {kept} and preempted "
                              f"{preempted}: every running group {sorted(by_id)} is one of them")
        # Replay the decision in the scheduler's order: a victim's blocks are freed just
        # before the group that needed them appends, so the free list changes in that order.
        queue, victims, running, done = list(self.running), list(preempted), [], []
        while queue:
            seq_group = queue.pop(0)
            while self._blocks_needed(seq_group) > len(self.free) and victims:
                victim = by_id[victims.pop(0)]
                self._preempt(victim, queue, running, done)
                if victim is seq_group:
                    break
            else:
                if seq_group.request_id in victims:  # it fits, but the plug-in preempts it
                    victims.remove(seq_group.request_id)
                    self._preempt(seq_group, queue, running, done)
                    continue
                if self._blocks_needed(seq_group) > len(self.free):
                    raise PluginError(self.num_steps, "pick_victims", f"kept "
                                      f"{group.request_id}, but its blocks do not fit")
                self._append_slots(seq_group, copies)
                running.append(seq_group)
        self.running = running
        return done

    def _blocks_needed(self, seq_group: SequenceGroup) -> int:
        """Blocks the group's next tokens take: ``append_action`` on a copy of the ref counts."""
        refs, needed = list(self.ref_counts), 0
        for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
            table = self.tables[seq.seq_id]
            action = self._call("append_action", table, refs,
                                len(table) < len(seq.logical_token_blocks))
            if action in ("new block", "copy"):
                needed += 1
            if action == "copy":
                refs[table[-1]] -= 1  # the next writer may find itself alone
        return needed

    def _append_slots(self, seq_group: SequenceGroup, copies: dict[int, list[int]]) -> None:
        for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
            table = self.tables[seq.seq_id]
            action = self._call("append_action", table, self.ref_counts,
                                len(table) < len(seq.logical_token_blocks))
            self._touch(seq.seq_id, "append_action")
            if action == "new block":
                self._call("grow_block_table", table, seq.get_len(), self.block_size,
                           self._allocate)
                self._touch(seq.seq_id, "grow_block_table")
            elif action == "copy":
                old, table[-1] = table[-1], self._allocate()
                self._free_block(old)
                copies.setdefault(old, []).append(table[-1])
            elif action != "in place":
                raise PluginError(self.num_steps, "append_action", f"returned {action!r}")

    def _preempt(self, seq_group: SequenceGroup, queue: list, running: list, done: list) -> None:
        for where in (queue, running):
            if seq_group in where:
                where.remove(seq_group)
        done.append(seq_group.request_id)
        for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
            self._free_seq(seq)
            seq.reset_for_recompute()
            self._touch(seq.seq_id, "pick_victims")
        self.waiting.append(seq_group)

    def _admit(self, budget: int) -> list[SequenceGroup]:
        """Step 4 of ``Scheduler.schedule``: waiting groups, oldest first, while they fit."""
        admitted = []
        self.waiting.sort(key=lambda g: g.arrival_time)
        while self.waiting:
            seq_group = self.waiting[0]
            seqs = seq_group.get_seqs(SequenceStatus.WAITING)
            tokens = seqs[0].get_token_ids()
            if any(s.get_token_ids() != tokens for s in seqs):
                raise RuntimeError(f"request {group.request_id}: its sequences differ; the "
                                   f"assembled engine recomputes only identical ones")
            num_blocks = -(-len(tokens) // self.block_size)
            num_running = sum(g.num_seqs(SequenceStatus.RUNNING) for g in self.running)
            if (budget < len(tokens) or num_running + len(seqs) > self.max_num_seqs
                    or len(self.free) - num_blocks < self.watermark_blocks):
                break
            self.waiting.pop(0)
            table: list[int] = []
            for num_tokens in range(1, len(tokens) + 1):
                self._call("grow_block_table", table, num_tokens, self.block_size,
                           self._allocate)
            self.tables[seqs[0].seq_id] = table
            self._touch(seqs[0].seq_id, "grow_block_table")
            for seq in seqs[1:]:  # parallel sampling: every sequence holds the prompt's blocks
                self.tables[seq.seq_id] = list(self._call("fork", table, self.ref_counts))
                self._touch(seq.seq_id, "fork")
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            self.running.append(seq_group)
            admitted.append(seq_group)
            budget -= len(tokens)
        return admitted

    # -- the model and the sampler ---------------------------------------------------------------
    @torch.inference_mode()
    def _run_model(self, prompts: list[SequenceGroup], decodes: list[SequenceGroup]) -> None:
        # A prompt is computed once for all its sequences (they share its blocks).
        rows = [g.get_seqs(SequenceStatus.RUNNING) for g in prompts]
        rows += [[s] for g in decodes for s in g.get_seqs(SequenceStatus.RUNNING)]
        views = [SeqView(r[0].get_token_ids(), r[0].num_computed_tokens,
                         list(self.tables[r[0].seq_id])) for r in rows]
        token_ids, positions = self._call("flat_batch", list(views))
        slots = self._call("step_slot_mapping", list(views), self.block_size,
                           self.plugins["slot_of"])
        sample_rows = self._call("sample_indices", list(views))
        decode_views = views[len(prompts):]
        width = max((len(v.block_table) for v in decode_views), default=0)
        meta = InputMetadata(
            prompt_lens=[len(v.token_ids) for v in views[:len(prompts)]],
            slot_mapping=torch.tensor(list(slots), dtype=torch.long, device=self.device),
            block_tables=torch.tensor([v.block_table + [0] * (width - len(v.block_table))
                                       for v in decode_views], dtype=torch.int32,
                                      device=self.device).view(len(decode_views), width),
            context_lens=torch.tensor([len(v.token_ids) for v in decode_views],
                                      dtype=torch.int32, device=self.device),
            max_context_len=max((len(v.token_ids) for v in decode_views), default=0),
            chunk_query_start_loc=torch.zeros(1, dtype=torch.int32, device=self.device),
            chunk_block_tables=torch.zeros(0, 0, dtype=torch.int32, device=self.device),
            chunk_context_lens=torch.zeros(0, dtype=torch.int32, device=self.device))
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=self.device)  # (T,)
        pos = torch.tensor(list(positions), dtype=torch.long, device=self.device)  # (T,)
        hidden = self.model(ids, pos, self.cache.gpu_cache, meta)  # (T, C)
        index = torch.tensor(list(sample_rows), dtype=torch.long, device=self.device)  # (R,)
        logits = self.model.compute_logits(hidden.index_select(0, index)).float()  # (R, V)
        for seqs in rows:
            for seq in seqs:  # what the step computed is in the cache now
                seq.num_computed_tokens = seq.get_len()
        for i, seqs in enumerate(rows):
            self._sample(logits[i], seqs)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """One row of logits (V,) -> the next token of each of ``seqs``; then the stop checks."""
        params = self._group_of(seqs[0]).sampling_params
        if params.greedy:
            tokens = [int(torch.argmax(logits))] * len(seqs)
            logprobs = torch.log_softmax(logits, dim=-1)  # (V,)
        else:
            scaled = (logits.cpu().unsqueeze(0)
                      / torch.tensor([params.temperature], device="cpu")[:, None])[0]  # (V,)
            logprobs = torch.log_softmax(scaled, dim=-1)  # (V,)
            filtered = self._call("top_p_filter", scaled, params.top_p)
            probs = torch.softmax(filtered, dim=-1)  # (V,)
            tokens = [draw(probs, self.generators[s.seq_id]) for s in seqs]
        for seq, token in zip(seqs, tokens):
            seq.append_token_id(token, {token: float(logprobs[token])})
            self._stops.check_stop(seq, params)  # the engine's EOS / max_tokens / length checks
            if seq.is_finished():
                self._free_seq(seq)

    def _group_of(self, seq: Sequence) -> SequenceGroup:
        return next(g for g in self.running if seq in g.get_seqs())

    # -- what the visualizer draws ---------------------------------------------------------------
    def all_seqs(self) -> list[Sequence]:
        return [s for g in self.waiting + self.running for s in g.get_seqs()]

    def snapshot(self) -> dict:
        """The block tables in the keys of ``BlockSpaceManager.snapshot()`` (GPU pool only)."""
        owners: dict[int, list[int]] = {}
        sequences = []
        requests = {s.seq_id: g.request_id for g in self.waiting + self.running
                    for s in g.get_seqs()}
        seqs = {s.seq_id: s for s in self.all_seqs()}
        for seq_id, table in self.tables.items():
            seq = seqs[seq_id]
            sequences.append({
                "seq_id": seq_id, "request_id": requests[seq_id], "status": seq.status.name,
                "device": Device.GPU.value, "num_tokens": seq.get_len(),
                "logical_blocks": [{"index": b.block_number, "num_filled": b.num_tokens,
                                    "token_ids": list(b.token_ids)}
                                   for b in seq.logical_token_blocks],
                "block_table": list(table)})
            for block in table:
                owners.setdefault(block, []).append(seq_id)
        return {
            "block_size": self.block_size, "watermark_blocks": self.watermark_blocks,
            "sequences": sequences,
            "gpu_blocks": [{"block_number": b, "ref_count": self.ref_counts[b],
                            "owners": owners.get(b, []), "block_hash": None, "cached": False,
                            "evictable": False} for b in range(self.num_gpu_blocks)],
            "cpu_blocks": [], "free_gpu_blocks": list(reversed(self.free)),
            "free_cpu_blocks": [], "evictable_gpu_blocks": [], "prefix_caching": False}

    def scheduler_snapshot(self) -> dict:
        """The queues in the keys of ``Scheduler.snapshot()``."""
        waiting = sorted(self.waiting, key=lambda g: g.arrival_time)
        return {"waiting": [queue_badge(g) for g in waiting],
                "running": [queue_badge(g) for g in self.running], "swapped": [],
                "num_gpu_blocks": self.num_gpu_blocks, "num_free_gpu_blocks": len(self.free),
                "num_cpu_blocks": 0, "num_free_cpu_blocks": 0}
