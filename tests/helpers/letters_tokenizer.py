"""A word-level tokenizer for the tiny models' ids whose text is short strings over six letters,
so that random tokens often spell a stop string (also across two tokens)."""
from __future__ import annotations

from tiny_models import VOCAB

LETTERS = "abcdef"


def spell(token_id: int) -> str:
    """The text of a token of the test tokenizer: its id in base 6, written with a-f."""
    text = ""
    while True:
        text = LETTERS[token_id % 6] + text
        token_id //= 6
        if token_id == 0:
            return text


def save_letters_tokenizer(path) -> str:
    """Save the tokenizer (``<s>`` 0, ``</s>`` 1, then ``spell(i)``) to ``path``; returns it."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, **{spell(i): i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tok.decoder = decoders.Fuse()  # the text is the tokens' strings joined, nothing between
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    return str(path)
