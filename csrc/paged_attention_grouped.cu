// paged_attention.cu again, instantiating version 3, the grouped kernel's instances only: the GPU build splits that file's
// template instances over three nvcc runs (see "three translation units" there).
#define MINIPAGED_PART_GROUPED
#include "paged_attention.cu"
