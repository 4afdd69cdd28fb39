"""A model-free driver of the real Scheduler, for checkers that need random engine steps.

It does what ``LLMEngine.step`` does around the scheduler, without a model: requests arrive at
random, every scheduled sequence gets one random token, and some requests stop at random.
"""
from __future__ import annotations

from minipaged import SamplingParams
from minipaged.block_manager import BlockSpaceManager
from minipaged.scheduler import Scheduler, SchedulerConfig
from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus


class RandomTraffic:
    def __init__(self, rng, block_size: int, num_gpu_blocks: int, preemption_mode="swap",
                 max_prompt_blocks: int = 3) -> None:
        self.rng, self.block_size = rng, block_size
        self.max_prompt_len = max_prompt_blocks * block_size
        self.bm = BlockSpaceManager(block_size, num_gpu_blocks, num_cpu_blocks=4 * num_gpu_blocks,
                                    watermark=0.0)
        self.scheduler = Scheduler(SchedulerConfig(preemption_mode=preemption_mode), self.bm)
        self.num_requests = 0

    def arrive(self, count: int) -> None:
        for _ in range(count):
            i = self.num_requests
            prompt = [self.rng.randrange(1000) for _ in range(self.rng.randint(1, self.max_prompt_len))]
            seq = Sequence(i, None, prompt, self.block_size)
            self.scheduler.add_seq_group(SequenceGroup(str(i), [seq], SamplingParams(),
                                                       arrival_time=float(i)))
            self.num_requests += 1

    def after_model(self, outs) -> None:
        """What the engine does once the model ran: new tokens, random stops, frees."""
        for group in outs.scheduled_seq_groups:
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                seq.num_computed_tokens = seq.get_len()
                token = self.rng.randrange(1000)
                seq.append_token_id(token, {token: 0.0})
                if self.rng.random() < 0.12:
                    seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
                    self.bm.free(seq)
        self.scheduler.free_finished_seq_groups()
