// The CUDA kernels of engine/src/backend/cuda/kernels.cu compiled for the CPU, for engine/tests/cuda_host.rs: a
// grid runs one thread block at a time, and a block's threads run as fibers (ucontext) that switch at each
// barrier, so `__syncthreads`, shared memory and warp shuffles behave as on a GPU for code whose threads all reach
// the same barriers (CUDA requires that too). Slow, and only for checking what the kernels compute: their speed
// and the GPU's own rounding of `__expf` and `rsqrtf` are the GPU check's (scripts/device/check.sh).

#include <ucontext.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <array>
#include <functional>
#include <utility>
#include <vector>

// CUDA's 16-byte vector of four 32-bit words.
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
static dim3 threadIdx, blockIdx, blockDim, gridDim;

#define __global__
#define __device__
#define __forceinline__ inline
// One block runs at a time, so a block's shared variables are the function's statics.
#define __shared__ static

namespace host {
static std::vector<ucontext_t> fibers;
static std::vector<std::vector<char>> stacks;
static std::vector<bool> finished;
static ucontext_t scheduler;
static unsigned current = 0;
static std::vector<float> lanes;
static std::vector<int> int_lanes;
static std::vector<unsigned char> dynamic_shared;
static std::function<void()> body;
const std::size_t STACK = 256 * 1024;

// The running thread waits at a barrier: the others run up to it before any goes on.
inline void barrier() { swapcontext(&fibers[current], &scheduler); }

void fiber_main() {
    body();
    finished[current] = true;
}
}  // namespace host

#define TANDEM_HOST 1
#define DYNAMIC_SHARED(T, name) T* name = reinterpret_cast<T*>(host::dynamic_shared.data())

inline void __syncthreads() { host::barrier(); }

// Every thread of the block calls it at once (as the kernels do): each leaves its value, all wait, each reads its
// partner's, all wait again before the slots are reused.
template <typename T>
inline T exchange(std::vector<T>& lanes, T v, int offset) {
    unsigned t = threadIdx.x;
    lanes[t] = v;
    host::barrier();
    T other = lanes[t ^ static_cast<unsigned>(offset)];
    host::barrier();
    return other;
}

inline float __shfl_xor_sync(unsigned, float v, int offset) { return exchange(host::lanes, v, offset); }
inline int __shfl_xor_sync(unsigned, int v, int offset) { return exchange(host::int_lanes, v, offset); }

inline float __expf(float x) { return std::exp(x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
using std::fmaxf;
using std::min;

// f16 conversions as the PTX `cvt` instructions do them (round to nearest even).
inline float tandem_host_h2f(unsigned short h) {
    _Float16 x;
    std::memcpy(&x, &h, 2);
    return static_cast<float>(x);
}
inline unsigned short tandem_host_f2h(float f) {
    _Float16 x = static_cast<_Float16>(f);
    unsigned short h;
    std::memcpy(&h, &x, 2);
    return h;
}

// mma.sync.m16n8k16 (f16 inputs, f32 sums) over the warp of the calling thread, from its lanes' fragments as the
// PTX ISA lays them out (kernels.cu's `mma_16816`): every lane leaves its registers, all wait, each rebuilds the two
// matrices and computes its own four sums, all wait again before the slots are reused.
namespace host {
static std::vector<std::array<unsigned, 6>> fragments;
}

inline void tandem_host_mma_16816(float* d, const unsigned* a, const unsigned* b) {
    unsigned me = threadIdx.x, warp = me & ~31u;
    host::fragments[me] = {a[0], a[1], a[2], a[3], b[0], b[1]};
    host::barrier();
    // The half of register `reg` of `lane` that holds index `lo_hi` (0: low, 1: high).
    auto half_of = [&](unsigned lane, int reg, int lo_hi) {
        return tandem_host_h2f(static_cast<unsigned short>(host::fragments[warp + lane][reg] >> (16 * lo_hi)));
    };
    // a[row][col]: lane (row % 8) * 4 + (col % 8) / 2, register row / 8 + 2 * (col / 8), half col % 2.
    auto a_at = [&](int row, int col) { return half_of((row % 8) * 4 + (col % 8) / 2, row / 8 + 2 * (col / 8), col % 2); };
    // b[k][n]: lane n * 4 + (k % 8) / 2, register 4 + k / 8, half k % 2.
    auto b_at = [&](int k, int n) { return half_of(n * 4 + (k % 8) / 2, 4 + k / 8, k % 2); };
    int g = static_cast<int>(me & 31u) / 4, t = static_cast<int>(me & 3u);
    for (int i = 0; i < 4; i++) {
        int row = g + 8 * (i / 2), col = 2 * t + (i % 2);
        float sum = 0.0f;
        for (int k = 0; k < 16; k++) sum += a_at(row, k) * b_at(k, col);
        d[i] += sum;
    }
    host::barrier();
}

#include "kernels.cu"

template <typename... A, std::size_t... I>
static void call_with(void (*f)(A...), void** args, std::index_sequence<I...>) {
    f(*static_cast<std::remove_reference_t<A>*>(args[I])...);
}

template <typename... A>
static void invoke(void (*f)(A...), void** args) {
    call_with(f, args, std::index_sequence_for<A...>{});
}

#define KERNEL(k) {#k, [](void** a) { invoke(k, a); }}
static const struct {
    const char* name;
    void (*run)(void**);
} KERNELS[] = {
    KERNEL(dequant_q8_0_f16), KERNEL(dequant_q4_1_f16), KERNEL(embed_f16), KERNEL(rms_norm), KERNEL(rope),
    KERNEL(store_kv),         KERNEL(attention),        KERNEL(silu_mul),  KERNEL(add),      KERNEL(to_f16),
    KERNEL(residual_norm),    KERNEL(rope_store),       KERNEL(attend),    KERNEL(swiglu),
    KERNEL(norm_matvec),      KERNEL(norm_swiglu),      KERNEL(matvec_add),  KERNEL(attend_rows),
    KERNEL(attend_split),     KERNEL(argmax_rows),      KERNEL(norm_qkv_rope), KERNEL(combine_matvec_add),
    KERNEL(attend_rows_tc),
};

// Runs kernel `name` over a grid of gx × gy blocks of `threads` threads with `shared` bytes of dynamic shared
// memory; `args` as cuLaunchKernel takes them (a pointer to each argument's value). 0, or -1 for an unknown name.
extern "C" int tandem_host_launch(const char* name, unsigned gx, unsigned gy, unsigned threads, unsigned shared,
                                  void** args) {
    void (*run)(void**) = nullptr;
    for (const auto& k : KERNELS) {
        if (std::strcmp(k.name, name) == 0) run = k.run;
    }
    if (run == nullptr || threads == 0 || threads > 1024) return -1;
    gridDim = {gx, gy, 1};
    blockDim = {threads, 1, 1};
    host::fibers.resize(threads);
    host::stacks.resize(threads);
    host::finished.assign(threads, false);
    host::lanes.assign(threads, 0.0f);
    host::int_lanes.assign(threads, 0);
    host::fragments.assign(threads, {});
    host::dynamic_shared.assign(shared, 0);
    host::body = [run, args] { run(args); };
    for (unsigned by = 0; by < gy; by++) {
        for (unsigned bx = 0; bx < gx; bx++) {
            blockIdx = {bx, by, 0};
            for (unsigned t = 0; t < threads; t++) {
                host::stacks[t].resize(host::STACK);
                getcontext(&host::fibers[t]);
                host::fibers[t].uc_stack.ss_sp = host::stacks[t].data();
                host::fibers[t].uc_stack.ss_size = host::STACK;
                host::fibers[t].uc_link = &host::scheduler;
                makecontext(&host::fibers[t], host::fiber_main, 0);
                host::finished[t] = false;
            }
            bool running = true;
            while (running) {
                running = false;
                for (unsigned t = 0; t < threads; t++) {
                    if (host::finished[t]) continue;
                    host::current = t;
                    threadIdx = {t, 0, 0};
                    swapcontext(&host::scheduler, &host::fibers[t]);
                    running = running || !host::finished[t];
                }
            }
        }
    }
    return 0;
}
