"""``quantization="gguf"``: a LLaMA or Gemma 3 GGUF file's weights held as its blocks (issue 58). A
tiny random LLaMA written as GGUF (Q4_1 layers, Q8_0 embedding and head), and a tiny Gemma 3 (Q5_0
q, k, gate and up, Q8_0 v, down and embedding, as Gemma 3 270M's file mixes them), give, read as
stored, the logits of the same file converted through transformers to float32, within float
tolerance, and transformers' greedy tokens; a file with a block format minipaged does not read
is refused by name before any weight loads."""
import os
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from minipaged import LLM, SamplingParams
from minipaged.engine.llm_engine import LLMEngine
from minipaged.models import gguf_linear
from minipaged.models.gguf_linear import GGUFWeight
from minipaged.worker import checkpoint
from minipaged.worker.gguf_loader import quantized_weights, tensor_bytes
from paged_forward import teacher_forced_logits
from minipaged.lab.tiny_gguf import save_tiny_gguf
from tiny_models import greedy_reference, pick_prompts

gguf = pytest.importorskip("gguf")


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch):
    """The tiny files' configs and conversions in a folder of their own, never the user's cache
    (which keeps the compiled op: ``MINIPAGED_CACHE`` would build it again)."""
    folder = tmp_path_factory.getbasetemp() / "gguf_cache"
    monkeypatch.setattr(checkpoint, "cache_root", lambda: folder)
    monkeypatch.setattr(gguf_linear, "choices", {})
    monkeypatch.delenv("MINIPAGED_GGUF_ROUTINE", raising=False)


def _file_and_reference(folder, **how):
    """(a tiny random model saved as GGUF by ``save_tiny_gguf(**how)``, transformers' model read
    from that file)."""
    from transformers import AutoModelForCausalLM

    path, _ = save_tiny_gguf(str(folder), **how)
    reference = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file="tiny.gguf",
                                                     dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None
    return path, reference


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    """(the GGUF file, transformers' model read from it) of a tiny random LLaMA."""
    return _file_and_reference(tmp_path_factory.mktemp("tiny_gguf"), seed=3)


def _assert_logits_agree(quantized, float32, reference, prompts):
    """Teacher-forced logits of the blocks' engine equal the float32 path's and transformers'
    within float tolerance."""
    ours = teacher_forced_logits(quantized, prompts, num_prefill=9, block_size=4)
    theirs = teacher_forced_logits(float32, prompts, num_prefill=9, block_size=4)
    for p, a, b in zip(prompts, ours, theirs):
        with torch.no_grad():
            ref = reference(torch.tensor([p])).logits[0]
        assert ref.abs().max() > 1.0
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(a, ref, atol=2e-4, rtol=1e-4)


SETTINGS = dict(block_size=4, num_gpu_blocks=64, max_model_len=256, dtype="float32")


@pytest.mark.parametrize("routine", [None, "cpp", "int4pack", "dequant"])
def test_logits_equal_the_float32_path_within_float_tolerance(tiny_file, routine, monkeypatch):
    path, reference = tiny_file
    if routine is not None:
        monkeypatch.setenv("MINIPAGED_GGUF_ROUTINE", routine)
    quantized = LLMEngine(path, quantization="gguf", **SETTINGS)
    float32 = LLMEngine(path, **SETTINGS)
    weights = quantized_weights(quantized.worker.model)
    assert {w.fmt.name for w in weights} == {"Q4_1", "Q8_0"}
    if routine is not None:
        assert any(w.routine == routine for w in weights)  # (where the routine can run)
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 256) for _ in range(n)] for n in (21, 14, 17)]
    _assert_logits_agree(quantized, float32, reference, prompts)


def test_greedy_tokens_equal_transformers_on_the_file(tiny_file):
    path, reference = tiny_file
    prompts = pick_prompts(reference, [13, 18], 10, seed=4)
    expected = [greedy_reference(reference, p, 10) for p in prompts]
    llm = LLM(path, quantization="gguf", seed=0, **SETTINGS)
    outs = llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                        sampling_params=SamplingParams(temperature=0, max_tokens=10,
                                                       ignore_eos=True))
    assert [list(o.outputs[0].token_ids) for o in outs] == expected


def test_the_model_holds_blocks_not_float32(tiny_file):
    path, _ = tiny_file
    model = LLMEngine(path, quantization="gguf", **SETTINGS).worker.model
    float_model = LLMEngine(path, **SETTINGS).worker.model
    assert not any(p.dim() == 2 for p in model.parameters())  # only the norms are parameters
    layer = model.layers[0]
    assert isinstance(layer.self_attn.qkv.weight, GGUFWeight)
    assert layer.self_attn.qkv.fused  # q, k, v: views of the fused blocks' rows
    blocks = sum(t.nbytes for w in quantized_weights(model) for t in w.tensors())
    floats = sum(p.nbytes for p in float_model.parameters() if p.dim() == 2)
    assert blocks < floats / 4
    assert tensor_bytes(model) < tensor_bytes(float_model) / 2


@pytest.fixture(scope="module")
def tiny_gemma_file(tmp_path_factory):
    """(the GGUF file, transformers' model read from it) of a tiny random Gemma 3."""
    return _file_and_reference(tmp_path_factory.mktemp("tiny_gemma_gguf"), seed=5,
                               family="gemma3", layers="Q5_0",
                               formats={"attn_v": "Q8_0", "ffn_down": "Q8_0"})


@pytest.mark.slow  # (three engines and transformers' conversion: 20-70 s on two cores)
def test_a_gemma3_file_gives_transformers_logits_and_tokens(tiny_gemma_file):
    path, reference = tiny_gemma_file
    quantized = LLMEngine(path, quantization="gguf", **SETTINGS)
    float32 = LLMEngine(path, **SETTINGS)
    model = quantized.worker.model
    assert {w.fmt.name for w in quantized_weights(model)} == {"Q5_0", "Q8_0"}
    layer = model.layers[0]
    assert not layer.self_attn.qkv.fused and layer.self_attn.qkv.weight is None  # (Q5_0, Q8_0)
    assert layer.mlp.gate_up.fused  # (both Q5_0: one weight of blocks)
    # Gemma's norms: the file's 1 + weight read back as the offset, as transformers holds it
    torch.testing.assert_close(layer.pre_feedforward_layernorm.weight,
                               reference.model.layers[0].pre_feedforward_layernorm.weight,
                               atol=0, rtol=0)
    rng = random.Random(1)
    _assert_logits_agree(quantized, float32, reference,
                         [[rng.randrange(2, 256) for _ in range(n)] for n in (21, 14)])
    prompts = pick_prompts(reference, [13, 18], 10, seed=4)
    expected = [greedy_reference(reference, p, 10) for p in prompts]
    outs = LLM(path, quantization="gguf", seed=0, **SETTINGS).generate(
        prompt_token_ids=prompts, use_tqdm=False,
        sampling_params=SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert [list(o.outputs[0].token_ids) for o in outs] == expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_half_precision_model_reads_its_blocks_as_the_float_path_does(tiny_file, dtype):
    """In bfloat16 or float16 the embedding's rows and every matmul come in the model's dtype
    (the embedding's rows came in float32, and the first step's cache write raised), and the
    logits are the float path's in that dtype: the same weights, rounded once to it."""
    path, reference = tiny_file
    settings = {**SETTINGS, "dtype": str(dtype).removeprefix("torch.")}
    blocks = LLMEngine(path, quantization="gguf", **settings)
    floats = LLMEngine(path, quantization="none", **settings)
    prompts = pick_prompts(reference, [13, 18, 9], 10, seed=5)
    ours = teacher_forced_logits(blocks, prompts, num_prefill=9, block_size=4)
    theirs = teacher_forced_logits(floats, prompts, num_prefill=9, block_size=4)
    for a, b in zip(ours, theirs):
        assert a.dtype == dtype and b.abs().max() > 1.0
        ulp = torch.finfo(dtype).eps * b.abs().max().item()  # (bit-equal on a Zen 3)
        torch.testing.assert_close(a.float(), b.float(), atol=4 * ulp, rtol=0)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    runs = [LLM(path, quantization=q, **settings).generate(
        prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False)
        for q in ("gguf", "none")]
    assert ([o.outputs[0].token_ids for o in runs[0]]
            == [o.outputs[0].token_ids for o in runs[1]])


def test_a_block_format_not_read_is_named_before_any_weight_loads(tmp_path):
    path, _ = save_tiny_gguf(str(tmp_path), seed=3, layers="Q5_1")
    from minipaged.worker import gguf_loader

    loads = []
    real_setattr = gguf_loader.GGUFWeight.__init__
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_loader.GGUFWeight, "__init__",
                   lambda *a, **k: loads.append(1) or real_setattr(*a, **k))
        with pytest.raises(ValueError, match=r"tensor 'blk.0.attn_q.weight': GGUF block format "
                                             r"Q5_1 is not supported: minipaged reads Q8_0, "
                                             r"Q4_1, Q5_0, Q4_K, Q6_K"):
            LLM(path, quantization="gguf", **SETTINGS)
    assert loads == []


def test_quantization_needs_a_gguf_file(tiny_llama):
    path, _ = tiny_llama
    with pytest.raises(ValueError, match="quantization='gguf' reads a GGUF file"):
        LLM(path, quantization="gguf")
    with pytest.raises(ValueError, match="quantization must be None, 'gguf' or 'none'"):
        LLM(path, quantization="awq")
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        LLM(path, quantization="gguf", tensor_parallel_size=2)


def _damaged(folder, good: str, how: str) -> str:
    """A copy of the GGUF file ``good`` damaged as ``how`` says, in ``folder``/``how``."""
    data = open(good, "rb").read()
    damaged = {"empty": b"", "not gguf": b"PK\x03\x04" + data[4:],
               "cut in the header": data[:200], "cut in the data": data[:len(data) // 2],
               "one byte short": data[:-1]}[how]
    target = os.path.join(folder, how.replace(" ", "_"))
    os.makedirs(target, exist_ok=True)
    path = os.path.join(target, "tiny.gguf")
    with open(path, "wb") as f:
        f.write(damaged)
    return path


@pytest.mark.parametrize("quantization", ["gguf", None])
@pytest.mark.parametrize("how, said", [
    ("empty", r"is empty \(0 bytes\), so it is not a GGUF file"),
    ("not gguf", r"is not a GGUF file: it starts with b'PK\\x03\\x04', and a GGUF file with "
                 r"b'GGUF'"),
    ("cut in the header", r"cannot be read as a GGUF file \(200 bytes\): .*cut short inside "
                          r"its header"),
    ("cut in the data", r"is cut short: its header describes tensor data up to byte [\d,]+, "
                        r"and the file has [\d,]+ bytes"),
    ("one byte short", r"is cut short: .* up to byte ([\d,]+), and the file has [\d,]+ bytes"),
])
def test_a_damaged_file_is_named_with_what_is_wrong_before_anything_reads_it(
        tmp_path, tiny_file, quantization, how, said):
    """A download cut short, an empty file, another format under the .gguf name: both ways of
    reading the file (as stored, and converted by transformers) say so, nothing deeper."""
    path = _damaged(str(tmp_path), tiny_file[0], how)
    with pytest.raises(ValueError, match=said) as caught:
        LLM(path, quantization=quantization, **SETTINGS)
    assert path in str(caught.value)
    if how == "one byte short":
        assert caught.match(f"up to byte {os.path.getsize(path) + 1:,}")


@settings(max_examples=60, deadline=None)
@given(cut=st.integers(0, 10**6),  # (positions past the end wrap: the header is the first 2 KB)
       flips=st.lists(st.tuples(st.one_of(st.integers(0, 2047), st.integers(0, 10**6)),
                                st.integers(1, 255)), max_size=3))
def test_any_cut_or_flipped_bytes_give_a_reader_or_a_value_error_naming_the_file(
        tmp_path_factory, tiny_file, cut, flips):
    """Whatever is left of the file, or changed in it: a reader, or a ValueError that names the
    file (never the parser's IndexError, struct.error or a reshape)."""
    from minipaged.worker.gguf_file import read_gguf

    data = bytearray(open(tiny_file[0], "rb").read())
    data = data[:cut % (len(data) + 1)]
    for at, xor in flips:
        if data:
            data[at % len(data)] ^= xor
    path = str(tmp_path_factory.mktemp("cut") / "f.gguf")
    with open(path, "wb") as f:
        f.write(bytes(data))
    try:
        reader = read_gguf(path)
    except ValueError as error:
        assert path in str(error)
    else:
        assert reader.tensors is not None


@pytest.mark.parametrize("quantization", ["gguf", None])
def test_a_gguf_path_with_no_file_is_named(tmp_path, quantization):
    """Not "cannot load model ...: could not be fetched from a model hub": the file is missing."""
    missing = str(tmp_path / "gone" / "model.gguf")
    with pytest.raises(FileNotFoundError, match=f"no GGUF file at '{missing}'$"):
        LLM(missing, quantization=quantization, **SETTINGS)
