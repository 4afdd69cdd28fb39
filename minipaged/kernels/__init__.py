"""The attention back-ends of lessons 05-07: ``ops`` (dispatch), ``reference`` (plain torch),
``build`` (compiling), ``cpu_op``, ``cuda_op``, ``cuda_on_cpu`` and the NumPy ``emulator``."""
