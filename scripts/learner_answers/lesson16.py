"""Lesson 16 as a learner answers it: the step's second half (beams, appends, stops) in helpers
of their own cells, the package's statistics kept as ``LLMEngine.step`` keeps them."""

# %%
import time


def reparent_beams(engine, seq_group, outputs):
    """Beam search: a sequence whose parent differs becomes a copy of its parent first."""
    for seq_id, out in outputs.items():
        if out.parent_seq_id == seq_id:
            continue
        child, parent = seq_group.find(seq_id), seq_group.find(out.parent_seq_id)
        engine.scheduler.free_seq(child)
        child.copy_state_from(parent)
        engine.scheduler.fork_seq(parent, child)


# %%
def append_and_stop(engine, seq_group, outputs):
    """Append each new token, then check the stops; a finished sequence frees its blocks."""
    reparent_beams(engine, seq_group, outputs)
    for seq_id, out in outputs.items():
        seq = seq_group.find(seq_id)
        seq.append_token_id(out.token_id, out.logprobs)
        engine.output_processor.check_stop(seq, seq_group.sampling_params)
        if seq.is_finished():
            engine.scheduler.free_seq(seq)
    if seq_group.is_finished():
        engine.output_processor.detokenize_all(seq_group)


# %%
def step(self):
    self._check_running()
    clock = [time.perf_counter()]
    outs = self.scheduler.schedule()
    aborted = self._collect_aborted()
    clock.append(time.perf_counter())
    self.worker.cache_swap(outs.blocks_to_swap_in, outs.blocks_to_swap_out, outs.blocks_to_copy)
    self.stats.count_schedule(outs, self.scheduler.pool_counts())
    inputs = llm_engine.prepare_inputs(outs.seq_runs, self.block_size, self.device)
    clock.append(time.perf_counter())
    if inputs.computed:
        logits = self.worker.execute_model(inputs)
        clock.append(time.perf_counter())
        sampled = self.sampler(logits, inputs.rows, self._generators) if inputs.rows else {}
        clock.append(time.perf_counter())
        self.stats.count_tokens(inputs.meta.num_prompt_tokens,
                                inputs.meta.num_generation_tokens, 0)
        for seq, n in inputs.computed:
            seq.num_computed_tokens = n
        for seq_group in outs.scheduled_seq_groups:
            if seq_group.request_id in sampled:
                new = sampled[seq_group.request_id]
                self.stats.num_sampled_tokens += len(new)
                append_and_stop(self, seq_group, new)
    else:
        clock += [time.perf_counter()] * 2
    finished = self.scheduler.free_finished_seq_groups()
    for seq_group in finished:
        self._forget(seq_group)
    clock.append(time.perf_counter())
    self.stats.count_times(clock)  # (it counts the step too)
    if self._observers:
        snapshot = StepSnapshot.of_step(outs, finished + aborted, self.scheduler, self.stats)
        for observer in list(self._observers):
            observer(snapshot)
    touched = {}
    for seq_group in outs.scheduled_seq_groups + aborted:
        touched[seq_group.request_id] = seq_group
    return [RequestOutput.from_seq_group(g) for g in touched.values()]
