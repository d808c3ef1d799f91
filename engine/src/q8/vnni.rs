//! The fast precision's integer dots on CPUs with 512-bit integer dot products (AVX-512 VNNI). Prompt-sized
//! matmuls and batches over four rows ([`matmul_rows`]): Q4_1 or Q8_0 weight rows against 8-bit activation rows
//! ([`super::Q8Rows`]) in tiles of four weight rows by four activation rows. Decode-sized ones ([`dot_tile`]): one
//! weight row, Q4_1 or Q8_0, against up to four activation rows, unpacked in registers.
//!
//! A group of weight rows is unpacked once per matmul into one byte per value (a Q4_1 nibble is already
//! unsigned, which is what `vpdpbusd` takes against signed activation bytes; a Q8_0 byte is taken plus 128, and
//! 128·Σx taken back from each block's integer sum, exactly), with its block scales and minimums in f32. One
//! 512-bit register then holds two blocks, `vpdpbusd` sums their 64 products into sixteen lanes of four, and each
//! lane is scaled by its block's weight scale times activation scale and added to a float accumulator: three
//! instructions and a multiply for 64 products, where the f32 tiles take eight fused multiply-adds. The minimums'
//! term `Σ m·s` (Q4_1's) is a short f32 dot over blocks at the end. The summation order differs from
//! [`super::dot`]'s, so results are not bit-identical to the single-row path: the fast precision is not
//! batch-invariant, and its tests hold it to tolerances instead.

#![allow(unsafe_code)]

use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::{BLOCK, Q8Rows};
use crate::columns::Part;
use crate::gguf::TensorType;
use crate::kernels::simd::{prefetch_weights, scales};

/// Whether the CPU has what the tiles use (AVX-512 F/BW with VNNI; F16C for the scales).
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        crate::kernels::simd::avx512_allowed()
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vnni")
            && is_x86_feature_detected!("f16c")
    })
}

/// Whether decode-sized steps (up to [`super::PAIRED_MAX_ROWS`] activation rows) take this module's [`dot_tile`]
/// rather than the AVX2 tiles: wherever [`available`], unless `TANDEM_DECODE_DOTS=avx2` asks for the AVX2 ones, for
/// measuring the choice. Read once per process.
///
/// On AMD's Zen 4 the AVX2 dots were measured faster at one and two rows (docs/performance.md, session 41), but
/// with prompts still computed by this module's tiles that mixture moved one golden decode step's top logit by 0.88
/// from the reference, past the 0.75 the precision tests hold the fast precision to, so it is not the default.
pub fn for_decode() -> bool {
    static CHOICE: OnceLock<bool> = OnceLock::new();
    *CHOICE.get_or_init(|| {
        available() && std::env::var("TANDEM_DECODE_DOTS").map_or(true, |v| !v.eq_ignore_ascii_case("avx2"))
    })
}

/// Whether rows of `ty` with `cols` columns go through the tiles: Q4_1 or Q8_0 (the output projection), whole
/// pairs of blocks.
pub fn supported(ty: TensorType, cols: usize) -> bool {
    matches!(ty, TensorType::Q4_1 | TensorType::Q8_0) && cols > 0 && cols.is_multiple_of(2 * BLOCK)
}

/// Weight rows unpacked for the tiles; reused across groups.
#[derive(Default)]
struct Unpacked {
    cols: usize,
    /// One byte per value, row after row.
    u: Vec<u8>,
    /// Per row, per block: the scale.
    d: Vec<f32>,
    /// Per row, per block: the minimum, each row padded with zeros to a multiple of 16 blocks.
    m: Vec<f32>,
}

impl Unpacked {
    fn blocks(&self) -> usize {
        self.cols / BLOCK
    }

    fn padded(&self) -> usize {
        self.blocks().next_multiple_of(16)
    }

    /// Unpacks rows of `ty` (Q4_1 or Q8_0, `cols` values each). [`available`] must hold.
    fn unpack<'a>(&mut self, ty: TensorType, rows: impl ExactSizeIterator<Item = &'a [u8]>, cols: usize) {
        self.cols = cols;
        let (blocks, padded, n) = (self.blocks(), self.padded(), rows.len());
        self.u.resize(n * cols, 0);
        self.d.resize(n * blocks, 0.0);
        self.m.clear();
        self.m.resize(n * padded, 0.0);
        for (r, row) in rows.enumerate() {
            let u = &mut self.u[r * cols..(r + 1) * cols];
            let (d, m) = (&mut self.d[r * blocks..(r + 1) * blocks], &mut self.m[r * padded..r * padded + blocks]);
            // SAFETY: `available()` holds (the caller's contract); the slices have the lengths the unpacking
            // functions read and write.
            match ty {
                TensorType::Q8_0 => unsafe { unpack_q8_0_row(&row[..blocks * 34], u, d, m) },
                _ => unsafe { unpack_row(&row[..blocks * 20], u, d, m) },
            }
        }
    }
}

/// One Q4_1 row: `u` gets 32 bytes per 20-byte block, `d` and `m` one float each.
///
/// # Safety
/// AVX2, FMA and F16C are there; `u.len() == 32 * d.len()`, `m.len() == d.len()`, `row.len() == 20 * d.len()`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack_row(row: &[u8], u: &mut [u8], d: &mut [f32], m: &mut [f32]) {
    let mask = _mm256_set1_epi8(0x0F);
    for (b, blk) in row.chunks_exact(20).enumerate() {
        (d[b], m[b]) = scales(blk);
        // SAFETY: bytes 4..20 are in the block; bytes 32b..32b + 32 are in `u`.
        unsafe {
            let qs = _mm_loadu_si128(blk.as_ptr().add(4).cast());
            // Low nibbles are values 0..16, high nibbles 16..32.
            let v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(qs), qs), mask);
            _mm256_storeu_si256(u.as_mut_ptr().add(32 * b).cast(), v);
        }
    }
}

/// One Q8_0 row: `u` gets each signed byte plus 128 (its top bit flipped), `d` the block's scale and `m` zero;
/// the tiles take 128·Σx back from each block's integer sum (`SHIFTED`).
///
/// # Safety
/// AVX2 and F16C are there; `u.len() == 32 * d.len()`, `m.len() == d.len()`, `row.len() == 34 * d.len()`.
#[target_feature(enable = "avx2,f16c")]
unsafe fn unpack_q8_0_row(row: &[u8], u: &mut [u8], d: &mut [f32], m: &mut [f32]) {
    let flip = _mm256_set1_epi8(-128);
    for (b, blk) in row.chunks_exact(34).enumerate() {
        let scale = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(u16::from_le_bytes([blk[0], blk[1]])))));
        (d[b], m[b]) = (scale, 0.0);
        // SAFETY: bytes 2..34 are in the block; bytes 32b..32b + 32 are in `u`.
        unsafe {
            let v = _mm256_loadu_si256(blk.as_ptr().add(2).cast());
            _mm256_storeu_si256(u.as_mut_ptr().add(32 * b).cast(), _mm256_xor_si256(v, flip));
        }
    }
}

/// The weight rows of `part` (`w(r)` is row `r`, of type `ty`: [`supported`]) against every row of `x` (`n`
/// rows), written into `part`. [`available`] must hold.
pub(crate) fn matmul_rows<'a>(ty: TensorType, w: impl Fn(usize) -> &'a [u8], part: &Part<'_>, x: &Q8Rows, n: usize) {
    match ty {
        TensorType::Q8_0 => matmul_rows_of::<true>(ty, w, part, x, n),
        _ => matmul_rows_of::<false>(ty, w, part, x, n),
    }
}

/// [`matmul_rows`] for weights whose bytes are unpacked plus 128 (`SHIFTED`: Q8_0) or as they are (Q4_1).
fn matmul_rows_of<'a, const SHIFTED: bool>(
    ty: TensorType,
    w: impl Fn(usize) -> &'a [u8],
    part: &Part<'_>,
    x: &Q8Rows,
    n: usize,
) {
    /// Weight rows unpacked at a time (18 KiB at the model's width of 576: they stay in L1 while four activation
    /// rows pass over them, and the activation rows stay there while the group's tiles use them).
    const GROUP: usize = 32;
    assert!(available(), "VNNI tiles on a CPU without them");
    assert!(x.d.len() >= n * x.blocks_per_row, "vnni::matmul_rows: {n} rows wanted");
    let cols = x.blocks_per_row * BLOCK;
    let (first, nr) = (part.first(), part.len());
    let mut scratch = Unpacked::default();
    for g0 in (0..nr).step_by(GROUP) {
        let gn = GROUP.min(nr - g0);
        scratch.unpack(ty, (first + g0..first + g0 + gn).map(&w), cols);
        let u = &scratch;
        let (full_r, full_t) = (gn / 4 * 4, n / 4 * 4);
        for t0 in (0..n).step_by(4) {
            for r0 in (0..gn).step_by(4) {
                // SAFETY: `available()` holds; the tiles stay inside `u`'s `gn` rows and `x`'s `n` rows.
                unsafe {
                    if r0 < full_r && t0 < full_t {
                        for (r, row) in tile::<4, 4, SHIFTED>(u, r0, x, t0).iter().enumerate() {
                            row.iter().enumerate().for_each(|(t, &v)| part.set(g0 + r0 + r, t0 + t, v));
                        }
                        continue;
                    }
                    // The edges: one weight row against one activation row at a time.
                    for r in r0..gn.min(r0 + 4) {
                        for t in t0..n.min(t0 + 4) {
                            part.set(g0 + r, t, tile::<1, 1, SHIFTED>(u, r, x, t)[0][0]);
                        }
                    }
                }
            }
        }
    }
}

/// Two floats at `at` (a pair of blocks' scales) spread over the 16 lanes as `lanes` names them (0: the first,
/// 1: the second).
///
/// # Safety
/// AVX-512F; two floats readable at `at`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn spread_pair(at: *const f32, lanes: __m512i) -> __m512 {
    // SAFETY: the caller's contract.
    let two = unsafe { _mm_castpd_ps(_mm_load_sd(at.cast())) };
    _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(two))
}

/// Unpacked rows `r0..r0 + R` against activation rows `t0..t0 + T`.
///
/// # Safety
/// The CPU has what [`available`] checks; the rows exist in `u` and `x`, and `x` has `u`'s width.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn tile<const R: usize, const T: usize, const SHIFTED: bool>(
    u: &Unpacked,
    r0: usize,
    x: &Q8Rows,
    t0: usize,
) -> [[f32; T]; R] {
    let (cols, blocks, padded) = (u.cols, u.blocks(), u.padded());
    // Lanes 0–7 take the first float of a pair, lanes 8–15 the second.
    let spread = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    let zero = _mm512_setzero_si512();
    let by128 = _mm512_set1_epi8(-128);
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    // SAFETY (every load below): pair `p` covers bytes `64p..64p + 64` and blocks `2p, 2p + 1` of a row, inside
    // the row since `cols` is a multiple of 64; rows `r0 + r` and `t0 + t` exist (the caller's contract).
    unsafe {
        for p in 0..cols / 64 {
            let pair = |scales: &[f32], row: usize| spread_pair(scales.as_ptr().add(row * blocks + 2 * p), spread);
            let xv: [__m512i; T] =
                std::array::from_fn(|t| _mm512_loadu_si512(x.q.as_ptr().add((t0 + t) * cols + 64 * p).cast()));
            let xs: [__m512; T] = std::array::from_fn(|t| pair(&x.d, t0 + t));
            // Shifted weights (Q8_0's, plus 128): 128·Σx per lane, taken back from every weight row's sums.
            let shift: [__m512i; T] =
                std::array::from_fn(|t| if SHIFTED { _mm512_dpbusd_epi32(zero, by128, xv[t]) } else { zero });
            for (r, acc) in acc.iter_mut().enumerate() {
                let wv = _mm512_loadu_si512(u.u.as_ptr().add((r0 + r) * cols + 64 * p).cast());
                let ws = pair(&u.d, r0 + r);
                for (((a, &xv), &xs), &shift) in acc.iter_mut().zip(&xv).zip(&xs).zip(&shift) {
                    let mut sums = _mm512_dpbusd_epi32(zero, wv, xv);
                    if SHIFTED {
                        sums = _mm512_sub_epi32(sums, shift);
                    }
                    *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(ws, xs), *a);
                }
            }
        }
        // The minimums: Σ over blocks of m·s, sixteen blocks at a time (the weights' side is zero-padded); Q8_0
        // has none.
        let mut out = [[0f32; T]; R];
        for (r, row) in out.iter_mut().enumerate() {
            for (t, v) in row.iter_mut().enumerate() {
                let mut mins = _mm512_setzero_ps();
                for b in (0..if SHIFTED { 0 } else { padded }).step_by(16) {
                    let left = blocks - b;
                    let keep: __mmask16 = if left >= 16 { 0xFFFF } else { (1 << left) - 1 };
                    let s = _mm512_maskz_loadu_ps(keep, x.s.as_ptr().add((t0 + t) * blocks + b));
                    let m = _mm512_loadu_ps(u.m.as_ptr().add((r0 + r) * padded + b));
                    mins = _mm512_fmadd_ps(m, s, mins);
                }
                *v = _mm512_reduce_add_ps(acc[r][t]) + _mm512_reduce_add_ps(mins);
            }
        }
        out
    }
}

/// Lane groups of four bytes to blocks, for a pair of blocks laid out as [`interleave`] and Q4_1's nibbles
/// order them (lanes 0–3 and 8–11 the first block, 4–7 and 12–15 the second).
#[inline(always)]
fn nibble_spread() -> __m512i {
    // SAFETY: no memory is touched; AVX-512F is there wherever this module's functions run.
    unsafe { _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0) }
}

/// Orders each pair of 32-byte blocks of `q` (block `a` then `b`) as Q4_1's nibbles come out of two blocks
/// loaded side by side: `a[..16]`, `b[..16]`, `a[16..]`, `b[16..]`. `q.len()` is a multiple of 64.
pub(super) fn interleave(q: &[i8], out: &mut [i8]) {
    for (src, dst) in q.chunks_exact(2 * BLOCK).zip(out.chunks_exact_mut(2 * BLOCK)) {
        dst[..16].copy_from_slice(&src[..16]);
        dst[16..32].copy_from_slice(&src[32..48]);
        dst[32..48].copy_from_slice(&src[16..32]);
        dst[48..].copy_from_slice(&src[48..]);
    }
}

/// Weight row `w` (Q4_1 or Q8_0) against `N` activation rows with their `paired` bytes: a pair (weight row,
/// activation row) takes the same operations in the same order whatever `N` is, so tiles equal single dots.
#[inline]
pub fn dot_tile<const N: usize>(ty: TensorType, w: &[u8], x: [super::Q8Row<'_>; N]) -> [f32; N] {
    let pairs = x.iter().map(|r| r.d.len().min(r.s.len()).min(r.paired.len() / BLOCK).min(r.q.len() / BLOCK)).min();
    let pairs = pairs.unwrap_or(0).min(w.len() / ty.block_bytes()) / 2;
    assert!(available(), "VNNI dots on a CPU without them");
    match ty {
        // SAFETY: checked above: the features, and `pairs` pairs of blocks in `w` and in every row.
        TensorType::Q4_1 => unsafe { dot_pairs::<N, true>(w, x, pairs) },
        // SAFETY: as above.
        _ => unsafe { dot_pairs::<N, false>(w, x, pairs) },
    }
}

/// `Q4` picks the weights' type: Q4_1 (40 bytes a pair; nibbles against the rows' `paired` bytes) or Q8_0 (68
/// bytes a pair; against the rows' bytes in order). A Q8_0 byte is signed and `vpdpbusd` wants unsigned weights,
/// so each is taken plus 128 (its top bit flipped) and 128·Σq is taken back through the minimums' term, as a
/// block minimum of −128·d.
///
/// # Safety
/// [`available`]; `w` and every row hold `pairs` pairs of blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_pairs<const N: usize, const Q4: bool>(w: &[u8], x: [super::Q8Row<'_>; N], pairs: usize) -> [f32; N] {
    let spread = if Q4 { nibble_spread() } else { _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0) };
    let stride = if Q4 { 40 } else { 68 };
    let zero = _mm512_setzero_si512();
    let mut acc = [_mm512_setzero_ps(); N];
    let mut mins = [_mm_setzero_ps(); N];
    // SAFETY (every access): pair `p` is bytes `stride·p..stride·(p + 1)` of `w`, blocks `2p, 2p + 1` and bytes
    // `64p..64p + 64` of each row.
    unsafe {
        for p in 0..pairs {
            let blk = w.as_ptr().add(stride * p);
            prefetch_weights(&w[stride * p..]);
            let (wv, ws, m) = if Q4 {
                // d0, m0, d1, m1.
                let halfs =
                    _mm_set_epi32(0, 0, blk.add(20).cast::<i32>().read_unaligned(), blk.cast::<i32>().read_unaligned());
                let scales = _mm_cvtph_ps(halfs);
                let ws = _mm512_permutexvar_ps(
                    _mm512_set_epi32(2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0),
                    _mm512_castps128_ps512(scales),
                );
                let both = _mm256_loadu2_m128i(blk.add(24).cast(), blk.add(4).cast());
                let wv = _mm512_and_si512(
                    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(both), _mm256_srli_epi16::<4>(both)),
                    _mm512_set1_epi8(0x0F),
                );
                (wv, ws, _mm_shuffle_ps::<0b11_01_11_01>(scales, scales))
            } else {
                let halfs = i32::from(blk.cast::<u16>().read_unaligned())
                    | (i32::from(blk.add(34).cast::<u16>().read_unaligned()) << 16);
                let scales = _mm_cvtph_ps(_mm_cvtsi32_si128(halfs));
                let bytes = _mm512_inserti64x4::<1>(
                    _mm512_castsi256_si512(_mm256_loadu_si256(blk.add(2).cast())),
                    _mm256_loadu_si256(blk.add(36).cast()),
                );
                let ws = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(scales));
                (_mm512_xor_si512(bytes, _mm512_set1_epi8(-128)), ws, _mm_mul_ps(scales, _mm_set1_ps(-128.0)))
            };
            for k in 0..N {
                let row = if Q4 { x[k].paired } else { x[k].q };
                let xv = _mm512_loadu_si512(row.as_ptr().add(64 * p).cast());
                let xs = spread_pair(x[k].d.as_ptr().add(2 * p), spread);
                let sums = _mm512_dpbusd_epi32(zero, wv, xv);
                acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(ws, xs), acc[k]);
                let s = _mm_castpd_ps(_mm_load_sd(x[k].s.as_ptr().add(2 * p).cast()));
                mins[k] = _mm_fmadd_ps(m, s, mins[k]);
            }
        }
    }
    std::array::from_fn(|k| finish(acc[k], mins[k]))
}

/// The lanes' sum plus the minimums' sums of the pairs' first and second blocks (lanes 0 and 1 of `mins`).
#[target_feature(enable = "avx512f,avx2,fma")]
fn finish(acc: __m512, mins: __m128) -> f32 {
    _mm512_reduce_add_ps(acc) + (_mm_cvtss_f32(mins) + _mm_cvtss_f32(_mm_movehdup_ps(mins)))
}
