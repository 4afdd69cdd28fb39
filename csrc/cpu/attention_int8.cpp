// The C++ CPU attention's kernel instances for int8 caches (lesson 18), compiled beside
// attention.cpp and attention_fp8.cpp at the same time (see MINIPAGED_INT8_KERNEL_INSTANCES
// there): the kernel itself, its argument checks and its Python bindings are all in attention.cpp.
#define MINIPAGED_KERNELS_ONLY
#include "attention.cpp"

namespace minipaged_cpu {
MINIPAGED_INT8_KERNEL_INSTANCES()
}  // namespace minipaged_cpu
