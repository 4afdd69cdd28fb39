"""The LM head (``VocabParallelEmbedding.logits``): on the CPU, two or more rows are computed as
(vocab, hidden) x (hidden, rows), which MKL runs faster for a long vocabulary; the logits are the
plain product's up to float rounding (lesson 07)."""
import pytest
import torch

from minipaged.models.parallel_layers import VocabParallelEmbedding


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 33])
def test_logits_equal_the_plain_product(rows):
    torch.manual_seed(rows)
    head = VocabParallelEmbedding(5000, 64)
    with torch.no_grad():
        head.weight.normal_(0, 0.05)
    hidden = torch.randn(rows, 64)
    logits = head.logits(hidden)  # (rows, vocab)
    plain = hidden @ head.weight.detach().t()
    assert logits.shape == (rows, 5000) and logits.is_contiguous()
    torch.testing.assert_close(logits, plain, atol=1e-5, rtol=1e-5)
    assert torch.equal(logits.argmax(-1), plain.argmax(-1))
    if rows == 1:
        assert torch.equal(logits, plain)  # one row: the plain product itself
