"""The embedded SmolLM2-135M-Instruct on a GPU: the engine's greedy text against transformers'.

Stage 6 of ``scripts/gpu_check.sh``, once the GGUF file has been carried to the machine and
reassembled (``scripts/carry_embedded.sh``). For fp16 and bf16, the same chat prompts run through
``LLM`` (paged KV cache, our CUDA kernels, CUDA graphs) and through transformers' ``generate``
(its own attention), greedy, and the token ids are compared.

Real weights have few near-ties, but half precision rounds differently in two implementations, so
a divergence can be legitimate. The check passes when every prompt's first ``--must-agree``
tokens are identical in both dtypes, or where they part, the two tokens are a near-tie: their
logits in a float32 run of transformers (same prefix) differ by less than two steps of the
dtype's rounding at that size (bf16 keeps 8 significant bits: at logit 28 a step is 0.125, and
the first run on an H200 met 'The' 28.674 against '1' 28.564, both 28.625 in bf16). The report
gives each prompt's agreeing prefix, and the float32 margin where they part.

    python3 scripts/embedded_vs_hf.py [--max-tokens 32] [--must-agree 8]
    python3 scripts/embedded_vs_hf.py --device cpu --dtypes float32 --max-tokens 4   # the script
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from minipaged import LLM, SamplingParams  # noqa: E402
from minipaged.worker.checkpoint import embedded_model_dir  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Explain in one sentence what a KV cache is.", "List three primary colours.",
             "What is 12 times 12?", "Say hello in Spanish and in German."]


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def rounding_step(value: float, dtype: torch.dtype) -> float:
    """The spacing of ``dtype``'s numbers next to ``value`` (one unit in the last place)."""
    v = torch.tensor(abs(value), dtype=dtype)
    return (torch.nextafter(v, torch.tensor(float("inf"), dtype=dtype)) - v).item()


def near_tie(reference, prefix: list[int], ours: int, theirs: int, dtype: torch.dtype,
             device: str) -> tuple[bool, float, float]:
    """Whether tokens ``ours`` and ``theirs`` after ``prefix`` are a near-tie in float32:
    (verdict, margin, two rounding steps of ``dtype`` at that logit)."""
    with torch.inference_mode():
        logits = reference(torch.tensor([prefix], device=device)).logits[0, -1].float()
    a, b = logits[ours].item(), logits[theirs].item()
    allowed = 2 * rounding_step(max(abs(a), abs(b)), dtype)
    return abs(a - b) < allowed, abs(a - b), allowed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--must-agree", type=int, default=8)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"])
    args = ap.parse_args(argv)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("embedded_vs_hf.py: needs a CUDA GPU (or --device cpu, to try the script)")
        return 1
    from transformers import AutoModelForCausalLM

    path = embedded_model_dir()  # (converted from the GGUF once; then cached)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    ok = True
    for dtype in args.dtypes:
        with LLM(path, dtype=dtype, device=device, max_model_len=512, num_gpu_blocks=256,
                 max_num_seqs=len(QUESTIONS)) as llm:
            outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS],
                            SamplingParams(temperature=0.0, max_tokens=args.max_tokens),
                            use_tqdm=False)
            eos = sorted(llm.llm_engine.eos_token_ids)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
        hf = hf.to(device).eval()
        print(f"{dtype}:")
        for question, out in zip(QUESTIONS, outs):
            ids = out.prompt_token_ids
            with torch.inference_mode():
                full = hf.generate(torch.tensor([ids], device=device),
                                   attention_mask=torch.ones(1, len(ids), device=device,
                                                             dtype=torch.long),
                                   max_new_tokens=args.max_tokens, do_sample=False,
                                   eos_token_id=eos, pad_token_id=eos[0])
            theirs = full[0, len(ids):].tolist()
            ours = list(out.outputs[0].token_ids)
            same = agreeing_prefix(ours, theirs)
            verdict = "identical" if ours == theirs else f"first {same} tokens agree"
            if same < min(args.must_agree, len(ours), len(theirs)):
                tie, margin, allowed = near_tie(reference, ids + ours[:same], ours[same],
                                                theirs[same], getattr(torch, dtype), device)
                verdict += (f"; then a near-tie in float32 ({margin:.3f} apart, under two "
                            f"{dtype} steps, {allowed:.3f})" if tie else
                            f"; then NOT a near-tie in float32 ({margin:.3f} apart, two {dtype} "
                            f"steps are {allowed:.3f})")
                ok &= tie
            print(f"  {question!r}: {verdict} ({len(ours)} tokens ours, {len(theirs)} "
                  f"transformers'): {out.outputs[0].text!r}")
        del hf
        if device == "cuda":
            torch.cuda.empty_cache()
    print("PASS" if ok else f"FAIL: some prompt's first {args.must_agree} tokens differ")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
