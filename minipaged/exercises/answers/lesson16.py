"""Lesson 16's reference answer: the engine's ``step()`` (the build track's ``LLMEngine.step``).

It is plugged in as ``LLMEngine.step`` (``minipaged/engine/llm_engine.py``), so ``self`` is the
real engine: its scheduler, worker, sampler and output processor. Speculative decoding (lesson
12) is left out: the capstone runs without it.
"""
from __future__ import annotations

import time

from minipaged.engine.stats import StepSnapshot
from minipaged.outputs import RequestOutput
from minipaged.engine import llm_engine


def step(self) -> list[RequestOutput]:
    """Run one iteration; returns the outputs of the groups touched by it.

    schedule -> move cache blocks -> run the model on the flat batch -> sample -> append the
    sampled tokens and check the stops -> free the finished groups -> tell the observers;
    ``self.stats`` counts what the step did.
    """
    self._check_running()
    # 1. The scheduler decides who runs, who is preempted and which blocks move.
    outs = self.scheduler.schedule()
    ended = self._collect_aborted()  # requests it gave up on (they can never fit)
    self.stats.count_schedule(outs, self.scheduler.pool_counts())
    # 2. Blocks move before the model reads the cache: a copy-on-write copy must hold the
    #    shared tokens before the step writes its new token next to them.
    self.worker.cache_swap(outs.blocks_to_swap_in, outs.blocks_to_swap_out, outs.blocks_to_copy)

    # 3. One flat batch, one model run, one token per sampled sequence.
    # (looked up in llm_engine at each call: lesson 08's prepare_inputs, when plugged in, runs)
    inputs = llm_engine.prepare_inputs(outs.seq_runs, self.block_size, self.device)
    sampled = {}
    if inputs.computed:
        start = time.perf_counter()
        logits = self.worker.execute_model(inputs)  # (rows, vocab)
        self.stats.time_model += time.perf_counter() - start
        self.stats.count_tokens(inputs.meta.num_prompt_tokens,
                                inputs.meta.num_generation_tokens, 0)
        if inputs.rows:
            sampled = self.sampler(logits, inputs.rows, self._generators)
        self.stats.num_sampled_tokens += sum(len(tokens) for tokens in sampled.values())
        for seq, num_computed in inputs.computed:  # their K/V are in the cache now
            seq.num_computed_tokens = num_computed

    # 4. Only now do the new tokens join their sequences; each is then checked for a stop.
    for seq_group in outs.scheduled_seq_groups:
        new_tokens = sampled.get(seq_group.request_id, {})
        for seq_id, out in new_tokens.items():  # beam search: a dropped beam copies its parent
            if out.parent_seq_id != seq_id:
                seq, parent = seq_group.find(seq_id), seq_group.find(out.parent_seq_id)
                self.scheduler.free_seq(seq)
                seq.copy_state_from(parent)
                self.scheduler.fork_seq(parent, seq)
        for seq_id, out in new_tokens.items():
            seq = seq_group.find(seq_id)
            seq.append_token_id(out.token_id, out.logprobs)
            self.output_processor.check_stop(seq, seq_group.sampling_params)
            if seq.is_finished():
                self.scheduler.free_seq(seq)  # its blocks go back at once
        if new_tokens and seq_group.is_finished():
            self.output_processor.detokenize_all(seq_group)

    # 5. Finished groups leave the running queue; the engine forgets them.
    finished = self.scheduler.free_finished_seq_groups()
    for seq_group in finished:
        self._forget(seq_group)
    self.stats.num_steps += 1
    if self._observers:
        snapshot = StepSnapshot.of_step(outs, finished + ended, self.scheduler, self.stats)
        for observer in list(self._observers):
            observer(snapshot)
    touched = {g.request_id: g for g in outs.scheduled_seq_groups + ended}
    return [RequestOutput.from_seq_group(g) for g in touched.values()]
