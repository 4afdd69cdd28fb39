"""What the engine counts and what its observers see after each step (lessons 04, 06, 07).

``EngineStats`` are the counters tests, lessons and benchmarks read (``llm.llm_engine.stats``);
a ``StepSnapshot`` is the plain data an observer receives after every step (the visualizer draws
it).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from minipaged.core.scheduler import Scheduler
from minipaged.core.scheduler_outputs import PoolCounts, SchedulerOutputs
from minipaged.sequence import SequenceGroup


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
    # Prefix caching (lesson 11): prompt tokens whose KV came from the cache and were not
    # computed (num_prompt_tokens counts the computed ones), and cached blocks evicted.
    num_cached_prompt_tokens: int = 0
    num_evicted_blocks: int = 0
    # Speculative decoding (lesson 12): drafts proposed, drafts accepted, tokens emitted by
    # verifications (accepted + one each), and verifications run.
    num_spec_proposed_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    num_spec_emitted_tokens: int = 0
    num_spec_verifications: int = 0
    # Where a step's time goes, in seconds, summed over all steps.
    time_schedule: float = 0.0
    time_prepare: float = 0.0
    time_model: float = 0.0
    time_sample: float = 0.0
    time_update: float = 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "spec_acceptance_rate": self.spec_acceptance_rate,
                "spec_mean_accepted_length": self.spec_mean_accepted_length}

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts (0 before any proposal)."""
        return self.num_spec_accepted_tokens / max(self.num_spec_proposed_tokens, 1)

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens emitted per verification (accepted drafts + 1; 0 before any)."""
        return self.num_spec_emitted_tokens / max(self.num_spec_verifications, 1)

    def count_verification(self, num_proposed: int, num_emitted: int) -> None:
        """One verification proposed ``num_proposed`` drafts and emitted ``num_emitted``
        tokens (the accepted drafts and one more)."""
        self.num_spec_verifications += 1
        self.num_spec_proposed_tokens += num_proposed
        self.num_spec_accepted_tokens += num_emitted - 1
        self.num_spec_emitted_tokens += num_emitted

    def reset(self) -> None:
        """Every counter back to zero (a benchmark measuring one run after a warm-up)."""
        for f in fields(self):
            setattr(self, f.name, f.default)

    def count_schedule(self, outs: SchedulerOutputs, pool: PoolCounts) -> None:
        """Count a step's preemptions and cache operations, and the pool's state after them.

        Args:
            outs: what the scheduler decided for the step.
            pool: the pools after the step's allocations (``Scheduler.pool_counts()``).
        """
        for _, mode in outs.preempted:
            if mode == "recompute":
                self.num_preemptions_recompute += 1
            elif mode == "swap":
                self.num_preemptions_swap += 1
        self.num_blocks_swapped_out += len(outs.blocks_to_swap_out)
        self.num_blocks_swapped_in += len(outs.blocks_to_swap_in)
        self.num_blocks_copied += sum(len(d) for d in outs.blocks_to_copy.values())
        used = pool.num_gpu_blocks - pool.num_free_gpu_blocks
        self.peak_gpu_blocks_used = max(self.peak_gpu_blocks_used, used)
        # NOTE: the block manager counts these; the stats show its counts as of this step.
        self.num_cached_prompt_tokens = pool.num_cached_tokens
        self.num_evicted_blocks = pool.num_evicted_blocks

    def count_tokens(self, num_prompt: int, num_generation: int, num_verified: int) -> None:
        """Count a step's computed tokens; the ``num_verified`` tokens of speculative
        verifications (lesson 12) ran as chunks but are generation, not prompt."""
        self.num_prompt_tokens += num_prompt - num_verified
        self.num_generation_tokens += num_generation + num_verified

    def count_times(self, t: list[float]) -> None:
        """Add one step's times; ``t`` holds six clock readings, one between each phase."""
        self.num_steps += 1
        self.time_schedule += t[1] - t[0]
        self.time_prepare += t[2] - t[1]
        self.time_model += t[3] - t[2]
        self.time_sample += t[4] - t[3]
        self.time_update += t[5] - t[4]


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
    # Speculative decoding (lesson 12), by seq id: "proposed" drafts, how many "accepted", the
    # "emitted" tokens, the "lookahead_slots" they were written to, "blocks_before"/"_after"
    # the rollback.
    spec: dict = field(default_factory=dict)
    # The step's clock readings (``time.perf_counter()`` seconds): its start, the end of each
    # phase (schedule, prepare, model, sample, update); the step trace draws them.
    times: list[float] = field(default_factory=list)
    # When each scheduled request arrived (``time.monotonic()`` seconds).
    arrival_times: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of_step(cls, outs: SchedulerOutputs, finished: list[SequenceGroup],
                scheduler: Scheduler, stats: EngineStats,
                spec: dict | None = None, times: list[float] | None = None) -> StepSnapshot:
        """The snapshot after a step: copies, so that later steps do not change it.

        Args:
            outs: the step's scheduler outputs.
            finished: the groups that ended in the step (finished or aborted).
            scheduler: gives the queues and the pool.
            stats: the engine's counters after the step.
            spec: the step's verifications (``Speculator.last_step``), if any.
            times: the step's clock readings, if measured.
        """
        return cls(
            step=stats.num_steps,
            scheduled=[g.request_id for g in outs.scheduled_seq_groups],
            prompt_run=list(outs.prompt_run),
            blocks_to_swap_in=dict(outs.blocks_to_swap_in),
            blocks_to_swap_out=dict(outs.blocks_to_swap_out),
            blocks_to_copy={k: list(v) for k, v in outs.blocks_to_copy.items()},
            preempted=list(outs.preempted),
            finished=[g.request_id for g in finished],
            block_manager=scheduler.block_snapshot(),
            scheduler=scheduler.snapshot(),
            stats=stats.as_dict(),
            num_batched_tokens=outs.num_batched_tokens,
            spec={k: dict(v) for k, v in (spec or {}).items()},
            times=list(times or []),
            arrival_times={g.request_id: g.arrival_time for g in outs.scheduled_seq_groups},
        )
