"""The attention back-ends of lessons 05-07: ``ops`` (dispatch), ``reference`` (plain torch),
``build`` (compiling, with ``build_cache`` and ``library_check``), ``cpu_kernels``,
``cuda_kernels``, ``cuda_on_cpu``, ``kv_quant`` (the 8-bit cache) and ``malformed`` (the bad
inputs every back-end must refuse); the NumPy emulator and the kernel trace are in ``lab/``."""
