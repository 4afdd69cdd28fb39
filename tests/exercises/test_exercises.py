"""Every exercise checker passes the solution and fails plausible wrong answers.

A checker that passed everything would teach nothing; one that failed the solution would block
the learner. Each wrong answer below is a mistake a learner makes (off by one, forgetting K or
V, forgetting shared blocks, preempting the wrong group, ...), and the checker must stop at it
with a short message and a hint, without raising. Unanswered exercises say "not done yet"
(the solution is used only when MINIPAGED_SOLUTIONS=1).
"""
import pytest

from minipaged.exercises import ExerciseFailed, NotDone, not_done, solutions as S
from minipaged.exercises import (lesson01, lesson02, lesson03, lesson04, lesson05, lesson08,
                                 lesson11, lesson13, lesson14)
from repo_paths import ROOT


# ---- plausible wrong answers -------------------------------------------------------------------
def bytes_without_v(num_layers, num_kv_heads, head_size, dtype_bytes):
    return num_layers * num_kv_heads * head_size * dtype_bytes  # forgot the value vectors


def reservation_no_internal(request, num_tokens):
    return {"used": num_tokens, "reserved": request.max_len - num_tokens, "internal": 0}


def paged_off_by_one(num_tokens, block_size):
    blocks = num_tokens // block_size + 1  # one block too many when the last one is exactly full
    return blocks, blocks * block_size - num_tokens


def slot_without_block_size(block_table, position, block_size):
    return block_table[position // block_size] + position % block_size


def grow_off_by_one(block_table, num_tokens, block_size, allocate):
    if num_tokens % block_size == 0:  # should be == 1: the FIRST token of a block opens it
        block_table.append(allocate())


def fork_without_refs(parent_table, ref_counts):
    return list(parent_table)


def append_ignoring_sharing(block_table, ref_counts, needs_new_block):
    return "new block" if needs_new_block else "in place"


def preempt_the_needy(running, num_free):
    kept, preempted = [], []
    for g in running:  # preempts the group that needs the block instead of the newest
        if g.needs_block and num_free == 0:
            preempted.append(g.request_id)
        else:
            num_free -= g.needs_block
            kept.append(g.request_id)
    return kept, preempted


def admit_while_swapped(swapped, waiting, num_free):
    swapped_in, admitted = S.resume_and_admit(swapped, [], num_free)
    num_free -= sum(g.blocks_held + g.needs_block for g in swapped if g.request_id in swapped_in)
    for g in waiting:  # forgets that nothing new is admitted while a group is still swapped
        if g.prompt_blocks > num_free:
            break
        num_free -= g.prompt_blocks
        admitted.append(g.request_id)
    return swapped_in, admitted


def decode_position_off_by_one(seqs):
    ids, pos = S.flat_batch(seqs)
    n_prompt = sum(len(s.token_ids) for s in seqs if s.num_computed_tokens == 0)
    return ids, pos[:n_prompt] + [p + 1 for p in pos[n_prompt:]]


def sample_every_token(seqs):
    return list(range(len(S.flat_batch(seqs)[0])))  # a prompt's every row, not its last


def sample_in_schedule_order(seqs):
    rows, end = [], 0  # decodes and prompts interleaved in the order given, not prompts first
    for s in seqs:
        end += len(s.token_ids) if s.num_computed_tokens == 0 else 1
        rows.append(end - 1)
    return rows


def reduce_missing_a_mask(values, op):
    import numpy as np

    from minipaged.lab.emulator import shfl_xor
    for mask in (8, 4, 2, 1):  # forgot 16: two half-warps each get their own result
        values = (np.add if op == "sum" else np.maximum)(values, shfl_xor(values, mask))
    return values


def naive_key_offset(block, head, dim, slot, num_kv_heads, head_size, block_size, x):
    # the value layout [blocks, heads, head_size, block_size], ignoring x
    return ((block * num_kv_heads + head) * head_size + dim) * block_size + slot


def hash_ignoring_parent(parent_hash, token_ids):
    return hash(tuple(token_ids))  # the same tokens after another prefix get the same name


def hash_of_the_sum(parent_hash, token_ids):
    return hash((parent_hash, sum(token_ids)))  # the order of the tokens is lost


def cached_tokens_with_the_last_block(prompt, cached_names, block_size):
    from minipaged.core.prefix_caching_allocator import block_hash
    parent, count = None, 0
    for i in range(len(prompt) // block_size):  # takes the block of the last token too
        name = block_hash(parent, tuple(prompt[i * block_size:(i + 1) * block_size]))
        if name not in cached_names:
            break
        parent, count = name, count + block_size
    return count


def cached_tokens_unchained(prompt, cached_names, block_size):
    from minipaged.core.prefix_caching_allocator import block_hash
    blocks = range((len(prompt) - 1) // block_size)  # each block named on its own
    return block_size * sum(block_hash(None, tuple(prompt[i * block_size:(i + 1) * block_size]))
                            in cached_names for i in blocks)


def lane_chunks_side_by_side(lane, head_size, block_size, x):
    group_size = max(32 // block_size, 1)  # a lane's chunks next to each other, not strided
    num_chunks = head_size // x
    per_lane = -(-num_chunks // group_size)
    first = lane % group_size * per_lane
    return lane // group_size, [c for c in range(first, first + per_lane) if c < num_chunks]


def lane_chunks_past_the_key(lane, head_size, block_size, x):
    group_size = max(32 // block_size, 1)
    per_lane = -(-(head_size // x) // group_size)  # forgets `if (c < NUM_K_CHUNKS)`
    return lane // group_size, [lane % group_size + k * group_size for k in range(per_lane)]


def delta_without_holdback(sent, text, finished, stop_strings):
    return text[len(sent):]  # sends what a stop string may still cut off


def delta_holding_back_at_the_end(sent, text, finished, stop_strings):
    holdback = max((len(s) for s in stop_strings), default=1) - 1  # even once finished
    return text[len(sent):max(len(sent), len(text) - holdback)]


def metric_by_prefix(metrics_text, name):
    for line in metrics_text.splitlines():
        if line.startswith(name):  # minipaged_num_steps matches minipaged_num_steps_total
            return float(line.split()[-1])
    return None


def metric_ignoring_labels(metrics_text, name):
    for line in metrics_text.splitlines():
        if not line.startswith("#") and line.split("{")[0].split()[0] == name.split("{")[0]:
            return float(line.split()[-1])  # the first label value, whichever was asked
    return None


def shard_ignoring_fused_parts(weight, kind, rank, world_size, parts=None):
    dim = 0 if kind == "column" else 1  # the r-th slice of the whole [q | k | v]
    per_rank = weight.shape[dim] // world_size
    return weight.narrow(dim, rank * per_rank, per_rank)


def shard_on_the_wrong_dimension(weight, kind, rank, world_size, parts=None):
    return S.shard_weight(weight, "row" if kind == "column" else "column", rank, world_size,
                          parts if kind == "row" else None)


def row_parallel_bias_on_every_rank(x, weight, bias, world_size):
    partials, _ = S.row_parallel(x, weight, bias, world_size)
    partials = [p + bias for p in partials]
    return partials, sum(partials)


def row_parallel_without_the_all_reduce(x, weight, bias, world_size):
    partials, _ = S.row_parallel(x, weight, bias, world_size)
    return partials, partials[0] + bias  # rank 0's partial sum alone


CHECKS = [
    (lesson01.check_bytes_per_token, S.bytes_per_token, [bytes_without_v]),
    (lesson01.check_reservation_slots, S.reservation_slots, [reservation_no_internal]),
    (lesson01.check_paged_slots, S.paged_slots, [paged_off_by_one]),
    (lesson02.check_slot_of, S.slot_of, [slot_without_block_size]),
    (lesson02.check_grow_block_table, S.grow_block_table, [grow_off_by_one]),
    (lesson03.check_fork, S.fork, [fork_without_refs]),
    (lesson03.check_append_action, S.append_action, [append_ignoring_sharing]),
    (lesson04.check_schedule_running, S.schedule_running, [preempt_the_needy]),
    (lesson04.check_resume_and_admit, S.resume_and_admit, [admit_while_swapped]),
    (lesson05.check_warp_reduce, S.warp_reduce, [reduce_missing_a_mask]),
    (lesson05.check_key_offset, S.key_offset, [naive_key_offset]),
    (lesson05.check_lane_key_chunks, S.lane_key_chunks,
     [lane_chunks_side_by_side, lane_chunks_past_the_key]),
    (lesson08.check_flat_batch, S.flat_batch, [decode_position_off_by_one]),
    (lesson08.check_sample_indices, S.sample_indices,
     [sample_every_token, sample_in_schedule_order]),
    (lesson11.check_block_hash, S.block_hash, [hash_ignoring_parent, hash_of_the_sum]),
    (lesson11.check_cached_tokens, S.cached_tokens,
     [cached_tokens_with_the_last_block, cached_tokens_unchained]),
    (lesson13.check_stream_delta, S.stream_delta,
     [delta_without_holdback, delta_holding_back_at_the_end]),
    (lesson13.check_metric_value, S.metric_value, [metric_by_prefix, metric_ignoring_labels]),
    (lesson14.check_shard_weight, S.shard_weight,
     [shard_ignoring_fused_parts, shard_on_the_wrong_dimension]),
    (lesson14.check_row_parallel, S.row_parallel,
     [row_parallel_bias_on_every_rank, row_parallel_without_the_all_reduce]),
]
# Each case carries its lesson's marker: `pytest -m lesson03` runs lesson 03's checkers.
CHECKS = [pytest.param(*case, id=case[0].__name__,
                       marks=getattr(pytest.mark, case[0].__module__.rsplit(".", 1)[-1]))
          for case in CHECKS]


@pytest.mark.parametrize("check, solution, wrong", CHECKS)
def test_checker_passes_the_solution_on_other_seeds(check, solution, wrong, monkeypatch):
    monkeypatch.delenv("MINIPAGED_SOLUTIONS", raising=False)
    for seed in (0, 1, 2):
        result = check(solution, seed=seed)
        assert result.passed and "✓" in result


@pytest.mark.parametrize("check, solution, wrong", CHECKS)
def test_checker_fails_a_plausible_wrong_answer_with_a_short_message(check, solution, wrong,
                                                                   capsys):
    """A wrong answer is told in a few lines (the case, yours, expected, a hint), printed once,
    with no traceback and none of the checker's source (which would show the answer)."""
    for fn in wrong:
        capsys.readouterr()
        result = check(fn)  # does not raise: Run All goes on
        assert result.status == "failed" and not result.passed
        message = str(result)
        assert "case" in message and "hint:" in message and "expected:" in message
        assert "yours:" in message and len(message.splitlines()) <= 6
        assert capsys.readouterr().out == message + "\n"
        assert "Traceback" not in message and "def " not in message


@pytest.mark.parametrize("check, solution, wrong", CHECKS)
def test_unanswered_exercise_says_not_done_unless_solutions_are_allowed(check, solution, wrong,
                                                                         monkeypatch):
    def unanswered(*args):
        not_done()

    monkeypatch.delenv("MINIPAGED_SOLUTIONS", raising=False)
    result = check(unanswered)  # does not raise: Run All goes on
    assert result.status == "not done" and "not done yet" in result
    monkeypatch.setenv("MINIPAGED_SOLUTIONS", "1")
    assert "solution was used" in check(unanswered)


def test_a_check_cell_shows_its_message_once(capsys, monkeypatch):
    """The checker prints its message; as a cell's last value it adds nothing (no second tick)."""
    from IPython.core.formatters import DisplayFormatter

    monkeypatch.delenv("MINIPAGED_SOLUTIONS", raising=False)
    result = lesson01.check_bytes_per_token(S.bytes_per_token)
    assert capsys.readouterr().out.count("✓") == 1
    assert DisplayFormatter().format(result) == ({}, {})


@pytest.mark.parametrize("module, name", [(lesson11, "block_hash"), (lesson13, "metric_value")])
def test_later_cells_use_the_package_function_until_the_learners_passes(module, name,
                                                                       monkeypatch):
    monkeypatch.delenv("MINIPAGED_SOLUTIONS", raising=False)
    check = getattr(module, f"check_{name}")

    def unanswered(*args):
        not_done()

    def mine(*args):
        return getattr(S, name)(*args)

    assert module.usable(unanswered) is not unanswered  # not done: the package's own
    assert module.usable(mine) is not mine  # not checked yet
    assert check(mine).passed
    assert module.usable(mine) is mine
    check(unanswered)  # a later check that does not pass withdraws the earlier pass
    assert module.usable(mine) is not mine


def test_a_learner_error_is_not_hidden_by_the_solution(monkeypatch):
    monkeypatch.setenv("MINIPAGED_SOLUTIONS", "1")

    def buggy(*args):
        raise ZeroDivisionError("the learner's own bug")

    with pytest.raises(ZeroDivisionError):
        lesson01.check_bytes_per_token(buggy)


def test_scheduler_cases_cover_preemption_resume_and_admission():
    from minipaged.exercises.checking import rng_for
    seen = {"preempt": 0, "swap_in": 0, "admit": 0, "self_preempt": 0}
    for (running, _, _, _), outs in lesson04._random_steps(rng_for(0), 300):
        seen["preempt"] += bool(outs.preempted)
        seen["swap_in"] += bool(outs.blocks_to_swap_in)
        seen["admit"] += any(outs.prompt_run)
        seen["self_preempt"] += bool(running) and any(r == running[0].request_id
                                                      for r, _ in outs.preempted)
    assert all(count >= 3 for count in seen.values()), seen


def test_flat_batch_cases_mix_prompts_and_decodes():
    from minipaged.exercises.checking import rng_for
    mixed = sum(len({s.num_computed_tokens == 0 for s in seqs}) == 2
                for seqs, _, _ in lesson08._random_batches(rng_for(0), 200))
    assert mixed >= 20


def test_block_manager_replay_of_lesson_01_trace_agrees_with_the_paged_model():
    from minipaged.lab import kv_memory
    from minipaged.lab.dry_run import replay_trace_paged

    trace = kv_memory.request_trace(40, seed=3)
    real = replay_trace_paged(trace, capacity=2048, block_size=16)
    model = kv_memory.paged_waste(trace, capacity=2048, block_size=16)
    assert real.slot_steps["used"] > 0 and real.slot_steps["internal"] > 0
    assert abs(real.waste_fraction - model.waste_fraction) < 0.01
    assert real.slot_steps["internal"] <= 15 * real.max_running * real.num_steps
    # Lesson 01's memory map of the paged pool is drawn from the block tables of one step.
    assert sum(n for _, n in real.layout) == real.capacity
    assert real.layout_step == model.layout_step and {k for k, _ in real.layout} <= {
        "used", "internal", "free"}


def _hint_texts(module):
    """The literal text of every ``hint = ...`` in a checker module."""
    import ast
    import inspect

    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "hint"
                                                for t in node.targets):
            yield "".join(part.value for part in ast.walk(node.value)
                          if isinstance(part, ast.Constant) and isinstance(part.value, str))


@pytest.mark.parametrize("module", [lesson01, lesson02, lesson03, lesson04, lesson05, lesson08,
                                    lesson11, lesson13, lesson14], ids=lambda m: m.__name__[-8:])
def test_hints_point_at_the_idea_without_stating_the_code(module):
    code = ["//", " % ", "ceil(", "hash(", "shfl_xor(", "block_table[", "+ 1 if", " * G"]
    for hint in _hint_texts(module):
        assert not [c for c in code if c in hint], hint


def test_the_stream_delta_rule_is_in_the_exercise_text():
    import json
    lesson = ROOT / "lessons" / "13_serving.ipynb"
    text = "".join("".join(c["source"]) for c in json.loads(lesson.read_text())["cells"]
                   if c["cell_type"] == "markdown")
    assert "len(longest stop string) - 1" in text
