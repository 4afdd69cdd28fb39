// paged_attention.cu again, instantiating the 8-bit cache's entry point (lesson 18) only: the GPU build splits that file's
// template instances over three nvcc runs (see "three translation units" there).
#define MINIPAGED_PART_8BIT
#include "paged_attention.cu"
