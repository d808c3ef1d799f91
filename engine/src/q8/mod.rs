//! The fast precision's matmul arithmetic: activation rows quantized to 8 bits per 32-value block, dotted with
//! Q4_1 and Q8_0 weight rows in integers (llama.cpp's scheme for quantized weights: a block's 32 products summed
//! exactly, then scaled once, instead of 32 dequantized floats multiplied one by one).
//!
//! A block of 32 activations `x` becomes a scale `d = max|x| / 127`, 32 signed bytes `q = round(x / d)`, and
//! `s = d·Σq`. Against a Q4_1 block (`w = dw·qw + mw`): `Σ w·x ≈ dw·d·Σ qw·q + mw·s`; against Q8_0 (`w = dw·qw`):
//! `dw·d·Σ qw·q`. Rounding the activations costs accuracy, which is why this is not the reference precision: see
//! [`crate::forward::Precision`].
//!
//! Within this module the result for a (weight row, activation row) pair does not depend on its company:
//! quantizing a row reads that row only, and the pair goes through the same operations in the same order alone
//! ([`dot`]) or in a tile ([`dot_tile`]). Where the CPU has AVX-512 VNNI the fast precision as a whole is still not
//! batch-invariant: steps of more than four activation rows go through [`vnni`]'s tiles (another summation order).
//! With AVX2 alone every step goes through [`dot_rows`]: tiles of four activation rows ([`tiles_any_rows`]), the
//! weight row unpacked once for all of them, so a row's results there do not depend on how many rows share its
//! matmul; without SIMD, large steps take the reference's f32 tiles.
//!
//! The AVX2 tiles sum each block's products exactly in integers, then gather eight blocks' sums into the eight lanes
//! of one register and scale them at once by the eight blocks' scale products, instead of a broadcast and a
//! multiply-add per block (llama.cpp's AVX2 dots scale block by block).

#[cfg(target_arch = "x86_64")]
pub mod vnni;

use half::f16;

use crate::gguf::TensorType;

/// Values per quantization block (the weights' and the activations').
pub const BLOCK: usize = 32;

/// Up to this many rows, a quantization also keeps the paired copy the VNNI dots read ([`dot_tile`]); more rows
/// than this go through tiles that do not need it, and a dot of rows without it takes the AVX2 path.
pub const PAIRED_MAX_ROWS: usize = 4;

/// Activation rows in 8 bits: per row, per block, 32 signed bytes, a scale and the scaled sum of the bytes.
#[derive(Debug, Default)]
pub struct Q8Rows {
    blocks_per_row: usize,
    q: Vec<i8>,
    d: Vec<f32>,
    s: Vec<f32>,
    /// Where [`vnni`] computes the dots: the bytes again, per pair of blocks in the order of Q4_1's nibbles
    /// (`vnni::interleave`), for up to [`PAIRED_MAX_ROWS`] rows; empty elsewhere.
    paired: Vec<i8>,
}

/// One quantized activation row.
#[derive(Clone, Copy, Debug)]
pub struct Q8Row<'a> {
    q: &'a [i8],
    d: &'a [f32],
    s: &'a [f32],
    paired: &'a [i8],
}

impl Q8Rows {
    /// Quantizes the `x.len() / cols` rows of `x` (`cols` a multiple of [`BLOCK`]), reusing this buffer.
    pub fn quantize(&mut self, x: &[f32], cols: usize) {
        debug_assert!(cols.is_multiple_of(BLOCK));
        let blocks = x.len() / BLOCK;
        self.blocks_per_row = cols / BLOCK;
        self.q.resize(blocks * BLOCK, 0);
        self.d.resize(blocks, 0.0);
        self.s.resize(blocks, 0.0);
        for (((xs, q), d), s) in
            x.chunks_exact(BLOCK).zip(self.q.chunks_exact_mut(BLOCK)).zip(&mut self.d).zip(&mut self.s)
        {
            #[cfg(target_arch = "x86_64")]
            if crate::kernels::simd_available() {
                (*d, *s) = simd::quantize_block(xs, q);
                continue;
            }
            (*d, *s) = quantize_block(xs, q);
        }
        self.paired.clear();
        // Only decode-sized steps read the paired copy (prompt-sized ones go through `vnni`'s tiles, which read `q`).
        #[cfg(target_arch = "x86_64")]
        if x.len() <= PAIRED_MAX_ROWS * cols && vnni::for_decode() && self.blocks_per_row.is_multiple_of(2) {
            self.paired.resize(self.q.len(), 0);
            vnni::interleave(&self.q, &mut self.paired);
        }
    }

    /// Row `t`.
    pub fn row(&self, t: usize) -> Q8Row<'_> {
        let b = self.blocks_per_row;
        Q8Row {
            q: &self.q[t * b * BLOCK..(t + 1) * b * BLOCK],
            d: &self.d[t * b..(t + 1) * b],
            s: &self.s[t * b..(t + 1) * b],
            paired: self.paired.get(t * b * BLOCK..(t + 1) * b * BLOCK).unwrap_or_default(),
        }
    }
}

/// Quantizes one block to nearest, ties away from zero (C's `roundf`, as llama.cpp's reference quantizer); returns
/// `(d, d·Σq)`. A NaN counts
/// as 0.
fn quantize_block(x: &[f32], q: &mut [i8]) -> (f32, f32) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut sum = 0i32;
    for (o, &v) in q.iter_mut().zip(x) {
        // A NaN becomes 0 (Rust's saturating cast); |v·inv| ≤ 127 otherwise.
        let r = ((v * inv).round() as i32).clamp(-127, 127);
        *o = r as i8;
        sum += r;
    }
    (d, d * sum as f32)
}

/// Whether steps of any number of activation rows go through [`dot_tile`] (in tiles of four) because VNNI's own
/// tiles are missing: on CPUs with AVX2 but not AVX-512 VNNI. Elsewhere steps of more than [`PAIRED_MAX_ROWS`]
/// take VNNI's tiles or, without SIMD, the reference's f32 tiles.
pub fn tiles_any_rows() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        crate::kernels::simd_available() && !vnni::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether rows of `ty` with `cols` columns have an integer dot here.
pub fn supported(ty: TensorType, cols: usize) -> bool {
    matches!(ty, TensorType::Q4_1 | TensorType::Q8_0) && cols.is_multiple_of(BLOCK) && cols > 0
}

/// Weight row `w` (of a [`supported`] type, as many blocks as `x`) against activation row `x`.
#[inline]
pub fn dot(ty: TensorType, w: &[u8], x: Q8Row<'_>) -> f32 {
    dot_tile(ty, w, [x; 1])[0]
}

/// Weight row `w` against `N` activation rows: the same values as `N` calls of [`dot`], bit for bit, with the
/// weight block unpacked once for all of them (with AVX-512 VNNI where the CPU has it and the rows have their
/// paired copy, else AVX2, else portable code: each sums in its own order). `ty` must be [`supported`] (any
/// other is read as Q8_0).
#[inline]
pub fn dot_tile<const N: usize>(ty: TensorType, w: &[u8], x: [Q8Row<'_>; N]) -> [f32; N] {
    debug_assert!(matches!(ty, TensorType::Q4_1 | TensorType::Q8_0), "no integer dot for {ty:?}");
    #[cfg(target_arch = "x86_64")]
    {
        if x.iter().all(|r| !r.paired.is_empty()) {
            return vnni::dot_tile(ty, w, x);
        }
        if crate::kernels::simd_available() {
            return simd::dot_tile(ty, w, x);
        }
    }
    portable::dot_tile(ty, w, x)
}

/// Weight row `w` against every row of `xs`, each value handed to `out(t, value)`: in tiles of four rows (the rest
/// one by one), so each value is [`dot`]'s for its row, bit for bit. With AVX2 (rows without the paired copy) and
/// more than one tile's rows, the weight row is unpacked once for all the tiles instead of once per tile.
pub fn dot_rows(ty: TensorType, w: &[u8], xs: &[Q8Row<'_>], mut out: impl FnMut(usize, f32)) {
    // One tile's rows or fewer: unpacking in registers is cheaper than through a copy (batch 4 measured 5–18%
    // slower that way), and small steps pay for every check here.
    #[cfg(target_arch = "x86_64")]
    if xs.len() > 4
        && crate::kernels::simd_available()
        && xs.iter().all(|r| r.paired.is_empty())
        && simd::dot_rows(ty, w, xs, &mut out)
    {
        return;
    }
    for (c, chunk) in xs.chunks(4).enumerate() {
        if let Ok(&four) = <&[Q8Row<'_>; 4]>::try_from(chunk) {
            dot_tile(ty, w, four).iter().enumerate().for_each(|(t, &v)| out(4 * c + t, v));
            continue;
        }
        for (t, &x) in chunk.iter().enumerate() {
            out(4 * c + t, dot(ty, w, x));
        }
    }
}

fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// Without SIMD: each block's integer sum exactly, scaled and added in block order.
mod portable {
    use super::{BLOCK, Q8Row, f16_at};
    use crate::gguf::TensorType;

    pub fn dot_tile<const N: usize>(ty: TensorType, w: &[u8], x: [Q8Row<'_>; N]) -> [f32; N] {
        let mut acc = [0f32; N];
        for (b, blk) in w.chunks_exact(ty.block_bytes()).enumerate() {
            for (a, x) in acc.iter_mut().zip(&x) {
                let xq = &x.q[b * BLOCK..(b + 1) * BLOCK];
                *a += match ty {
                    TensorType::Q4_1 => {
                        let qs = &blk[4..20];
                        let isum: i32 = (0..16)
                            .map(|j| {
                                i32::from(qs[j] & 0x0F) * i32::from(xq[j])
                                    + i32::from(qs[j] >> 4) * i32::from(xq[j + 16])
                            })
                            .sum();
                        f16_at(blk, 0) * x.d[b] * isum as f32 + f16_at(blk, 2) * x.s[b]
                    }
                    _ => {
                        let isum: i32 =
                            blk[2..34].iter().zip(xq).map(|(&q, &v)| i32::from(q as i8) * i32::from(v)).sum();
                        f16_at(blk, 0) * x.d[b] * isum as f32
                    }
                };
            }
        }
        acc
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod simd {
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;

    use super::{BLOCK, Q8Row};
    use crate::gguf::TensorType;
    use crate::kernels::simd::{prefetch_weights, scales};

    pub fn dot_tile<const N: usize>(ty: TensorType, w: &[u8], x: [Q8Row<'_>; N]) -> [f32; N] {
        let blocks = x.iter().map(|r| r.d.len().min(r.s.len()).min(r.q.len() / BLOCK)).min().unwrap_or(0);
        let blocks = blocks.min(w.len() / ty.block_bytes());
        match ty {
            // SAFETY: the caller checked AVX2 and FMA; every row holds at least `blocks` blocks.
            TensorType::Q4_1 => unsafe { tile_q4_1(&w[..blocks * 20], x, blocks) },
            // SAFETY: as above.
            _ => unsafe { tile_q8_0(&w[..blocks * 34], x, blocks) },
        }
    }

    /// Blocks whose integer sums are gathered into one register before they are scaled: eight, one per lane.
    const GROUP: usize = 8;

    /// The f16 words at bytes `0, stride, …, 7·stride` of `at` (the scales of eight blocks; for Q4_1 the minimums
    /// are the words after them): lanes 0..8 the words at those places, 8..16 the words 2 bytes after.
    ///
    /// Eight scalar loads into two 128-bit registers and in-lane shuffles, not a gather and cross-lane permutes: on
    /// Zen 1 (`vpgatherdd` microcoded, 256-bit permutes split in two) the gather alone took a fifth of the Q4_1
    /// tile's time at batch 1 (docs/performance.md).
    ///
    /// # Safety
    /// AVX2 and F16C; `at` holds at least `7·stride + 4` bytes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn group_scales<const STRIDE: usize>(at: &[u8]) -> (__m256, __m256) {
        assert!(at.len() >= 7 * STRIDE + 4);
        // SAFETY: the eight 4-byte reads are inside `at` (checked above).
        let word = |j: usize| unsafe { at.as_ptr().add(j * STRIDE).cast::<i32>().read_unaligned() };
        let low = _mm_setr_epi32(word(0), word(1), word(2), word(3));
        let high = _mm_setr_epi32(word(4), word(5), word(6), word(7));
        // Per register: the low halves of its four words, then the high halves.
        let split = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
        let (low, high) = (_mm_shuffle_epi8(low, split), _mm_shuffle_epi8(high, split));
        (_mm256_cvtph_ps(_mm_unpacklo_epi64(low, high)), _mm256_cvtph_ps(_mm_unpackhi_epi64(low, high)))
    }

    /// The eight blocks' 32-bit integer sums `v[0..8]` (eight lanes each) as one register of eight totals, block
    /// `j` in lane `j`: exact.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn totals(v: [__m256i; GROUP]) -> __m256i {
        // After two rounds of pairwise sums: the four 128-bit halves' sums of blocks 0..4, then of 4..8.
        let low = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
        let high = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
        _mm256_add_epi32(_mm256_permute2x128_si256::<0x20>(low, high), _mm256_permute2x128_si256::<0x31>(low, high))
    }

    /// Per group of eight blocks, each block's exact integer sum for each row, gathered into one register and
    /// multiplied by the eight blocks' scale products at once (instead of a broadcast and a multiply-add per
    /// block); the blocks after the last whole group one by one. `unpack(b)` is weight block `b` as the sums read
    /// it, `sums(w, b, k)` that block's integer sums against activation row `k` (eight lanes), `scales_of(b0)` the
    /// scales and minimums of the group starting at `b0` ([`group_scales`]), `one(b)` block `b`'s alone;
    /// `with_mins` adds the minimums' term (Q4_1's).
    #[inline(always)]
    unsafe fn tile<const N: usize, W: Copy>(
        x: &[Q8Row<'_>; N],
        blocks: usize,
        unpack: impl Fn(usize) -> W,
        sums: impl Fn(W, usize, usize) -> __m256i,
        scales_of: impl Fn(usize) -> (__m256, __m256),
        one: impl Fn(usize) -> (f32, f32),
        with_mins: bool,
    ) -> [f32; N] {
        // SAFETY: the callers have AVX2, FMA and F16C (this function is inlined into them); every row holds at
        // least `blocks` scales and sums.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); N];
            let mut mins = [_mm256_setzero_ps(); N];
            let groups = blocks / GROUP;
            for g in 0..groups {
                let b0 = g * GROUP;
                let mut v = [[_mm256_setzero_si256(); GROUP]; N];
                for j in 0..GROUP {
                    let wv = unpack(b0 + j);
                    for (k, vk) in v.iter_mut().enumerate() {
                        vk[j] = sums(wv, b0 + j, k);
                    }
                }
                let (dw, mw) = scales_of(b0);
                for k in 0..N {
                    let dx = _mm256_loadu_ps(x[k].d.as_ptr().add(b0));
                    acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(totals(v[k])), _mm256_mul_ps(dw, dx), acc[k]);
                    if with_mins {
                        mins[k] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(x[k].s.as_ptr().add(b0)), mins[k]);
                    }
                }
            }
            let mut tail = [0f32; N];
            for b in groups * GROUP..blocks {
                let wv = unpack(b);
                let (dw, mw) = one(b);
                for k in 0..N {
                    let s = sums(wv, b, k);
                    acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(dw * x[k].d[b]), acc[k]);
                    tail[k] += mw * x[k].s[b];
                }
            }
            std::array::from_fn(|k| hsum(acc[k]) + (hsum(mins[k]) + tail[k]))
        }
    }

    /// Weight row `w` (`blocks` blocks) against every row of `xs`, unpacked once for all of them; false, and
    /// nothing done, for a row of more than [`UNPACKED_MAX`] blocks. The caller checked AVX2, FMA and F16C.
    pub fn dot_rows(ty: TensorType, w: &[u8], xs: &[Q8Row<'_>], out: &mut impl FnMut(usize, f32)) -> bool {
        let blocks = xs.iter().map(|r| r.d.len().min(r.s.len()).min(r.q.len() / BLOCK)).min().unwrap_or(0);
        let blocks = blocks.min(w.len() / ty.block_bytes());
        if blocks > UNPACKED_MAX {
            return false;
        }
        match ty {
            // SAFETY: the caller checked the features; every row holds at least `blocks` blocks.
            TensorType::Q4_1 => unsafe { rows_q4_1(&w[..blocks * 20], xs, blocks, out) },
            // SAFETY: as above.
            _ => unsafe { rows_q8_0(&w[..blocks * 34], xs, blocks, out) },
        }
        true
    }

    /// The most blocks [`dot_rows`] unpacks a weight row into (8,192 columns: 8 KiB of Q4_1 on the stack, 16 KiB of
    /// Q8_0).
    const UNPACKED_MAX: usize = 256;

    /// The weight row's `blocks` blocks unpacked once (`unpack(b)`), then `xs` in tiles of four rows (`tile4`) and
    /// the rest one by one (`tile1`), each tile given the unpacked blocks, each value handed to `out`.
    #[inline(always)]
    fn over_rows<'a, W: Copy>(
        xs: &[Q8Row<'a>],
        blocks: usize,
        unpack: impl Fn(usize) -> W,
        out: &mut impl FnMut(usize, f32),
        tile4: impl Fn([Q8Row<'a>; 4], &[W]) -> [f32; 4],
        tile1: impl Fn([Q8Row<'a>; 1], &[W]) -> [f32; 1],
    ) {
        // Not zeroed first: only the first `blocks` are written, and only they are read.
        let mut buffer = [MaybeUninit::<W>::uninit(); UNPACKED_MAX];
        let blocks = blocks.min(UNPACKED_MAX);
        for (b, u) in buffer[..blocks].iter_mut().enumerate() {
            u.write(unpack(b));
        }
        // SAFETY: the first `blocks` entries were written just above.
        let unpacked = unsafe { std::slice::from_raw_parts(buffer.as_ptr().cast::<W>(), blocks) };
        for (c, chunk) in xs.chunks(4).enumerate() {
            if let Ok(&four) = <&[Q8Row<'a>; 4]>::try_from(chunk) {
                tile4(four, unpacked).iter().enumerate().for_each(|(t, &v)| out(4 * c + t, v));
                continue;
            }
            for (t, &x) in chunk.iter().enumerate() {
                out(4 * c + t, tile1([x], unpacked)[0]);
            }
        }
    }

    /// Q4_1 block `b` of `w` as the sums read it: one byte per value, in order.
    #[inline(always)]
    fn unpack_q4_1(w: &[u8], b: usize) -> __m256i {
        let blk = &w[20 * b..20 * b + 20];
        prefetch_weights(blk);
        // SAFETY: bytes 4..20 are in the block; the callers have AVX2 (this function is inlined into them).
        unsafe {
            let qs = _mm_loadu_si128(blk.as_ptr().add(4).cast());
            // Low nibbles are values 0..16, high nibbles 16..32.
            _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(qs), qs), _mm256_set1_epi8(0x0F))
        }
    }

    /// Q8_0 block `b` of `w` as the sums read it: its bytes' magnitudes, and the bytes (for their signs).
    #[inline(always)]
    fn unpack_q8_0(w: &[u8], b: usize) -> (__m256i, __m256i) {
        let blk = &w[34 * b..34 * b + 34];
        prefetch_weights(blk);
        // SAFETY: bytes 2..34 are in the block; the callers have AVX2 (this function is inlined into them).
        unsafe {
            let wv = _mm256_loadu_si256(blk.as_ptr().add(2).cast());
            // `maddubs` takes unsigned × signed bytes: |w| against x carrying w's sign.
            (_mm256_sign_epi8(wv, wv), wv)
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn rows_q4_1(w: &[u8], xs: &[Q8Row<'_>], blocks: usize, out: &mut impl FnMut(usize, f32)) {
        // SAFETY: this function's features; every block read is in `w` and the rows.
        let tile4 = |x, u: &[__m256i]| unsafe { tile_q4_1_with(w, x, blocks, |b| u[b]) };
        // SAFETY: as above.
        let tile1 = |x, u: &[__m256i]| unsafe { tile_q4_1_with(w, x, blocks, |b| u[b]) };
        over_rows(xs, blocks, |b| unpack_q4_1(w, b), out, tile4, tile1);
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn rows_q8_0(w: &[u8], xs: &[Q8Row<'_>], blocks: usize, out: &mut impl FnMut(usize, f32)) {
        // SAFETY: as in `rows_q4_1`.
        let tile4 = |x, u: &[(__m256i, __m256i)]| unsafe { tile_q8_0_with(w, x, blocks, |b| u[b]) };
        // SAFETY: as above.
        let tile1 = |x, u: &[(__m256i, __m256i)]| unsafe { tile_q8_0_with(w, x, blocks, |b| u[b]) };
        over_rows(xs, blocks, |b| unpack_q8_0(w, b), out, tile4, tile1);
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile_q4_1<const N: usize>(w: &[u8], x: [Q8Row<'_>; N], blocks: usize) -> [f32; N] {
        // SAFETY: this function's features; every block read is in `w` and the rows.
        unsafe { tile_q4_1_with(w, x, blocks, |b| unpack_q4_1(w, b)) }
    }

    /// The Q4_1 tile, weight block `b` read as `unpack(b)`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile_q4_1_with<const N: usize>(
        w: &[u8],
        x: [Q8Row<'_>; N],
        blocks: usize,
        unpack: impl Fn(usize) -> __m256i,
    ) -> [f32; N] {
        let ones = _mm256_set1_epi16(1);
        let sums = |wv: __m256i, b: usize, k: usize| {
            // SAFETY: each row's bytes `32b..32b + 32` are inside its `blocks`.
            let xv = unsafe { _mm256_loadu_si256(x[k].q.as_ptr().add(b * 32).cast()) };
            _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), ones)
        };
        // SAFETY: a whole group's 160 bytes are in `w`.
        let group = |b0: usize| unsafe { group_scales::<20>(&w[20 * b0..20 * b0 + 160]) };
        // SAFETY: AVX2, FMA and F16C are there (this function's features); every block read is in `w` and the rows.
        unsafe { tile(&x, blocks, unpack, sums, group, |b| scales(&w[20 * b..]), true) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile_q8_0<const N: usize>(w: &[u8], x: [Q8Row<'_>; N], blocks: usize) -> [f32; N] {
        // SAFETY: this function's features; every block read is in `w` and the rows.
        unsafe { tile_q8_0_with(w, x, blocks, |b| unpack_q8_0(w, b)) }
    }

    /// The Q8_0 tile, weight block `b` read as `unpack(b)`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile_q8_0_with<const N: usize>(
        w: &[u8],
        x: [Q8Row<'_>; N],
        blocks: usize,
        unpack: impl Fn(usize) -> (__m256i, __m256i),
    ) -> [f32; N] {
        let ones = _mm256_set1_epi16(1);
        let sums = |(wabs, wv): (__m256i, __m256i), b: usize, k: usize| {
            // SAFETY: each row's bytes `32b..32b + 32` are inside its `blocks`.
            let xv = unsafe { _mm256_loadu_si256(x[k].q.as_ptr().add(b * 32).cast()) };
            _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xv, wv)), ones)
        };
        // SAFETY: a whole group's 272 bytes are in `w`.
        let group = |b0: usize| unsafe { group_scales::<34>(&w[34 * b0..34 * b0 + 272]) };
        // SAFETY: as in `tile_q4_1`.
        unsafe { tile(&x, blocks, unpack, sums, group, |b| (scales(&w[34 * b..]).0, 0.0), false) }
    }

    /// [`super::quantize_block`] for one block of 32, bit for bit. The caller checked AVX2 and FMA.
    pub fn quantize_block(x: &[f32], q: &mut [i8]) -> (f32, f32) {
        assert!(x.len() == BLOCK && q.len() == BLOCK);
        // SAFETY: the caller checked the features; both slices hold one block.
        unsafe { quantize_avx2(x, q) }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn quantize_avx2(x: &[f32], q: &mut [i8]) -> (f32, f32) {
        // SAFETY: 32 floats are read from `x` and 32 bytes written to `q` (checked by the caller).
        unsafe {
            // NaNs become 0 first (`x == x` is false only for them), as the scalar code's `max` and cast treat them.
            let v: [__m256; 4] = std::array::from_fn(|k| {
                let a = _mm256_loadu_ps(x.as_ptr().add(8 * k));
                _mm256_and_ps(a, _mm256_cmp_ps::<_CMP_ORD_Q>(a, a))
            });
            let sign = _mm256_set1_ps(-0.0);
            let abs = v.map(|a| _mm256_andnot_ps(sign, a));
            let m = _mm256_max_ps(_mm256_max_ps(abs[0], abs[1]), _mm256_max_ps(abs[2], abs[3]));
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<0b01>(m, m)));
            let d = amax / 127.0;
            let inv = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
            let (lo, hi) = (_mm256_set1_epi32(-127), _mm256_set1_epi32(127));
            // Rounds to nearest, ties away from zero, exactly as `f32::round`: the truncation plus one step away
            // from zero where the dropped fraction (exact below 2^23) is at least a half. (Adding ±0.5 and
            // truncating would round 0.49999997 up.)
            let (half, one) = (_mm256_set1_ps(0.5), _mm256_set1_ps(1.0));
            let round = |y: __m256| {
                let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
                let up = _mm256_cmp_ps::<_CMP_GE_OQ>(_mm256_andnot_ps(sign, _mm256_sub_ps(y, t)), half);
                _mm256_add_ps(t, _mm256_and_ps(up, _mm256_or_ps(_mm256_and_ps(y, sign), one)))
            };
            let r =
                v.map(|a| _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(round(_mm256_mul_ps(a, inv))), lo), hi));
            let sum = _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
            let sum = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256::<1>(sum));
            let sum = _mm_add_epi32(sum, _mm_unpackhi_epi64(sum, sum));
            let sum = _mm_cvtsi128_si32(_mm_add_epi32(sum, _mm_shuffle_epi32::<0b01>(sum)));
            // Packing interleaves 128-bit lanes; the permute puts the 32 bytes back in order.
            let w16 = [_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3])];
            let b = _mm256_permutevar8x32_epi32(
                _mm256_packs_epi16(w16[0], w16[1]),
                _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7),
            );
            _mm256_storeu_si256(q.as_mut_ptr().cast(), b);
            (d, d * sum as f32)
        }
    }

    #[target_feature(enable = "avx2")]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
        _mm_cvtss_f32(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{dequantize_row, dot as dot_f32};

    /// Deterministic pseudo-random bytes and floats (no RNG crate in the engine's dependencies).
    fn noise(seed: u64, n: usize) -> Vec<u64> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                s
            })
            .collect()
    }

    /// A weight row of `blocks` blocks of `ty` with small, finite scales.
    fn weights(ty: TensorType, blocks: usize, seed: u64) -> Vec<u8> {
        let mut out = Vec::new();
        for (b, r) in noise(seed, blocks).into_iter().enumerate() {
            let scale = f16::from_f32(0.001 + (r % 1000) as f32 * 1e-5).to_le_bytes();
            out.extend_from_slice(&scale);
            if ty == TensorType::Q4_1 {
                out.extend_from_slice(&f16::from_f32(-0.01 * (b % 3) as f32).to_le_bytes());
            }
            let n = if ty == TensorType::Q4_1 { 16 } else { 32 };
            out.extend(noise(r, n).into_iter().map(|v| v as u8));
        }
        out
    }

    fn activations(n: usize, seed: u64) -> Vec<f32> {
        noise(seed, n).into_iter().map(|v| ((v % 20_001) as f32 - 10_000.0) / 2_500.0).collect()
    }

    #[test]
    fn integer_dots_stay_near_the_f32_dot_of_dequantized_weights() {
        for ty in [TensorType::Q4_1, TensorType::Q8_0] {
            for seed in 0..20 {
                let cols = 576;
                let w = weights(ty, cols / BLOCK, seed);
                let x = activations(cols, seed + 100);
                let mut deq = vec![0f32; cols];
                dequantize_row(ty, &w, &mut deq);
                let exact = dot_f32(&deq, &x);
                let mut q = Q8Rows::default();
                q.quantize(&x, cols);
                let fast = dot(ty, &w, q.row(0));
                // The activations' rounding: at most half a step (d/2) per value, |w| summed.
                let bound: f32 = deq
                    .iter()
                    .zip(x.chunks_exact(BLOCK).flat_map(|b| {
                        let d = b.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
                        std::iter::repeat_n(d / 2.0, BLOCK)
                    }))
                    .map(|(w, h)| w.abs() * h)
                    .sum();
                assert!(
                    (fast - exact).abs() <= bound * 1.01 + 1e-4,
                    "{ty:?} seed {seed}: {fast} vs {exact} (bound {bound})"
                );
                // Without SIMD (or with AVX2 where VNNI took the dot) the same sums, added in another order.
                let portable = portable::dot_tile(ty, &w, [q.row(0)])[0];
                assert!((portable - fast).abs() <= 1e-4 * exact.abs().max(1.0), "{ty:?}: {portable} vs {fast}");
                #[cfg(target_arch = "x86_64")]
                if crate::kernels::simd_available() {
                    let avx2 = simd::dot_tile(ty, &w, [q.row(0)])[0];
                    assert!((avx2 - fast).abs() <= 1e-4 * exact.abs().max(1.0), "{ty:?}: {avx2} vs {fast}");
                }
            }
        }
    }

    #[test]
    fn tiles_equal_single_dots_bit_for_bit() {
        for (ty, cols) in
            // Widths below one group of eight blocks, one group, and groups plus a remainder (the model's 576).
            [96, 128, 256, 576]
                .into_iter()
                .flat_map(|cols| [(TensorType::Q4_1, cols), (TensorType::Q8_0, cols)])
        {
            let w = weights(ty, cols / BLOCK, 7);
            let x = activations(4 * cols, 8);
            let mut q = Q8Rows::default();
            q.quantize(&x, cols);
            let tile = dot_tile(ty, &w, [q.row(0), q.row(1), q.row(2), q.row(3)]);
            for (t, v) in tile.iter().enumerate() {
                assert_eq!(v.to_bits(), dot(ty, &w, q.row(t)).to_bits(), "{ty:?} row {t}");
            }
        }
    }

    /// A weight row against many activation rows at once (unpacked once with AVX2) gives each row's single dot bit
    /// for bit: row counts with and without a remainder of four, and a row too long to unpack (the per-tile path).
    #[test]
    fn rows_at_once_equal_single_dots_bit_for_bit() {
        for (ty, cols, n) in [(576, 32), (576, 7), (96, 1), (128, 4), (256, 13), (32 * 260, 6)]
            .into_iter()
            .flat_map(|(cols, n)| [(TensorType::Q4_1, cols, n), (TensorType::Q8_0, cols, n)])
        {
            let w = weights(ty, cols / BLOCK, 11);
            let x = activations(n * cols, 12);
            let mut q = Q8Rows::default();
            q.quantize(&x, cols);
            let rows: Vec<Q8Row<'_>> = (0..n).map(|t| q.row(t)).collect();
            let mut got = vec![None; n];
            dot_rows(ty, &w, &rows, |t, v| got[t] = Some(v.to_bits()));
            for (t, v) in got.iter().enumerate() {
                assert_eq!(*v, Some(dot(ty, &w, q.row(t)).to_bits()), "{ty:?} {cols} columns, row {t} of {n}");
            }
        }
    }

    /// The VNNI tiles (prompt-sized matmuls) against single integer dots of the same quantized rows: the same
    /// exact block sums, scaled and added in another order, for every shape of remainder (rows and activation rows
    /// not multiples of four, more than one group of weight rows).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vnni_tiles_match_single_integer_dots() {
        if !vnni::available() {
            eprintln!("this CPU has no AVX-512 VNNI: the tiles are never used here");
            return;
        }
        let shapes = [(1, 1, 64), (4, 4, 576), (7, 5, 576), (37, 9, 1536), (64, 16, 128)];
        let team = crate::team::Team::new(2, "test").expect("team");
        for (ty, (nr, n, cols)) in
            [TensorType::Q4_1, TensorType::Q8_0].into_iter().flat_map(|ty| shapes.map(|s| (ty, s)))
        {
            let rows: Vec<Vec<u8>> = (0..nr).map(|r| weights(ty, cols / BLOCK, r as u64)).collect();
            let x = activations(n * cols, 99 + n as u64);
            let mut q = Q8Rows::default();
            q.quantize(&x, cols);
            for per_task in [32, 5] {
                let mut out = vec![f32::NAN; nr * n];
                crate::columns::par_rows(&team, &mut out, n, nr, per_task, |part| {
                    vnni::matmul_rows(ty, |r| rows[r].as_slice(), part, &q, n)
                });
                for r in 0..nr {
                    for t in 0..n {
                        let single = dot(ty, &rows[r], q.row(t));
                        let tiled = out[t * nr + r];
                        assert!(
                            (tiled - single).abs() <= 1e-5 * single.abs().max(1.0),
                            "{ty:?} {nr}x{n}x{cols}: row {r}, activation row {t}: {tiled} vs {single}"
                        );
                    }
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_quantization_equals_the_scalar_one() {
        if !crate::kernels::simd_available() {
            eprintln!("no AVX2 here: only the scalar quantization runs");
            return;
        }
        let mut x = activations(32 * 64, 5);
        // Exact ties (k + 0.5 steps), a NaN and a zero block.
        x[..32].iter_mut().enumerate().for_each(|(i, v)| *v = (i as f32 - 16.0) + 0.5);
        x[..32][31] = 127.0;
        x[40] = f32::NAN;
        x[64..96].fill(0.0);
        // Just under a half (adding 0.5 and truncating would round these away from zero), with a scale of 1.
        x[96..128]
            .copy_from_slice(&[[127.0, 0.499_999_97, -0.499_999_97, 1.499_999_9, -2.5, 2.5, -0.0, 126.5]; 4].concat());
        for (b, xs) in x.chunks_exact(BLOCK).enumerate() {
            let (mut a, mut s) = ([0i8; 32], [0i8; 32]);
            let fast = simd::quantize_block(xs, &mut a);
            let scalar = quantize_block(xs, &mut s);
            assert_eq!(
                (a, fast.0.to_bits(), fast.1.to_bits()),
                (s, scalar.0.to_bits(), scalar.1.to_bits()),
                "block {b}"
            );
        }
    }

    #[test]
    fn a_row_quantizes_the_same_alone_or_among_others() {
        let cols = 64;
        let x = activations(3 * cols, 3);
        let mut all = Q8Rows::default();
        all.quantize(&x, cols);
        let mut one = Q8Rows::default();
        one.quantize(&x[cols..2 * cols], cols);
        assert_eq!(all.row(1).q, one.row(0).q);
        assert_eq!(all.row(1).d, one.row(0).d);
        assert_eq!(all.row(1).s, one.row(0).s);
    }

    #[test]
    fn zeros_and_extremes_quantize_without_overflow() {
        let mut q = Q8Rows::default();
        let mut x = vec![0f32; 64];
        x[32] = -3.0;
        x[33] = 3.0;
        x[34] = f32::NAN;
        q.quantize(&x, 64);
        let r = q.row(0);
        assert_eq!((r.d[0], r.s[0]), (0.0, 0.0));
        assert!(r.q[..32].iter().all(|&v| v == 0));
        assert_eq!((r.q[32], r.q[33], r.q[34]), (-127, 127, 0));
    }
}
