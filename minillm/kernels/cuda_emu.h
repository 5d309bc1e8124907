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
//     (build with -fsanitize=thread and ThreadSanitizer reports them);
//   - threadIdx, blockIdx, blockDim, gridDim are thread_local;
//   - `extern __shared__` storage is one static array, used by the one block being run and
//     filled with NaN before each block (uninitialized shared memory shows up as NaN);
//   - __syncthreads() is a barrier (atomics, no mutex: see BlockBarrier) that checks what CUDA
//     leaves undefined: every thread of the block must reach the *same* __syncthreads() (same
//     source line), and no thread may leave
//     the kernel while others wait at one. A violation (divergence) breaks the barrier: all
//     waiters are released and the launch returns an error that names the line and the threads.
//   - launches are serialized by a global lock.
// Supported: extern __shared__ (dynamic) shared memory, 1-D/2-D/3-D grids and blocks, the math
// functions below. Not supported: statically sized __shared__ arrays, warp intrinsics, atomics.
#pragma once
#define CUDA_EMU 1

#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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

// ---- math: the intrinsics map to the accurate libm versions ------------------------------
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __int_as_float(int i) { return std::bit_cast<float>(i); }
inline int __float_as_int(float f) { return std::bit_cast<int>(f); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
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
    void reset(int expected) {  // called between blocks, while no thread of a block runs
        expected_ = expected;
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
            fail("thread " + std::to_string(tid) + " reached __syncthreads() at line " + std::to_string(line) +
                 " while other threads wait at line " + std::to_string(first_line));
            return;
        }
        if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == expected_) {  // the last one releases all
            arrived_.store(0, std::memory_order_relaxed);
            line_.store(-1, std::memory_order_relaxed);
            generation_.fetch_add(1, std::memory_order_acq_rel);
            return;
        }
        if (exited_.load() > 0) {  // checked after arriving: thread_exit checks arrived_ after exiting
            fail("thread " + std::to_string(tid) + " waits at __syncthreads() (line " + std::to_string(line) +
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
                     " threads reached __syncthreads() at line " + std::to_string(line) + " within " +
                     std::to_string(timeout) + " s");
                return;
            }
        }
    }

    void thread_exit(int tid) {
        exited_.fetch_add(1);
        if (arrived_.load() > 0) {
            fail("thread " + std::to_string(tid) + " left the kernel while " + std::to_string(arrived_.load()) +
                 " thread(s) wait at __syncthreads() (line " + std::to_string(line_.load()) + ")");
        }
    }

    std::string error() {
        std::lock_guard<std::mutex> lk(error_mu_);
        return error_;
    }

  private:
    void fail(const std::string& msg) {  // record the first divergence and release every waiter
        {
            std::lock_guard<std::mutex> lk(error_mu_);
            if (error_.empty()) error_ = "threads of a block diverged at a barrier: " + msg;
        }
        broken_.store(true, std::memory_order_release);
    }

    int expected_ = 0;
    std::atomic<int> arrived_{0}, exited_{0}, line_{-1};
    std::atomic<unsigned long> generation_{0};
    std::atomic<bool> broken_{false};
    std::mutex error_mu_;  // only taken on the error path
    std::string error_;
};

inline BlockBarrier g_barrier;
inline std::mutex g_launch_lock;

inline void syncthreads(int line) {
    const int tid = static_cast<int>(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z));
    g_barrier.sync(line, tid);
}

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
                std::vector<std::thread> threads;
                threads.reserve(nthreads);
                for (int t = 0; t < nthreads; ++t) {
                    threads.emplace_back([=] {
                        threadIdx = uint3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
                        blockIdx = uint3{bx, by, bz};
                        blockDim = block;
                        gridDim = grid;
                        kernel(args...);
                        g_barrier.thread_exit(t);
                    });
                }
                for (auto& th : threads) th.join();
                const std::string e = g_barrier.error();
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

// The bytes of dynamic shared memory of this launch (on a GPU: the %dynamic_smem_size register).
inline unsigned int dynamic_smem_size() { return cuda_emu::g_dynamic_smem_bytes; }

// Storage for `extern __shared__ type name[];` -- put it in the launcher, after the #include of the .cu.
#define CUDA_EMU_DYNAMIC_SHARED(type, name) alignas(16) type name[CUDA_EMU_SHARED_BYTES / sizeof(type)]
