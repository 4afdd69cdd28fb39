"""A GGUF file opened only when it is whole: else a ValueError that says what is wrong with it.

A GGUF file is the magic bytes ``GGUF``, a header (the version, the metadata, and each tensor's
name, shape, format and offset), then the tensors' data. A download or copy cut short leaves a
file that starts right and ends early; read as it is, it fails deep inside a parser ("cannot
reshape array of size 4864 into shape (64,80)", a ``struct.error``). ``read_gguf`` says instead
that the file is empty, is not GGUF, or ends before the data its header describes.
"""
from __future__ import annotations

import os

GGUF_MAGIC = b"GGUF"


def read_gguf(path: str, mode: str = "r"):
    """``gguf.GGUFReader(path, mode)`` of a whole GGUF file.

    Raises:
        ValueError: the file is empty, does not start with ``GGUF``, ends before the end of the
            tensor data its header describes, or cannot be parsed (the parser's error follows).
    """
    import gguf

    check_gguf_start(path)
    size = os.path.getsize(path)
    try:
        return gguf.GGUFReader(path, mode)
    except Exception as error:  # noqa: BLE001 - any parser error: said with what it means
        end = _data_end(path)
        if end is not None and end > size:
            raise ValueError(
                f"{path} is cut short: its header describes tensor data up to byte {end:,}, "
                f"and the file has {size:,} bytes (an interrupted download or copy leaves a "
                f"file like this); get the file again") from None
        raise ValueError(
            f"{path} cannot be read as a GGUF file ({size:,} bytes): "
            f"{type(error).__name__}: {error}. A file cut short inside its header, or written "
            f"by a tool that does not follow the format, fails like this") from None


def check_gguf_start(path: str) -> None:
    """A ValueError unless ``path`` holds at least the magic bytes of a GGUF file."""
    size = os.path.getsize(path)
    if size == 0:
        raise ValueError(f"{path} is empty (0 bytes), so it is not a GGUF file")
    with open(path, "rb") as f:
        start = f.read(len(GGUF_MAGIC))
    if start != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file: it starts with {start!r}, and a GGUF file "
                         f"with {GGUF_MAGIC!r}")


def _data_end(path: str) -> int | None:
    """Where the header says the last tensor's data ends (in bytes from the file's start), or
    None when the header itself cannot be read."""
    import gguf
    import numpy as np
    from gguf.gguf_reader import GGUFReader  # (the class: ``gguf.GGUFReader`` may be wrapped)

    class HeaderOnly(GGUFReader):
        def _build_tensors(self, start_offs, fields):
            ends = [start_offs]
            for field in fields:
                dims, raw_type, offset = field.parts[3], field.parts[4], field.parts[5]
                block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(raw_type[0])]
                num = int(np.prod(dims, dtype=np.int64))
                ends.append(int(start_offs + offset[0]) + num * type_size // block)
            self.data_end = max(ends)

    try:
        return HeaderOnly(path).data_end
    except Exception:  # noqa: BLE001 - the header is damaged too (or gguf's reader changed)
        return None
