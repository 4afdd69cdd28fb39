"""Lesson 16, the capstone's verdict in words: what a run of ``LLM()`` went through (preemptions by
recompute and by swap, copy-on-write copies, prompts in chunks, aborts, stop strings, cached prompt
tokens, accepted drafts, the sampling rules its requests use, the steps the sequence limit held a
request back), so that the tick lists what the workload covered. ``result`` is a
``capstone.RunResult``."""
from __future__ import annotations

from minipaged.exercises.capstone_steps import Request


def count_of(number: int, thing: str) -> str:
    plural = thing[:-1] + "ies" if thing.endswith("y") else thing + "s"
    return f"{number} {thing if number == 1 else plural}"


def in_words(names) -> str:
    names = list(names)
    return ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else "".join(names)


def what_happened(result) -> str:
    """What LLM()'s run went through: the events the run exists for."""
    snapshots = [s.snapshot for s in result.expected]
    stats = result.expected[-1].state["stats"] if result.expected else {}
    modes = [mode for snap in snapshots for _, mode in snap.preempted]
    copies = sum(len(d) for snap in snapshots for d in snap.blocks_to_copy.values())
    parts = []
    if modes:
        parts.append(f"{count_of(len(modes), 'preemption')} ({modes.count('recompute')} by "
                     f"recompute, {modes.count('swap')} by swap)")
    if copies:
        parts.append(count_of(copies, "copy-on-write copy"))
    prompts = [{rid for rid, prompt in zip(snap.scheduled, snap.prompt_run) if prompt}
               for snap in snapshots]
    chunked = set().union(*(a & b for a, b in zip(prompts, prompts[1:])))  # two steps running
    if chunked:
        parts.append(f"{count_of(len(chunked), 'prompt')} run in chunks")
    finals = result.expected[-1].outputs if result.expected else {}
    reasons = [c.finish_reason for o in finals.values() for c in o.outputs]
    if reasons.count("abort"):
        parts.append(count_of(reasons.count("abort"), "abort"))
    stopped = sum(1 for i, o in finals.items() for c in o.outputs if c.finish_reason == "stop"
                  and result.workload[int(i)].params.stop_strings)
    if stopped:
        parts.append(count_of(stopped, "stop string"))
    if stats.get("num_cached_prompt_tokens"):
        parts.append(f"{stats['num_cached_prompt_tokens']} prompt tokens from the prefix cache")
    if stats.get("num_spec_proposed_tokens"):
        parts.append(f"{stats['num_spec_accepted_tokens']} of "
                     f"{stats['num_spec_proposed_tokens']} drafted tokens accepted")
    parts += sampling_covered(result.workload)
    held = held_by_the_limit(result)
    if held:
        parts.append(f"the sequence limit ({result.settings['max_num_seqs']}) held a request "
                     f"back at {count_of(held, 'step')}")
    if result.run.note:
        parts.append(result.run.note)
    return ", ".join(parts) or "nothing of note"


def sampling_covered(workload: list[Request]) -> list[str]:
    """The sampling rules the run's requests use, in words."""
    params = [r.params for r in workload]
    rules = {"presence and frequency penalties": any(p.presence_penalty or p.frequency_penalty
                                                     for p in params),
             "top-k": any(p.top_k > 0 for p in params),
             "top-p": any(p.top_p < 1 for p in params),
             "logprobs": any(p.logprobs for p in params),
             "n > 1": any(p.n > 1 and not p.use_beam_search for p in params),
             "beam search": any(p.use_beam_search for p in params)}
    used = [rule for rule, there in rules.items() if there]
    return [f"sampling with {in_words(used)}"] if used else []


def held_by_the_limit(result) -> int:
    """Steps after which the oldest waiting request did not fit beside the running sequences
    under ``max_num_seqs`` (LLM()'s run)."""
    limit = result.settings.get("max_num_seqs")
    if not limit:
        return 0
    held = 0
    for stepped in result.expected:
        state = stepped.state
        waiting = state["queues"]["waiting"]
        if not waiting:
            continue
        running = sum(s["status"] == "RUNNING" for s in state["sequences"].values())
        first = sum(s["request"] == waiting[0] and not s["status"].startswith("FINISHED")
                    for s in state["sequences"].values())
        held += running + first > limit
    return held
