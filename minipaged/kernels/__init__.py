"""Attention back-ends: the torch reference, the C++ CPU op, the CUDA kernels, the CUDA-on-CPU build, the NumPy emulator."""
