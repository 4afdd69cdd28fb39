"""The decode-step breakdown charges asynchronous device work to the section that launched it.

On a GPU the model's kernels are queued and the call returns at once; the sampler's first read
of the logits then waits for them, and a clock read without a synchronisation blames the
sampler (minipaged's first H200 run reported "attention 0.0 ms, linear 0.0 ms, sample 10.4 ms"
under CUDA graphs). ``FakeDevice`` reproduces that on the CPU: the model "launches" work that
completes only when someone synchronises, and the sampler synchronises before it reads, as
``.tolist()`` would.
"""
import time

import pytest

from minipaged.lab.step_breakdown import decode_step_breakdown, format_decode_breakdown

DELAY = 0.2  # seconds of device work each model call queues (well above this machine's noise)


class FakeDevice:
    def __init__(self):
        self.pending = 0.0

    def launch(self, seconds: float) -> None:
        self.pending += seconds

    def synchronize(self) -> None:
        time.sleep(self.pending)
        self.pending = 0.0


@pytest.fixture
def asynchronous_llm(tiny_llama):
    """An engine whose model queues DELAY seconds of work, and whose sampler waits for it."""
    from minipaged import LLM

    llm = LLM(tiny_llama[0], num_gpu_blocks=64, num_cpu_blocks=0, max_model_len=128)
    engine, device = llm.llm_engine, FakeDevice()
    execute, sample = engine.worker.execute_model, engine.sampler

    def execute_async(inputs):
        logits = execute(inputs)
        device.launch(DELAY)  # returns before the "kernels" ran
        return logits

    def sample_after_reading(*args, **kwargs):
        device.synchronize()  # the first host read waits for the model's work
        return sample(*args, **kwargs)

    engine.worker.execute_model = execute_async
    engine.sampler = sample_after_reading
    return llm, device


def test_without_synchronisation_the_engine_timers_blame_the_sampler(asynchronous_llm):
    """The failure the breakdown must not repeat: the engine's own clocks see the delay in
    "sample"."""
    llm, _ = asynchronous_llm
    stats = llm.llm_engine.stats
    from minipaged import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=params, use_tqdm=False)  # warm
    stats.reset()
    llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=params, use_tqdm=False)
    assert stats.time_sample >= 4 * DELAY * 0.9  # every step's model work, read as sampling


def test_the_breakdown_charges_the_delay_to_the_model_that_launched_it(asynchronous_llm):
    llm, device = asynchronous_llm
    parts = decode_step_breakdown(llm, [[5, 6, 7, 8]] * 3, num_steps=3, sync=device.synchronize)
    assert parts["model"] >= DELAY * 0.95
    assert parts["sample"] < DELAY * 0.5
    assert parts["other model"] >= DELAY * 0.9  # not the attention ops, not the linear layers
    assert parts["step"] >= parts["model"] + parts["sample"]
    for k in ("schedule", "prepare", "update", "python", "sample"):
        assert 0 <= parts[k] < DELAY * 0.5, k
    assert parts["graphs"] is False
    assert parts["attention"] > 0 and parts["linear"] > 0
    # the instruments are gone: the engine runs as before
    assert "execute_model" in vars(llm.llm_engine.worker)  # (the fixture's own wrapper)
    assert "schedule" not in vars(llm.llm_engine.scheduler)


def test_under_cuda_graphs_the_replay_is_one_section_never_zeros(asynchronous_llm):
    """A captured step runs nothing in Python: attention and linear are not measured (None),
    the replay is the model section, and the FLOPs are counted instead of instrumented."""
    llm, device = asynchronous_llm
    engine = llm.llm_engine
    engine.worker.enable_cuda_graphs(8, engine.max_model_len, engine.block_size, capture=False)
    runner = engine.worker.model_runner.graph_runner
    replay_on_buffers = runner.execute
    runner.capture = True  # as on CUDA (the replay itself runs eagerly on the buffers here)

    def replay(inputs):
        runner.capture = False
        try:
            return replay_on_buffers(inputs)
        finally:
            runner.capture = True

    runner.execute = replay
    parts = decode_step_breakdown(llm, [[5, 6, 7, 8, 9]] * 3, num_steps=2,
                                  sync=device.synchronize)
    assert parts["graphs"] is True
    assert parts["attention"] is None and parts["linear"] is None
    assert parts["other model"] is None
    assert parts["model"] >= DELAY * 0.95 and parts["sample"] < DELAY * 0.5
    from minipaged.lab import roofline as rl
    from minipaged.model_shape import ModelShape

    dims = ModelShape.from_hf(engine.hf_config)  # timed steps attend to 7 and 8 tokens
    expected = (rl.decode_step(dims, 3, 7, 4).flops + rl.decode_step(dims, 3, 8, 4).flops) / 2
    assert parts["flops"] == pytest.approx(expected, rel=1e-9)
    text = format_decode_breakdown(parts, peak=1e9)
    assert "model (one CUDA graph replay)" in text and "attention" not in text
