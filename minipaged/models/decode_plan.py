"""A decode step's layers as direct kernel calls: the same kernels, without the Python between.

A decode step of the embedded SmolLM2 runs 30 layers, each a dozen small kernels (two norms,
four matmuls, rotary, the cache write, attention, SiLU-and-multiply, the residual adds). On the
CPU the kernels of one layer take about 0.3 ms; the Python that reaches them (module calls,
choosing a back-end, checking dtypes, converting the block tables again in every layer) took
about 0.4 ms more: on two cores, more than half of the step was Python (benchmarks/RESULTS.md,
2026-12-07: 13 ms of a 21 ms step of SmolLM2's GGUF).

``DecodePlan`` is what vLLM gets from CUDA graphs, made the plain way: for a step of decode
tokens only, each ``LlamaDecoderLayer`` runs as the same calls of the same compiled functions
(``csrc/cpu/``) with the same arguments, in the same order, that its modules make, looked up
once, and the step's integer tensors (positions, slots, block tables, context lengths)
converted once for all layers. So its hidden states are those of the modules bit for bit
(tests/models/test_decode_plan.py), and ``ops.calls`` counts the kernels as the modules do.

The modules stay the reference: ``LlamaForCausalLM.forward`` runs them whenever the plan does
not apply (``usable``): prompts and chunks, a GPU, dtypes other than float32, the C++ op off or
not built, Gemma 3's layers (their own norms), query/key norms, biases, tensor parallelism, an
8-bit cache, KV cache groups, a learner's component plugged in, a forward or a kernel function
replaced, a forward hook (lesson 15's ``StepBreakdown`` times the modules through hooks), or
the weights changed since the plan was made.
"""
from __future__ import annotations

import weakref

import torch

from minipaged.kernels import build, ops
from minipaged.kernels.cpu_kernels import CpuKernels
from minipaged.models import cpu_matmul
from minipaged.models import llama
from minipaged.models.attention import PagedAttention
from minipaged.models.gguf_linear import CPP_MAX_ROWS, KQUANTS, GGUFWeight
from minipaged.models.parallel_layers import (FusedColumns, RowParallelLinear,
                                              get_tensor_parallel_state)
from minipaged.models.rotary import RotaryEmbedding

SWITCH = "MINIPAGED_DECODE_PLAN"  # "0": every step runs the modules

# The functions the modules' forward passes reach; a plan runs only while each is the original
# (a test or a lesson that replaces one wants its replacement to run)
_ORIGINALS = {
    (ops, "rms_norm"): ops.rms_norm, (ops, "add_rms_norm"): ops.add_rms_norm,
    (ops, "rotary"): ops.rotary, (ops, "silu_and_mul"): ops.silu_and_mul,
    (ops, "reshape_and_cache"): ops.reshape_and_cache,
    (ops, "paged_attention"): ops.paged_attention, (cpu_matmul, "linear"): cpu_matmul.linear,
}
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its DecodePlan
_CLASSES = (llama.LlamaDecoderLayer, llama.LlamaAttention, llama.LlamaMLP, llama.RMSNorm,
            RotaryEmbedding, PagedAttention, FusedColumns, RowParallelLinear)
_FORWARDS = {cls: cls.forward for cls in _CLASSES}
_MODEL_FORWARD = llama.LlamaForCausalLM.forward


def _originals_in_place() -> bool:
    """Whether every kernel function and forward the plan stands for is the original one, and
    no forward hook is registered for all modules."""
    from torch.nn.modules import module as torch_module

    return (all(getattr(owner, name) is f for (owner, name), f in _ORIGINALS.items())
            and all(cls.forward is f for cls, f in _FORWARDS.items())
            and ops.DECODE_STAND_IN is None
            and not (torch_module._global_forward_hooks
                     or torch_module._global_forward_pre_hooks))


def _linear_call(weight, sizes: list[int] | None, kernels):
    """A function ``x -> x W^T`` (split into ``sizes`` when given) by the routine
    ``cpu_matmul.linear`` would run: for one row of a GGUF weight whose routine is ``cpp``, the
    C++ op at once; otherwise ``cpu_matmul.linear`` itself (its own choice per shape and rows)."""
    if isinstance(weight, GGUFWeight) and weight.routine == "cpp" and weight.runs("cpp"):
        op = (kernels.module.gguf_kquant_linear if weight.fmt.name in KQUANTS
              else kernels.module.gguf_linear)
        blocks, code, linear = weight.blocks, weight.fmt.ggml_type, weight.linear

        def one_row_at_once(x):
            return op(x, blocks, code) if x.shape[0] == 1 else linear(x)

        if sizes is None:
            return one_row_at_once
        return lambda x: one_row_at_once(x).split(sizes, dim=-1)
    if sizes is None:
        return lambda x: cpu_matmul.linear(x, weight)
    return lambda x: cpu_matmul.linear(x, weight).split(sizes, dim=-1)


class LayerPlan:
    """One ``LlamaDecoderLayer``'s decode as direct calls, or ``why`` it cannot be one."""

    def __init__(self, layer, kernels) -> None:
        self.why = _unplannable(layer)
        if self.why:
            return
        attn, mlp = layer.self_attn, layer.mlp
        self.layer = layer
        self.kernels = kernels
        self.modules = [layer, attn, mlp, layer.input_layernorm, layer.post_attention_layernorm,
                        attn.qkv, attn.o_proj, attn.rotary, attn.attn, mlp.gate_up,
                        mlp.down_proj]
        # what the plan read, checked before each step: the same objects still in place
        self.guards = [(attn, "qkv", attn.qkv), (attn, "o_proj", attn.o_proj),
                       (attn, "rotary", attn.rotary), (attn, "attn", attn.attn),
                       (mlp, "gate_up", mlp.gate_up), (mlp, "down_proj", mlp.down_proj),
                       (layer, "self_attn", attn), (layer, "mlp", mlp),
                       (attn.qkv, "weight", attn.qkv.weight),
                       (mlp.gate_up, "weight", mlp.gate_up.weight),
                       (attn.o_proj, "weight", attn.o_proj.weight),
                       (mlp.down_proj, "weight", mlp.down_proj.weight),
                       (layer.input_layernorm, "weight", layer.input_layernorm.weight),
                       (layer.post_attention_layernorm, "weight",
                        layer.post_attention_layernorm.weight),
                       (attn.rotary, "cos_cache", attn.rotary.cos_cache),
                       (attn.rotary, "sin_cache", attn.rotary.sin_cache)]
        self.guards += [(l, "weight", l.weight) for l in attn.qkv.linears + mlp.gate_up.linears]
        self.routines = [(w, w.routine) for w in (attn.qkv.weight, mlp.gate_up.weight,
                                                  attn.o_proj.weight, mlp.down_proj.weight)
                         if isinstance(w, GGUFWeight)]
        self.qkv = _linear_call(attn.qkv.weight, attn.qkv.sizes, kernels)
        self.o_proj = _linear_call(attn.o_proj.weight, None, kernels)
        self.gate_up = _linear_call(mlp.gate_up.weight, mlp.gate_up.sizes, kernels)
        self.down = _linear_call(mlp.down_proj.weight, None, kernels)
        self.H, self.KVH, self.D = attn.num_heads, attn.num_kv_heads, attn.head_size
        self.norm1 = (layer.input_layernorm.weight.contiguous(), float(layer.input_layernorm.eps))
        self.norm2 = (layer.post_attention_layernorm.weight.contiguous(),
                      float(layer.post_attention_layernorm.eps))
        self.scale = float(attn.attn.scale)
        self.window = attn.attn.sliding_window or 0
        self.cos, self.sin = attn.rotary.cos_cache, attn.rotary.sin_cache  # (guarded above)

    def current(self) -> bool:
        """Whether the layer is still as the plan read it (no module, weight or routine
        replaced, no hook or forward of an instance's own)."""
        return (all(getattr(o, name) is v for o, name, v in self.guards)
                and all(w.routine == r for w, r in self.routines)
                and attn_fused(self.layer)
                and not any(m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__
                            for m in self.modules))

    def run(self, hidden: torch.Tensor, kv_cache, step) -> torch.Tensor:
        """``LlamaDecoderLayer.forward`` for a step of T decode tokens: (T, hidden) -> same."""
        m = self.kernels.module
        T = hidden.shape[0]
        normed = m.rms_norm(hidden, *self.norm1)
        q, k, v = self.qkv(normed)
        q, k = m.rotary(step.positions, q.view(T, self.H, self.D), k.view(T, self.KVH, self.D),
                        self.cos, self.sin)
        key_cache, value_cache = kv_cache
        m.reshape_and_cache(k, v.view(T, self.KVH, self.D), key_cache, value_cache,
                            step.slots)
        out = m.paged_attention(q, key_cache, value_cache, step.block_tables,
                                step.context_lens, self.scale, self.window)
        attended = self.o_proj(out.view(T, self.H * self.D))
        normed, hidden = m.add_rms_norm(attended, hidden, *self.norm2)
        gate, up = self.gate_up(normed)
        return hidden + self.down(m.silu_and_mul(gate, up))


def attn_fused(layer) -> bool:
    """Whether both fused matmuls of the layer still run as one (``FusedColumns.fused``)."""
    return layer.self_attn.qkv.fused and layer.mlp.gate_up.fused


def _unplannable(layer) -> str:
    """Why a plan cannot stand for ``layer``'s modules ("" where it can)."""
    if type(layer) is not llama.LlamaDecoderLayer:
        return f"{type(layer).__name__} is not LlamaDecoderLayer"
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn) is not llama.LlamaAttention or type(mlp) is not llama.LlamaMLP:
        return "its attention or MLP is not LLaMA's"
    if type(attn.attn) is not PagedAttention:
        return "its attention layer is not PagedAttention (a learner's, lesson 07)"
    if attn.qk_norm or attn.kv_group or attn.grouped_cache:
        return "query/key norms or KV cache groups"
    if mlp.act != "silu":
        return f"activation {mlp.act}"
    if any(type(n) is not llama.RMSNorm for n in (layer.input_layernorm,
                                                   layer.post_attention_layernorm)):
        return "its norms are not RMSNorm"
    if (attn.qkv.bias is not None or attn.o_proj.bias is not None
            or mlp.gate_up.bias is not None or mlp.down_proj.bias is not None
            or attn.o_proj.transposed or mlp.down_proj.transposed):
        return "biases or transposed weights"
    if not attn_fused(layer):
        return "its q/k/v or gate/up weights are no longer fused"
    weights = [attn.qkv.weight, attn.o_proj.weight, mlp.gate_up.weight, mlp.down_proj.weight,
               layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
    if any(w.dtype != torch.float32 or w.device.type != "cpu"
           for w in weights if not isinstance(w, GGUFWeight)):
        return "weights not float32 on the CPU"
    if attn.rotary.cos_cache.dtype != torch.float32:
        return "rotary tables not float32"
    return ""


class StepInputs:
    """A decode step's integer tensors, converted once for every layer."""

    def __init__(self, positions: torch.Tensor, meta) -> None:
        self.positions = positions.to(torch.long).contiguous()
        self.slots = meta.slot_mapping.to(torch.long).contiguous()
        self.block_tables = meta.block_tables.to(torch.int32).contiguous()
        self.context_lens = meta.context_lens.to(torch.int32).contiguous()


def forward(model, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta):
    """``model(input_ids, positions, kv_caches, meta)``: the final hidden states (T, hidden),
    by ``model``'s plan where it stands for the layers (``DecodePlan.why`` says why not)."""
    if type(model) is not llama.LlamaForCausalLM or _hooked(model):
        return model(input_ids, positions, kv_caches, meta)
    plan = plan_for(model)
    plan.why = plan.usable(model.norm.weight, input_ids.shape[0], kv_caches, meta)
    if plan.why:
        return model(input_ids, positions, kv_caches, meta)
    hidden = model.embed(input_ids)  # (T, hidden)
    return model.norm(plan.run(positions, hidden, kv_caches, meta))


def _hooked(model) -> bool:
    """Whether the model's own forward was replaced or hooked (the plan runs in its place)."""
    return (model._forward_hooks or model._forward_pre_hooks or "forward" in model.__dict__
            or type(model).forward is not _MODEL_FORWARD)


def plan_for(model) -> DecodePlan:
    """``model``'s plan (one per model, made on first use; not an attribute of the model, so
    that copying or pickling the model never meets the compiled op)."""
    plan = _PLANS.get(model)
    if plan is None:
        plan = _PLANS[model] = DecodePlan(model)
    return plan


class DecodePlan:
    """The plans of a model's layers, made on first use and kept while they stay current."""

    def __init__(self, model) -> None:
        self._model = weakref.ref(model)  # (the plan never keeps its model alive)
        self.kernels = None
        self.layers: list[LayerPlan] = []
        self.why = ""  # why the last step did not use the plan ("" when it did)

    def usable(self, like: torch.Tensor, T: int, kv_caches, meta) -> str:
        """Why a step of T tokens must run the modules ("" where the plan stands for them);
        ``like``: a tensor of the model's (the final norm's weight), for its dtype and device."""
        if not build.switched_on(SWITCH):
            return f"{SWITCH}=0"
        if like.device.type != "cpu" or like.dtype != torch.float32:
            return "not float32 on the CPU"
        if not kv_caches or meta.num_fresh_prompt_tokens or meta.num_chunk_tokens:
            return "prompt or chunk tokens in the step"
        if meta.group_metas is not None:
            return "KV cache groups"
        if T == 0 or T > CPP_MAX_ROWS or meta.context_lens.shape[0] != T:
            return f"{T} decode tokens"
        if get_tensor_parallel_state().world_size != 1:
            return "tensor parallel"
        if any(len(c) != 2 or c[0].dtype != torch.float32 for c in kv_caches):
            return "the KV cache is not float32 (an 8-bit cache)"
        name, kernels = ops._pick(like)  # (the op the modules' kernels would get)
        if name != "cpu" or type(kernels) is not CpuKernels:
            return "the C++ CPU op is off, not built, or stood in for"
        if not _originals_in_place():
            return "a kernel function or a forward was replaced, or a global hook is set"
        layers = self._model().layers
        if kernels is not self.kernels or len(self.layers) != len(layers):
            self.kernels = kernels
            self.layers = [LayerPlan(layer, kernels) for layer in layers]
        for i, plan in enumerate(self.layers):
            if plan.why or plan.layer is not layers[i] or not plan.current():
                plan = self.layers[i] = LayerPlan(layers[i], kernels)
                if plan.why or not plan.current():
                    return plan.why or "a hook or a forward of an instance's own"
        return ""

    def run(self, positions: torch.Tensor, hidden: torch.Tensor, kv_caches, meta):
        """Every layer's decode, in turn: (T, hidden) -> (T, hidden), before the final norm."""
        step = StepInputs(positions, meta)
        counted = ("rms_norm", "rotary", "reshape_and_cache", "paged_attention",
                   "add_rms_norm", "silu_and_mul")
        for plan, cache in zip(self.layers, kv_caches):
            hidden = plan.run(hidden, cache, step)
        for name in counted:  # (as the modules' calls through ops count them)
            ops.calls[name, "cpu"] += len(self.layers)
        return hidden
