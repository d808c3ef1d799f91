//! CPU kernels: dequantizing weight rows and the f32 dot product every matmul and attention score uses.
//!
//! Batch and chunk invariance rests on this module: every output element of a matmul is one call of [`dot`] on a
//! dequantized weight row and one activation row, with a fixed reduction order that does not depend on how many
//! rows or tokens are processed together.

use half::f16;

use crate::gguf::TensorType;

/// Whether this CPU runs the AVX2 + FMA + F16C kernels (the other kernel modules ask too, so that all agree).
pub(crate) fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        simd::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Dequantizes one row of `ty`-typed `bytes` into `out` (`out.len()` elements).
pub fn dequantize_row(ty: TensorType, bytes: &[u8], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if simd::available() && simd::dequantize_row(ty, bytes, out) {
            return;
        }
    }
    dequantize_row_portable(ty, bytes, out);
}

/// The portable dequantization; the SIMD one computes exactly the same values (multiply, then add).
pub fn dequantize_row_portable(ty: TensorType, bytes: &[u8], out: &mut [f32]) {
    match ty {
        TensorType::F32 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        TensorType::F16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        TensorType::Q8_0 => {
            for (o, blk) in out.chunks_exact_mut(32).zip(bytes.chunks_exact(34)) {
                let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                for (o, &q) in o.iter_mut().zip(&blk[2..34]) {
                    *o = f32::from(q as i8) * d;
                }
            }
        }
        TensorType::Q4_0 => {
            for (o, blk) in out.chunks_exact_mut(32).zip(bytes.chunks_exact(18)) {
                let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                let (lo, hi) = o.split_at_mut(16);
                for j in 0..16 {
                    let q = blk[2 + j];
                    lo[j] = (f32::from(q & 0x0F) - 8.0) * d;
                    hi[j] = (f32::from(q >> 4) - 8.0) * d;
                }
            }
        }
        TensorType::Q4_1 => {
            for (o, blk) in out.chunks_exact_mut(32).zip(bytes.chunks_exact(20)) {
                let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                let m = f16::from_le_bytes([blk[2], blk[3]]).to_f32();
                let (lo, hi) = o.split_at_mut(16);
                for j in 0..16 {
                    let q = blk[4 + j];
                    lo[j] = f32::from(q & 0x0F) * d + m;
                    hi[j] = f32::from(q >> 4) * d + m;
                }
            }
        }
    }
}

/// `a · b` over `min(a.len(), b.len())` elements, with a fixed reduction order.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if simd::available() {
            return simd::dot(a, b);
        }
    }
    dot_portable(a, b)
}

/// Rows a [`dot_tile`] takes at once.
pub const TILE_ROWS: usize = 2;
/// Activation rows a [`dot_tile`] takes at once.
pub const TILE_COLS: usize = 4;

/// `out[r][t] = dot(w[r], x[t])` for a tile of two weight rows and four activation rows, every element
/// bit-identical to [`dot`]: the same lanes go to the same accumulators in the same order. With the SIMD kernel
/// each weight load serves four products and each activation load two (a lone `dot` loads twice per product,
/// which is what bounds it); without one, the elements are plain [`dot`]s.
#[inline]
pub fn dot_tile(w: [&[f32]; TILE_ROWS], x: [&[f32]; TILE_COLS]) -> [[f32; TILE_COLS]; TILE_ROWS] {
    #[cfg(target_arch = "x86_64")]
    {
        if simd::available() {
            return simd::dot_tile(w, x);
        }
    }
    w.map(|row| x.map(|xt| dot(row, xt)))
}

/// `dot(dequantized row, x)` straight from the row's bytes, when a kernel for `ty` exists on this CPU: the same
/// arithmetic in the same order as [`dequantize_row`] then [`dot`], so the result is bit-identical and callers
/// may use either. `None` when no fused kernel applies.
#[inline]
pub fn dot_quantized(ty: TensorType, row: &[u8], x: &[f32]) -> Option<f32> {
    #[cfg(target_arch = "x86_64")]
    {
        if simd::available() {
            return simd::dot_quantized(ty, row, x);
        }
    }
    let _ = (ty, row, x);
    None
}

/// The portable dot product: eight lanes, summed pairwise at the end.
pub fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `out[i] += w * v[i]`.
#[inline]
pub fn axpy(out: &mut [f32], w: f32, v: &[f32]) {
    for (o, x) in out.iter_mut().zip(v) {
        *o += w * x;
    }
}

/// `out[j] = dot(q, rows[j]) * scale` for the `out.len()` rows of `width` floats in `rows` (attention's scores:
/// a query against every key), each exactly the [`dot`] it names, in one call.
pub fn scaled_dots(q: &[f32], rows: &[f32], width: usize, scale: f32, out: &mut [f32]) {
    assert!(q.len() == width && rows.len() >= out.len() * width, "scaled_dots: {} rows of {width}", out.len());
    #[cfg(target_arch = "x86_64")]
    {
        if simd::available() {
            return simd::scaled_dots(q, rows, width, scale, out);
        }
    }
    for (o, row) in out.iter_mut().zip(rows.chunks_exact(width)) {
        *o = dot(q, row) * scale;
    }
}

/// `out += (weights[j] / sum) · rows[j]` for every row `j` in turn, each as [`axpy`] computes it (attention's
/// weighted sum of the values), in one call.
pub fn weighted_rows(out: &mut [f32], weights: &[f32], sum: f32, rows: &[f32]) {
    let width = out.len();
    assert!(rows.len() >= weights.len() * width, "weighted_rows: {} rows of {width}", weights.len());
    #[cfg(target_arch = "x86_64")]
    {
        if simd::available() {
            return simd::weighted_rows(out, weights, sum, rows);
        }
    }
    for (&w, row) in weights.iter().zip(rows.chunks_exact(width)) {
        axpy(out, w / sum, row);
    }
}

/// [`scaled_dots`] over rows of f16 (the KV cache's keys, read where they are stored), each value converted exactly
/// as it is read: the same scores, bit for bit, as [`scaled_dots`] over the rows converted to f32 first.
pub fn scaled_dots_f16(q: &[f32], rows: &[f16], width: usize, scale: f32, out: &mut [f32]) {
    assert!(q.len() == width && rows.len() >= out.len() * width, "scaled_dots_f16: {} rows of {width}", out.len());
    #[cfg(target_arch = "x86_64")]
    {
        if simd::available() {
            return simd::scaled_dots_f16(q, rows, width, scale, out);
        }
    }
    let mut row32 = vec![0f32; width];
    for (o, row) in out.iter_mut().zip(rows.chunks_exact(width)) {
        f16_to_f32(row, &mut row32);
        *o = dot(q, &row32) * scale;
    }
}

/// [`weighted_rows`] over rows of f16 (the KV cache's values), each value converted exactly as it is read: the
/// same sums, bit for bit, as [`weighted_rows`] over the rows converted to f32 first.
pub fn weighted_rows_f16(out: &mut [f32], weights: &[f32], sum: f32, rows: &[f16]) {
    let width = out.len();
    assert!(rows.len() >= weights.len() * width, "weighted_rows_f16: {} rows of {width}", weights.len());
    #[cfg(target_arch = "x86_64")]
    {
        if simd::available() {
            return simd::weighted_rows_f16(out, weights, sum, rows);
        }
    }
    let mut row32 = vec![0f32; width];
    for (&w, row) in weights.iter().zip(rows.chunks_exact(width)) {
        f16_to_f32(row, &mut row32);
        axpy(out, w / sum, &row32);
    }
}

/// f16 storage to f32 (exact either way: every f16 is an f32). With F16C, sixteen values per loop step in one
/// inlined loop: `half`'s slice conversion called a function per eight values, 9% of a batch-16 decode step
/// reading the KV cache.
pub fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if simd_available() {
        simd::f16_to_f32(src, dst);
        return;
    }
    use half::slice::HalfFloatSliceExt;
    src.convert_to_f32_slice(dst);
}

/// f32 to f16 storage, rounding to nearest even.
pub fn f32_to_f16(src: &[f32], dst: &mut [f16]) {
    use half::slice::HalfFloatSliceExt;
    dst.convert_from_f32_slice(src);
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
pub(crate) mod simd {
    use std::arch::x86_64::*;
    use std::sync::OnceLock;

    use crate::gguf::TensorType;

    /// How far ahead in a weight matrix a kernel asks for lines: decode streams every weight once per token, and on
    /// the VMs measured the hardware prefetcher alone left the kernels waiting on memory (batch-1 decode at one
    /// thread, fast precision: 30 tok/s without, 36 at 2 KiB ahead, 47–51 at 8–16 KiB).
    const PREFETCH_BYTES: usize = 8192;

    /// Asks for the weight line `PREFETCH_BYTES` after `at`. A prefetch is a hint: it cannot fault, whatever the
    /// address, and changes no result.
    #[inline(always)]
    pub(crate) fn prefetch_weights(at: &[u8]) {
        // SAFETY: `_mm_prefetch` reads nothing architecturally and never faults; SSE is in the x86_64 baseline.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(at.as_ptr().wrapping_add(PREFETCH_BYTES).cast()) }
    }

    /// The two f16 values at the start of a block (its scale, and Q4_1's minimum), converted in registers (exact,
    /// as every f16 is an f32): a call out to a conversion function inside a kernel's loop cost more than the
    /// block's arithmetic.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(crate) fn scales(blk: &[u8]) -> (f32, f32) {
        let bits = i32::from_le_bytes([blk[0], blk[1], blk[2], blk[3]]);
        let v = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
        (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
    }

    /// Dequantizes Q4_1 and Q8_0 rows with AVX2; `false` for types it leaves to the portable code.
    pub fn dequantize_row(ty: TensorType, bytes: &[u8], out: &mut [f32]) -> bool {
        let blocks = out.len() / 32;
        match ty {
            TensorType::Q4_1 if bytes.len() >= blocks * 20 => {
                // SAFETY: AVX2 is present (checked by the caller) and the lengths were checked above.
                unsafe { q4_1_avx2(&bytes[..blocks * 20], &mut out[..blocks * 32]) };
                true
            }
            TensorType::Q8_0 if bytes.len() >= blocks * 34 => {
                // SAFETY: as above.
                unsafe { q8_0_avx2(&bytes[..blocks * 34], &mut out[..blocks * 32]) };
                true
            }
            _ => false,
        }
    }

    /// Fused dequantize-and-dot for whole-block rows (see `super::dot_quantized`).
    pub fn dot_quantized(ty: TensorType, row: &[u8], x: &[f32]) -> Option<f32> {
        if !x.len().is_multiple_of(32) || row.len() < x.len() / 32 * ty.block_bytes() {
            return None;
        }
        let wide = avx512();
        match ty {
            // SAFETY: AVX-512F checked by `avx512()`; lengths checked above.
            TensorType::Q4_1 if wide => Some(unsafe { dot_q4_1_avx512(row, x) }),
            // SAFETY: as above.
            TensorType::Q8_0 if wide => Some(unsafe { dot_q8_0_avx512(row, x) }),
            // SAFETY: AVX2/FMA/F16C present (checked by the caller); lengths checked above.
            TensorType::Q4_1 => Some(unsafe { dot_q4_1(row, x) }),
            // SAFETY: as above.
            TensorType::Q8_0 => Some(unsafe { dot_q8_0(row, x) }),
            _ => None,
        }
    }

    /// Whether the CPU has AVX-512F, for the fused dots' wide forms (bit-identical to the AVX2 ones).
    fn avx512() -> bool {
        static AVAILABLE: OnceLock<bool> = OnceLock::new();
        *AVAILABLE.get_or_init(|| avx512_allowed() && is_x86_feature_detected!("avx512f"))
    }

    /// Whether the kernels may use AVX-512 where the CPU has it: not when `TANDEM_CPU=avx2` is set, which runs
    /// the AVX2 kernels (and the fast precision's choices for a CPU without VNNI) on any x86-64 CPU, to measure
    /// and test what a CPU without AVX-512 runs. Read once per process.
    pub(crate) fn avx512_allowed() -> bool {
        static ALLOWED: OnceLock<bool> = OnceLock::new();
        *ALLOWED.get_or_init(|| std::env::var("TANDEM_CPU").map_or(true, |v| !v.eq_ignore_ascii_case("avx2")))
    }

    /// Lanes 8..16 of `v`.
    #[target_feature(enable = "avx512f")]
    fn upper(v: __m512) -> __m256 {
        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)))
    }

    /// `dot_q4_1`, bit for bit, sixteen lanes at a time: its accumulators 0 and 1 (values 0..16 of each block) are
    /// the low register here, 2 and 3 (values 16..32) the high one; every lane takes the same dequantization and
    /// products in the same order, and the reduction is the same.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn dot_q4_1_avx512(row: &[u8], x: &[f32]) -> f32 {
        let (mut lo_acc, mut hi_acc) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        for (blk, xs) in row.chunks_exact(20).zip(x.chunks_exact(32)) {
            prefetch_weights(blk);
            let (d, m) = scales(blk);
            let (d, m) = (_mm512_set1_ps(d), _mm512_set1_ps(m));
            // SAFETY: `blk` has 20 bytes and `xs` 32 floats; every load stays inside them.
            unsafe {
                let qs = _mm_loadu_si128(blk.as_ptr().add(4).cast());
                let mask = _mm_set1_epi8(0x0F);
                let lo = _mm_and_si128(qs, mask);
                let hi = _mm_and_si128(_mm_srli_epi16::<4>(qs), mask);
                let w = |b| _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)), d), m);
                lo_acc = _mm512_fmadd_ps(w(lo), _mm512_loadu_ps(xs.as_ptr()), lo_acc);
                hi_acc = _mm512_fmadd_ps(w(hi), _mm512_loadu_ps(xs.as_ptr().add(16)), hi_acc);
            }
        }
        reduce([_mm512_castps512_ps256(lo_acc), upper(lo_acc), _mm512_castps512_ps256(hi_acc), upper(hi_acc)])
    }

    /// `dot_q8_0`, bit for bit, sixteen lanes at a time (as `dot_q4_1_avx512`).
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn dot_q8_0_avx512(row: &[u8], x: &[f32]) -> f32 {
        let mut acc = [_mm512_setzero_ps(); 2];
        for (blk, xs) in row.chunks_exact(34).zip(x.chunks_exact(32)) {
            prefetch_weights(blk);
            let d = _mm512_set1_ps(scales(blk).0);
            for (k, a) in acc.iter_mut().enumerate() {
                // SAFETY: bytes 2 + 16k .. 18 + 16k lie in the 34-byte block; `xs` has 32 floats.
                unsafe {
                    let q8 = _mm_loadu_si128(blk.as_ptr().add(2 + 16 * k).cast());
                    let w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q8)), d);
                    *a = _mm512_fmadd_ps(w, _mm512_loadu_ps(xs.as_ptr().add(16 * k)), *a);
                }
            }
        }
        reduce([_mm512_castps512_ps256(acc[0]), upper(acc[0]), _mm512_castps512_ps256(acc[1]), upper(acc[1])])
    }

    /// See `super::dot_tile`.
    pub fn dot_tile(w: [&[f32]; 2], x: [&[f32]; 4]) -> [[f32; 4]; 2] {
        let n = w.iter().chain(&x).map(|s| s.len()).min().unwrap_or(0);
        // SAFETY: AVX2/FMA present (checked by the caller); every slice holds at least `n` floats.
        unsafe { dot_tile_avx2(w, x, n) }
    }

    /// `dot_avx2` for eight elements at once. `dot_avx2` keeps four accumulators per element, accumulator `k`
    /// taking lanes `8k..8k + 8` of every 32-float chunk (and accumulator 0 the 8-float chunks after them); the
    /// four are independent sums, so here each is computed in a pass of its own, for all eight elements together
    /// (eight accumulators, one per element, fit the registers where thirty-two would not), then reduced and
    /// finished exactly as `dot_avx2` does.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot_tile_avx2(w: [&[f32]; 2], x: [&[f32]; 4], n: usize) -> [[f32; 4]; 2] {
        let whole = n / 32 * 32;
        let eights = n / 8 * 8;
        let mut passes = [[[_mm256_setzero_ps(); 4]; 2]; 4];
        for (k, acc) in passes.iter_mut().enumerate() {
            // SAFETY: `tile_pass` reads 8 floats at each `i < end` it visits: `i = 8k + 32m < whole` leaves 8 floats
            // before `whole`, and `i < eights` 8 before `eights`; both are at most `n`, every slice's length.
            *acc = unsafe { tile_pass(w, x, 8 * k, whole, 32, *acc) };
            if k == 0 {
                // SAFETY: as above.
                *acc = unsafe { tile_pass(w, x, whole, eights, 8, *acc) };
            }
        }
        let mut out = [[0f32; 4]; 2];
        for (r, row) in out.iter_mut().enumerate() {
            for (t, o) in row.iter_mut().enumerate() {
                let mut total = reduce(passes.map(|p| p[r][t]));
                for i in eights..n {
                    total += w[r][i] * x[t][i];
                }
                *o = total;
            }
        }
        out
    }

    /// One accumulator per element of the tile, adding the 8 lanes at `start`, `start + step`, ... below `end`.
    /// Named locals rather than arrays, so that the eight accumulators stay in registers.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile_pass(
        w: [&[f32]; 2],
        x: [&[f32]; 4],
        start: usize,
        end: usize,
        step: usize,
        acc: [[__m256; 4]; 2],
    ) -> [[__m256; 4]; 2] {
        let [[mut c00, mut c01, mut c02, mut c03], [mut c10, mut c11, mut c12, mut c13]] = acc;
        let (w0, w1) = (w[0].as_ptr(), w[1].as_ptr());
        let (x0, x1, x2, x3) = (x[0].as_ptr(), x[1].as_ptr(), x[2].as_ptr(), x[3].as_ptr());
        let mut i = start;
        // SAFETY: the caller guarantees 8 floats at every `i < end` in each slice.
        unsafe {
            while i < end {
                let a0 = _mm256_loadu_ps(w0.add(i));
                let a1 = _mm256_loadu_ps(w1.add(i));
                let b = _mm256_loadu_ps(x0.add(i));
                c00 = _mm256_fmadd_ps(a0, b, c00);
                c10 = _mm256_fmadd_ps(a1, b, c10);
                let b = _mm256_loadu_ps(x1.add(i));
                c01 = _mm256_fmadd_ps(a0, b, c01);
                c11 = _mm256_fmadd_ps(a1, b, c11);
                let b = _mm256_loadu_ps(x2.add(i));
                c02 = _mm256_fmadd_ps(a0, b, c02);
                c12 = _mm256_fmadd_ps(a1, b, c12);
                let b = _mm256_loadu_ps(x3.add(i));
                c03 = _mm256_fmadd_ps(a0, b, c03);
                c13 = _mm256_fmadd_ps(a1, b, c13);
                i += step;
            }
        }
        [[c00, c01, c02, c03], [c10, c11, c12, c13]]
    }

    /// Horizontal sum of four accumulators, in the order `dot_avx2` uses.
    #[target_feature(enable = "avx2,fma")]
    fn reduce(acc: [__m256; 4]) -> f32 {
        let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let lo = _mm256_castps256_ps128(s);
        let hi = _mm256_extractf128_ps::<1>(s);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
        _mm_cvtss_f32(s)
    }

    // The Q4_1 unpacking below is written out again in `q4_1_avx2` on purpose: sharing it through a helper
    // returning four vectors measured a third slower in decode (not inlined across the target-feature
    // boundary). `fused_dots_equal_dequantize_then_dot` keeps the two bit-identical.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_q4_1(row: &[u8], x: &[f32]) -> f32 {
        let mut acc = [_mm256_setzero_ps(); 4];
        for (blk, xs) in row.chunks_exact(20).zip(x.chunks_exact(32)) {
            prefetch_weights(blk);
            let (d, m) = scales(blk);
            let (d, m) = (_mm256_set1_ps(d), _mm256_set1_ps(m));
            // SAFETY: `blk` has 20 bytes and `xs` 32 floats; every load stays inside them.
            unsafe {
                let qs = _mm_loadu_si128(blk.as_ptr().add(4).cast());
                let mask = _mm_set1_epi8(0x0F);
                let lo = _mm_and_si128(qs, mask);
                let hi = _mm_and_si128(_mm_srli_epi16::<4>(qs), mask);
                let parts = [lo, _mm_srli_si128::<8>(lo), hi, _mm_srli_si128::<8>(hi)];
                for (k, part) in parts.into_iter().enumerate() {
                    let q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part));
                    let w = _mm256_add_ps(_mm256_mul_ps(q, d), m);
                    acc[k] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xs.as_ptr().add(8 * k)), acc[k]);
                }
            }
        }
        reduce(acc)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_q8_0(row: &[u8], x: &[f32]) -> f32 {
        let mut acc = [_mm256_setzero_ps(); 4];
        for (blk, xs) in row.chunks_exact(34).zip(x.chunks_exact(32)) {
            prefetch_weights(blk);
            let d = _mm256_set1_ps(scales(blk).0);
            for (k, a) in acc.iter_mut().enumerate() {
                // SAFETY: bytes 2 + 8k .. 10 + 8k lie in the 34-byte block; `xs` has 32 floats.
                unsafe {
                    let q8 = _mm_loadl_epi64(blk.as_ptr().add(2 + 8 * k).cast());
                    let w = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)), d);
                    *a = _mm256_fmadd_ps(w, _mm256_loadu_ps(xs.as_ptr().add(8 * k)), *a);
                }
            }
        }
        reduce(acc)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_1_avx2(bytes: &[u8], out: &mut [f32]) {
        for (blk, o) in bytes.chunks_exact(20).zip(out.chunks_exact_mut(32)) {
            prefetch_weights(blk);
            let (d, m) = scales(blk);
            let (d, m) = (_mm256_set1_ps(d), _mm256_set1_ps(m));
            // SAFETY: `blk` has 20 bytes, so bytes 4..20 are readable; `o` has 32 floats for the four stores.
            unsafe {
                let qs = _mm_loadu_si128(blk.as_ptr().add(4).cast());
                let mask = _mm_set1_epi8(0x0F);
                let lo = _mm_and_si128(qs, mask);
                let hi = _mm_and_si128(_mm_srli_epi16::<4>(qs), mask);
                for (k, half) in [lo, lo, hi, hi].into_iter().enumerate() {
                    let bytes8 = if k % 2 == 0 { half } else { _mm_srli_si128::<8>(half) };
                    let q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8));
                    _mm256_storeu_ps(o.as_mut_ptr().add(8 * k), _mm256_add_ps(_mm256_mul_ps(q, d), m));
                }
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q8_0_avx2(bytes: &[u8], out: &mut [f32]) {
        for (blk, o) in bytes.chunks_exact(34).zip(out.chunks_exact_mut(32)) {
            prefetch_weights(blk);
            let d = _mm256_set1_ps(scales(blk).0);
            for k in 0..4 {
                // SAFETY: bytes 2 + 8k .. 2 + 8k + 8 lie inside the 34-byte block; `o` has 32 floats.
                unsafe {
                    let q8 = _mm_loadl_epi64(blk.as_ptr().add(2 + 8 * k).cast());
                    let q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8));
                    _mm256_storeu_ps(o.as_mut_ptr().add(8 * k), _mm256_mul_ps(q, d));
                }
            }
        }
    }

    /// AVX2, FMA and F16C: every kernel here (and in `q8`) needs the first two, the quantized ones the third.
    pub fn available() -> bool {
        static AVAILABLE: OnceLock<bool> = OnceLock::new();
        *AVAILABLE.get_or_init(|| {
            is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
        })
    }

    /// [`super::f16_to_f32`] with F16C. Panics unless the lengths are equal; callers check `available()` first.
    pub fn f16_to_f32(src: &[half::f16], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len(), "f16_to_f32: lengths differ");
        // SAFETY: the CPU has F16C and AVX (callers check `available()`); the lengths are equal.
        unsafe { f16_to_f32_f16c(src, dst) }
    }

    /// # Safety
    /// F16C and AVX are there; `src.len() == dst.len()`.
    #[target_feature(enable = "avx,f16c")]
    unsafe fn f16_to_f32_f16c(src: &[half::f16], dst: &mut [f32]) {
        let n = src.len() / 16 * 16;
        for i in (0..n).step_by(16) {
            // SAFETY: `i + 16 <= n <= len` for both slices; unaligned loads and stores.
            unsafe {
                let a = _mm_loadu_si128(src.as_ptr().add(i).cast());
                let b = _mm_loadu_si128(src.as_ptr().add(i + 8).cast());
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(a));
                _mm256_storeu_ps(dst.as_mut_ptr().add(i + 8), _mm256_cvtph_ps(b));
            }
        }
        for (d, s) in dst[n..].iter_mut().zip(&src[n..]) {
            *d = s.to_f32();
        }
    }

    #[inline]
    pub fn dot(a: &[f32], b: &[f32]) -> f32 {
        // SAFETY: callers check `available()` first, so the CPU has AVX2 and FMA.
        unsafe { dot_avx2(a, b) }
    }

    pub fn scaled_dots(q: &[f32], rows: &[f32], width: usize, scale: f32, out: &mut [f32]) {
        // SAFETY: callers check `available()` first (AVX2 and FMA).
        unsafe { scaled_dots_avx2(q, rows, width, scale, out) }
    }

    pub fn scaled_dots_f16(q: &[f32], rows: &[half::f16], width: usize, scale: f32, out: &mut [f32]) {
        // SAFETY: callers check `available()` first (AVX2, FMA and F16C).
        unsafe { scaled_dots_f16_avx2(q, rows, width, scale, out) }
    }

    /// `dot_avx2` per row, inlined here (same target features), so each score is the same `dot` bit for bit.
    #[target_feature(enable = "avx2,fma")]
    fn scaled_dots_avx2(q: &[f32], rows: &[f32], width: usize, scale: f32, out: &mut [f32]) {
        for (o, row) in out.iter_mut().zip(rows.chunks_exact(width)) {
            // SAFETY: AVX2 and FMA are enabled here.
            *o = unsafe { dot_avx2(q, row) } * scale;
        }
    }

    /// `scaled_dots_avx2` over f16 rows, each converted as it is loaded.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn scaled_dots_f16_avx2(q: &[f32], rows: &[half::f16], width: usize, scale: f32, out: &mut [f32]) {
        for (o, row) in out.iter_mut().zip(rows.chunks_exact(width)) {
            // SAFETY: AVX2, FMA and F16C are enabled here.
            *o = unsafe { dot_f16_avx2(q, row) } * scale;
        }
    }

    pub fn weighted_rows(out: &mut [f32], weights: &[f32], sum: f32, rows: &[f32]) {
        // SAFETY: callers check `available()` first (AVX2).
        unsafe { weighted_rows_avx2(out, weights, sum, rows) }
    }

    pub fn weighted_rows_f16(out: &mut [f32], weights: &[f32], sum: f32, rows: &[half::f16]) {
        // SAFETY: callers check `available()` first (AVX2 and F16C).
        unsafe { weighted_rows_f16_avx2(out, weights, sum, rows) }
    }

    /// `weighted_rows`'s loop with the rows' eight floats at `p` given by `$load(p)` and one float at `i` by
    /// `$at(i)`: written once for the f32 rows and the f16 ones, so that both compute the same, element for element.
    macro_rules! weighted_rows_body {
        ($out:expr, $weights:expr, $sum:expr, $rows:expr, |$p:ident| $load:expr, |$i:ident| $at:expr) => {{
            let (out, weights, sum, rows) = ($out, $weights, $sum, $rows);
            let width = out.len();
            let whole = width / 64 * 64;
            for c in (0..whole).step_by(64) {
                // SAFETY: floats `c..c + 64` are inside `out` and inside every row (`c + 64 <= width`).
                unsafe {
                    let mut acc: [__m256; 8] =
                        std::array::from_fn(|k| _mm256_loadu_ps(out.as_ptr().add(c + 8 * k)));
                    for (j, &w) in weights.iter().enumerate() {
                        let p = _mm256_set1_ps(w / sum);
                        let row = rows.as_ptr().add(j * width + c);
                        for (k, a) in acc.iter_mut().enumerate() {
                            let $p = row.add(8 * k);
                            *a = _mm256_add_ps(*a, _mm256_mul_ps(p, $load));
                        }
                    }
                    for (k, a) in acc.iter().enumerate() {
                        _mm256_storeu_ps(out.as_mut_ptr().add(c + 8 * k), *a);
                    }
                }
            }
            for (j, &w) in weights.iter().enumerate() {
                let p = w / sum;
                for (o, $i) in out[whole..].iter_mut().zip(j * width + whole..(j + 1) * width) {
                    *o += p * $at;
                }
            }
        }};
    }

    /// Sixty-four output floats at a time stay in registers while every row adds its share to them, each lane a
    /// multiply then an add, rows in order: `axpy`'s arithmetic, element for element.
    #[target_feature(enable = "avx2")]
    fn weighted_rows_avx2(out: &mut [f32], weights: &[f32], sum: f32, rows: &[f32]) {
        weighted_rows_body!(out, weights, sum, rows, |p| _mm256_loadu_ps(p), |i| rows[i])
    }

    /// `weighted_rows_avx2` over f16 rows, each converted as it is loaded.
    #[target_feature(enable = "avx2,f16c")]
    fn weighted_rows_f16_avx2(out: &mut [f32], weights: &[f32], sum: f32, rows: &[half::f16]) {
        weighted_rows_body!(out, weights, sum, rows, |p| _mm256_cvtph_ps(_mm_loadu_si128(p.cast())), |i| rows[i]
            .to_f32())
    }

    /// `dot_avx2`'s loop over `a` and a second operand whose eight floats at `p` are `$load(p)` and float `i`
    /// is `$at(i)`: written once for f32 and f16 operands, so that both sum the same products in the same order.
    macro_rules! dot_body {
        ($a:expr, $b:expr, |$p:ident| $load:expr, |$i:ident| $at:expr) => {{
            let (a, b) = ($a, $b);
            let n = a.len().min(b.len());
            let mut acc = [_mm256_setzero_ps(); 4];
            let mut i = 0;
            // SAFETY: every load reads 8 floats at `i + 8k < n`, inside both slices.
            unsafe {
                while i + 32 <= n {
                    for (k, acc) in acc.iter_mut().enumerate() {
                        let x = _mm256_loadu_ps(a.as_ptr().add(i + 8 * k));
                        let $p = b.as_ptr().add(i + 8 * k);
                        *acc = _mm256_fmadd_ps(x, $load, *acc);
                    }
                    i += 32;
                }
                while i + 8 <= n {
                    let x = _mm256_loadu_ps(a.as_ptr().add(i));
                    let $p = b.as_ptr().add(i);
                    acc[0] = _mm256_fmadd_ps(x, $load, acc[0]);
                    i += 8;
                }
            }
            let mut total = reduce(acc);
            while i < n {
                let $i = i;
                total += a[i] * $at;
                i += 1;
            }
            total
        }};
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
        dot_body!(a, b, |p| _mm256_loadu_ps(p), |i| b[i])
    }

    /// `dot_avx2` with `b` in f16, each lane converted exactly as it is loaded: the same value, bit for bit, as
    /// `dot_avx2` over `b` converted first.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_f16_avx2(a: &[f32], b: &[half::f16]) -> f32 {
        dot_body!(a, b, |p| _mm256_cvtph_ps(_mm_loadu_si128(p.cast())), |i| b[i].to_f32())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_agrees_with_a_plain_sum() {
        for n in [0, 1, 7, 8, 31, 32, 64, 100, 576] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let want: f64 = a.iter().zip(&b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
            assert!((f64::from(dot(&a, &b)) - want).abs() < 1e-4, "n={n}");
            assert!((f64::from(dot_portable(&a, &b)) - want).abs() < 1e-4, "n={n}");
        }
    }

    /// The attention kernels against the plain calls they stand for, bit for bit (widths with and without a
    /// part past the last 64 floats).
    #[test]
    fn attention_kernels_equal_their_plain_loops() {
        for width in [64, 72, 8, 3] {
            let f = |i: usize, s: f32| ((i as f32) * s).sin();
            let q: Vec<f32> = (0..width).map(|i| f(i, 0.37)).collect();
            let rows: Vec<f32> = (0..9 * width).map(|i| f(i, 0.11)).collect();
            let mut scores = vec![0f32; 9];
            scaled_dots(&q, &rows, width, 0.125, &mut scores);
            for (j, s) in scores.iter().enumerate() {
                assert_eq!(s.to_bits(), (dot(&q, &rows[j * width..(j + 1) * width]) * 0.125).to_bits(), "{width} {j}");
            }
            let mut out: Vec<f32> = (0..width).map(|i| f(i, 0.7)).collect();
            let mut want = out.clone();
            weighted_rows(&mut out, &scores, 1.7, &rows);
            for (j, &w) in scores.iter().enumerate() {
                for (o, v) in want.iter_mut().zip(&rows[j * width..(j + 1) * width]) {
                    *o += (w / 1.7) * v;
                }
            }
            assert!(out.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "width {width}");
        }
    }

    /// Over f16 rows, read in place block by block (as attention reads the KV cache), the kernels give what they
    /// give over the same rows converted to f32 first, in one call, bit for bit.
    #[test]
    fn attention_kernels_over_f16_equal_them_over_converted_rows() {
        for width in [64, 72, 8, 3] {
            let f = |i: usize, s: f32| ((i as f32) * s).sin();
            let q: Vec<f32> = (0..width).map(|i| f(i, 0.37)).collect();
            let rows16: Vec<f16> = (0..9 * width).map(|i| f16::from_f32(f(i, 0.11) * 3.0)).collect();
            let mut rows = vec![0f32; rows16.len()];
            f16_to_f32(&rows16, &mut rows);
            let (mut want, mut got) = (vec![0f32; 9], vec![0f32; 9]);
            scaled_dots(&q, &rows, width, 0.125, &mut want);
            // In blocks of four rows, the last one short.
            for (b, block) in rows16.chunks(4 * width).enumerate() {
                scaled_dots_f16(&q, block, width, 0.125, &mut got[b * 4..b * 4 + block.len() / width]);
            }
            assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "scores, width {width}");
            let start: Vec<f32> = (0..width).map(|i| f(i, 0.7)).collect();
            let (mut want, mut got) = (start.clone(), start);
            weighted_rows(&mut want, &weights(), 1.7, &rows);
            for (b, block) in rows16.chunks(4 * width).enumerate() {
                weighted_rows_f16(&mut got, &weights()[b * 4..b * 4 + block.len() / width], 1.7, block);
            }
            assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "sums, width {width}");
        }
        fn weights() -> Vec<f32> {
            (0..9).map(|j| 0.1 + j as f32 * 0.13).collect()
        }
    }

    #[test]
    fn simd_dequantization_equals_the_portable_one() {
        let mut state = 0x1234_5678_u32;
        let mut bytes = vec![0u8; 20 * 34 * 4];
        for b in &mut bytes {
            state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            *b = (state >> 24) as u8;
        }
        // Keep the f16 scales finite so the comparison is about the arithmetic.
        for ty in [TensorType::Q4_1, TensorType::Q8_0] {
            let bb = ty.block_bytes();
            let mut row = bytes[..bb * 8].to_vec();
            for blk in row.chunks_exact_mut(bb) {
                blk[1] &= 0x3B;
                if ty == TensorType::Q4_1 {
                    blk[3] &= 0x3B;
                }
            }
            let (mut a, mut b) = (vec![0f32; 256], vec![0f32; 256]);
            dequantize_row(ty, &row, &mut a);
            dequantize_row_portable(ty, &row, &mut b);
            assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "{ty:?}");
        }
    }

    #[test]
    fn fused_dots_equal_dequantize_then_dot() {
        let mut state = 0x9E37_79B9_u32;
        let mut next = || {
            state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            state
        };
        let x: Vec<f32> = (0..576).map(|_| (next() >> 8) as f32 / (1 << 24) as f32 - 0.5).collect();
        for ty in [TensorType::Q4_1, TensorType::Q8_0] {
            let bb = ty.block_bytes();
            let mut row: Vec<u8> = (0..18 * bb).map(|_| (next() >> 24) as u8).collect();
            for blk in row.chunks_exact_mut(bb) {
                blk[1] &= 0x3B;
                blk[3] &= 0x3B;
            }
            let mut w = vec![0f32; 576];
            dequantize_row(ty, &row, &mut w);
            if let Some(fused) = dot_quantized(ty, &row, &x) {
                assert_eq!(fused.to_bits(), dot(&w, &x).to_bits(), "{ty:?}");
            }
        }
    }

    #[test]
    fn f16_conversion_equals_halfs_for_every_value() {
        use half::slice::HalfFloatSliceExt;
        // Every f16 bit pattern, and a length that leaves a remainder after the sixteen-wide steps.
        let src: Vec<f16> = (0..=u16::MAX).chain(0..5).map(f16::from_bits).collect();
        let (mut ours, mut theirs) = (vec![0f32; src.len()], vec![0f32; src.len()]);
        f16_to_f32(&src, &mut ours);
        src.convert_to_f32_slice(&mut theirs);
        for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
            assert!(a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()), "{:#06x}: {a} vs {b}", src[i].to_bits());
        }
        assert!(ours.iter().zip(&src).all(|(a, s)| a.is_nan() || *a == s.to_f32()));
    }

    #[test]
    fn tiles_equal_dots_bit_for_bit() {
        let mut state = 0x2545_F491_u32;
        let mut next = || {
            state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (state >> 8) as f32 / (1 << 24) as f32 - 0.5
        };
        // Lengths with and without 32-float chunks, 8-float chunks after them and a scalar tail; the model's 576
        // and 1,536.
        for n in [0, 3, 8, 13, 32, 40, 47, 64, 100, 576, 1536] {
            let w: Vec<Vec<f32>> = (0..TILE_ROWS).map(|_| (0..n).map(|_| next()).collect()).collect();
            let x: Vec<Vec<f32>> = (0..TILE_COLS).map(|_| (0..n).map(|_| next()).collect()).collect();
            let tile = dot_tile([&w[0], &w[1]], [&x[0], &x[1], &x[2], &x[3]]);
            for r in 0..TILE_ROWS {
                for t in 0..TILE_COLS {
                    assert_eq!(tile[r][t].to_bits(), dot(&w[r], &x[t]).to_bits(), "n={n} r={r} t={t}");
                }
            }
        }
    }

    #[test]
    fn q4_1_dequantizes_low_then_high_nibbles() {
        let mut blk = vec![0u8; 20];
        blk[0..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        blk[2..4].copy_from_slice(&f16::from_f32(-1.0).to_le_bytes());
        blk[4] = 0x3A; // element 0 = 10, element 16 = 3
        let mut out = [0f32; 32];
        dequantize_row(TensorType::Q4_1, &blk, &mut out);
        assert_eq!(out[0], 10.0 * 0.5 - 1.0);
        assert_eq!(out[16], 3.0 * 0.5 - 1.0);
        assert_eq!(out[1], -1.0);
    }
}
