// The C++ CPU attention's kernel instances for fp8 (e4m3) caches (lesson 18), compiled beside
// attention.cpp and attention_int8.cpp at the same time (see MINIPAGED_FP8_KERNEL_INSTANCES
// there): the kernel itself, its argument checks and its Python bindings are all in attention.cpp.
#define MINIPAGED_KERNELS_ONLY
#include "attention.cpp"

namespace minipaged_cpu {
MINIPAGED_FP8_KERNEL_INSTANCES()
}  // namespace minipaged_cpu
