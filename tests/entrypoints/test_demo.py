"""``make demo`` (``minipaged demo``): a packaged model's weights held as its GGUF blocks where
no GPU is present (measured faster there with the same greedy tokens, issue 58), float32 on
request or on a GPU; a bad choice is named."""
import pytest

from minipaged.entrypoints import cli, demo


@pytest.mark.parametrize("model, gpu, want", [
    (None, False, "gguf"), ("gemma-3-270m", False, "gguf"), (demo.EMBEDDED_MODEL, False, "gguf"),
    (None, True, "float32"), ("/some/hf/folder", False, "float32")])
def test_auto_picks_the_blocks_for_a_packaged_model_on_the_cpu(monkeypatch, model, gpu, want):
    monkeypatch.setattr(demo, "_has_gpu", lambda: gpu)
    assert demo.chosen_weights(model, "auto") == want
    assert demo.chosen_weights(model, "float32") == "float32"
    assert demo.chosen_weights(model, "gguf") == "gguf"


def test_a_bad_choice_is_named(capsys):
    with pytest.raises(ValueError, match="weights must be auto, gguf or float32, got 'int4'"):
        demo.chosen_weights(None, "int4")
    with pytest.raises(SystemExit):
        cli.main(["demo", "--weights", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err


@pytest.mark.slow
def test_the_demo_answers_with_the_blocks(monkeypatch, capsys):
    monkeypatch.setattr(demo, "_has_gpu", lambda: False)
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "weights: the GGUF file's blocks as stored" in out
    assert "### What is the capital of France?\nThe capital of France is Paris" in out
