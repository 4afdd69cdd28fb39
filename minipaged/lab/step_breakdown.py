"""Where one decode step's time goes, and how close it gets to the machine's matmul peak.

Used by benchmarks/throughput.py and lesson 15 (performance). ``decode_step_breakdown`` fills
the engine with ``num_seqs`` requests, computes their prompts, then times decode-only steps by
section:

    schedule    the scheduler's ``schedule()``
    prepare     cache moves and the step's flat batch (``prepare_inputs``)
    model       the worker's ``execute_model``, split when it runs eagerly into
        attention   minipaged.kernels.ops calls made by the attention layers (cache writes too)
        linear      every linear layer (nn.Linear and the tensor-parallel ones: the weight
                    matmuls) and the LM head, on the sampled rows only
        other model norms, rotary embedding, activations, embedding lookup, glue
    sample      the sampler
    update      appending tokens, stop checks, freeing finished groups
    python      the rest of the step (step wall time minus all of the above)

With multi-step decode (``num_scheduler_steps = k``, ``engine/multi_step.py``) one ``step()``
runs up to k decode steps: "model" is then the sum of its k model calls, "sample" of the k
on-device greedy choices (each from its model call's end until its tokens' copy to the host is
launched), "update" the host applying all k steps' tokens, and every number is per decode step
(the step() times divided by the decode steps they ran). Each section still ends with a
synchronisation, so the overlap multi-step decode exists for is not measured here: this is the
host's work per token, as if nothing overlapped.

NOTE: a GPU runs asynchronously: a call returns once its kernels are queued, and the work is
waited for by whoever first reads a result on the host, usually the sampler. A clock read
right after a call would credit the model's time to the sampler. So every section here starts
and ends with a synchronisation (``torch.cuda.synchronize``; the ``sync`` argument), and a
section is charged exactly the work it launched. Under CUDA graphs a decode step's model is one
graph replay: nothing in Python runs inside it, so "model" is that one measured replay and the
attention / linear / other split is None (not measured), never zero. Run with
``enforce_eager=True`` to take the model apart.

Useful FLOPs of a decode step are counted exactly: 2 * in * out * rows for each linear layer, and
4 * context_len * num_heads * head_size per sequence and layer for attention (q.k and p.V). The
peak is one large square matmul (``roofline.measure_matmul_peak``) measured in the same run, in
the same dtype and thread count.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch

from minipaged.sampling_params import SamplingParams
from minipaged.kernels import ops
from minipaged.models.parallel_layers import (ColumnParallelLinear, FusedColumns,
                                              RowParallelLinear)

# (FusedColumns: several column-parallel linears as one matmul; when it runs them one by one,
# only the FusedColumns call is counted)
LINEAR_LAYERS = (torch.nn.Linear, ColumnParallelLinear, RowParallelLinear, FusedColumns)

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


def device_sync(device: torch.device) -> Callable[[], None]:
    """A function that waits until ``device`` has finished the work queued so far."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None  # the CPU runs each op before returning


class _Instruments:
    """Timers around the attention ops and the linear layers, and their FLOP counts."""

    def __init__(self, model: torch.nn.Module, sync: Callable[[], None]):
        self.sync = sync
        self.time = {"attention": 0.0, "linear": 0.0}
        self.flops = {"attention": 0.0, "linear": 0.0}
        self._originals = {name: getattr(ops, name) for name in ATTENTION_OPS}
        self._hooks = []
        self._started: dict[int, float] = {}
        self._depth = 0  # linear calls open now
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
            self.sync()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.sync()
            self.time["attention"] += time.perf_counter() - t0
            if name == "paged_attention":
                query, context_lens = args[0], args[4]
                self.flops["attention"] += (4 * float(context_lens.sum()) * query.shape[1]
                                            * query.shape[2])
            return out
        return wrapper

    def _linear_start(self, module, inputs):
        self._depth += 1
        if self._depth == 1:  # (a linear inside a FusedColumns call is the call's)
            self.sync()
            self._started[id(module)] = time.perf_counter()

    def _linear_end(self, module, inputs, output):
        self._depth -= 1
        if self._depth:
            return
        self.sync()
        self.time["linear"] += time.perf_counter() - self._started.pop(id(module))
        # weights (out, in) or, transposed, (in, out): in * out either way
        weights = (sum(l.weight.numel() for l in module.linears)
                   if isinstance(module, FusedColumns) else module.weight.numel())
        rows = inputs[0].numel() // inputs[0].shape[-1]
        self.flops["linear"] += 2.0 * rows * weights

    def _timed_logits(self, hidden):
        self.sync()
        t0 = time.perf_counter()
        logits = self._compute_logits(hidden)  # (R, vocab)
        self.sync()
        self.time["linear"] += time.perf_counter() - t0
        self.flops["linear"] += 2.0 * hidden.shape[0] * hidden.shape[1] * logits.shape[-1]
        return logits

    def remove(self):
        for name, fn in self._originals.items():
            setattr(ops, name, fn)
        for hook in self._hooks:
            hook.remove()
        del self._model.compute_logits  # back to the class's method


@contextlib.contextmanager
def _wrapped(obj, name: str, wrap: Callable):
    """``obj.name`` replaced by ``wrap(original)`` for the duration, then put back."""
    original = getattr(obj, name)
    own = name in vars(obj)  # an instance attribute (not the class's method) to restore
    setattr(obj, name, wrap(original))
    try:
        yield
    finally:
        if own:
            setattr(obj, name, original)
        else:
            delattr(obj, name)


class _Sections:
    """Synchronised clock marks around the engine's seams: each section closes with a sync.

    A section may run several times in a step (the k model calls of a multi-step decode): its
    time is the sum of its runs, its "start" mark the first run's and its "end" mark the last's.
    """

    def __init__(self, sync: Callable[[], None]):
        self.sync = sync
        self.marks: dict[str, float] = {}
        self.spans: dict[str, float] = {}  # this step's time in each section
        self.total: dict[str, float] = {}

    def mark(self, name: str) -> None:
        self.sync()
        self.marks[name] = time.perf_counter()

    def add(self, section: str, seconds: float) -> None:
        self.spans[section] = self.spans.get(section, 0.0) + seconds

    def around(self, section: str) -> Callable:
        def wrap(fn):
            def timed(*args, **kwargs):
                self.sync()
                t0 = time.perf_counter()
                self.marks.setdefault(f"{section} start", t0)  # (the first run's)
                out = fn(*args, **kwargs)
                self.mark(f"{section} end")
                self.add(section, self.marks[f"{section} end"] - t0)
                return out
            return timed
        return wrap

    def after(self, section: str, since: str) -> Callable:
        """A wrapper whose call ends ``section``, begun when ``since`` last ended (multi-step
        decode's greedy choice: from the model call's end until its copy is launched)."""
        def wrap(fn):
            def timed(*args, **kwargs):
                out = fn(*args, **kwargs)
                self.mark(f"{section} end")
                self.add(section, self.marks[f"{section} end"] - self.marks[f"{since} end"])
                return out
            return timed
        return wrap

    def add_step(self) -> None:
        """Charge the step just marked to its sections."""
        m = self.marks
        last = max(m["model end"], m.get("sample end", m["model end"]))  # (sampled after)
        spans = {"schedule": self.spans["schedule"],
                 "prepare": m["model start"] - m["schedule end"],
                 "model": self.spans["model"],
                 "sample": self.spans.get("sample", 0.0),
                 "update": m["step end"] - last,
                 "step": m["step end"] - m["step start"]}
        for k, v in spans.items():
            self.total[k] = self.total.get(k, 0.0) + v
        self.marks, self.spans = {}, {}


def decode_step_breakdown(llm, prompts: list[list[int]], num_steps: int = 4,
                          sync: Callable[[], None] | None = None) -> dict:
    """Seconds per decode-only step of ``len(prompts)`` sequences, by section, and useful FLOPs.

    Args:
        llm: an ``LLM`` with one worker in this process (no tensor parallelism).
        prompts: one prompt (token ids) per sequence.
        num_steps: ``step()`` calls timed (after the prompts and one warm-up call); each runs
            one decode step, or up to k with multi-step decode.
        sync: waits for the device's queued work (default: ``torch.cuda.synchronize`` on CUDA,
            nothing on the CPU); every section is closed by it.

    Returns:
        seconds per decode step of "step", "schedule", "prepare", "model", "attention",
        "linear", "other model" (these three None under CUDA graphs), "sample", "update",
        "python", and "num_seqs", "flops" (useful FLOPs per decode step), "graphs" (whether the
        model replayed a CUDA graph), "decode_steps" (how many the timed calls ran).
    """
    from minipaged.engine import multi_step

    engine = llm.llm_engine
    sync = sync or device_sync(engine.device)
    k = engine.multi_step.num_steps  # decode steps per step() call at most (num_scheduler_steps)
    # the prompt's token, then k per call: the warm-up's and the timed calls' (all run k steps
    # where max_model_len leaves room)
    params = SamplingParams(temperature=0.0, max_tokens=1 + k * (num_steps + 1), ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"breakdown-{i}", None, params, prompt_token_ids=prompt)
    while engine.scheduler.waiting:
        engine.step()  # the prompt steps
    engine.step()  # one decode to warm up
    graph_runner = getattr(engine.worker.model_runner, "graph_runner", None)
    replays_before = graph_runner.replays if graph_runner is not None else 0
    later_before = engine.multi_step.num_later_steps
    sections = _Sections(sync)
    tools = _Instruments(engine.worker.model, sync)
    try:
        with _wrapped(engine.scheduler, "schedule", sections.around("schedule")), \
                _wrapped(engine.worker, "execute_model", sections.around("model")), \
                _wrapped(engine, "sampler", sections.around("sample")), \
                _wrapped(multi_step, "to_host_soon", sections.after("sample", since="model")):
            for _ in range(num_steps):
                sections.mark("step start")
                engine.step()
                sections.mark("step end")
                sections.add_step()
    finally:
        tools.remove()
    while engine.has_unfinished_requests():
        engine.step()
    decode_steps = num_steps + engine.multi_step.num_later_steps - later_before
    per = {name: v / decode_steps for name, v in sections.total.items()}
    graphs = (graph_runner is not None and graph_runner.capture
              and graph_runner.replays - replays_before == decode_steps)
    result = {"num_seqs": len(prompts), "graphs": graphs, "decode_steps": decode_steps, **per,
              "flops": (tools.flops["attention"] + tools.flops["linear"]) / decode_steps}
    if graphs:  # one replay: nothing inside it was timed, and nothing is claimed
        result.update({"attention": None, "linear": None, "other model": None})
        result["flops"] = _decode_flops(engine, prompts, decode_steps, 1 + k)
    else:
        result["attention"] = tools.time["attention"] / decode_steps
        result["linear"] = tools.time["linear"] / decode_steps
        result["other model"] = per["model"] - result["attention"] - result["linear"]
    parts = ("schedule", "prepare", "model", "sample", "update")
    result["python"] = per["step"] - sum(per[p] for p in parts)
    return result


def _decode_flops(engine, prompts: list[list[int]], num_steps: int, before: int) -> float:
    """Useful FLOPs per timed decode step, counted (``roofline.decode_step``) where nothing could
    be instrumented (a graph replay). Timed decode step ``i`` attends to ``len(prompt) + before
    + i`` tokens: the prompt, the ``before`` tokens generated before the timed steps (its first
    and the warm-up call's), and the ``i`` steps before it."""
    from minipaged.lab.roofline import decode_step
    from minipaged.model_shape import ModelShape

    dims = ModelShape.from_hf(engine.hf_config)
    total = sum(decode_step(dims, 1, len(p) + before + i, 4).flops
                for p in prompts for i in range(num_steps))
    return total / num_steps


def format_decode_breakdown(b: dict, peak: float) -> str:
    """One paragraph: each section's milliseconds and share, and the FLOPs achieved."""
    if b["graphs"]:
        keys = ("model", "sample", "schedule", "prepare", "update", "python")
    else:
        keys = ("attention", "linear", "other model", "sample", "schedule", "prepare", "update",
                "python")
    names = {"model": "model (one CUDA graph replay)"}
    cells = ", ".join(f"{names.get(k, k)} {1000 * b[k]:.1f} ms ({100 * b[k] / b['step']:.0f} %)"
                      for k in keys)
    achieved = b["flops"] / b["step"]
    how = ("the step's model is one graph replay, so it is not split (enforce_eager=True splits "
           "it)" if b["graphs"] else "the timers synchronise around each linear layer and "
           "attention op, so the instrumented step is a little slower than an untimed one")
    return (f"one decode step of {b['num_seqs']} sequences: {1000 * b['step']:.1f} ms = {cells}. "
            f"Useful work {b['flops'] / 1e9:.3g} GFLOP per step = {achieved / 1e9:.3g} GFLOP/s, "
            f"{100 * achieved / peak:.0f} % of the measured matmul peak ({peak / 1e9:.1f} GFLOP/s, "
            f"one 2048x2048 matmul, same dtype and threads). Each section ends with a device "
            f"synchronisation, so it is charged the work it launched; {how}.")
