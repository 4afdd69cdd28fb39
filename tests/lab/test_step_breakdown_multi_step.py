"""The decode-step breakdown of a multi-step engine (``num_scheduler_steps``) is per decode step.

One ``step()`` of such an engine runs k model calls from one schedule, chooses each step's tokens
on the device and applies them all after. ``decode_step_breakdown`` must charge all k model calls
to "model" (not the last one only), the k on-device greedy choices to "sample", and divide by the
decode steps run, not by the ``step()`` calls. As in tests/engine/test_step_breakdown_sync.py,
the model "launches" work that completes only when someone synchronises.
"""
import time

import pytest

from minipaged.lab import roofline as rl
from minipaged.lab.step_breakdown import decode_step_breakdown
from minipaged.model_shape import ModelShape

pytestmark = pytest.mark.lesson15

DELAY = 0.05  # seconds of device work each model call queues
K = 4  # num_scheduler_steps
PROMPTS = [[5, 6, 7, 8, 9]] * 3


class FakeDevice:
    def __init__(self):
        self.pending = 0.0

    def synchronize(self) -> None:
        time.sleep(self.pending)
        self.pending = 0.0


@pytest.fixture
def multi_step_llm(tiny_llama):
    """A k-step engine whose model queues DELAY seconds of work per call."""
    from minipaged import LLM

    llm = LLM(tiny_llama[0], num_gpu_blocks=64, num_cpu_blocks=0, max_model_len=128,
              num_scheduler_steps=K)
    engine, device = llm.llm_engine, FakeDevice()
    execute = engine.worker.execute_model

    def execute_async(inputs):
        logits = execute(inputs)
        device.pending += DELAY  # returns before the "kernels" ran
        return logits

    engine.worker.execute_model = execute_async
    return llm, device


class EagerGraph:
    """Stands in for a captured CUDA graph: a replay runs the model on the runner's buffers."""

    def __init__(self, runner, size: int):
        self.runner, self.size = runner, size

    def replay(self) -> None:
        self.runner.outputs[self.size] = self.runner._forward(self.size)


def counted_flops(engine) -> float:
    """Useful FLOPs per timed decode step: 2 calls of K steps after the prompt's token and the
    warm-up call's K, so the 2K timed steps attend to 5 + 1 + K + i tokens."""
    dims = ModelShape.from_hf(engine.hf_config)
    steps = [rl.decode_step(dims, len(PROMPTS), 6 + K + i, 4).flops for i in range(2 * K)]
    return sum(steps) / len(steps)


def test_every_model_call_of_a_multi_step_call_is_charged_per_decode_step(multi_step_llm):
    llm, device = multi_step_llm
    engine = llm.llm_engine
    runs = engine.multi_step.num_runs
    parts = decode_step_breakdown(llm, PROMPTS, num_steps=2, sync=device.synchronize)
    assert parts["decode_steps"] == 2 * K
    assert engine.multi_step.num_runs - runs >= 3  # the warm-up and the 2 timed calls at least
    # one call's DELAY per decode step (the last call alone would give DELAY / K)
    assert DELAY * 0.95 <= parts["model"] < DELAY * 1.5
    assert parts["other model"] >= DELAY * 0.9
    assert parts["step"] >= parts["model"] + parts["sample"]
    for k in ("schedule", "prepare", "update", "python", "sample"):
        assert 0 <= parts[k] < DELAY * 0.5, k
    assert parts["sample"] > 0  # the on-device greedy choice, timed
    assert parts["flops"] == pytest.approx(counted_flops(engine), rel=1e-9)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.get_num_free_gpu_blocks() == 64
    # the instruments are gone
    from minipaged.engine import multi_step

    assert multi_step.to_host_soon.__name__ == "to_host_soon"
    assert "schedule" not in vars(engine.scheduler)


def test_under_cuda_graphs_every_decode_step_is_one_replay(multi_step_llm):
    """"graphs" holds when each decode step replayed (K replays per call), and the FLOPs are
    counted over the decode steps run."""
    llm, device = multi_step_llm
    engine = llm.llm_engine
    engine.worker.enable_cuda_graphs(8, engine.max_model_len, engine.block_size, capture=False)
    runner = engine.worker.model_runner.graph_runner
    runner.capture = True  # as on CUDA, with graphs that run the model on the static buffers
    runner.graphs = {size: EagerGraph(runner, size) for size in runner.sizes}
    replays = runner.replays
    parts = decode_step_breakdown(llm, PROMPTS, num_steps=2, sync=device.synchronize)
    assert parts["graphs"] is True and parts["decode_steps"] == 2 * K
    assert runner.replays - replays > 2 * K  # (the warm-up and the last tokens replay too)
    assert parts["attention"] is None and parts["linear"] is None
    assert DELAY * 0.95 <= parts["model"] < DELAY * 1.5
    assert parts["flops"] == pytest.approx(counted_flops(engine), rel=1e-9)


def test_a_single_step_engine_counts_one_decode_step_per_call(tiny_llama):
    from minipaged import LLM

    llm = LLM(tiny_llama[0], num_gpu_blocks=64, num_cpu_blocks=0, max_model_len=128)
    parts = decode_step_breakdown(llm, PROMPTS, num_steps=2)
    assert parts["decode_steps"] == 2 and llm.llm_engine.multi_step.num_runs == 0
