// cuda_emu.h -- run a CUDA C kernel, unchanged, on a CPU.
//
// Compile the .cu file with g++ and this header force-included:
//
//     g++ -std=c++20 -O2 -shared -fPIC -pthread -include cuda_emu.h launcher.cpp -o kernel.so
//
// where launcher.cpp #includes the .cu, defines the dynamic shared memory with
// CUDA_EMU_DYNAMIC_SHARED(type, name) and calls cuda_emu::launch(grid, block, smem, kernel, args...).
// (minillm.kernels.build writes that launcher for you and caches the build.)
//
// The execution model, kept as close to CUDA as a CPU allows:
//   - blocks run one after another, in blockIdx order x, then y, then z;
//   - the threads of one block run as real std::threads, so races are real races
//     (build with -fsanitize=thread and ThreadSanitizer reports them); the threads are kept between
//     blocks and launches (ThreadPool), since making a thread costs more than a small block's work;
//   - threadIdx, blockIdx, blockDim, gridDim are thread_local;
//   - `extern __shared__` storage is one static array, used by the one block being run and
//     filled with NaN before each block (uninitialized shared memory shows up as NaN);
//   - __syncthreads() is a barrier (atomics, no mutex: see BlockBarrier) that checks what CUDA
//     leaves undefined: every thread of the block must reach the *same* __syncthreads() (same
//     source line), and no thread may leave
//     the kernel while others wait at one. A violation (divergence) breaks the barrier: all
//     waiters are released and the launch returns an error that names the line and the threads.
//   - the warp-level calls __shfl_xor_sync(), __shfl_sync() and __syncwarp() are warp-wide barriers
//     with the same checks, warp by warp (32 consecutive threads): every lane of the warp must make
//     the *same* call (same source line) with the full mask, as the kernels here do. A shuffle really
//     exchanges the values through memory between two barriers, so lanes that skip __syncwarp()
//     before reading what other lanes wrote to shared memory show up as races under ThreadSanitizer;
//   - launches are serialized by a global lock.
// Supported: extern __shared__ (dynamic) shared memory, 1-D/2-D/3-D grids and blocks, the math
// functions below, float2/float4 and the warp calls above (full warps, full masks).
// Not supported: statically sized __shared__ arrays, partial-warp masks, atomics.
#pragma once
#define CUDA_EMU 1

#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

// ---- qualifiers -------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __shared__  // only `extern __shared__` is supported: its storage comes from the launcher
#define __launch_bounds__(...)  // a hint to nvcc's register allocator; nothing to do on a CPU

// ---- built-in variables ------------------------------------------------------------------
struct uint3 {
    unsigned int x, y, z;
};
struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};
inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

// ---- vector types: 16- and 8-byte aligned, so a float4 load is one 128-bit access on a GPU ------
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(8) float2 {
    float x, y;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline float2 make_float2(float x, float y) { return float2{x, y}; }

// ---- math: the intrinsics map to the accurate libm versions ------------------------------
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __int_as_float(int i) { return std::bit_cast<float>(i); }
inline int __float_as_int(float f) { return std::bit_cast<int>(f); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float fmaf(float a, float b, float c) { return std::fma(a, b, c); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
// expf, logf, fmaxf, fminf, sqrtf come from <cmath>

namespace cuda_emu {

// Bytes of dynamic shared memory the emulated device offers per block (like the 48 KiB
// default of every NVIDIA GPU since Kepler).
#ifndef CUDA_EMU_SHARED_BYTES
#define CUDA_EMU_SHARED_BYTES (48 * 1024)
#endif

inline unsigned int g_dynamic_smem_bytes = 0;  // set per launch, read by dynamic_smem_size()

inline double barrier_timeout_s() {
    const char* s = std::getenv("CUDA_EMU_BARRIER_TIMEOUT");
    return s ? std::atof(s) : 30.0;
}

// __syncthreads() for the threads of one block, with divergence checks.
//
// Built on atomics and polling rather than a mutex + condition variable, on purpose: a mutex shared by
// all threads would order a fast thread's work *after* barrier k before a slow thread's wake-up from
// barrier k (both take the same lock), and ThreadSanitizer would then miss exactly the race a missing
// __syncthreads() causes. Here the only synchronization is CUDA's: everything a thread did before
// barrier k happens-before everything any thread does after barrier k -- and nothing else.
class BlockBarrier {
  public:
    // called between blocks, while no thread of a block runs. what: the call this barrier stands for
    void reset(int expected, const std::string& what = "__syncthreads()") {
        expected_ = expected;
        what_ = what;
        arrived_.store(0);
        exited_.store(0);
        line_.store(-1);
        generation_.store(0);
        broken_.store(false);
        std::lock_guard<std::mutex> lk(error_mu_);
        error_.clear();
    }

    void sync(int line, int tid) {
        if (broken_.load(std::memory_order_acquire)) return;
        const unsigned long gen = generation_.load(std::memory_order_acquire);
        int first_line = -1;  // the first thread to arrive records its line; the others must match it
        if (!line_.compare_exchange_strong(first_line, line) && first_line != line) {
            fail("thread " + std::to_string(tid) + " reached " + what_ + " at line " + std::to_string(line) +
                 " while other threads wait at line " + std::to_string(first_line));
            return;
        }
        if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == expected_) {  // the last one releases all
            arrived_.store(0, std::memory_order_relaxed);
            line_.store(-1, std::memory_order_relaxed);
            generation_.fetch_add(1, std::memory_order_acq_rel);
            return;
        }
#ifdef CUDA_EMU_RACE_WINDOW_US  // tests widen the window in which a waiting thread can be descheduled
        std::this_thread::sleep_for(std::chrono::microseconds(CUDA_EMU_RACE_WINDOW_US));
#endif
        // Checked after arriving (thread_exit checks arrived_ after exiting), and only while this barrier is
        // still the current one: a thread descheduled here may find the others released, gone past this
        // barrier and out of the kernel, and that is no divergence.
        if (exited_.load() > 0 && generation_.load(std::memory_order_acquire) == gen) {
            fail("thread " + std::to_string(tid) + " waits at " + what_ + " (line " + std::to_string(line) +
                 ") but " + std::to_string(exited_.load()) + " thread(s) of the block already left the kernel");
            return;
        }
        const auto start = std::chrono::steady_clock::now();
        const double timeout = barrier_timeout_s();
        for (int spin = 0; generation_.load(std::memory_order_acquire) == gen; ++spin) {
            if (broken_.load(std::memory_order_acquire)) return;
            if (spin < 64) {
                std::this_thread::yield();
                continue;
            }
            std::this_thread::sleep_for(std::chrono::microseconds(20));
            if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > timeout) {
                fail("only " + std::to_string(arrived_.load()) + " of " + std::to_string(expected_) +
                     " threads reached " + what_ + " at line " + std::to_string(line) + " within " +
                     std::to_string(timeout) + " s");
                return;
            }
        }
    }

    void thread_exit(int tid) {
        exited_.fetch_add(1);
        if (arrived_.load() > 0) {
            fail("thread " + std::to_string(tid) + " left the kernel while " + std::to_string(arrived_.load()) +
                 " thread(s) wait at " + what_ + " (line " + std::to_string(line_.load()) + ")");
        }
    }

    std::string error() {
        std::lock_guard<std::mutex> lk(error_mu_);
        return error_;
    }

    void fail(const std::string& msg) {  // record the first divergence and release every waiter
        {
            std::lock_guard<std::mutex> lk(error_mu_);
            if (error_.empty()) error_ = "threads of a block diverged at a barrier: " + msg;
        }
        broken_.store(true, std::memory_order_release);
    }

  private:
    int expected_ = 0;
    std::string what_ = "__syncthreads()";
    std::atomic<int> arrived_{0}, exited_{0}, line_{-1};
    std::atomic<unsigned long> generation_{0};
    std::atomic<bool> broken_{false};
    std::mutex error_mu_;  // only taken on the error path
    std::string error_;
};

inline BlockBarrier g_barrier;
inline std::mutex g_launch_lock;

// The threads that run a block's CUDA threads, made once and kept: run(n, job) hands job(t) to threads
// 0..n-1, all at once, and returns when every one has finished. Each thread is a real std::thread, so the
// threads of one block still run concurrently (and race, where a kernel lets them).
class ThreadPool {
  public:
    void run(int n, const std::function<void(int)>& job) {
        std::unique_lock<std::mutex> lk(mu_);
        while (static_cast<int>(started_) < n) {
            const int id = static_cast<int>(started_++);
            std::thread([this, id] { work(id); }).detach();  // lives as long as the process
        }
        job_ = &job;
        n_ = n;
        remaining_ = n;
        ++generation_;
        wake_.notify_all();
        done_.wait(lk, [this] { return remaining_ == 0; });
        job_ = nullptr;
    }

  private:
    void work(int id) {
        unsigned long seen = 0;
        std::unique_lock<std::mutex> lk(mu_);
        for (;;) {
            wake_.wait(lk, [&] { return generation_ != seen; });
            seen = generation_;
            if (id >= n_) continue;  // this block has fewer threads
            const std::function<void(int)>* job = job_;
            lk.unlock();
            (*job)(id);
            lk.lock();
            if (--remaining_ == 0) done_.notify_one();
        }
    }

    std::mutex mu_;
    std::condition_variable wake_, done_;
    const std::function<void(int)>* job_ = nullptr;
    int n_ = 0, remaining_ = 0;
    unsigned long generation_ = 0, started_ = 0;
};

inline ThreadPool& thread_pool() {
    static ThreadPool* pool = new ThreadPool;  // never destroyed: its threads wait on it until the process exits
    return *pool;
}

constexpr int kWarpSize = 32;
constexpr int kMaxWarps = 1024 / kWarpSize;
constexpr unsigned int kFullMask = 0xffffffffu;
inline BlockBarrier g_warp_barriers[kMaxWarps];  // one per warp of the block being run
inline std::uint64_t g_shuffle_slots[1024];      // what each thread offers to a shuffle

inline int thread_rank() {
    return static_cast<int>(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z));
}

inline void syncthreads(int line) { g_barrier.sync(line, thread_rank()); }

inline int warp_lanes(int warp, int nthreads) {
    return nthreads - warp * kWarpSize < kWarpSize ? nthreads - warp * kWarpSize : kWarpSize;
}

// __syncwarp(mask): a barrier for the lanes of this thread's warp. Only the full mask of a full warp
// is emulated; anything else is reported as a divergence of the warp.
inline void syncwarp(int line, unsigned int mask = kFullMask) {
    const int tid = thread_rank();
    BlockBarrier& warp = g_warp_barriers[tid / kWarpSize];
    const int nthreads = static_cast<int>(blockDim.x * blockDim.y * blockDim.z);
    if (mask != kFullMask || warp_lanes(tid / kWarpSize, nthreads) != kWarpSize) {
        warp.fail("thread " + std::to_string(tid) + " made a warp call at line " + std::to_string(line) +
                  " with a partial mask or in a partial warp; only full warps with the full mask are emulated");
        return;
    }
    warp.sync(line, tid);
}

// __shfl_sync / __shfl_xor_sync: each lane offers its value, the warp meets at a barrier, each lane reads
// the value of its source lane, and the warp meets again before anyone may offer a new value.
template <typename T>
T shuffle(int line, unsigned int mask, T value, int src_of_lane(int, int), int arg) {
    static_assert(sizeof(T) <= sizeof(std::uint64_t), "the emulated shuffles move values of up to 8 bytes");
    const int tid = thread_rank();
    const int base = tid - tid % kWarpSize;
    std::uint64_t bits = 0;
    std::memcpy(&bits, &value, sizeof(T));
    g_shuffle_slots[tid] = bits;
    syncwarp(line, mask);
    const int src = base + (src_of_lane(tid % kWarpSize, arg) & (kWarpSize - 1));
    bits = g_shuffle_slots[src];
    syncwarp(line, mask);
    T out;
    std::memcpy(&out, &bits, sizeof(T));
    return out;
}
inline int lane_xor(int lane, int lane_mask) { return lane ^ lane_mask; }
inline int lane_from(int, int src_lane) { return src_lane; }

inline int write_error(char* err, int errlen, const std::string& msg) {
    if (err && errlen > 0) std::snprintf(err, static_cast<size_t>(errlen), "%s", msg.c_str());
    return 1;
}

// Run kernel<<<grid, block, smem_bytes>>>(args...) on the CPU. `shared` is the storage that
// `extern __shared__` names (CUDA_EMU_DYNAMIC_SHARED). Returns 0, or 1 with a message in err.
template <typename Kernel, typename... Args>
int launch(dim3 grid, dim3 block, unsigned int smem_bytes, void* shared, char* err, int errlen, Kernel kernel,
           Args... args) {
    std::lock_guard<std::mutex> launch_guard(g_launch_lock);  // one launch at a time
    if (smem_bytes > CUDA_EMU_SHARED_BYTES) {
        return write_error(err, errlen,
                           "launch asks for " + std::to_string(smem_bytes) +
                               " bytes of dynamic shared memory; the emulated device has " +
                               std::to_string(CUDA_EMU_SHARED_BYTES));
    }
    const int nthreads = static_cast<int>(block.x * block.y * block.z);
    if (nthreads < 1 || nthreads > 1024) {
        return write_error(err, errlen, "block of " + std::to_string(nthreads) + " threads (need 1..1024)");
    }
    g_dynamic_smem_bytes = smem_bytes;
    for (unsigned int bz = 0; bz < grid.z; ++bz)
        for (unsigned int by = 0; by < grid.y; ++by)
            for (unsigned int bx = 0; bx < grid.x; ++bx) {
                std::memset(shared, 0xff, CUDA_EMU_SHARED_BYTES);  // 0xffffffff is a float NaN
                g_barrier.reset(nthreads);
                for (int w = 0; w * kWarpSize < nthreads; ++w)
                    g_warp_barriers[w].reset(warp_lanes(w, nthreads), "a warp call of warp " + std::to_string(w));
                thread_pool().run(nthreads, [=](int t) {
                    threadIdx = uint3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
                    blockIdx = uint3{bx, by, bz};
                    blockDim = block;
                    gridDim = grid;
                    kernel(args...);
                    g_barrier.thread_exit(t);
                    g_warp_barriers[t / kWarpSize].thread_exit(t);
                });
                std::string e = g_barrier.error();
                for (int w = 0; e.empty() && w * kWarpSize < nthreads; ++w) e = g_warp_barriers[w].error();
                if (!e.empty()) {
                    return write_error(err, errlen,
                                       e + " [block (" + std::to_string(bx) + ", " + std::to_string(by) + ", " +
                                           std::to_string(bz) + ")]");
                }
            }
    return 0;
}

}  // namespace cuda_emu

#define __syncthreads() ::cuda_emu::syncthreads(__LINE__)
#define __syncwarp(...) ::cuda_emu::syncwarp(__LINE__ __VA_OPT__(, ) __VA_ARGS__)
#define __shfl_xor_sync(mask, value, lane_mask, ...) \
    ::cuda_emu::shuffle(__LINE__, mask, value, ::cuda_emu::lane_xor, lane_mask)
#define __shfl_sync(mask, value, src_lane, ...) ::cuda_emu::shuffle(__LINE__, mask, value, ::cuda_emu::lane_from, src_lane)

// The bytes of dynamic shared memory of this launch (on a GPU: the %dynamic_smem_size register).
inline unsigned int dynamic_smem_size() { return cuda_emu::g_dynamic_smem_bytes; }

// Storage for `extern __shared__ type name[];` -- put it in the launcher, after the #include of the .cu.
#define CUDA_EMU_DYNAMIC_SHARED(type, name) alignas(16) type name[CUDA_EMU_SHARED_BYTES / sizeof(type)]
