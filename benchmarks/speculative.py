"""Speculative decoding with n-gram prompt lookup: decode tokens/s with and without, in one run.

    python benchmarks/speculative.py              # embedded SmolLM2-135M-Instruct on the CPU
    python benchmarks/speculative.py --record     # and append the table to RESULTS.md
    python benchmarks/speculative.py --quick --model DIR   # a few tokens (the smoke test)

Two workloads, each as one stream (requests one after another) and as ``--streams`` (8) requests
at once, each run on an engine without speculation and on one with
``speculative_config={"method": "ngram", ...}`` (``--k`` proposed tokens, prompt lookup of the
last ``--lookup-max`` .. ``--lookup-min`` tokens):
  * copying: the chat asks to rewrite, fix or edit a passage (text or code) given in the prompt,
    so the answer repeats long runs of the prompt: the n-gram proposer finds them there;
  * open-ended chat: questions whose answers are not in the prompt.
Greedy (temperature 0), ``--max-tokens`` (160) new tokens at most, the chat template the demo
uses. The greedy outputs with and without speculation are compared token by token (they must be
identical: verification keeps exactly the target's own tokens). The acceptance rate is accepted
/ proposed guesses; the mean accepted length is the tokens a verification emits (the accepted
guesses plus the correction or bonus token), as vLLM reports it. Under the table, each run's
breakdown: steps, tokens per step, time in the model and elsewhere.
"""
from __future__ import annotations

import argparse
import datetime
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from machine import machine_description  # noqa: E402
from minipaged import LLM, SamplingParams  # noqa: E402
from minipaged.entrypoints.prompts import chat_prompt_ids  # noqa: E402

PASSAGES = [
    "The city library opens at nine in the morning and closes at six in the evening, from Monday "
    "to Saturday. Members may borrow up to five books at a time for three weeks, and they can "
    "renew a book twice, online or at the front desk, unless another member has asked for it. "
    "Books that are returned late cost ten cents a day. The reading room on the second floor is "
    "quiet: phones must be silent, and food is not allowed, although a bottle of water is fine. "
    "On Saturday mornings a volunteer reads stories to small children in the garden room, and "
    "on the first Tuesday of every month the library shows an old film in the basement hall.",
    "To make the bread, mix the flour, the salt and the yeast in a large bowl. Add the warm "
    "water slowly and stir until the dough comes together. Knead it on a floured table for ten "
    "minutes, until it is smooth and springs back when you press it with a finger. Put the "
    "dough back in the bowl, cover it with a damp cloth, and leave it to rise in a warm place "
    "for about an hour, until it has doubled in size. Then press the air out, shape it into a "
    "loaf, and let it rise again for half an hour. Bake it for forty minutes in a hot oven, and "
    "let it cool on a rack before you cut it.",
    "def mean(values):\n    total = 0\n    for value in values:\n        total = total + value\n"
    "    return total / len(values)\n\n\ndef variance(values):\n    m = mean(values)\n"
    "    total = 0\n    for value in values:\n        total = total + (value - m) ** 2\n"
    "    return total / len(values)\n\n\ndef normalise(values):\n    m = mean(values)\n"
    "    s = variance(values) ** 0.5\n    result = []\n    for value in values:\n"
    "        result.append((value - m) / s)\n    return result\n",
    "The train to the coast leaves from platform four every hour, on the hour, between six in "
    "the morning and ten at night. The journey takes two hours and ten minutes, with stops in "
    "three small towns, and the last train back leaves the coast at nine in the evening. "
    "Tickets can be bought at the station, on the website or on the train, and children under "
    "twelve travel for half the price. Bicycles are allowed in the first carriage, but only "
    "outside the morning rush, and dogs travel for free if they stay on a lead. In summer an "
    "extra train runs on Sundays, and it is often full, so it is wise to book a seat.",
    "class Counter:\n    def __init__(self):\n        self.counts = {}\n\n"
    "    def add(self, word):\n        if word in self.counts:\n"
    "            self.counts[word] = self.counts[word] + 1\n        else:\n"
    "            self.counts[word] = 1\n\n    def add_all(self, words):\n"
    "        for word in words:\n            self.add(word)\n\n    def count(self, word):\n"
    "        return self.counts.get(word, 0)\n\n    def most_common(self):\n"
    "        return max(self.counts, key=self.counts.get)\n",
    "Our garden has three apple trees, two pear trees and a small plum tree near the fence. "
    "Every autumn we pick the apples on a sunny weekend, store the best ones in the cellar in "
    "wooden boxes, and cook the rest into jam with a little lemon and cinnamon. The pears ripen "
    "two weeks later, and we eat most of them straight from the tree. The birds usually eat "
    "most of the plums before we can reach them, so last year we covered the tree with a net. "
    "In the spring we plant beans, peas and lettuce along the south wall, where the sun stays "
    "longest, and the children grow sunflowers by the gate.",
]
COPY_TASKS = [
    "Rewrite the following text exactly, but replace every number with digits:\n\n{}",
    "Fix any mistakes in the following and return the full text unchanged otherwise:\n\n{}",
    "Repeat the following passage word for word, then add one sentence at the end:\n\n{}",
    "Rename the variable 'total' to 'acc' in this code and return the whole code:\n\n{}",
    "Add a short comment above each method of this code and return the whole code:\n\n{}",
]
QUESTIONS = [
    "Write a short story about a robot who learns to paint.",
    "What are some good ways to stay focused while studying?",
    "Describe your ideal weekend in a few sentences.",
    "Explain why the sky looks blue to a ten-year-old.",
    "Give me ideas for a birthday party for a friend who loves music.",
    "What would you pack for a week-long hiking trip, and why?",
    "Write a poem about the sea in winter.",
    "How would you explain the internet to someone from the year 1800?",
]


def copying_prompts(n: int) -> list[list[dict]]:
    pairs = [(t, p) for p in range(len(PASSAGES)) for t in range(len(COPY_TASKS))
             if ("def " in PASSAGES[p] or "class " in PASSAGES[p]) == ("code" in COPY_TASKS[t])]
    random.Random(0).shuffle(pairs)
    return [[{"role": "user", "content": COPY_TASKS[t].format(PASSAGES[p])}]
            for t, p in pairs[:n]]


def chat_prompts(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": q}] for q in QUESTIONS[:n]]


def prompt_ids(llm: LLM, conversations: list[list[dict]], seed: int) -> list[list[int]]:
    """The chat template's token ids; a model without a tokenizer (the smoke test's tiny random
    model) gets random ids, a copying prompt's passage written twice."""
    tok = llm.get_tokenizer()
    if tok is not None and getattr(tok, "chat_template", None):
        return [chat_prompt_ids(tok, c) for c in conversations]
    rng = random.Random(seed)
    vocab = llm.llm_engine.model_shape.vocab_size
    ids = []
    for _ in conversations:
        passage = [rng.randrange(3, vocab) for _ in range(24)]
        ids.append(passage + passage[:12])
    return ids


def measure(llm: LLM, prompts: list[list[int]], streams: int, params) -> dict:
    """Decode ``prompts`` ``streams`` at a time; tokens/s over the whole run."""
    stats = llm.llm_engine.stats
    stats.reset()
    outputs: list[list[int]] = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), streams):
        outs = llm.generate(prompt_token_ids=prompts[i:i + streams], sampling_params=params,
                            use_tqdm=False)
        outputs += [o.outputs[0].token_ids for o in outs]
    wall = time.perf_counter() - t0
    tokens = sum(len(o) for o in outputs)
    return dict(outputs=outputs, wall=wall, tokens=tokens, tokens_per_s=tokens / wall,
                steps=stats.num_steps, proposed=stats.num_spec_proposed_tokens,
                accepted=stats.num_spec_accepted_tokens, emitted=stats.num_spec_emitted_tokens,
                verifications=stats.num_spec_verifications,
                acceptance=stats.spec_acceptance_rate,
                mean_accepted=stats.spec_mean_accepted_length,
                time_model=stats.time_model, time_other=wall - stats.time_model)


def breakdown(name: str, r: dict) -> str:
    spec = ""
    if r["proposed"]:
        spec = (f"; {r['verifications']} verifications: proposed {r['proposed']}, accepted "
                f"{r['accepted']}, emitted {r['emitted']}")
    return (f"  {name}: {r['tokens']} tokens in {r['wall']:.1f} s, {r['steps']} steps "
            f"({r['tokens'] / max(r['steps'], 1):.2f} tokens/step), model {r['time_model']:.1f} s "
            f"+ rest {r['time_other']:.1f} s{spec}")


def format_table(rows: list[dict]) -> str:
    lines = ["| workload | streams | tokens/s without | tokens/s with | speedup | "
             "acceptance rate | mean accepted length | greedy outputs identical |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['streams']} | {r['off']:.1f} | {r['on']:.1f} | "
                     f"{r['on'] / r['off']:.2f}x | {r['acceptance']:.2f} | "
                     f"{r['mean_accepted']:.2f} | {'yes' if r['same'] else 'NO'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup-max", type=int, default=3, help="prompt_lookup_max")
    ap.add_argument("--lookup-min", type=int, default=1, help="prompt_lookup_min")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--streams", type=int, default=8, help="requests at once in the batched run")
    ap.add_argument("--single-requests", type=int, default=2,
                    help="requests decoded one after another in the single-stream run")
    ap.add_argument("--quick", action="store_true", help="a few tokens: the smoke test")
    ap.add_argument("--record", action="store_true", help="append to benchmarks/RESULTS.md")
    args = ap.parse_args(argv)
    if args.quick:
        args.max_tokens, args.streams, args.single_requests = 8, 2, 1

    load_start = os.getloadavg()[0]  # the machine may be shared: say how busy it was
    capability = torch.backends.cpu.get_cpu_capability()
    print(f"{machine_description('cpu')}; CPU capability {capability}; torch {torch.__version__}")
    spec_config = {"method": "ngram", "num_speculative_tokens": args.k,
                   "prompt_lookup_max": args.lookup_max, "prompt_lookup_min": args.lookup_min}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    engines = {False: LLM(args.model), True: LLM(args.model, speculative_config=spec_config)}
    for llm in engines.values():  # warm up: the first steps pay for allocations
        llm.generate(prompt_token_ids=[[5, 6, 7, 5, 6]], sampling_params=SamplingParams(
            temperature=0.0, max_tokens=4), use_tqdm=False)
    rows = []
    n = max(args.streams, args.single_requests)
    workloads = {"copying": prompt_ids(engines[False], copying_prompts(n), 0),
                 "open-ended chat": prompt_ids(engines[False], chat_prompts(n), 1)}
    for workload, prompts in workloads.items():
        for streams, count in ((1, args.single_requests), (args.streams, args.streams)):
            off = measure(engines[False], prompts[:count], streams, params)
            on = measure(engines[True], prompts[:count], streams, params)
            row = dict(workload=workload, streams=streams, off=off["tokens_per_s"],
                       on=on["tokens_per_s"], same=off["outputs"] == on["outputs"],
                       acceptance=on["acceptance"], mean_accepted=on["mean_accepted"])
            rows.append(row)
            print(format_table([row]).splitlines()[-1], flush=True)
            print(breakdown("without", off))
            print(breakdown("with   ", on), flush=True)
    table = format_table(rows)
    same = all(r["same"] for r in rows)
    verdict = ("greedy outputs identical with and without speculation in every run" if same else
               "GREEDY OUTPUTS DIFFER with and without speculation (see the table)")
    load = (f"load average (1 min) {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the "
            f"end, on {os.cpu_count()} cores")
    print()
    print(table)
    print(verdict)
    print(load)
    if args.record:
        path = os.path.join(os.path.dirname(__file__), "RESULTS.md")
        command = "python benchmarks/speculative.py " + " ".join(sys.argv[1:])
        text = (f"\n## Speculative decoding, n-gram prompt lookup: "
                f"{args.model or 'SmolLM2-135M-Instruct'}, CPU ({datetime.date.today()})\n\n"
                f"- machine: {machine_description('cpu')}, capability {capability}\n"
                f"- versions: torch {torch.__version__}\n"
                f"- speculation: k = {args.k} proposed tokens, prompt lookup of the last "
                f"{args.lookup_max}..{args.lookup_min} tokens; greedy, at most {args.max_tokens} "
                f"new tokens, chat template\n"
                f"- streams 1: {args.single_requests} request(s) one after another; streams "
                f"{args.streams}: {args.streams} requests at once\n"
                f"- {verdict}\n"
                f"- {load}\n"
                f"- command: `{command.strip()}`\n\n{table}\n")
        with open(path, "a") as f:
            f.write(text)
        print(f"recorded in {path}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
