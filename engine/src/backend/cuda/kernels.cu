// The CUDA backend's kernels, compiled by NVRTC at start-up for the device's compute capability (no headers:
// f16 values travel as their bits, converted with PTX instructions). Each mirrors a step of the CPU forward pass
// (engine/src/forward.rs) in the same order of operations where it can, so that the two can be compared on the
// same weights. The KV cache has the CPU engine's block layout: per block, [layer][K, V][kv head][token][dim],
// f16.

typedef unsigned char u8;
typedef unsigned short u16;

#ifdef TANDEM_HOST
// Compiled for the CPU by engine/tests/cuda_host.rs (engine/tests/cuda_host/host.cpp): the same conversions.
__device__ __forceinline__ float h2f(u16 h) { return tandem_host_h2f(h); }
__device__ __forceinline__ u16 f2h(float f) { return tandem_host_f2h(f); }
#else
__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#endif

// A kernel's dynamic shared memory (the host build gives it another form).
#ifndef DYNAMIC_SHARED
#define DYNAMIC_SHARED(T, name) extern __shared__ T name[]
#endif

__device__ __forceinline__ u16 load_u16(const u8* p) {
    return (u16)p[0] | ((u16)p[1] << 8);
}

// Sum of `v` over the thread block (blockDim.x a multiple of 32, at most 1024); every thread gets the total.
__device__ float block_sum(float v) {
    __shared__ float partial[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    int warps = blockDim.x >> 5;
    v = lane < warps ? partial[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    return v;
}

// The paged cache's layout, the CPU engine's: per block, [layer][K, V][kv head][token][dim], f16. `head` counts the
// elements of one (layer, part, kv head)'s tokens, `block` a whole block's.
struct Paged {
    long head;
    long block;
    int kv_heads, head_dim, block_tokens;
};

__device__ __forceinline__ Paged paged(int layers, int kv_heads, int head_dim, int block_tokens) {
    Paged p;
    p.head = (long)block_tokens * head_dim;
    p.block = (long)layers * 2 * kv_heads * p.head;
    p.kv_heads = kv_heads;
    p.head_dim = head_dim;
    p.block_tokens = block_tokens;
    return p;
}

// Where position j of the sequence with block table `table` lies, relative to its part's start (`part_at`).
__device__ __forceinline__ long token_at(Paged p, const int* table, int j) {
    return (long)table[j / p.block_tokens] * p.block + (long)(j % p.block_tokens) * p.head_dim;
}

// Where the tokens of (layer, part: 0 for K and 1 for V, kv head) start within a block.
__device__ __forceinline__ long part_at(Paged p, int layer, int part, int kv_head) {
    return ((long)(layer * 2 + part) * p.kv_heads + kv_head) * p.head;
}

// Q8_0 (34 bytes: f16 scale, 32 int8) to f16, `blocks` quantization blocks.
extern "C" __global__ void dequant_q8_0_f16(const u8* src, u16* dst, long blocks) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= blocks * 32) return;
    long b = i / 32;
    int j = (int)(i % 32);
    const u8* q = src + b * 34;
    float d = h2f(load_u16(q));
    dst[i] = f2h(d * (float)(signed char)q[2 + j]);
}

// Q4_1 (20 bytes: f16 scale, f16 minimum, 16 bytes of nibbles: element j low, j + 16 high) to f16.
extern "C" __global__ void dequant_q4_1_f16(const u8* src, u16* dst, long blocks) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= blocks * 32) return;
    long b = i / 32;
    int j = (int)(i % 32);
    const u8* q = src + b * 20;
    float d = h2f(load_u16(q)), m = h2f(load_u16(q + 2));
    u8 byte = q[4 + (j & 15)];
    int nibble = j < 16 ? (byte & 15) : (byte >> 4);
    dst[i] = f2h(d * (float)nibble + m);
}

// One token's embedding row per thread block, from an f16 table: out[t][i] = table[tokens[t]][i].
extern "C" __global__ void embed_f16(const u16* table, const unsigned* tokens, float* out, int n_embd) {
    int t = blockIdx.x;
    const u16* row = table + (long)tokens[t] * n_embd;
    for (int i = threadIdx.x; i < n_embd; i += blockDim.x) out[(long)t * n_embd + i] = h2f(row[i]);
}

// RMSNorm of each row (one thread block per row): out = x / sqrt(mean(x^2) + eps) * w; also writes the result as
// f16 for the next matmul when `out_f16` is not null.
extern "C" __global__ void rms_norm(const float* x, const float* w, float* out, u16* out_f16, int d, float eps) {
    const float* xr = x + (long)blockIdx.x * d;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss);
    float scale = rsqrtf(ss / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = xr[i] * scale * w[i];
        out[(long)blockIdx.x * d + i] = v;
        if (out_f16) out_f16[(long)blockIdx.x * d + i] = f2h(v);
    }
}

// One pair's rotation by (c, s).
__device__ __forceinline__ void rotate(float* p, float c, float s) {
    float a = p[0], b = p[1];
    p[0] = a * c - b * s;
    p[1] = a * s + b * c;
}

// Rotary embedding on adjacent pairs of every head of each row (one thread block per row), with the CPU engine's
// table: rope[pos][pair] = (cos, sin).
extern "C" __global__ void rope(float* x, const int* positions, const float* table, int heads, int head_dim) {
    int row = blockIdx.x, pairs = head_dim / 2;
    const float* t = table + (long)positions[row] * pairs * 2;
    float* xr = x + (long)row * heads * head_dim;
    for (int i = threadIdx.x; i < heads * pairs; i += blockDim.x) {
        int head = i / pairs, pair = i % pairs;
        rotate(xr + head * head_dim + 2 * pair, t[2 * pair], t[2 * pair + 1]);
    }
}

// Writes each row's K and V (kv_dim = kv_heads * head_dim values each) into its slot of the paged cache:
// block slot_block[row], token slot_pos[row] of that block, at `layer`.
extern "C" __global__ void store_kv(const float* k, const float* v, u16* cache, const int* slot_block,
                                    const int* slot_pos, int layer, int layers, int kv_heads, int head_dim,
                                    int block_tokens) {
    int row = blockIdx.x, kv_dim = kv_heads * head_dim;
    Paged pg = paged(layers, kv_heads, head_dim, block_tokens);
    u16* block = cache + (long)slot_block[row] * pg.block;
    for (int i = threadIdx.x; i < kv_dim; i += blockDim.x) {
        int head = i / head_dim, dim = i % head_dim;
        long at = slot_pos[row] * head_dim + dim;
        block[part_at(pg, layer, 0, head) + at] = f2h(k[(long)row * kv_dim + i]);
        block[part_at(pg, layer, 1, head) + at] = f2h(v[(long)row * kv_dim + i]);
    }
}

// Causal attention over the paged cache, one thread block per (query row, head). Row `r` is at position
// positions[r] of the sequence whose block table starts at tables + table_of[r] (max_blocks entries per
// sequence); it attends to positions 0..=positions[r], whose K/V are already stored. Dynamic shared memory:
// (positions + 1) floats of scores, so the longest context is bounded by the device's shared memory per block.
extern "C" __global__ void attention(const float* q, const u16* cache, const int* tables, const int* table_of,
                                     const int* positions, float* out, int layer, int layers, int n_heads,
                                     int kv_heads, int head_dim, int block_tokens, float scale) {
    DYNAMIC_SHARED(float, scores);
    int row = blockIdx.x, head = blockIdx.y;
    int kv_head = head / (n_heads / kv_heads);
    int n = positions[row] + 1;
    const int* table = tables + table_of[row];
    const float* qr = q + ((long)row * n_heads + head) * head_dim;
    Paged pg = paged(layers, kv_heads, head_dim, block_tokens);
    long k_off = part_at(pg, layer, 0, kv_head), v_off = part_at(pg, layer, 1, kv_head);
    float local_max = -3.0e38f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const u16* kr = cache + token_at(pg, table, j) + k_off;
        float s = 0.0f;
        for (int d = 0; d < head_dim; d++) s += qr[d] * h2f(kr[d]);
        s *= scale;
        scores[j] = s;
        local_max = fmaxf(local_max, s);
    }
    // Block-wide maximum, through the same reduction as the sum (max of negated is -min: use a second pass).
    __shared__ float maxes[32];
    for (int o = 16; o > 0; o >>= 1) local_max = fmaxf(local_max, __shfl_xor_sync(0xffffffffu, local_max, o));
    if ((threadIdx.x & 31) == 0) maxes[threadIdx.x >> 5] = local_max;
    __syncthreads();
    float m = -3.0e38f;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) m = fmaxf(m, maxes[w]);
    float sum = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        float e = __expf(scores[j] - m);
        scores[j] = e;
        sum += e;
    }
    sum = block_sum(sum);
    __syncthreads();
    float inv = 1.0f / sum;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < n; j++) {
            const u16* vr = cache + token_at(pg, table, j) + v_off;
            acc += scores[j] * h2f(vr[d]);
        }
        out[((long)row * n_heads + head) * head_dim + d] = acc * inv;
    }
}

// out = silu(gate) * up, also as f16 for the down projection.
extern "C" __global__ void silu_mul(const float* gate, const float* up, u16* out_f16, long n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float g = gate[i];
    out_f16[i] = f2h(g / (1.0f + __expf(-g)) * up[i]);
}

// x += y (the residual stream).
extern "C" __global__ void add(float* x, const float* y, long n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

// f32 to f16 (activations into a matmul).
extern "C" __global__ void to_f16(const float* x, u16* out, long n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f2h(x[i]);
}

// ---- The fused forward's kernels (engine/src/backend/gpu): a layer in five kernels and four matmuls. ----

// Maximum of `v` over the thread block, as `block_sum`.
__device__ float block_max(float v) {
    __shared__ float partial[32];
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    int warps = blockDim.x >> 5;
    v = lane < warps ? partial[lane] : -3.0e38f;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    return v;
}

// The residual add and the next RMSNorm together: x += y (when y is not null), then the row's norm times w, as f16
// for the next matmul. One thread block per output row i, which reads row rows[i] of x when `rows` is not null (the
// final norm, over the rows whose logits are asked for) and row i otherwise.
extern "C" __global__ void residual_norm(float* x, const float* y, const float* w, u16* out_f16, const int* rows,
                                         int d, float eps) {
    long r = rows ? rows[blockIdx.x] : blockIdx.x;
    float* xr = x + r * d;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = xr[i];
        if (y) {
            v += y[r * d + i];
            xr[i] = v;
        }
        ss += v * v;
    }
    ss = block_sum(ss);
    float scale = rsqrtf(ss / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) out_f16[(long)blockIdx.x * d + i] = f2h(xr[i] * scale * w[i]);
}

// One thread block per row of the stacked Q/K/V matmul's output (each row Q, then K, then V: n_heads + 2 *
// kv_heads heads of head_dim): RoPE on the Q and K heads in place (the table as `rope`), then K and V as f16 into
// the row's slot of the paged cache (as `store_kv`).
extern "C" __global__ void rope_store(float* qkv, const int* positions, const float* table, u16* cache,
                                      const int* slot_block, const int* slot_pos, int layer, int layers, int n_heads,
                                      int kv_heads, int head_dim, int block_tokens) {
    int row = blockIdx.x, pairs = head_dim / 2;
    int kv_dim = kv_heads * head_dim, q_dim = n_heads * head_dim;
    float* xr = qkv + (long)row * (q_dim + 2 * kv_dim);
    const float* t = table + (long)positions[row] * pairs * 2;
    // Q's heads and K's lie next to each other in the row: one loop rotates both.
    for (int i = threadIdx.x; i < (n_heads + kv_heads) * pairs; i += blockDim.x) {
        int head = i / pairs, pair = i % pairs;
        rotate(xr + head * head_dim + 2 * pair, t[2 * pair], t[2 * pair + 1]);
    }
    __syncthreads();
    Paged pg = paged(layers, kv_heads, head_dim, block_tokens);
    u16* block = cache + (long)slot_block[row] * pg.block;
    for (int i = threadIdx.x; i < kv_dim; i += blockDim.x) {
        int head = i / head_dim, dim = i % head_dim;
        long at = (long)slot_pos[row] * head_dim + dim;
        block[part_at(pg, layer, 0, head) + at] = f2h(xr[q_dim + i]);
        block[part_at(pg, layer, 1, head) + at] = f2h(xr[q_dim + kv_dim + i]);
    }
}

// q · k over head_dim values, k in f16: eight at a time (one 16-byte load) when head_dim is a multiple of 8, as the
// cache's layout then keeps every key row 16-byte aligned; the products are summed in the same order either way.
__device__ __forceinline__ float dot_f16(const float* q, const u16* k, int head_dim) {
    float dot = 0.0f;
    if (head_dim % 8 == 0) {
        const uint4* k8 = reinterpret_cast<const uint4*>(k);
        for (int c = 0; c < head_dim / 8; c++) {
            uint4 v = k8[c];
            unsigned w[4] = {v.x, v.y, v.z, v.w};
            for (int i = 0; i < 4; i++) {
                dot += q[8 * c + 2 * i] * h2f((u16)(w[i] & 0xffffu));
                dot += q[8 * c + 2 * i + 1] * h2f((u16)(w[i] >> 16));
            }
        }
    } else {
        for (int d = 0; d < head_dim; d++) dot += q[d] * h2f(k[d]);
    }
    return dot;
}

// Keys per tile of `attend`: its thread blocks have this many threads, one key each.
#define ATTEND_TILE 128

// The keys of tiles first, first + step, first + 2 * step, ... (ATTEND_TILE positions each, up to the row's own
// position) of row `row`'s sequence for `head`, one thread block of ATTEND_TILE threads, with a running maximum
// (online softmax): leaves the weighted sum of their values, not yet divided by the weights' sum, in sums[0,
// head_dim) (shared memory of the caller's), the maximum in *m_out, and returns the weights' sum. head_dim is at
// most 2 * ATTEND_TILE.
__device__ float attend_keys(const float* q, int q_stride, const u16* cache, const int* tables, const int* table_of,
                             const int* positions, int row, int head, int first, int step, int layer, int layers,
                             int n_heads, int kv_heads, int head_dim, int block_tokens, float scale, float* sums,
                             float* m_out) {
    __shared__ float qs[2 * ATTEND_TILE];
    __shared__ float weights[ATTEND_TILE];
    __shared__ float partial[2 * ATTEND_TILE];
    int t = threadIdx.x;
    int kv_head = head / (n_heads / kv_heads);
    int n = positions[row] + 1;
    const int* table = tables + table_of[row];
    Paged pg = paged(layers, kv_heads, head_dim, block_tokens);
    long k_off = part_at(pg, layer, 0, kv_head), v_off = part_at(pg, layer, 1, kv_head);
    for (int i = t; i < head_dim; i += blockDim.x) qs[i] = q[(long)row * q_stride + head * head_dim + i];
    // The output's dims: with head_dim <= the block's threads, `groups` threads share each dim, each taking every
    // groups-th key of a tile; otherwise each thread takes dims t and t + blockDim.x over every key.
    int groups = head_dim <= (int)blockDim.x ? (int)blockDim.x / head_dim : 1;
    int group = head_dim <= (int)blockDim.x ? t / head_dim : 0;
    int dim = head_dim <= (int)blockDim.x ? t % head_dim : t;
    bool accumulates = group < groups;
    float acc0 = 0.0f, acc1 = 0.0f, m = -3.0e38f, l = 0.0f;
    __syncthreads();
    for (int j0 = first * blockDim.x; j0 < n; j0 += step * blockDim.x) {
        int j = j0 + t;
        float s = -3.0e38f;
        if (j < n) {
            const u16* kr = cache + token_at(pg, table, j) + k_off;
            s = dot_f16(qs, kr, head_dim) * scale;
        }
        float m_new = fmaxf(m, block_max(s));
        float alpha = __expf(m - m_new);
        float p = j < n ? __expf(s - m_new) : 0.0f;
        weights[t] = p;
        l = l * alpha + p;
        m = m_new;
        __syncthreads();
        acc0 *= alpha;
        acc1 *= alpha;
        int keys = min((int)blockDim.x, n - j0);
        if (accumulates) {
            for (int k = group; k < keys; k += groups) {
                int jj = j0 + k;
                const u16* vr = cache + token_at(pg, table, jj) + v_off;
                float w = weights[k];
                if (dim < head_dim) acc0 += w * h2f(vr[dim]);
                if (dim + (int)blockDim.x < head_dim) acc1 += w * h2f(vr[dim + blockDim.x]);
            }
        }
        __syncthreads();
    }
    float total = block_sum(l);
    if (accumulates) {
        partial[group * head_dim + dim] = acc0;
        if (dim + (int)blockDim.x < head_dim) partial[dim + blockDim.x] = acc1;
    }
    __syncthreads();
    for (int i = t; i < head_dim; i += blockDim.x) {
        float sum = 0.0f;
        for (int g = 0; g < groups; g++) sum += partial[g * head_dim + i];
        sums[i] = sum;
    }
    __syncthreads();
    *m_out = m;
    return total;
}

// Causal attention over the paged cache, one thread block of ATTEND_TILE threads per (query row, head), over all
// of the row's keys (`attend_keys`): shared memory does not grow with the context, so a step's launch does not
// depend on its longest sequence. Block x takes row rows[x] when `rows` is not null (a step's single-token rows,
// next to prompts that go through `attend_rows`), row x otherwise. Q is read from the stacked Q/K/V rows
// (q_stride floats apart); the output goes out as f16, `[row][head][head_dim]`, for the output projection.
extern "C" __global__ void attend(const float* q, int q_stride, const u16* cache, const int* tables,
                                  const int* table_of, const int* positions, const int* rows, u16* out, int layer,
                                  int layers, int n_heads, int kv_heads, int head_dim, int block_tokens,
                                  float scale) {
    __shared__ float sums[2 * ATTEND_TILE];
    int row = rows ? rows[blockIdx.x] : blockIdx.x, head = blockIdx.y;
    float m;
    float inv = 1.0f / attend_keys(q, q_stride, cache, tables, table_of, positions, row, head, 0, 1, layer, layers,
                                   n_heads, kv_heads, head_dim, block_tokens, scale, sums, &m);
    u16* o = out + ((long)row * n_heads + head) * head_dim;
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) o[i] = f2h(sums[i] * inv);
}

// Splits of a small decode step's attention: each (row, head) over ATTEND_SPLITS thread blocks, split s taking
// key tiles s, s + ATTEND_SPLITS, ..., so that a batch of one sequence keeps more than n_heads blocks busy. Block
// (x, y) is row x, head y / ATTEND_SPLITS, split y % ATTEND_SPLITS; it writes its maximum, its weights' sum and
// its undivided sums to partials, `[row][head][split][2 + head_dim]`, for `combine_matvec_add`.
#define ATTEND_SPLITS 8
extern "C" __global__ void attend_split(const float* q, int q_stride, const u16* cache, const int* tables,
                                        const int* table_of, const int* positions, float* partials, int layer,
                                        int layers, int n_heads, int kv_heads, int head_dim, int block_tokens,
                                        float scale) {
    __shared__ float sums[2 * ATTEND_TILE];
    int row = blockIdx.x, head = blockIdx.y / ATTEND_SPLITS, split = blockIdx.y % ATTEND_SPLITS;
    float m;
    float l = attend_keys(q, q_stride, cache, tables, table_of, positions, row, head, split, ATTEND_SPLITS, layer,
                          layers, n_heads, kv_heads, head_dim, block_tokens, scale, sums, &m);
    float* p = partials + ((long)(row * n_heads + head) * ATTEND_SPLITS + split) * (2 + head_dim);
    if (threadIdx.x == 0) {
        p[0] = m;
        p[1] = l;
    }
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) p[2 + i] = sums[i];
}

// silu(gate) * up as f16 from the stacked gate/up matmul's rows (`[row][gate: ff][up: ff]`); n = rows * ff.
extern "C" __global__ void swiglu(const float* gate_up, u16* out_f16, int ff, long n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    long r = i / ff, j = i % ff;
    float g = gate_up[r * 2 * ff + j], u = gate_up[r * 2 * ff + ff + j];
    out_f16[i] = f2h(g / (1.0f + __expf(-g)) * u);
}

// ---- Small steps (up to MV_MAX_ROWS rows) without cuBLAS: each matmul is a matrix-vector kernel that does the
// work around it too, so a decode layer is five kernels (`norm_qkv_rope`, `attend_split`, `combine_matvec_add`,
// `norm_swiglu`, `matvec_add`). One warp per output row (or pair of rows); its lanes walk the row's weights (two
// f16 or half a quantized block at a time), for every input row at once. A warp with no output row of its own still takes part in the shuffles (all
// threads of a block reach the same reductions), computing a row it does not write. ----

#define MV_MAX_ROWS 4
#define MV_WARPS 8

// The sum over the warp, every lane getting it.
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Normalizes rows of x (RMSNorm with w; input row rows[i] when `rows` is not null) into xs, `[i][d]`, in the
// block's shared memory: every block needs all of them, and they are small.
__device__ void norm_rows(const float* x, const int* rows, int n, const float* w, int d, float eps, float* xs) {
    for (int i = 0; i < n; i++) {
        const float* xr = x + (long)(rows ? rows[i] : i) * d;
        float ss = 0.0f;
        for (int c = threadIdx.x; c < d; c += blockDim.x) ss += xr[c] * xr[c];
        ss = block_sum(ss);
        float scale = rsqrtf(ss / (float)d + eps);
        for (int c = threadIdx.x; c < d; c += blockDim.x) xs[i * d + c] = xr[c] * scale * w[c];
    }
    __syncthreads();
}

// The weight formats the matrix-vector kernels read: f16, or a matrix as the GGUF stores it (Q4_1: 20 bytes per 32
// weights, an f16 scale and minimum, then weights j and j + 16 in the low and high nibbles of byte j; Q8_0: 34 bytes,
// an f16 scale and 32 signed bytes), a quarter to a half of f16's bytes for a decode step to read.
#define W_F16 0
#define W_Q4_1 1
#define W_Q8_0 2

// Bytes in one row of `cols` weights (a multiple of 32 when quantized).
__device__ __forceinline__ long row_bytes(int wtype, int cols) {
    return wtype == W_F16 ? 2L * cols : (wtype == W_Q4_1 ? 20L : 34L) * (cols / 32);
}

// Weights 16 h .. 16 h + 15 of a quantized row, dequantized as the CPU engine does (scale × q + minimum).
__device__ __forceinline__ void half_block(const u8* wr, int wtype, int h, float* w) {
    int hi = h & 1;
    if (wtype == W_Q4_1) {
        // Rows of whole 20-byte blocks from 4-byte aligned starts: the nibbles in four 32-bit loads.
        const u8* q = wr + 20L * (h >> 1);
        float d = h2f(load_u16(q)), m = h2f(load_u16(q + 2));
        const unsigned* nibbles = reinterpret_cast<const unsigned*>(q + 4);
        for (int k = 0; k < 4; k++) {
            unsigned v = nibbles[k] >> (4 * hi);
            for (int b = 0; b < 4; b++) w[4 * k + b] = d * (float)((v >> (8 * b)) & 15) + m;
        }
    } else {
        const u8* q = wr + 34L * (h >> 1);
        float d = h2f(load_u16(q));
        for (int j = 0; j < 16; j++) w[j] = d * (float)(signed char)q[2 + 16 * hi + j];
    }
}

// acc[i] += w[0..16) · a[i][c0 .. c0 + 16).
__device__ __forceinline__ void dot16(const float* w, const float* a, int n, int cols, int c0, float* acc) {
    for (int i = 0; i < n; i++) {
        float s = 0.0f;
        for (int j = 0; j < 16; j++) s += w[j] * a[i * cols + c0 + j];
        acc[i] += s;
    }
}

// acc[r][i] = W[o_r] · a[i] over `cols` columns for the warp's R weight rows (wr[r], in format wtype; two: a rotary
// pair, or gate and up), summed over the warp; `a` in f32. f16 rows are walked two columns a lane at a time (`cols`
// even), quantized ones 16 (half a block); the rows' loads go out together, so the warp waits on memory once.
template <int R>
__device__ void dot_rows(const u8* const* wr, int wtype, const float* a, int n, int cols, float (*acc)[MV_MAX_ROWS]) {
    int lane = threadIdx.x & 31;
    for (int r = 0; r < R; r++)
        for (int i = 0; i < MV_MAX_ROWS; i++) acc[r][i] = 0.0f;
    if (wtype == W_F16) {
        for (int c = 2 * lane; c < cols; c += 64) {
            float w[R][2];
            for (int r = 0; r < R; r++) {
                const u16* row = reinterpret_cast<const u16*>(wr[r]);
                w[r][0] = h2f(row[c]);
                w[r][1] = h2f(row[c + 1]);
            }
            for (int i = 0; i < n; i++)
                for (int r = 0; r < R; r++) acc[r][i] += w[r][0] * a[i * cols + c] + w[r][1] * a[i * cols + c + 1];
        }
    } else {
        for (int h = lane; h < cols / 16; h += 32) {
            float w[R][16];
            for (int r = 0; r < R; r++) half_block(wr[r], wtype, h, w[r]);
            for (int r = 0; r < R; r++) dot16(w[r], a, n, cols, 16 * h, acc[r]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < MV_MAX_ROWS; i++) acc[r][i] = warp_sum(acc[r][i]);
}

// y[i][o] = W[o] · norm(x[i]) for the n (at most MV_MAX_ROWS) rows; W is `out_rows × d` in format wtype. Grid: one
// block per MV_WARPS output rows; dynamic shared memory n * d floats.
extern "C" __global__ void norm_matvec(const float* x, const int* rows, int n, const float* w, int d, float eps,
                                       const u8* W, int wtype, int out_rows, float* y) {
    DYNAMIC_SHARED(float, xs);
    norm_rows(x, rows, n, w, d, eps, xs);
    int warp = threadIdx.x >> 5, o = blockIdx.x * MV_WARPS + warp;
    const u8* wr = W + (o < out_rows ? o : out_rows - 1) * row_bytes(wtype, d);
    float acc[1][MV_MAX_ROWS];
    dot_rows<1>(&wr, wtype, xs, n, d, acc);
    if ((threadIdx.x & 31) == 0 && o < out_rows)
        for (int i = 0; i < n; i++) y[(long)i * out_rows + o] = acc[0][i];
}

// act[i][j] = silu(gate_j · norm(x[i])) * (up_j · norm(x[i])) as f16, W the stacked gate/up rows (2 ff × d).
extern "C" __global__ void norm_swiglu(const float* x, int n, const float* w, int d, float eps, const u8* W, int wtype,
                                       int ff, u16* act) {
    DYNAMIC_SHARED(float, xs);
    norm_rows(x, 0, n, w, d, eps, xs);
    int warp = threadIdx.x >> 5, o = blockIdx.x * MV_WARPS + warp;
    int j = o < ff ? o : ff - 1;
    long stride = row_bytes(wtype, d);
    const u8* wr[2] = {W + j * stride, W + (ff + j) * stride};
    float acc[2][MV_MAX_ROWS];
    dot_rows<2>(wr, wtype, xs, n, d, acc);
    if ((threadIdx.x & 31) == 0 && o < ff)
        for (int i = 0; i < n; i++) {
            float gate = acc[0][i], up = acc[1][i];
            act[(long)i * ff + o] = f2h(gate / (1.0f + __expf(-gate)) * up);
        }
}

// x[i][o] += W[o] · as[i] for the block's MV_WARPS output rows, `as` `[i][cols]` f32 in shared memory.
__device__ void project_add(const u8* W, int wtype, int out_rows, int cols, const float* as, int n, float* x) {
    int warp = threadIdx.x >> 5, o = blockIdx.x * MV_WARPS + warp;
    const u8* wr = W + (o < out_rows ? o : out_rows - 1) * row_bytes(wtype, cols);
    float acc[1][MV_MAX_ROWS];
    dot_rows<1>(&wr, wtype, as, n, cols, acc);
    if ((threadIdx.x & 31) == 0 && o < out_rows)
        for (int i = 0; i < n; i++) x[(long)i * out_rows + o] += acc[0][i];
}

// x[i][o] += W[o] · a[i]: a projection straight into the residual stream; `a` is `[i][cols]` f16 (attention's
// output, SiLU-multiply's), read into shared memory as f32 (dynamic: n * cols floats).
extern "C" __global__ void matvec_add(const u8* W, int wtype, int out_rows, int cols, const u16* a, int n, float* x) {
    DYNAMIC_SHARED(float, as);
    for (int k = threadIdx.x; k < n * cols; k += blockDim.x) as[k] = h2f(a[k]);
    __syncthreads();
    project_add(W, wtype, out_rows, cols, as, n, x);
}

// The stacked Q/K/V projection of norm(x[i]) for the n rows, with RoPE and the K/V store (`norm_matvec` and then
// `rope_store`, in one kernel): warp w takes output rows 2w and 2w + 1, one rotary pair (a head's head_dim rows
// start at an even row), rotates them where they are Q or K, and leaves them in qkv (`[row][q_dim + 2 kv_dim]`,
// where attention reads Q) and, for K and V, as f16 in the row's cache slot. Grid: one block per 2 * MV_WARPS
// output rows; dynamic shared memory n * d floats.
extern "C" __global__ void norm_qkv_rope(const float* x, int n, const float* w, int d, float eps, const u8* W,
                                         int wtype, float* qkv, const int* positions, const float* table, u16* cache,
                                         const int* slot_block, const int* slot_pos, int layer, int layers,
                                         int n_heads, int kv_heads, int head_dim, int block_tokens) {
    DYNAMIC_SHARED(float, xs);
    norm_rows(x, 0, n, w, d, eps, xs);
    int kv_dim = kv_heads * head_dim, q_dim = n_heads * head_dim, out_rows = q_dim + 2 * kv_dim;
    int warp = threadIdx.x >> 5, o = 2 * (blockIdx.x * MV_WARPS + warp);
    int row = o < out_rows ? o : out_rows - 2;
    long stride = row_bytes(wtype, d);
    const u8* wr[2] = {W + row * stride, W + (row + 1) * stride};
    float acc[2][MV_MAX_ROWS];
    dot_rows<2>(wr, wtype, xs, n, d, acc);
    if ((threadIdx.x & 31) != 0 || o >= out_rows) return;
    int pairs = head_dim / 2, pair = (o % head_dim) / 2;
    Paged pg = paged(layers, kv_heads, head_dim, block_tokens);
    for (int i = 0; i < n; i++) {
        float p[2] = {acc[0][i], acc[1][i]};
        if (o < q_dim + kv_dim) {
            const float* t = table + (long)positions[i] * pairs * 2;
            rotate(p, t[2 * pair], t[2 * pair + 1]);
        }
        float* xr = qkv + (long)i * out_rows;
        xr[o] = p[0];
        xr[o + 1] = p[1];
        if (o < q_dim) continue;
        // K (part 0) or V (part 1), at k of its kv_dim values.
        int part = o < q_dim + kv_dim ? 0 : 1, k = o - q_dim - part * kv_dim;
        int head = k / head_dim, dim = k % head_dim;
        u16* slot = cache + (long)slot_block[i] * pg.block +
                    part_at(pg, layer, part, head) + (long)slot_pos[i] * head_dim + dim;
        slot[0] = f2h(p[0]);
        slot[1] = f2h(p[1]);
    }
}

// A small decode step's split attention merged (the splits' sums and weights' sums rescaled to their common
// maximum, divided; a split with no keys, its maximum at the floor and its sum zero, weighs nothing) into shared
// memory for every row and head, rounded to f16 as attention's output is elsewhere, then the output projection
// added into the residual stream: x[i][o] += W[o] · attended[i]. Every block merges all of it (a few KB of
// partials) instead of a kernel of its own doing it once. Grid: one block per MV_WARPS output rows; dynamic
// shared memory (n * n_heads * (head_dim + ATTEND_SPLITS + 1)) floats.
extern "C" __global__ void combine_matvec_add(const float* partials, int n_heads, int head_dim, const u8* W,
                                              int wtype, int out_rows, int n, float* x) {
    DYNAMIC_SHARED(float, as);
    int cols = n_heads * head_dim, width = 2 + head_dim, pairs = n * n_heads;
    // Per (row, head): each split's factor to the common maximum, and the weights' sum.
    float* factor = as + n * cols;
    float* total = factor + pairs * ATTEND_SPLITS;
    for (int h = threadIdx.x; h < pairs; h += blockDim.x) {
        const float* p = partials + (long)h * ATTEND_SPLITS * width;
        float top = -3.0e38f;
        for (int s = 0; s < ATTEND_SPLITS; s++) top = fmaxf(top, p[s * width]);
        float sum = 0.0f;
        for (int s = 0; s < ATTEND_SPLITS; s++) {
            float f = __expf(p[s * width] - top);
            factor[h * ATTEND_SPLITS + s] = f;
            sum += f * p[s * width + 1];
        }
        total[h] = sum;
    }
    __syncthreads();
    for (int k = threadIdx.x; k < n * cols; k += blockDim.x) {
        int h = k / head_dim, dim = k % head_dim;
        const float* p = partials + (long)h * ATTEND_SPLITS * width;
        float acc = 0.0f;
        for (int s = 0; s < ATTEND_SPLITS; s++) acc += factor[h * ATTEND_SPLITS + s] * p[s * width + 2 + dim];
        as[k] = h2f(f2h(acc / total[h]));
    }
    __syncthreads();
    project_add(W, wtype, out_rows, cols, as, n, x);
}

// ---- Prompts: attention for a tile of a sequence's consecutive query rows at once, so each key and value is read
// from the cache once per tile instead of once per row. ----

#define ROWS_TILE 16
#define KEYS_TILE 32
#define ROWS_MAX_HEAD_DIM 128

// Causal attention for tiles of up to ROWS_TILE consecutive rows of one sequence (tile k: rows tiles[2k] ..
// tiles[2k] + tiles[2k + 1], at consecutive positions), one thread block of 128 threads per (tile, head). Keys and
// values go through shared memory KEYS_TILE positions at a time; eight threads serve each query row, each taking
// four keys of a tile for the scores and head_dim / 8 dims of the output, with a running maximum per row (online
// softmax). Inputs and output as `attend`'s; head_dim at most ROWS_MAX_HEAD_DIM and a multiple of 8.
extern "C" __global__ void attend_rows(const float* q, int q_stride, const u16* cache, const int* tables,
                                       const int* table_of, const int* positions, const int* tiles, u16* out,
                                       int layer, int layers, int n_heads, int kv_heads, int head_dim,
                                       int block_tokens, float scale) {
    __shared__ float qs[ROWS_TILE][ROWS_MAX_HEAD_DIM];
    __shared__ float ks[KEYS_TILE][ROWS_MAX_HEAD_DIM];
    __shared__ float vs[KEYS_TILE][ROWS_MAX_HEAD_DIM];
    __shared__ float ps[ROWS_TILE][KEYS_TILE];
    int first = tiles[2 * blockIdx.x], count = tiles[2 * blockIdx.x + 1];
    int head = blockIdx.y, t = threadIdx.x;
    int kv_head = head / (n_heads / kv_heads);
    // This thread's query row in the tile (a row past the tile's end computes the last row's and writes nothing)
    // and its part: keys part, part + 8, ... of each key tile, and dims part * per .. (part + 1) * per.
    int r = t >> 3, part = t & 7, per = head_dim / 8;
    int row = first + (r < count ? r : count - 1);
    int pos = positions[row], last = positions[first + count - 1];
    const int* table = tables + table_of[first];
    Paged pg = paged(layers, kv_heads, head_dim, block_tokens);
    long k_off = part_at(pg, layer, 0, kv_head), v_off = part_at(pg, layer, 1, kv_head);
    for (int i = t; i < ROWS_TILE * head_dim; i += blockDim.x) {
        int rr = i / head_dim, d = i % head_dim;
        int src = first + (rr < count ? rr : count - 1);
        qs[rr][d] = q[(long)src * q_stride + head * head_dim + d];
    }
    float acc[ROWS_MAX_HEAD_DIM / 8];
    for (int k = 0; k < per; k++) acc[k] = 0.0f;
    float m = -3.0e38f, l = 0.0f;
    for (int j0 = 0; j0 <= last; j0 += KEYS_TILE) {
        __syncthreads();
        for (int i = t; i < KEYS_TILE * head_dim; i += blockDim.x) {
            int jj = i / head_dim, d = i % head_dim, j = j0 + jj;
            float kv = 0.0f, vv = 0.0f;
            if (j <= last) {
                long at = token_at(pg, table, j) + d;
                kv = h2f(cache[at + k_off]);
                vv = h2f(cache[at + v_off]);
            }
            ks[jj][d] = kv;
            vs[jj][d] = vv;
        }
        __syncthreads();
        // Scores of this row's keys part, part + 8, part + 16, part + 24 of the tile; the row's maximum over the
        // eight threads that share it (lanes next to each other in one warp).
        float s[KEYS_TILE / 8];
        float tile_max = -3.0e38f;
        for (int k = 0; k < KEYS_TILE / 8; k++) {
            int jj = part + 8 * k, j = j0 + jj;
            float dot = 0.0f;
            for (int d = 0; d < head_dim; d++) dot += qs[r][d] * ks[jj][d];
            s[k] = j <= pos ? dot * scale : -3.0e38f;
            tile_max = fmaxf(tile_max, s[k]);
        }
        for (int o = 4; o > 0; o >>= 1) tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, o));
        float m_new = fmaxf(m, tile_max);
        float alpha = __expf(m - m_new);
        float sum = 0.0f;
        for (int k = 0; k < KEYS_TILE / 8; k++) {
            int jj = part + 8 * k;
            float p = j0 + jj <= pos ? __expf(s[k] - m_new) : 0.0f;
            ps[r][jj] = p;
            sum += p;
        }
        for (int o = 4; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        l = l * alpha + sum;
        m = m_new;
        __syncthreads();
        for (int k = 0; k < per; k++) {
            int d = part * per + k;
            float a = acc[k] * alpha;
            for (int jj = 0; jj < KEYS_TILE; jj++) a += ps[r][jj] * vs[jj][d];
            acc[k] = a;
        }
    }
    if (r < count) {
        u16* o = out + ((long)row * n_heads + head) * head_dim;
        for (int k = 0; k < per; k++) o[part * per + k] = f2h(acc[k] / l);
    }
}

// ---- Greedy sampling on the device: a chunk that takes only its top token gets it without its logits leaving. ----

// top[r] = the index of the largest of logits row r's `vocab` values, the lowest index among equal ones: the CPU
// sampler's `argmax`, NaNs included (one is never the largest, and a row that starts with one gives 0). One thread
// block per row. An index of `vocab` means no value yet, so no value needs to stand for minus infinity.
__device__ __forceinline__ void take_larger(float& best, int& at, float v, int i, int vocab) {
    if (i != vocab && (at == vocab || v > best || (v == best && i < at))) {
        best = v;
        at = i;
    }
}

extern "C" __global__ void argmax_rows(const float* logits, int vocab, int* top) {
    const float* row = logits + (long)blockIdx.x * vocab;
    float best = 0.0f;
    int at = vocab;
    // A thread's indices rise, so only a strictly larger value moves it: the first of equal ones stays.
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float v = row[i];
        if (v == v && (at == vocab || v > best)) {
            best = v;
            at = i;
        }
    }
    __shared__ float values[32];
    __shared__ int indices[32];
    for (int o = 16; o > 0; o >>= 1) {
        float v = __shfl_xor_sync(0xffffffffu, best, o);
        int i = __shfl_xor_sync(0xffffffffu, at, o);
        take_larger(best, at, v, i, vocab);
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        values[warp] = best;
        indices[warp] = at;
    }
    __syncthreads();
    // Every warp takes part in the last round (the host build's shuffles are the whole block's); thread 0 writes.
    int warps = blockDim.x >> 5;
    best = lane < warps ? values[lane] : 0.0f;
    at = lane < warps ? indices[lane] : vocab;
    for (int o = 16; o > 0; o >>= 1) {
        float v = __shfl_xor_sync(0xffffffffu, best, o);
        int i = __shfl_xor_sync(0xffffffffu, at, o);
        take_larger(best, at, v, i, vocab);
    }
    if (threadIdx.x == 0) top[blockIdx.x] = (at == vocab || row[0] != row[0]) ? 0 : at;
}

// ---- Prompts on tensor cores (sm_80 and later): `attend_rows`' tiles with the scores and the weighted sums as
// 16×8×16 matrix products (mma.sync: f16 inputs, f32 sums), one warp per (tile, head). ----

// d += a · b over one warp: a 16×16 and b 16×8 in f16, d 16×8 in f32. Lane (g = lane / 4, t = lane % 4) holds a's
// rows g (a[0]) and g + 8 (a[1]) at columns 2t and 2t + 1, and the same rows at columns 8 + 2t and 9 + 2t (a[2],
// a[3]); b's column g at rows 2t, 2t + 1 (b[0]) and 8 + 2t, 9 + 2t (b[1]); d's row g at columns 2t, 2t + 1 (d[0],
// d[1]) and row g + 8 at the same columns (d[2], d[3]). Two f16 to a 32-bit register, the lower index in the low
// half.
#ifdef TANDEM_HOST
__device__ __forceinline__ void mma_16816(float* d, const unsigned* a, const unsigned* b) {
    tandem_host_mma_16816(d, a, b);
}
#else
__device__ __forceinline__ void mma_16816(float* d, const unsigned* a, const unsigned* b) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    // The forward launches the tensor-core kernels on devices of compute capability 8.0 and later only.
    __trap();
#endif
}
#endif

__device__ __forceinline__ unsigned pack_f16(float lo, float hi) {
    return (unsigned)f2h(lo) | ((unsigned)f2h(hi) << 16);
}

__device__ __forceinline__ unsigned pack_u16(u16 lo, u16 hi) {
    return (unsigned)lo | ((unsigned)hi << 16);
}

#define TC_MAX_HEAD_DIM 128
// A shared K or V row's padding: rows 272 bytes apart instead of 256, so the lanes reading one column of 16 rows
// do not all hit one bank.
#define TC_PAD 8

// `attend_rows` (the same arguments and tiles of up to ROWS_TILE rows) with one warp of 32 threads per (tile,
// head): Q's 16 rows as f16 fragments; per 16 keys of the cache (their K and V rows brought into shared memory by
// the whole warp, 16 bytes a lane at a time), the scores S = Q Kᵀ as two 16×8 products per 16 dims, the running
// maximum and sum per row (online softmax, over the four lanes that share a row), then O += P V
// with P (the weights, f16) as the left operand, 8 dims per product. Keys past the tile's last position read
// nothing; a row past the tile's end computes the last row's and writes nothing. head_dim a multiple of 16, at
// most TC_MAX_HEAD_DIM.
extern "C" __global__ void attend_rows_tc(const float* q, int q_stride, const u16* cache, const int* tables,
                                          const int* table_of, const int* positions, const int* tiles, u16* out,
                                          int layer, int layers, int n_heads, int kv_heads, int head_dim,
                                          int block_tokens, float scale) {
    int first = tiles[2 * blockIdx.x], count = tiles[2 * blockIdx.x + 1];
    int head = blockIdx.y, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int kv_head = head / (n_heads / kv_heads);
    int rows[2] = {first + min(g, count - 1), first + min(g + 8, count - 1)};
    int pos[2] = {positions[rows[0]], positions[rows[1]]};
    int last = positions[first + count - 1];
    const int* table = tables + table_of[first];
    Paged pg = paged(layers, kv_heads, head_dim, block_tokens);
    long k_off = part_at(pg, layer, 0, kv_head), v_off = part_at(pg, layer, 1, kv_head);
    int steps = head_dim / 16, dim_tiles = head_dim / 8;
    unsigned qa[TC_MAX_HEAD_DIM / 16][4];
    for (int kk = 0; kk < steps; kk++) {
        const float* q0 = q + (long)rows[0] * q_stride + head * head_dim + 16 * kk;
        const float* q1 = q + (long)rows[1] * q_stride + head * head_dim + 16 * kk;
        qa[kk][0] = pack_f16(q0[2 * t], q0[2 * t + 1]);
        qa[kk][1] = pack_f16(q1[2 * t], q1[2 * t + 1]);
        qa[kk][2] = pack_f16(q0[8 + 2 * t], q0[9 + 2 * t]);
        qa[kk][3] = pack_f16(q1[8 + 2 * t], q1[9 + 2 * t]);
    }
    float o[TC_MAX_HEAD_DIM / 8][4];
    for (int dt = 0; dt < dim_tiles; dt++)
        for (int c = 0; c < 4; c++) o[dt][c] = 0.0f;
    // Per row (g, g + 8): the running maximum, and this lane's share of the weights' sum.
    float m[2] = {-3.0e38f, -3.0e38f}, l[2] = {0.0f, 0.0f};
    // The 16 keys' K and V rows of each step, brought in by the whole warp 16 bytes a lane at a time (a row is
    // 16-byte aligned: head_dim a multiple of 16), zeros past the tile's last position.
    __shared__ u16 ks[16][TC_MAX_HEAD_DIM + TC_PAD];
    __shared__ u16 vs[16][TC_MAX_HEAD_DIM + TC_PAD];
    int chunks = head_dim / 8;
    for (int j0 = 0; j0 <= last; j0 += 16) {
        __syncthreads();
        for (int i = lane; i < 16 * chunks; i += 32) {
            int kk = i / chunks, c = i % chunks, key = j0 + kk;
            uint4 kv = {0u, 0u, 0u, 0u}, vv = {0u, 0u, 0u, 0u};
            if (key <= last) {
                long at = token_at(pg, table, key) + 8 * c;
                kv = *reinterpret_cast<const uint4*>(cache + k_off + at);
                vv = *reinterpret_cast<const uint4*>(cache + v_off + at);
            }
            unsigned kw[4] = {kv.x, kv.y, kv.z, kv.w}, vw[4] = {vv.x, vv.y, vv.z, vv.w};
            for (int w = 0; w < 4; w++) {
                ks[kk][8 * c + 2 * w] = (u16)(kw[w] & 0xffffu);
                ks[kk][8 * c + 2 * w + 1] = (u16)(kw[w] >> 16);
                vs[kk][8 * c + 2 * w] = (u16)(vw[w] & 0xffffu);
                vs[kk][8 * c + 2 * w + 1] = (u16)(vw[w] >> 16);
            }
        }
        __syncthreads();
        // S for keys j0 .. j0 + 15, as two products of 8 keys: this lane feeds key 8 nt + g of the tile.
        float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
        for (int nt = 0; nt < 2; nt++) {
            const u16* kr = ks[8 * nt + g];
            for (int kk = 0; kk < steps; kk++) {
                unsigned b[2] = {pack_u16(kr[16 * kk + 2 * t], kr[16 * kk + 2 * t + 1]),
                                 pack_u16(kr[16 * kk + 8 + 2 * t], kr[16 * kk + 9 + 2 * t])};
                mma_16816(s[nt], qa[kk], b);
            }
        }
        // This lane's scores: row g (c = 0, 1) and row g + 8 (c = 2, 3), keys j0 + 8 nt + 2t + (c & 1).
        float top[2] = {-3.0e38f, -3.0e38f};
        for (int nt = 0; nt < 2; nt++)
            for (int c = 0; c < 4; c++) {
                int r = c >> 1, key = j0 + 8 * nt + 2 * t + (c & 1);
                s[nt][c] = key <= pos[r] ? s[nt][c] * scale : -3.0e38f;
                top[r] = fmaxf(top[r], s[nt][c]);
            }
        float alpha[2];
        for (int r = 0; r < 2; r++) {
            for (int x = 1; x < 4; x <<= 1) top[r] = fmaxf(top[r], __shfl_xor_sync(0xffffffffu, top[r], x));
            float m_new = fmaxf(m[r], top[r]);
            alpha[r] = __expf(m[r] - m_new);
            m[r] = m_new;
            l[r] *= alpha[r];
        }
        float p[2][4];
        for (int nt = 0; nt < 2; nt++)
            for (int c = 0; c < 4; c++) {
                int r = c >> 1, key = j0 + 8 * nt + 2 * t + (c & 1);
                p[nt][c] = key <= pos[r] ? __expf(s[nt][c] - m[r]) : 0.0f;
                l[r] += p[nt][c];
            }
        for (int dt = 0; dt < dim_tiles; dt++) {
            o[dt][0] *= alpha[0];
            o[dt][1] *= alpha[0];
            o[dt][2] *= alpha[1];
            o[dt][3] *= alpha[1];
        }
        // P as the left operand (16 rows × 16 keys): S's layout for two products of 8 keys is the left operand's.
        unsigned pa[4] = {pack_f16(p[0][0], p[0][1]), pack_f16(p[0][2], p[0][3]), pack_f16(p[1][0], p[1][1]),
                          pack_f16(p[1][2], p[1][3])};
        // V as the right operand: keys 2t, 2t + 1, 8 + 2t, 9 + 2t of the tile, this lane's dim 8 dt + g.
        for (int dt = 0; dt < dim_tiles; dt++) {
            int dim = 8 * dt + g;
            unsigned b[2] = {pack_u16(vs[2 * t][dim], vs[2 * t + 1][dim]),
                             pack_u16(vs[8 + 2 * t][dim], vs[9 + 2 * t][dim])};
            mma_16816(o[dt], pa, b);
        }
    }
    for (int r = 0; r < 2; r++)
        for (int x = 1; x < 4; x <<= 1) l[r] += __shfl_xor_sync(0xffffffffu, l[r], x);
    for (int r = 0; r < 2; r++) {
        int rr = g + 8 * r;
        if (rr >= count) continue;
        u16* orow = out + ((long)(first + rr) * n_heads + head) * head_dim;
        for (int dt = 0; dt < dim_tiles; dt++) {
            orow[8 * dt + 2 * t] = f2h(o[dt][2 * r] / l[r]);
            orow[8 * dt + 2 * t + 1] = f2h(o[dt][2 * r + 1] / l[r]);
        }
    }
}
