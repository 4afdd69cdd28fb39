"""Turning a sequence's new tokens into text as they arrive (lesson 08).

Decoding one token on its own loses information: a byte-level BPE token may hold half of a UTF-8
character, and SentencePiece drops the leading space of the first token it decodes. So each step
decodes a small window -- a few tokens already shown (``prefix_offset:read_offset``) plus the new
ones -- and appends only the part of the text that is new. Text that ends in an incomplete
character (U+FFFD) waits for the next token.
"""
from __future__ import annotations

from minipaged.sequence import Sequence


def detokenize_incrementally(tokenizer, seq: Sequence) -> str:
    """Append the text of ``seq``'s newest tokens to ``seq.output_text``; return the new text."""
    ids = seq.output_token_ids
    shown = tokenizer.decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=True)
    window = tokenizer.decode(ids[seq.prefix_offset:], skip_special_tokens=True)
    if len(window) <= len(shown) or window.endswith("\ufffd"):
        return ""  # nothing printable yet
    new_text = window[len(shown):]
    seq.output_text += new_text
    seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
    return new_text
