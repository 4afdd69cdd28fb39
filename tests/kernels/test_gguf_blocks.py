"""GGUF's block formats dequantized in torch (``kernels/gguf_blocks.py``) equal the ``gguf``
package's reference bit for bit, on random blocks of every format (any bytes: NaN and infinite
scales included), and a format minipaged does not read is named with the ones it does."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from budgets import examples
from minipaged.kernels import gguf_blocks

gguf = pytest.importorskip("gguf")


@settings(max_examples=examples(60), deadline=None)
@given(name=st.sampled_from(sorted(gguf_blocks.FORMATS)), rows=st.integers(1, 5),
       blocks_per_row=st.integers(1, 4), seed=st.integers(0, 2**32 - 1))
def test_dequantize_equals_the_gguf_package_bit_for_bit(name, rows, blocks_per_row, seed):
    fmt = gguf_blocks.FORMATS[name]
    raw = np.random.default_rng(seed).integers(0, 256, (rows, blocks_per_row * fmt.bytes),
                                               dtype=np.uint8)
    with np.errstate(all="ignore"):  # (NaN and infinite scales: numpy warns)
        want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])
    got = gguf_blocks.dequantize(torch.from_numpy(raw), fmt).numpy()
    assert got.shape == want.shape == (rows, blocks_per_row * fmt.weights)
    # the same float32 bits (a NaN scale gives NaNs in both, compared as NaNs)
    assert np.array_equal(got, want, equal_nan=True)


@settings(max_examples=examples(20), deadline=None)
@given(name=st.sampled_from(["Q8_0", "Q4_1"]), seed=st.integers(0, 2**32 - 1))
def test_blocks_quantized_by_the_gguf_package_come_back(name, seed):
    """Real blocks (as a file holds them) round-trip within the format's step."""
    weights = np.random.default_rng(seed).standard_normal((3, 64)).astype(np.float32)
    raw = gguf.quants.quantize(weights, gguf.GGMLQuantizationType[name])
    got = gguf_blocks.dequantize(torch.from_numpy(raw), gguf_blocks.FORMATS[name]).numpy()
    assert np.array_equal(got, gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name]))
    assert np.abs(got - weights).max() < 0.5


def test_ggml_numbers_match_the_gguf_package():
    for name, fmt in gguf_blocks.FORMATS.items():
        qtype = gguf.GGMLQuantizationType[name]
        assert fmt.ggml_type == int(qtype)
        assert (fmt.weights, fmt.bytes) == gguf.GGML_QUANT_SIZES[qtype]


def test_an_unsupported_format_is_named_with_the_supported_ones():
    with pytest.raises(ValueError, match=r"Q5_K is not supported: minipaged reads Q8_0, Q4_1, "
                                         r"Q5_0, Q4_K, Q6_K"):
        gguf_blocks.block_format("Q5_K")


def test_rows_of_the_wrong_size_are_refused():
    with pytest.raises(ValueError, match="multiple of 34 bytes"):
        gguf_blocks.dequantize(torch.zeros(2, 35, dtype=torch.uint8), gguf_blocks.FORMATS["Q8_0"])
