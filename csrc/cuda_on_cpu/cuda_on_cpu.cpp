// The runtime behind cuda_on_cpu.h: devices, launch checks, the thread pool that plays the CUDA
// threads of one block, its barriers and warp exchanges, and the static __shared__ census.
//
// The threads of a block synchronise only where the kernel says so (__syncthreads, shuffles),
// through atomics that ThreadSanitizer understands, so a missing __syncthreads shows up as a data
// race. A barrier that some threads never reach is reported as a deadlock (the launch fails)
// instead of hanging.

#include "cuda_on_cpu.h"

#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <ctime>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace cuda_on_cpu {
namespace {

// ---- the two devices ----------------------------------------------------------------------------
struct Device {
  const char* name;
  int major, minor;
  int multiprocessors;
  int smem_optin;  // bytes of shared memory one block may use after opting in
};
constexpr Device kDevices[] = {
    {"H100 (sm_90) on the CPU", 9, 0, 132, 227 * 1024},
    {"A100 (sm_80) on the CPU", 8, 0, 108, 163 * 1024},
};
constexpr int kNumDevices = sizeof(kDevices) / sizeof(kDevices[0]);
constexpr int kSmemDefault = 48 * 1024;  // without opting in
constexpr int kMaxThreadsPerBlock = 1024;

thread_local int tl_device = 0;  // the current device, per host thread as in CUDA
thread_local cudaError_t tl_last_error = cudaSuccess;
thread_local std::string tl_error_detail;

void set_error(cudaError_t error, std::string detail) {
  tl_last_error = error;
  tl_error_detail = std::move(detail);
}

std::atomic<long long> g_launches{0}, g_blocks{0}, g_block_barriers{0}, g_warp_exchanges{0};

// set_block_order: how later launches order their blocks (the permutations' generator is
// used under g_launch_mutex, one launch at a time).
std::atomic<int> g_block_order{IN_ORDER};
std::mt19937_64 g_block_shuffle;

// The shuffle recorder (trace_warp): which block and warp, and what they exchanged.
std::atomic<int> g_trace_warp{-1};
std::atomic<unsigned> g_trace_block[3] = {};
std::mutex g_trace_mutex;
std::vector<ShuffleRecord> g_trace;

// The event recorder (trace_events / record_event).
std::atomic<bool> g_events_on{false};
std::mutex g_events_mutex;
std::vector<TraceEvent> g_events;

// ---- static __shared__ census ---------------------------------------------------------------
// A kernel's __shared__ variables are function-local statics (see cuda_on_cpu.h). The host
// compiler names them after the kernel: _ZZ<kernel's mangled name without _Z>E<variable>. The
// symbol table of the binary that holds the kernel gives each one's address and size.
struct SharedVariable {
  char* address;
  size_t bytes;
};
struct KernelInfo {
  std::string name;  // mangled
  std::vector<SharedVariable> statics;
  size_t static_bytes = 0;
  int max_dynamic[kNumDevices];  // cudaFuncAttributeMaxDynamicSharedMemorySize, per device
};

std::vector<char> read_file(const char* path) {
  std::ifstream file(path, std::ios::binary);
  return std::vector<char>((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
}

KernelInfo census(const void* kernel) {
  KernelInfo info;
  Dl_info where{};
  link_map* map = nullptr;
  if (!dladdr1(kernel, &where, reinterpret_cast<void**>(&map), RTLD_DL_LINKMAP) || !map) {
    return info;
  }
  std::vector<char> image = read_file(where.dli_fname && *where.dli_fname ? where.dli_fname
                                                                            : "/proc/self/exe");
  if (image.size() < sizeof(Elf64_Ehdr)) image = read_file("/proc/self/exe");
  if (image.size() < sizeof(Elf64_Ehdr) || std::memcmp(image.data(), ELFMAG, SELFMAG) != 0 ||
      image[EI_CLASS] != ELFCLASS64) {
    return info;
  }
  const auto* header = reinterpret_cast<const Elf64_Ehdr*>(image.data());
  const auto* sections = reinterpret_cast<const Elf64_Shdr*>(image.data() + header->e_shoff);
  const Elf64_Shdr* table = nullptr;
  for (int i = 0; i < header->e_shnum; ++i) {
    if (sections[i].sh_type == SHT_SYMTAB) table = &sections[i];
  }
  for (int i = 0; i < header->e_shnum && !table; ++i) {
    if (sections[i].sh_type == SHT_DYNSYM) table = &sections[i];
  }
  if (!table) return info;
  const auto* symbols = reinterpret_cast<const Elf64_Sym*>(image.data() + table->sh_offset);
  const size_t count = table->sh_size / sizeof(Elf64_Sym);
  const char* names = image.data() + sections[table->sh_link].sh_offset;
  const uintptr_t base = map->l_addr;
  const uintptr_t target = reinterpret_cast<uintptr_t>(kernel);

  for (size_t i = 0; i < count && info.name.empty(); ++i) {
    const Elf64_Sym& s = symbols[i];
    if (ELF64_ST_TYPE(s.st_info) == STT_FUNC && s.st_shndx != SHN_UNDEF &&
        base + s.st_value <= target && target < base + s.st_value + std::max<size_t>(s.st_size, 1)) {
      info.name = names + s.st_name;
    }
  }
  if (info.name.rfind("_Z", 0) != 0) return info;  // not a C++ function: no statics to find
  const std::string prefix = "_ZZ" + info.name.substr(2) + "E";
  for (size_t i = 0; i < count; ++i) {
    const Elf64_Sym& s = symbols[i];
    if (ELF64_ST_TYPE(s.st_info) == STT_OBJECT && s.st_shndx != SHN_UNDEF && s.st_size > 0 &&
        std::strncmp(names + s.st_name, prefix.c_str(), prefix.size()) == 0) {
      info.statics.push_back({reinterpret_cast<char*>(base + s.st_value), (size_t)s.st_size});
    }
  }
  // Lay them out one after another as the GPU would, each at its own alignment (at most 16).
  std::sort(info.statics.begin(), info.statics.end(),
            [](const SharedVariable& a, const SharedVariable& b) { return a.address < b.address; });
  for (const auto& v : info.statics) {
    const size_t align = std::min<size_t>(16, reinterpret_cast<uintptr_t>(v.address) &
                                                  -reinterpret_cast<uintptr_t>(v.address));
    info.static_bytes = (info.static_bytes + align - 1) / align * align + v.bytes;
  }
  return info;
}

std::mutex g_kernels_mutex;
std::map<const void*, std::unique_ptr<KernelInfo>> g_kernels;

KernelInfo& kernel_info(const void* kernel) {
  std::lock_guard<std::mutex> lock(g_kernels_mutex);
  auto& slot = g_kernels[kernel];
  if (!slot) {
    slot = std::make_unique<KernelInfo>(census(kernel));
    for (int& d : slot->max_dynamic) d = kSmemDefault - (int)slot->static_bytes;
  }
  return *slot;
}

// ---- one running block -------------------------------------------------------------------------
// A barrier (a __syncthreads, a warp's exchange, the end of a block) is a SyncPoint: one 64-bit
// word counts the threads that take part (high half: live threads, which drops when a thread
// returns from the kernel) and those that have arrived (low half); the thread whose arrival (or
// return) makes them equal releases the others by bumping `generation`, on which they sleep
// (futex). Atomic read-modify-writes order everything, so ThreadSanitizer sees the barrier.
struct KernelAbort {};  // thrown out of a barrier when the block has failed (e.g. a deadlock)

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

struct SyncPoint {
  std::atomic<std::uint64_t> state{0};  // live << 32 | arrived
  std::atomic<uint32_t> generation{0};
  void reset(int live) { state.store((std::uint64_t)live << 32, std::memory_order_relaxed); }
};
constexpr std::uint64_t kOneLive = 1ull << 32;
inline uint32_t arrived_of(std::uint64_t state) { return (uint32_t)state; }
inline uint32_t live_of(std::uint64_t state) { return (uint32_t)(state >> 32); }

struct Warp {
  int lanes = 0;  // threads of the block in this warp (32 but for a partial last warp)
  SyncPoint sync;
  std::uint64_t slots[2][32] = {};  // double-buffered: a lane's n-th exchange uses slots[n % 2]
};

struct BlockState {
  int num_threads = 0;
  int num_warps = 0;
  SyncPoint barrier;                 // __syncthreads
  std::unique_ptr<Warp[]> warps;
  SyncPoint finished;                // every thread has left the kernel: the next block may start
  std::atomic<int> waiting{0};       // threads inside a barrier or an exchange
  std::atomic<std::uint64_t> progress{0};  // barriers completed and threads returned
  std::atomic<bool> failed{false};
  std::mutex why_mutex;
  std::string why;
  int live() const { return (int)live_of(barrier.state.load(std::memory_order_acquire)); }
};

struct AlignedDelete {
  void operator()(char* p) const { ::operator delete[](p, std::align_val_t(16)); }
};

struct Job {
  dim3 grid, block;
  int num_threads = 0;
  long long num_blocks = 0;
  detail::KernelBody body{};
  const KernelInfo* kernel = nullptr;
  std::unique_ptr<char[], AlignedDelete> dynamic_smem;  // exactly the launch's size
  size_t dynamic_bytes = 0;
  std::vector<long long> order;  // the n-th block to run (its linear index); empty: in order
  BlockState state;
};

thread_local BlockState* tl_block = nullptr;
thread_local Job* tl_job = nullptr;
thread_local int tl_thread = 0;  // linear index in the block
thread_local int tl_parity = 0;  // which half of the warp's exchange slots is next

void wake_all(SyncPoint& sync) { futex(&sync.generation, FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr); }

void fail(BlockState& b, const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(b.why_mutex);
    if (b.failed.load()) return;
    b.why = why + " (block " + std::to_string(blockIdx.x) + ", " + std::to_string(blockIdx.y) +
            ", " + std::to_string(blockIdx.z) + ")";
    b.failed.store(true, std::memory_order_release);
  }
  wake_all(b.barrier);
  for (int w = 0; w < b.num_warps; ++w) wake_all(b.warps[w].sync);
}

void release(BlockState& b, SyncPoint& sync, uint32_t arrived) {
  sync.state.fetch_sub(arrived, std::memory_order_acq_rel);
  b.waiting.fetch_sub((int)arrived, std::memory_order_relaxed);
  b.progress.fetch_add(1, std::memory_order_relaxed);
  sync.generation.fetch_add(1, std::memory_order_release);
  wake_all(sync);
}

// Sleep until `sync` moves past `generation`. Every live thread waiting and nothing happening
// for a second is a deadlock (a barrier or a shuffle that some threads never reach): the block
// fails instead of hanging.
void wait_for_release(BlockState& b, SyncPoint& sync, uint32_t generation) {
  std::uint64_t seen = b.progress.load(std::memory_order_relaxed);
  int quiet = 0;
  for (;;) {
    if (sync.generation.load(std::memory_order_acquire) != generation) return;
    if (b.failed.load(std::memory_order_acquire)) throw KernelAbort();
    const timespec timeout{0, 200 * 1000 * 1000};
    if (futex(&sync.generation, FUTEX_WAIT_PRIVATE, generation, &timeout) == -1 &&
        errno == ETIMEDOUT) {
      const std::uint64_t now = b.progress.load(std::memory_order_relaxed);
      if (now != seen || b.waiting.load() < b.live()) {
        seen = now;
        quiet = 0;
      } else if (++quiet >= 5) {
        fail(b, "deadlock: all " + std::to_string(b.live()) + " live threads wait in a "
                "__syncthreads or a shuffle that the others never reach");
      }
    }
  }
}

// Arrive at `sync` and wait for the others; `live_expected` (if > 0) is checked against the
// number of live participants (a shuffle needs the whole warp).
void arrive_and_wait(BlockState& b, SyncPoint& sync, int live_expected = 0) {
  const uint32_t generation = sync.generation.load(std::memory_order_acquire);
  b.waiting.fetch_add(1, std::memory_order_relaxed);
  const std::uint64_t old = sync.state.fetch_add(1, std::memory_order_acq_rel);
  const uint32_t arrived = arrived_of(old) + 1, live = live_of(old);
  if (live_expected > 0 && (int)live != live_expected) {
    fail(b, "a shuffle in a warp of which " + std::to_string(live_expected - (int)live) +
                " lane(s) have returned from the kernel: only whole-warp shuffles run here");
    throw KernelAbort();
  }
  if (arrived == live) {
    release(b, sync, arrived);
  } else {
    wait_for_release(b, sync, generation);
  }
}

void poison_shared_memory(Job& job) {
  // 0xff bytes read as NaN in fp32, fp16 and bf16: shared memory read before it was written
  // in this block poisons the result, as stale data from another block would on the GPU.
  if (job.dynamic_bytes) std::memset(job.dynamic_smem.get(), 0xff, job.dynamic_bytes);
  for (const auto& v : job.kernel->statics) std::memset(v.address, 0xff, v.bytes);
}

void reset_block(Job& job) {
  BlockState& b = job.state;
  b.barrier.reset(b.num_threads);
  for (int w = 0; w < b.num_warps; ++w) b.warps[w].sync.reset(b.warps[w].lanes);
  b.finished.reset(b.num_threads);
  b.waiting.store(0, std::memory_order_relaxed);
  poison_shared_memory(job);
}

// This thread has returned from the kernel (or left it because the block failed).
void thread_exit(BlockState& b) {
  b.progress.fetch_add(1, std::memory_order_relaxed);
  const std::uint64_t old = b.barrier.state.fetch_sub(kOneLive, std::memory_order_acq_rel);
  const uint32_t arrived = arrived_of(old);
  if (arrived > 0 && arrived == live_of(old) - 1) release(b, b.barrier, arrived);
  Warp& warp = b.warps[tl_thread / 32];
  const std::uint64_t warp_old = warp.sync.state.fetch_sub(kOneLive, std::memory_order_acq_rel);
  if (arrived_of(warp_old) > 0 && !b.failed.load()) {
    fail(b, "lane " + std::to_string(tl_thread % 32) + " of warp " +
                std::to_string(tl_thread / 32) +
                " returned from the kernel while other lanes wait for it in a shuffle");
  }
}

// The end of a block: the last thread to get here resets the block for the next one.
void finish_block(Job& job) {
  BlockState& b = job.state;
  const uint32_t generation = b.finished.generation.load(std::memory_order_acquire);
  const std::uint64_t old = b.finished.state.fetch_add(1, std::memory_order_acq_rel);
  if (arrived_of(old) + 1 == live_of(old)) {
    if (!b.failed.load()) reset_block(job);
    b.finished.generation.fetch_add(1, std::memory_order_release);
    wake_all(b.finished);
    return;
  }
  while (b.finished.generation.load(std::memory_order_acquire) == generation) {
    futex(&b.finished.generation, FUTEX_WAIT_PRIVATE, generation, nullptr);
  }
}

void run_thread(Job& job, int t) {
  tl_job = &job;
  tl_block = &job.state;
  tl_thread = t;
  const dim3 bd = job.block, gd = job.grid;
  threadIdx = {t % bd.x, t / bd.x % bd.y, t / (bd.x * bd.y)};
  blockDim = bd;
  gridDim = gd;
  for (long long n = 0; n < job.num_blocks; ++n) {
    const long long linear = job.order.empty() ? n : job.order[n];
    blockIdx = {(unsigned)(linear % gd.x), (unsigned)(linear / gd.x % gd.y),
                (unsigned)(linear / ((long long)gd.x * gd.y))};
    tl_parity = 0;
    try {
      job.body.call(job.body.closure);
    } catch (const KernelAbort&) {
    }
    thread_exit(job.state);
    finish_block(job);
    if (job.state.failed.load(std::memory_order_acquire)) break;
  }
  tl_job = nullptr;
  tl_block = nullptr;
}

// ---- the pool: host thread t always plays CUDA thread t ------------------------------------
class Pool {
 public:
  void run(Job& job) {
    std::unique_lock<std::mutex> lock(m_);
    while ((int)workers_.size() < job.num_threads) start_worker();
    job_ = &job;
    remaining_ = job.num_threads;
    for (int t = 0; t < job.num_threads; ++t) {
      workers_[t]->go = true;
      workers_[t]->cv.notify_one();
    }
    done_.wait(lock, [&] { return remaining_ == 0; });
    job_ = nullptr;
  }

 private:
  struct Worker {
    bool go = false;
    std::condition_variable cv;
  };

  void start_worker() {
    const int t = (int)workers_.size();
    workers_.push_back(std::make_unique<Worker>());
    Worker* self = workers_.back().get();
    std::thread([this, t, self] {
      for (;;) {
        Job* job;
        {
          std::unique_lock<std::mutex> lock(m_);
          self->cv.wait(lock, [&] { return self->go; });
          self->go = false;
          job = job_;
        }
        run_thread(*job, t);
        std::lock_guard<std::mutex> lock(m_);
        if (--remaining_ == 0) done_.notify_one();
      }
    }).detach();
  }

  std::mutex m_;
  std::condition_variable done_;
  std::vector<std::unique_ptr<Worker>> workers_;
  Job* job_ = nullptr;
  int remaining_ = 0;
};

Pool& pool() {
  static Pool* p = new Pool;  // never destroyed: its threads live as long as the process
  return *p;
}
std::mutex g_launch_mutex;  // one grid at a time

std::string kib(size_t bytes) { return std::to_string(bytes) + " bytes"; }

}  // namespace

// ---- public ------------------------------------------------------------------------------------
Counters counters() {
  return {g_launches.load(), g_blocks.load(), g_block_barriers.load(), g_warp_exchanges.load()};
}
const char* last_error_detail() { return tl_error_detail.c_str(); }

void set_block_order(BlockOrder order, unsigned seed) {
  std::lock_guard<std::mutex> lock(g_launch_mutex);
  g_block_order.store(order);
  g_block_shuffle.seed(seed);
}

void trace_warp(dim3 block, int warp) {
  std::lock_guard<std::mutex> lock(g_trace_mutex);
  g_trace.clear();
  g_trace_block[0].store(block.x);
  g_trace_block[1].store(block.y);
  g_trace_block[2].store(block.z);
  g_trace_warp.store(warp);
}

std::vector<ShuffleRecord> take_warp_trace() {
  std::lock_guard<std::mutex> lock(g_trace_mutex);
  return std::move(g_trace);
}

void trace_events(bool enabled) {
  std::lock_guard<std::mutex> lock(g_events_mutex);
  g_events.clear();
  g_events_on.store(enabled);
}

void record_event(int kind, long long a, long long b, float value) {
  if (!g_events_on.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lock(g_events_mutex);
  g_events.push_back({kind, {blockIdx.x, blockIdx.y, blockIdx.z}, tl_thread, a, b, value});
}

std::vector<TraceEvent> take_events() {
  std::lock_guard<std::mutex> lock(g_events_mutex);
  return std::move(g_events);
}

namespace detail {

int lane_id() { return tl_thread % 32; }

void* dynamic_shared_base() { return tl_job ? tl_job->dynamic_smem.get() : nullptr; }

void syncthreads() {
  BlockState& b = *tl_block;
  if (b.failed.load(std::memory_order_acquire)) throw KernelAbort();
  g_block_barriers.fetch_add(1, std::memory_order_relaxed);
  arrive_and_wait(b, b.barrier);
}

std::uint64_t warp_exchange(unsigned mask, std::uint64_t bits, int src_lane, bool record) {
  BlockState& b = *tl_block;
  if (b.failed.load(std::memory_order_acquire)) throw KernelAbort();
  g_warp_exchanges.fetch_add(1, std::memory_order_relaxed);
  Warp& warp = b.warps[tl_thread / 32];
  const unsigned all = warp.lanes == 32 ? 0xffffffffu : (1u << warp.lanes) - 1;
  if (mask != all) {
    fail(b, "a shuffle with mask " + std::to_string(mask) + " in a warp of " +
                std::to_string(warp.lanes) + " lanes: only whole-warp shuffles run here");
    throw KernelAbort();
  }
  if (src_lane >= warp.lanes) src_lane = tl_thread % 32;  // no such lane: read one's own value
  const int parity = tl_parity;
  tl_parity ^= 1;
  warp.slots[parity][tl_thread % 32] = bits;
  arrive_and_wait(b, warp.sync, warp.lanes);
  const std::uint64_t received = warp.slots[parity][src_lane];
  if (record && tl_thread / 32 == g_trace_warp.load(std::memory_order_relaxed) &&
      blockIdx.x == g_trace_block[0].load(std::memory_order_relaxed) &&
      blockIdx.y == g_trace_block[1].load(std::memory_order_relaxed) &&
      blockIdx.z == g_trace_block[2].load(std::memory_order_relaxed)) {
    std::lock_guard<std::mutex> lock(g_trace_mutex);
    g_trace.push_back({tl_thread % 32, src_lane, bits, received});
  }
  return received;
}

cudaError_t func_attributes(cudaFuncAttributes* attributes, const void* kernel) {
  if (!attributes || !kernel) return cudaErrorInvalidValue;
  const KernelInfo& info = kernel_info(kernel);
  std::memset(attributes, 0, sizeof(*attributes));
  attributes->sharedSizeBytes = info.static_bytes;
  attributes->maxThreadsPerBlock = kMaxThreadsPerBlock;
  attributes->maxDynamicSharedSizeBytes = info.max_dynamic[tl_device];
  return cudaSuccess;
}

cudaError_t func_set_attribute(const void* kernel, cudaFuncAttribute attribute, int value) {
  if (attribute != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaErrorInvalidValue;
  KernelInfo& info = kernel_info(kernel);
  if (value < 0 || (size_t)value + info.static_bytes > (size_t)kDevices[tl_device].smem_optin) {
    return cudaErrorInvalidValue;
  }
  std::lock_guard<std::mutex> lock(g_kernels_mutex);
  info.max_dynamic[tl_device] = value;
  return cudaSuccess;
}

void launch(const void* kernel, dim3 grid, dim3 block, size_t dynamic_smem, KernelBody body) {
  const long long threads = (long long)block.x * block.y * block.z;
  if (threads < 1 || threads > kMaxThreadsPerBlock || block.z > 64 || grid.x < 1 ||
      grid.y < 1 || grid.z < 1 || grid.x > 2147483647u || grid.y > 65535 || grid.z > 65535) {
    set_error(cudaErrorInvalidConfiguration,
              "grid (" + std::to_string(grid.x) + ", " + std::to_string(grid.y) + ", " +
                  std::to_string(grid.z) + ") x block of " + std::to_string(threads) +
                  " threads is outside the limits (1024 threads; grid y and z <= 65535)");
    return;
  }
  const KernelInfo& info = kernel_info(kernel);
  const int allowed = info.max_dynamic[tl_device];
  if (dynamic_smem > (size_t)std::max(allowed, 0)) {
    set_error(cudaErrorInvalidValue,
              "dynamic shared memory of " + kib(dynamic_smem) + " + static " +
                  kib(info.static_bytes) + " is more than this kernel may use on " +
                  kDevices[tl_device].name + " (" + kib(allowed) +
                  " of dynamic memory; above 48 KiB in all a kernel must opt in with "
                  "cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize))");
    return;
  }
  std::lock_guard<std::mutex> launch_lock(g_launch_mutex);
  g_launches.fetch_add(1, std::memory_order_relaxed);
  auto job = std::make_unique<Job>();
  job->grid = grid;
  job->block = block;
  job->num_threads = (int)threads;
  job->num_blocks = (long long)grid.x * grid.y * grid.z;
  job->body = body;
  job->kernel = &info;
  job->dynamic_bytes = dynamic_smem;
  if (g_block_order.load() != IN_ORDER) {
    job->order.resize(job->num_blocks);
    std::iota(job->order.begin(), job->order.end(), 0LL);
    if (g_block_order.load() == REVERSED) {
      std::reverse(job->order.begin(), job->order.end());
    } else {
      std::shuffle(job->order.begin(), job->order.end(), g_block_shuffle);
    }
  }
  if (dynamic_smem) {
    job->dynamic_smem.reset(static_cast<char*>(::operator new[](dynamic_smem, std::align_val_t(16))));
  }
  BlockState& b = job->state;
  b.num_threads = (int)threads;
  b.num_warps = (int)((threads + 31) / 32);
  b.warps.reset(new Warp[b.num_warps]);
  for (int w = 0; w < b.num_warps; ++w) b.warps[w].lanes = (int)std::min(32LL, threads - 32 * w);
  reset_block(*job);
  pool().run(*job);
  g_blocks.fetch_add(job->num_blocks, std::memory_order_relaxed);
  if (b.failed.load()) set_error(cudaErrorLaunchFailure, b.why);
}

}  // namespace detail
}  // namespace cuda_on_cpu

// ---- the runtime API -------------------------------------------------------------------------
using cuda_on_cpu::kDevices;
using cuda_on_cpu::kNumDevices;

cudaError_t cudaGetDevice(int* device) {
  *device = cuda_on_cpu::tl_device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= kNumDevices) return cudaErrorInvalidDevice;
  cuda_on_cpu::tl_device = device;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceCount(int* count) {
  *count = kNumDevices;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device < 0 || device >= kNumDevices) return cudaErrorInvalidDevice;
  const auto& d = kDevices[device];
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = cuda_on_cpu::kMaxThreadsPerBlock; break;
    case cudaDevAttrMaxGridDimX: *value = 2147483647; break;
    case cudaDevAttrMaxGridDimY: *value = 65535; break;
    case cudaDevAttrMaxGridDimZ: *value = 65535; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = cuda_on_cpu::kSmemDefault; break;
    case cudaDevAttrWarpSize: *value = 32; break;
    case cudaDevAttrMultiProcessorCount: *value = d.multiprocessors; break;
    case cudaDevAttrComputeCapabilityMajor: *value = d.major; break;
    case cudaDevAttrComputeCapabilityMinor: *value = d.minor; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = d.smem_optin; break;
    default: return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}
cudaError_t cudaGetLastError() {
  const cudaError_t e = cuda_on_cpu::tl_last_error;
  cuda_on_cpu::tl_last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() { return cuda_on_cpu::tl_last_error; }
const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDeviceFunction: return "invalid device function";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorIllegalInstruction: return "an illegal instruction was encountered";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
  }
  return "unknown error";
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t) {
  if (kind < cudaMemcpyHostToHost || kind > cudaMemcpyDefault) return cudaErrorInvalidValue;
  if (bytes) std::memmove(dst, src, bytes);  // every "device" here is host memory
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  return cudaMemcpyAsync(dst, src, bytes, kind, nullptr);
}
cudaError_t cudaMemsetAsync(void* dst, int value, size_t bytes, cudaStream_t) {
  if (bytes && dst == nullptr) return cudaErrorInvalidValue;
  if (bytes) std::memset(dst, value, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemset(void* dst, int value, size_t bytes) {
  return cudaMemsetAsync(dst, value, bytes, nullptr);
}
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }  // launches are synchronous
cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
