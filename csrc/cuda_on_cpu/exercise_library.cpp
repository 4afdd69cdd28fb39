// Lesson 06's exercise build as a shared library, for the engine (lesson 16's capstone, run 4):
// the same translation unit as the sanitizer programs (the kernel file with the learner's phase
// 3, and csrc/cuda_on_cpu/exercise_launch.cu), linked with the CPU CUDA runtime and this file
// instead of exercise_main.cpp. Python calls it through ctypes (minipaged/lab/kernel_exercise.py).

#include <cuda_runtime.h>

// Why the last launch of this host thread failed, in words ("" if it did not).
extern "C" const char* exercise_last_error() { return cuda_on_cpu::last_error_detail(); }
