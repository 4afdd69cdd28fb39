// The launch plan: V1, V2 or version 3, the partition size, the workspace, the error codes.
// Part of paged_attention.cu, included by it once per translation unit (no include guard).
// The CPU builds paste it into that file (minipaged/kernels/cuda_on_cpu.py).

namespace minipaged {

// ----------------------------------------------------------------------------------------------
// Launch: choose V1, V2 or the grouped kernel, pick the template instance, size the shared
// memory, check errors
// ----------------------------------------------------------------------------------------------
constexpr int NUM_THREADS = 128;
constexpr int MAX_GRID_Y = 65535;      // gridDim.y (sequences) and gridDim.z (partitions)
constexpr int V1_MAX_CONTEXT = 8192;   // V2 above this: V1's logits would crowd shared memory
constexpr int V1_MIN_BLOCKS = 512;     // V1 only when num_seqs * num_heads fills the GPU

// Error codes of the extern "C" functions (paged_attention_instances.cuh):
// 0 = success, > 0 = a cudaError_t.
enum ErrorCode {
  UNSUPPORTED_DTYPE = -1,
  UNSUPPORTED_HEAD_SIZE = -2,
  UNSUPPORTED_BLOCK_SIZE = -3,
  SHARED_MEMORY_TOO_SMALL = -4,  // V1's logits of max_context_len tokens do not fit
  TOO_MANY_SEQUENCES = -5,       // more than MAX_GRID_Y sequences (or partitions)
  MISALIGNED = -6,               // a cache pointer or stride is not a multiple of 16 bytes
  WORKSPACE_TOO_SMALL = -7,
  BAD_HEAD_COUNTS = -8,          // num_heads is not a multiple of num_kv_heads
  BAD_VERSION = -9,
  BAD_PARTITION_SIZE = -10,      // a forced partition size that is no power of two in [64, 512]
  NOT_GROUPED_SHAPE = -11,       // version 3 forced where the grouped kernel is not built
  BAD_REDUCE_MODE = -12,         // minipaged_set_v2_reduce's mode is neither 0 nor 1
  BAD_WINDOW = -13,              // a negative sliding window
};

// Where the grouped kernel (version 3) is built: at most MAX_GROUP query heads per kv head,
// head sizes 64 and 128, a 16- or 32-bit cache (an 8-bit cache runs V1 or V2).
inline bool grouped_kernel_built(int num_heads, int num_kv_heads, int head_size, bool codes) {
  const int group = num_heads / num_kv_heads;
  return !codes && group <= MAX_GROUP && (head_size == 64 || head_size == 128);
}

// The grouped kernel whenever query heads share a kv head and it is built for the shape: it
// reads each key and value once per group instead of once per query head. Otherwise V1 for
// short contexts, or when the batch alone has enough CUDA blocks to fill the GPU, and V2
// (partitions) for the rest. `requested` 1, 2 or 3 forces a version (tests, benchmarks).
inline int choose_version(int num_seqs, int num_heads, int max_context_len, int requested,
                          bool grouped) {
  if (requested != 0) return requested;
  if (grouped) return 3;
  if (max_context_len <= MIN_PARTITION_SIZE) return 1;  // one partition at most: nothing to split
  if (max_context_len <= V1_MAX_CONTEXT && (int64_t)num_seqs * num_heads >= V1_MIN_BLOCKS) return 1;
  return 2;
}

// A partition size every caller may force (benchmarks): 0 = the plan's own choice.
inline std::atomic<int>& forced_partition_size() {
  static std::atomic<int> size{0};
  return size;
}

// How V2 and version 3 combine the partitions, for every caller (benchmarks, tests): a reduce
// kernel of its own (SEPARATE_REDUCE, the default) or the partitions' last CUDA block
// (FUSED_REDUCE, "The fused reduce" above). The fused reduce puts its weights in the logits
// buffer, so it takes at most FUSED_MAX_PARTITIONS partitions; longer contexts keep the
// separate reduce.
// NOTE: the fused reduce saves the second launch and the reduce kernel's wait for the slowest
// partition, but adds a memset of the counters before the launch; off by default until a GPU
// has timed both (benchmarks/kernel.py --partitions).
enum ReduceMode { SEPARATE_REDUCE = 0, FUSED_REDUCE = 1 };
constexpr int FUSED_MAX_PARTITIONS = PARTITION_SIZE;
inline std::atomic<int>& v2_reduce_mode() {
  static std::atomic<int> mode{SEPARATE_REDUCE};
  return mode;
}

// Device facts, queried once per device rather than on every call.
constexpr int MAX_DEVICES = 64;
struct DeviceLimits {
  int error = 0;
  int smem_optin = 0;        // shared memory one block may use after opting in
  int multiprocessors = 0;   // SMs
};
inline const DeviceLimits& device_limits(int device) {
  static DeviceLimits limits[MAX_DEVICES];
  static std::once_flag once[MAX_DEVICES];
  std::call_once(once[device], [device] {
    DeviceLimits& l = limits[device];
    l.error = (int)cudaDeviceGetAttribute(&l.smem_optin,
                                          cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (!l.error) {
      l.error = (int)cudaDeviceGetAttribute(&l.multiprocessors,
                                            cudaDevAttrMultiProcessorCount, device);
    }
  });
  return limits[device];
}

// What runs for a batch: the version and, for V2, the partition size and count.
struct Plan {
  int error = 0;
  int version = 1;
  int partition_size = 0;  // tokens (V2 and version 3)
  int partitions = 0;      // of the longest context (V2 and version 3)
  bool fused_reduce = false;  // the partitions' last CUDA block combines them (no reduce kernel)
};

// What a batch needs: num_seqs sequences of num_heads query heads over num_kv_heads kv heads,
// `codes` for an 8-bit cache. The grouped kernel has one CUDA block per kv head, so the grid it
// fills has num_seqs * num_kv_heads rows.
inline Plan make_plan(int num_seqs, int num_heads, int num_kv_heads, int head_size,
                      int max_context_len, int requested, bool codes) {
  Plan plan;
  const bool grouped = grouped_kernel_built(num_heads, num_kv_heads, head_size, codes);
  if (requested == 3 && !grouped) {
    plan.error = NOT_GROUPED_SHAPE;
    return plan;
  }
  plan.version = choose_version(num_seqs, num_heads, max_context_len, requested,
                                grouped && num_heads > num_kv_heads);
  if (plan.version == 1) return plan;
  int size = forced_partition_size().load();
  if (size == 0) {
    size = PARTITION_SIZE;
    if (requested == 0) {  // forced V2 (or 3) keeps the textbook 512 tokens (lesson 06)
      int device = 0;
      plan.error = (int)cudaGetDevice(&device);
      if (!plan.error && (device < 0 || device >= MAX_DEVICES)) {
        plan.error = (int)cudaErrorInvalidDevice;
      }
      if (plan.error) return plan;
      const DeviceLimits& limits = device_limits(device);
      if ((plan.error = limits.error)) return plan;
      const int64_t target = (int64_t)V2_BLOCKS_PER_SM * limits.multiprocessors;
      const int64_t rows = (int64_t)num_seqs * (plan.version == 3 ? num_kv_heads : num_heads);
      while (size > MIN_PARTITION_SIZE &&
             rows * ((max_context_len + size - 1) / size) < target) {
        size /= 2;
      }
    }
  }
  plan.partition_size = size;
  plan.partitions = (max_context_len + size - 1) / size;
  // (version 3 with one partition writes the outputs itself: there is nothing to combine)
  plan.fused_reduce = v2_reduce_mode().load() == FUSED_REDUCE &&
                      plan.partitions <= FUSED_MAX_PARTITIONS &&
                      !(plan.version == 3 && plan.partitions == 1);
  return plan;
}

// V2's scratch: max_logits and exp_sums [num_seqs, num_heads, P] then tmp_out [..., P, head_size],
// then, with the fused reduce, its counters: num_seqs * num_heads int32s in float-sized slots
// (V2 counts per (sequence, head), version 3 per (sequence, kv head): fewer).
// (The grouped kernel needs none when one partition holds every context: it writes the output.)
inline int64_t fused_counters(int num_seqs, int num_heads, const Plan& plan) {
  return plan.fused_reduce ? (int64_t)num_seqs * num_heads : 0;
}
inline int64_t workspace_floats(int num_seqs, int num_heads, int head_size, const Plan& plan) {
  if (plan.version == 1 || (plan.version == 3 && plan.partitions == 1)) return 0;
  return (int64_t)num_seqs * num_heads * plan.partitions * (2 + head_size) +
         fused_counters(num_seqs, num_heads, plan);
}
static_assert(sizeof(int) == sizeof(float), "a counter takes one float's slot");


// Static shared memory of a kernel, and permission to use all the rest dynamically (a kernel
// must opt in above 48 KiB of static + dynamic shared memory). Done once per kernel and device.
struct KernelSmem {
  int error = 0;
  size_t static_bytes = 0;
  size_t max_dynamic = 0;
};
// (A template on the kernel itself: kernels of one dtype share a function type.)
template <auto kernel>
const KernelSmem& kernel_smem() {
  static KernelSmem smem[MAX_DEVICES];
  static std::once_flag once[MAX_DEVICES];
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess || device < 0 || device >= MAX_DEVICES) {
    static KernelSmem failed;
    failed.error = err != cudaSuccess ? (int)err : (int)cudaErrorInvalidDevice;
    return failed;
  }
  std::call_once(once[device], [device] {
    KernelSmem& s = smem[device];
    const DeviceLimits& limits = device_limits(device);
    cudaFuncAttributes attrs;
    s.error = limits.error ? limits.error : (int)cudaFuncGetAttributes(&attrs, kernel);
    if (s.error) return;
    s.static_bytes = attrs.sharedSizeBytes;
    s.max_dynamic = limits.smem_optin > (int)attrs.sharedSizeBytes
                        ? limits.smem_optin - attrs.sharedSizeBytes : 0;
    s.error = (int)cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)s.max_dynamic);
  });
  return smem[device];
}

struct AttentionArgs {
  void* out;
  const void* query;
  const void* key_cache;
  const void* value_cache;
  int num_seqs, num_heads, head_size, max_context_len;
  Plan plan;
  float* workspace;
  int64_t workspace_floats;
  cudaStream_t stream;
  KernelArgs k;
};

// The launch error of *this* launch: an error left pending by an earlier call is cleared before
// launching (it was that call's to report), and the launch is checked right after.

}  // namespace minipaged
