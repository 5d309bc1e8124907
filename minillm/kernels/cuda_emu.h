// cuda_emu.h -- run a CUDA C kernel, unchanged, on a CPU.
//
// Compile the .cu file with g++ and this header force-included:
//
//     g++ -std=c++20 -O2 -shared -fPIC -pthread -include cuda_emu.h launcher.cpp -o kernel.so
//
// where launcher.cpp #includes the .cu, defines the dynamic shared memory with
// CUDA_EMU_DYNAMIC_SHARED(type, name) and calls cuda_emu::launch(grid, block, smem, kernel, args...).
// (minillm.flash_attention writes that launcher for you and caches the build.)
//
// The execution model, kept as close to CUDA as a CPU allows:
//   - blocks run one after another, in blockIdx order x, then y, then z;
//   - the threads of one block run as real std::threads, so races are real races
//     (build with -fsanitize=thread and ThreadSanitizer reports them);
//   - threadIdx, blockIdx, blockDim, gridDim are thread_local;
//   - `extern __shared__` storage is one static array, used by the one block being run and
//     filled with NaN before each block (uninitialized shared memory shows up as NaN);
//   - __syncthreads() is a barrier that checks what CUDA leaves undefined: every thread of the
//     block must reach the *same* __syncthreads() (same source line), and no thread may leave
//     the kernel while others wait at one. A violation (divergence) breaks the barrier: all
//     waiters are released and the launch returns an error that names the line and the threads.
//   - launches are serialized by a global lock.
// Supported: extern __shared__ (dynamic) shared memory, 1-D/2-D/3-D grids and blocks, the math
// functions below. Not supported: statically sized __shared__ arrays, warp intrinsics, atomics.
#pragma once
#define CUDA_EMU 1

#include <bit>
#include <chrono>
#include <cmath>
#include <condition_variable>
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
class BlockBarrier {
  public:
    void reset(int expected) {
        std::lock_guard<std::mutex> lk(mu_);
        expected_ = expected;
        arrived_ = exited_ = 0;
        line_ = -1;
        generation_ = 0;
        broken_ = false;
        error_.clear();
    }

    void sync(int line, int tid) {
        std::unique_lock<std::mutex> lk(mu_);
        if (broken_) return;
        if (exited_ > 0) {
            fail(lk, "thread " + std::to_string(tid) + " waits at __syncthreads() (line " + std::to_string(line) +
                         ") but " + std::to_string(exited_) + " thread(s) of the block already left the kernel");
            return;
        }
        if (arrived_ == 0) {
            line_ = line;
        } else if (line != line_) {
            fail(lk, "thread " + std::to_string(tid) + " reached __syncthreads() at line " + std::to_string(line) +
                         " while " + std::to_string(arrived_) + " thread(s) wait at line " + std::to_string(line_));
            return;
        }
        if (++arrived_ == expected_) {  // the last one in releases everybody
            arrived_ = 0;
            ++generation_;
            cv_.notify_all();
            return;
        }
        const unsigned long gen = generation_;
        const auto timeout = std::chrono::duration<double>(barrier_timeout_s());
        if (!cv_.wait_for(lk, timeout, [&] { return generation_ != gen || broken_; })) {
            fail(lk, "only " + std::to_string(arrived_) + " of " + std::to_string(expected_) +
                         " threads reached __syncthreads() at line " + std::to_string(line_) + " within " +
                         std::to_string(barrier_timeout_s()) + " s");
        }
    }

    void thread_exit(int tid) {
        std::unique_lock<std::mutex> lk(mu_);
        ++exited_;
        if (!broken_ && arrived_ > 0) {
            fail(lk, "thread " + std::to_string(tid) + " left the kernel while " + std::to_string(arrived_) +
                         " thread(s) wait at __syncthreads() (line " + std::to_string(line_) + ")");
        }
    }

    std::string error() {
        std::lock_guard<std::mutex> lk(mu_);
        return error_;
    }

  private:
    void fail(std::unique_lock<std::mutex>&, const std::string& msg) {
        broken_ = true;
        error_ = "threads of a block diverged at a barrier: " + msg;
        cv_.notify_all();
    }

    std::mutex mu_;
    std::condition_variable cv_;
    int expected_ = 0, arrived_ = 0, exited_ = 0, line_ = -1;
    unsigned long generation_ = 0;
    bool broken_ = false;
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
