// The C++ CPU attention's kernel instances for 8-bit caches (lesson 18), compiled beside
// attention.cpp at the same time (see MINIPAGED_8BIT_KERNEL_INSTANCES there): the kernel itself,
// its argument checks and its Python bindings are all in attention.cpp.
#define MINIPAGED_KERNELS_ONLY
#include "attention.cpp"

namespace minipaged_cpu {
MINIPAGED_8BIT_KERNEL_INSTANCES()
}  // namespace minipaged_cpu
