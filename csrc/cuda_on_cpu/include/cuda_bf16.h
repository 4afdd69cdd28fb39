// Shim for the CPU build: CUDA on the CPU (see ../cuda_on_cpu.h).
#pragma once
#include "../cuda_on_cpu.h"
