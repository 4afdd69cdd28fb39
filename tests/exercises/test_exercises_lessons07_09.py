"""Lessons 07 and 09's checkers: each passes the solution, fails plausible wrong answers with a
short message, and says "not done yet" for an unanswered exercise; the lessons' helpers hold.
(`pytest -m lesson07` or `-m lesson09` picks one lesson's.)"""
import pytest
import torch

from minipaged.exercises import lesson07, lesson09, not_done, solutions as S


# ---- plausible wrong answers: lesson 07 ------------------------------------------------------
def mask_as_if_from_scratch(context_len, num_new):
    return torch.ones(context_len, context_len).tril().bool()[:num_new]  # row i as position i


def mask_without_causality(context_len, num_new):
    return torch.ones(num_new, context_len, dtype=torch.bool)  # the chunk sees its own future


def mask_missing_the_prefix(context_len, num_new):
    full = S.chunk_mask(context_len, num_new).clone()
    full[:, :context_len - num_new] = False  # forgot the cached prefix
    return full


def rotate_adjacent_pairs(vec, position, inv_freq):
    x, y = vec[0::2], vec[1::2]  # pairs (2i, 2i+1): another model's layout, not LLaMA's
    angle = position * inv_freq
    out = torch.empty_like(vec)
    out[0::2] = x * angle.cos() - y * angle.sin()
    out[1::2] = x * angle.sin() + y * angle.cos()
    return out


def rotate_clockwise(vec, position, inv_freq):
    return S.rotate(vec, -position, inv_freq)


def rotate_by_position_only(vec, position, inv_freq):
    return S.rotate(vec, position, torch.ones_like(inv_freq))  # forgot the frequencies


# lesson 09
def chunks_ignoring_decodes(budget, num_decodes, tokens_left):
    return S.prefill_chunks(budget, 0, tokens_left)  # the decodes' tokens not counted


def chunks_only_the_first_prompt(budget, num_decodes, tokens_left):
    got = S.prefill_chunks(budget, num_decodes, tokens_left)
    return got[:1] + [0] * (len(got) - 1)  # a second prompt never shares a step


def chunks_with_negative_budget(budget, num_decodes, tokens_left):
    left = budget - num_decodes
    out = []
    for need in tokens_left:
        out.append(min(need, left))  # negative when the decodes overspent the budget
        left -= max(out[-1], 0)
    return out


def first_steps_without_new_decodes(budget, num_decodes, prompt_lens):
    left, steps, step = list(prompt_lens), [0] * len(prompt_lens), 0
    while not all(steps):  # a prompt that sampled never takes its decode token
        step += 1
        todo = [i for i, s in enumerate(steps) if not s]
        for i, take in zip(todo, S.prefill_chunks(budget, num_decodes, [left[i] for i in todo])):
            left[i] -= take
            if left[i] == 0:
                steps[i] = step
    return steps


def first_steps_zero_based(budget, num_decodes, prompt_lens):
    return [s - 1 for s in S.first_token_steps(budget, num_decodes, prompt_lens)]


CASES = [(lesson07.check_chunk_mask, S.chunk_mask,
          [mask_as_if_from_scratch, mask_without_causality, mask_missing_the_prefix]),
         (lesson07.check_rotate, S.rotate,
          [rotate_adjacent_pairs, rotate_clockwise, rotate_by_position_only]),
         (lesson09.check_prefill_chunks, S.prefill_chunks,
          [chunks_ignoring_decodes, chunks_only_the_first_prompt, chunks_with_negative_budget]),
         (lesson09.check_first_token_steps, S.first_token_steps,
          [first_steps_without_new_decodes, first_steps_zero_based])]
CASES = [pytest.param(*case, id=case[0].__name__,
                      marks=getattr(pytest.mark, case[0].__module__.rsplit(".", 1)[-1]))
         for case in CASES]


@pytest.mark.parametrize("check, solution, wrong", CASES)
def test_checker_passes_the_solution_and_fails_wrong_answers(check, solution, wrong, capsys,
                                                             monkeypatch):
    monkeypatch.delenv("MINIPAGED_SOLUTIONS", raising=False)
    for seed in (0, 1):
        assert check(solution, seed=seed).passed
    for fn in wrong:
        capsys.readouterr()
        result = check(fn)
        message = str(result)
        assert result.status == "failed", fn.__name__
        assert "yours:" in message and "expected:" in message and "hint:" in message
        assert len(message.splitlines()) <= 6 and "Traceback" not in message
        assert capsys.readouterr().out == message + "\n"


@pytest.mark.parametrize("check, solution, wrong", CASES)
def test_unanswered_says_not_done(check, solution, wrong, monkeypatch):
    monkeypatch.delenv("MINIPAGED_SOLUTIONS", raising=False)
    result = check(lambda *args: not_done())
    assert result.status == "not done" and "not done yet" in result
    monkeypatch.setenv("MINIPAGED_SOLUTIONS", "1")
    assert "solution was used" in check(lambda *args: not_done())


@pytest.mark.lesson07
def test_wrong_way_round_gets_its_own_hint():
    assert "wrong way round" in lesson07.check_rotate(rotate_clockwise)
    assert "which dimensions pair up" in lesson07.check_rotate(rotate_adjacent_pairs)


@pytest.mark.lesson07
def test_the_mask_read_out_of_the_package_is_causal_over_the_whole_context():
    mask = lesson07.package_chunk_mask(context_len=7, num_new=3, block_size=2)
    assert mask.tolist() == [[True] * 5 + [False] * 2, [True] * 6 + [False], [True] * 7]


@pytest.mark.lesson07
def test_first_layers_hold_the_real_weights_of_layer_0(tiny_llama):
    """The cut model's layer 0 computes what the whole model's layer 0 computes."""
    from minipaged.lab.first_layers import load_first_layers
    from minipaged.worker import checkpoint

    path, _ = tiny_llama
    config, _, model = load_first_layers(path, num_layers=1)
    assert len(model.layers) == 1 and config.num_hidden_layers == 1
    full = checkpoint.load_state_dict(path)
    mine = dict(model.named_parameters())
    assert torch.equal(mine["layers.0.self_attn.q_proj.weight"],
                       full["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(mine["embed_tokens.weight"], full["model.embed_tokens.weight"])
    with pytest.raises(ValueError, match="num_layers"):
        load_first_layers(path, num_layers=0)
    with pytest.raises(ValueError, match="num_layers"):
        load_first_layers(path, num_layers=99)


@pytest.mark.lesson07
def test_pair_rotation_drawing_has_one_arrow_per_vector_and_labels_apart():
    import math
    import xml.etree.ElementTree as ET

    from visualizer.rotary import render_pair_rotation

    vectors = [(f"p={p}", math.cos(p), math.sin(p)) for p in range(6)]
    root = ET.fromstring(render_pair_rotation(vectors, title="pair 0 of one query at 6 positions"))
    ns = "{http://www.w3.org/2000/svg}"
    arrows = [e for e in root.iter(ns + "line") if e.get("class") == "pair-arrow"]
    assert [a.get("data-label") for a in arrows] == [label for label, _, _ in vectors]
    labels = [(float(t.get("x")), float(t.get("y"))) for t in root.iter(ns + "text")
              if t.get("class") == "pair-label"]
    width, height = float(root.get("width")), float(root.get("height"))
    assert all(0 < x < width and 0 < y < height for x, y in labels)
    assert all(math.dist(a, b) > 20 for i, a in enumerate(labels) for b in labels[i + 1:])
    with pytest.raises(ValueError):
        render_pair_rotation([])


@pytest.mark.lesson09
def test_random_steps_cover_overspent_budgets_and_shared_steps():
    """The cases hold decodes that use the whole budget, and steps where two prompts share it."""
    from minipaged.exercises.checking import rng_for

    cases = list(lesson09._random_steps(rng_for(0), 300))
    assert any(decodes >= budget for budget, decodes, _, _ in cases)
    assert any(sum(1 for n in expected if n) >= 2 for _, _, _, expected in cases)
    assert any(0 < e < left for _, _, lefts, exp in cases for e, left in zip(exp, lefts))


@pytest.mark.lesson09
def test_first_token_steps_of_a_lone_prompt_is_a_ceiling():
    assert lesson09.first_token_steps_of_scheduler(budget=6, num_decodes=2, prompt_lens=[9]) == [3]
    assert lesson09.first_token_steps_of_scheduler(6, 2, [8, 1]) == [2, 3]


@pytest.mark.lesson07
def test_first_layers_of_gpt2_keep_their_blocks_and_positions(tiny_gpt2):
    from minipaged.lab.first_layers import load_first_layers
    from minipaged.worker import checkpoint

    path, _ = tiny_gpt2
    _, _, model = load_first_layers(path, num_layers=1)
    full = checkpoint.load_state_dict(path)
    assert len(model.h) == 1
    assert torch.equal(model.wpe.weight, full["transformer.wpe.weight"])


@pytest.mark.lesson07
@pytest.mark.parametrize("kind", ["qwen2", "gemma3"])
def test_first_layers_cut_a_model_with_layer_types(kind, tmp_path):
    """Qwen2 and Gemma 3 name each layer's kind (``layer_types``): the cut keeps as many."""
    from minipaged.lab.first_layers import load_first_layers
    from tiny_models import save_tiny_model

    save_tiny_model(kind, tmp_path)
    config, _, model = load_first_layers(str(tmp_path), num_layers=1)
    assert len(model.layers) == 1 and len(config.layer_types) == 1
