"""Lesson 08: text streamed token by token equals the text of all tokens decoded at once."""
import pytest

from minipaged.engine.detokenizer import detokenize_incrementally
from minipaged.worker.checkpoint import embedded_model_dir
from minipaged.sequence import Sequence

pytestmark = pytest.mark.lesson08

TEXTS = [
    "Hello world, this is a plain sentence.",
    "Accents: café, naïve, São Paulo; symbols: ∑ ≤ ∞; emoji: 🙂🚀 done",
    "中文字符和日本語のテキスト、そして한국어",
    "  leading spaces\nand\ttabs\n\nnew paragraphs   ",
    "<|im_end|> special tokens are skipped",
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_model_dir())


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    seq = Sequence(0, None, [1], block_size=16)
    pieces = []
    for token in ids:
        seq.append_token_id(token, {token: 0.0})
        piece = detokenize_incrementally(tokenizer, seq)
        assert "\ufffd" not in piece  # never half a character
        pieces.append(piece)
    assert "".join(pieces) == seq.output_text
    assert seq.output_text == tokenizer.decode(ids, skip_special_tokens=True)
    if len(ids) > 3:
        assert sum(bool(p) for p in pieces) > 1  # it really streams
