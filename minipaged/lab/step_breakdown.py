"""Where one decode step's time goes, and how close it gets to the machine's matmul peak.

Used by benchmarks/throughput.py and lesson 15 (performance). ``decode_step_breakdown`` fills
the engine with ``num_seqs`` requests, computes their prompts, then times decode-only steps with
the model's attention operations and linear layers instrumented:

    attention   minipaged.kernels.ops calls made by the attention layers (cache writes included)
    linear      every linear layer (nn.Linear and the tensor-parallel ones: the weight matmuls)
                and the LM head, on the sampled rows only
    other model norms, rotary embedding, activations, embedding lookup, glue
    sample, schedule, prepare, update      the engine's own timers (EngineStats)
    python      the rest of the step (step wall time minus all of the above)

Useful FLOPs of a decode step are counted exactly: 2 * in * out * rows for each linear layer, and
4 * context_len * num_heads * head_size per sequence and layer for attention (q.k and p.V). The
peak is one large square matmul (``roofline.measure_matmul_peak``) measured in the same run, in
the same dtype and thread count.
"""
from __future__ import annotations

import time

import torch

from minipaged.sampling_params import SamplingParams
from minipaged.kernels import ops
from minipaged.models.parallel_layers import ColumnParallelLinear, RowParallelLinear

LINEAR_LAYERS = (torch.nn.Linear, ColumnParallelLinear, RowParallelLinear)

ATTENTION_OPS = ("reshape_and_cache", "paged_attention", "prefill_attention",
                 "paged_prefill_attention")


def cpu_capability_notes(dtype: torch.dtype) -> str:
    """The CPU's vector instructions as torch sees them, and what that means for bf16."""
    capability = torch.backends.cpu.get_cpu_capability()
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next(line for line in f if line.startswith("flags")).split(":")[1].split())
    except (OSError, StopIteration):
        pass
    native_bf16 = bool({"avx512_bf16", "amx_bf16"} & flags)
    note = f"CPU capability {capability}, native bf16 {'yes' if native_bf16 else 'no'}"
    if dtype == torch.bfloat16 and not native_bf16:
        note += (" (no AVX512-BF16/AMX: bf16 matmuls convert to fp32 on the fly and are slower "
                 "than fp32 here; bf16 saves memory, not time, on this CPU)")
    return note


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


class _Instruments:
    """Timers around the attention ops and the linear layers, and their FLOP counts."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.device = device
        self.time = {"attention": 0.0, "linear": 0.0}
        self.flops = {"attention": 0.0, "linear": 0.0}
        self._originals = {name: getattr(ops, name) for name in ATTENTION_OPS}
        self._hooks = []
        self._started: dict[int, float] = {}
        for name in ATTENTION_OPS:
            setattr(ops, name, self._timed(name, self._originals[name]))
        for module in model.modules():
            if isinstance(module, LINEAR_LAYERS):
                self._hooks.append(module.register_forward_pre_hook(self._linear_start))
                self._hooks.append(module.register_forward_hook(self._linear_end))
        # The LM head (on the sampled rows only) counts as a linear layer too.
        self._model = model
        self._compute_logits = model.compute_logits
        model.compute_logits = self._timed_logits

    def _timed(self, name, fn):
        def wrapper(*args, **kwargs):
            _sync(self.device)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            _sync(self.device)
            self.time["attention"] += time.perf_counter() - t0
            if name == "paged_attention":
                query, context_lens = args[0], args[4]
                self.flops["attention"] += (4 * float(context_lens.sum()) * query.shape[1]
                                            * query.shape[2])
            return out
        return wrapper

    def _linear_start(self, module, inputs):
        _sync(self.device)
        self._started[id(module)] = time.perf_counter()

    def _linear_end(self, module, inputs, output):
        _sync(self.device)
        self.time["linear"] += time.perf_counter() - self._started.pop(id(module))
        weight = module.weight  # (out, in) or, transposed, (in, out): in * out either way
        rows = output.numel() // output.shape[-1]
        self.flops["linear"] += 2.0 * rows * weight.numel()

    def _timed_logits(self, hidden):
        _sync(self.device)
        t0 = time.perf_counter()
        logits = self._compute_logits(hidden)  # (R, vocab)
        _sync(self.device)
        self.time["linear"] += time.perf_counter() - t0
        self.flops["linear"] += 2.0 * hidden.shape[0] * hidden.shape[1] * logits.shape[-1]
        return logits

    def remove(self):
        for name, fn in self._originals.items():
            setattr(ops, name, fn)
        for hook in self._hooks:
            hook.remove()
        del self._model.compute_logits  # back to the class's method


def decode_step_breakdown(llm, prompts: list[list[int]], num_steps: int = 4) -> dict:
    """Seconds per decode-only step of ``len(prompts)`` sequences, by part, and useful FLOPs."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=num_steps + 2, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"breakdown-{i}", None, params, prompt_token_ids=prompt)
    while engine.scheduler.waiting:
        engine.step()  # the prompt steps
    engine.step()  # one decode to warm up
    parts = ("schedule", "prepare", "model", "sample", "update")
    before = {p: getattr(engine.stats, f"time_{p}") for p in parts}
    tools = _Instruments(engine.worker.model, engine.device)
    try:
        t0 = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        wall = time.perf_counter() - t0
    finally:
        tools.remove()
    while engine.has_unfinished_requests():
        engine.step()
    per = {p: (getattr(engine.stats, f"time_{p}") - before[p]) / num_steps for p in parts}
    step = wall / num_steps
    result = {
        "num_seqs": len(prompts),
        "step": step,
        "attention": tools.time["attention"] / num_steps,
        "linear": tools.time["linear"] / num_steps,
        "flops": (tools.flops["attention"] + tools.flops["linear"]) / num_steps,
    }
    result["other model"] = per["model"] - result["attention"] - result["linear"]
    for p in ("sample", "schedule", "prepare", "update"):
        result[p] = per[p]
    result["python"] = step - sum(per.values())
    return result


def format_decode_breakdown(b: dict, peak: float) -> str:
    keys = ("attention", "linear", "other model", "sample", "schedule", "prepare", "update",
            "python")
    cells = ", ".join(f"{k} {1000 * b[k]:.1f} ms ({100 * b[k] / b['step']:.0f} %)" for k in keys)
    achieved = b["flops"] / b["step"]
    return (f"one decode step of {b['num_seqs']} sequences: {1000 * b['step']:.1f} ms = {cells}. "
            f"Useful work {b['flops'] / 1e9:.3g} GFLOP per step = {achieved / 1e9:.3g} GFLOP/s, "
            f"{100 * achieved / peak:.0f} % of the measured matmul peak ({peak / 1e9:.1f} GFLOP/s, "
            f"one 2048x2048 matmul, same dtype and threads); the timers synchronise around each "
            f"linear layer, so the instrumented step is a little slower than an untimed one.")
