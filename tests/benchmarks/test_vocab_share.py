"""``benchmarks/vocab_share.py`` (the LM head's and the sampler's share of a decode step) runs,
here on a tiny random LLaMA so that it needs no real model."""
import importlib.util

from repo_paths import ROOT
from tiny_models import save_tiny_model


def test_vocab_share_reports_each_batch(tmp_path, capsys):
    save_tiny_model("llama", tmp_path, vocab_size=1000)
    spec = importlib.util.spec_from_file_location("vocab_share",
                                                  ROOT / "benchmarks" / "vocab_share.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--model", str(tmp_path), "--batch", "1", "3", "--steps", "2",
                        "--prompt-len", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "vocabulary 1,000" in lines[0]
    for line, batch in zip(lines[1:], (1, 3)):
        assert line.startswith(f"batch {batch}: decode step ") and "% of the step" in line
