"""Every malformed input raises on the real CUDA kernels too (minipaged/kernels/malformed.py).

On the GPU machine that first ran this project, each error message that formatted a number
crashed the process (a private libstdc++ linked into the extension; see
minipaged/kernels/library_check.py). The cases run in child processes, so a crash fails its
case, not the run; the library check itself ran when the extension was built.
"""
from minipaged.kernels import malformed


def test_each_malformed_input_raises_on_the_gpu():
    rows = malformed.run_table("cuda")
    assert rows is not None, "CUDA is present but the CUDA kernels were not built"
    print(malformed.format_table("cuda", rows))
    failed = [row for row in rows if not row["ok"]]
    assert not failed, malformed.format_table("cuda", failed)
