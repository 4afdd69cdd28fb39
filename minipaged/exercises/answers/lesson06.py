"""Lesson 06's reference answer: phase 3 of the attention kernel (the softmax), in CUDA C++.

The text replaces the lines between ``// >>> softmax_phase`` and ``// <<< softmax_phase`` of
``attend`` in ``csrc/paged_attention.cu`` (``minipaged.lab.kernel_exercise`` builds it). It
writes the two block-wide reductions out by hand: a butterfly of ``__shfl_xor_sync`` inside each
warp, the warps' results through shared memory with a barrier, a short butterfly over them and
a broadcast from lane 0, so that every thread ends with the same maximum and sum.
"""

SOFTMAX_PHASE = r"""  // 1. The largest logit of the CUDA block. The G lanes of a thread group already hold the
  //    same qk_max, so the warp's butterfly stops at mask G.
  float m = qk_max;
  for (int mask = WARP_SIZE / 2; mask >= G; mask /= 2) {
    m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, mask));  // lane l and lane l ^ mask
  }
  if (lane == 0) red_smem[warp] = m;  // one maximum per warp
  __syncthreads();  // every warp's maximum (and every logit of phase 2) is written
  m = lane < NUM_WARPS ? red_smem[lane] : -FLT_MAX;
  for (int mask = NUM_WARPS / 2; mask >= 1; mask /= 2) {
    m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, mask));
  }
  const float max_logit = __shfl_sync(FULL_MASK, m, 0);  // lanes >= NUM_WARPS hold -FLT_MAX

  // 2. The exponentials, in place, and their sum: every thread takes tokens threadIdx.x,
  //    threadIdx.x + NUM_THREADS, ...; then all 32 lanes and the warps add up.
  float exp_sum = 0.f;
  for (int i = threadIdx.x; i < num_tokens; i += NUM_THREADS) {
    const float e = expf(logits[i] - max_logit);
    logits[i] = e;
    exp_sum += e;
  }
  for (int mask = WARP_SIZE / 2; mask >= 1; mask /= 2) {
    exp_sum += __shfl_xor_sync(FULL_MASK, exp_sum, mask);
  }
  if (lane == 0) red_smem[NUM_WARPS + warp] = exp_sum;  // slots of its own: no reuse race
  __syncthreads();
  exp_sum = lane < NUM_WARPS ? red_smem[NUM_WARPS + lane] : 0.f;
  for (int mask = NUM_WARPS / 2; mask >= 1; mask /= 2) {
    exp_sum += __shfl_xor_sync(FULL_MASK, exp_sum, mask);
  }
  exp_sum = __shfl_sync(FULL_MASK, exp_sum, 0);

  // 3. Probabilities, in place; phase 4 reads any of them, so a barrier ends the phase.
  const float inv_sum = 1.f / exp_sum;
  for (int i = threadIdx.x; i < num_tokens; i += NUM_THREADS) logits[i] *= inv_sum;
  __syncthreads();
"""
