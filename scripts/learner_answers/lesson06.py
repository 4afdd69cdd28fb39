"""Lesson 06 as a learner answers it: phase 3 with a full butterfly inside each warp, and the
warps' partial results read back by every thread from shared memory (no second butterfly)."""

# %%
SOFTMAX_PHASE = r"""  // my phase 3
  float max_logit = -FLT_MAX;
  float exp_sum = 0.f;
  // the warp's maximum: a butterfly over all 32 lanes
  float m = qk_max;
  for (int offset = 16; offset > 0; offset >>= 1) {
    m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, offset));
  }
  if (lane == 0) red_smem[warp] = m;
  __syncthreads();  // every warp's maximum, and every logit, written
  for (int w = 0; w < NUM_WARPS; ++w) max_logit = fmaxf(max_logit, red_smem[w]);

  for (int i = threadIdx.x; i < num_tokens; i += NUM_THREADS) {
    float e = expf(logits[i] - max_logit);
    logits[i] = e;
    exp_sum += e;
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    exp_sum += __shfl_xor_sync(FULL_MASK, exp_sum, offset);
  }
  if (lane == 0) red_smem[NUM_WARPS + warp] = exp_sum;  // not the slots read above
  __syncthreads();
  exp_sum = 0.f;
  for (int w = 0; w < NUM_WARPS; ++w) exp_sum += red_smem[NUM_WARPS + w];

  for (int i = threadIdx.x; i < num_tokens; i += NUM_THREADS) logits[i] = logits[i] / exp_sum;
  __syncthreads();  // phase 4 reads them all
"""
