//! The CUDA backend's kernels (`engine/src/backend/cuda/kernels.cu`) compiled for the CPU and run against the CPU
//! engine's own arithmetic, on every CI run, without a GPU: the host build (`tests/cuda_host/host.cpp`) runs a
//! grid one thread block at a time, the block's threads as fibers that meet at each barrier, so shared memory,
//! `__syncthreads` and warp shuffles behave as they do on a GPU. This checks what each kernel computes (indexing,
//! reductions, the paged cache's layout); the GPU check (`scripts/device/check.sh`) checks the same kernels on the
//! device, NVRTC and cuBLAS included. The f16 conversions round to nearest even on both.

use std::ffi::{CString, c_void};
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use engine::backend::gpu::Arg;
use engine::gguf::TensorType;
use half::f16;

/// The kernels compiled for the CPU, loaded once per test process.
fn library() -> &'static libloading::Library {
    static LIB: OnceLock<libloading::Library> = OnceLock::new();
    LIB.get_or_init(|| {
        let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let dir = std::env::temp_dir().join(format!("tandem-cuda-host-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        let lib = dir.join("libtandem_cuda_host.so");
        let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let out = Command::new(&compiler)
            .args(["-std=c++17", "-O1", "-shared", "-fPIC", "-Wall", "-Werror", "-I"])
            .arg(here.join("src/backend/cuda"))
            .arg(here.join("tests/cuda_host/host.cpp"))
            .arg("-o")
            .arg(&lib)
            .output()
            .unwrap_or_else(|e| panic!("these tests need a C++ compiler ({compiler}): {e}"));
        assert!(out.status.success(), "the host build failed:\n{}", String::from_utf8_lossy(&out.stderr));
        // SAFETY: the library is the one just built from host.cpp; its initializers only set up empty statics.
        #[allow(unsafe_code)]
        let loaded = unsafe { libloading::Library::new(&lib) }.expect("the host build loads");
        // Loaded, it stays mapped: the file is not needed any more (every test process built one, and left it).
        std::fs::remove_dir_all(&dir).ok();
        loaded
    })
}

#[path = "cuda_host/forward.rs"]
mod forward;
#[path = "cuda_host/engine.rs"]
mod over_engine;

fn ptr<T>(v: &mut [T]) -> Arg {
    Arg::Ptr(v.as_mut_ptr() as u64)
}

/// An input the kernel only reads.
fn input<T>(v: &[T]) -> Arg {
    Arg::Ptr(v.as_ptr() as u64)
}

/// Runs kernel `name` over `grid` (x, y) blocks of `threads` threads with `shared` bytes of dynamic shared memory.
fn launch(name: &str, grid: (u32, u32), threads: u32, shared: u32, args: &[Arg]) {
    assert_eq!(try_launch(name, grid, threads, shared, args), 0, "kernel {name}");
}

/// [`launch`], returning the launcher's status (0, or -1 for an unknown kernel or block size).
fn try_launch(name: &str, grid: (u32, u32), threads: u32, shared: u32, args: &[Arg]) -> i32 {
    let mut slots: Vec<u64> = args.iter().map(|a| a.slot()).collect();
    // The host build runs one grid at a time (its fibers and shared memory are statics): tests on other threads
    // wait.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let mut pointers: Vec<*mut c_void> = slots.iter_mut().map(|s| (s as *mut u64).cast()).collect();
    let name_c = CString::new(name).expect("a kernel name");
    type Launch = unsafe extern "C" fn(*const i8, u32, u32, u32, u32, *mut *mut c_void) -> i32;
    #[allow(unsafe_code)]
    // SAFETY: `tandem_host_launch` has this signature (host.cpp); every pointer argument points into a buffer the
    // caller sized for the kernel's indexing, and the slots outlive the call.
    unsafe {
        let f: libloading::Symbol<'_, Launch> = library().get(b"tandem_host_launch").expect("the launcher");
        f(name_c.as_ptr(), grid.0, grid.1, threads, shared, pointers.as_mut_ptr())
    }
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn to_f32(h: &[u16]) -> Vec<f32> {
    h.iter().map(|&b| f16::from_bits(b).to_f32()).collect()
}

fn round_f16(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

fn assert_close(got: &[f32], want: &[f32], tolerance: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tolerance * w.abs().max(1.0), "{what}[{i}]: {g} against {w}");
    }
}

#[test]
fn quantized_weights_dequantize_to_the_cpu_engines_values_rounded_to_f16() {
    let blocks = 6;
    let scale = |k: usize| f16::from_f32(0.01 + 0.003 * k as f32).to_bits().to_le_bytes();
    let noise = values(blocks * 32, 3);
    // Q8_0: f16 scale, 32 signed bytes.
    let mut q8 = Vec::new();
    for b in 0..blocks {
        q8.extend(scale(b));
        q8.extend((0..32).map(|j| (noise[b * 32 + j] * 127.0) as i8 as u8));
    }
    // Q4_1: f16 scale, f16 minimum, 16 bytes of nibble pairs.
    let mut q4 = Vec::new();
    for b in 0..blocks {
        q4.extend(scale(b));
        q4.extend(f16::from_f32(-0.1 * b as f32).to_bits().to_le_bytes());
        q4.extend((0..16).map(|j| (((noise[b * 32 + j] + 1.0) * 7.9) as u8) | ((b as u8 + j as u8) % 16) << 4));
    }
    for (ty, kernel, bytes) in
        [(TensorType::Q8_0, "dequant_q8_0_f16", &mut q8), (TensorType::Q4_1, "dequant_q4_1_f16", &mut q4)]
    {
        let mut want = vec![0f32; blocks * 32];
        engine::kernels::dequantize_row_portable(ty, bytes, &mut want);
        let mut out = vec![0u16; blocks * 32];
        launch(kernel, (1, 1), 256, 0, &[ptr(bytes), ptr(&mut out), Arg::I64(blocks as i64)]);
        let want: Vec<f32> = want.into_iter().map(round_f16).collect();
        assert_eq!(to_f32(&out), want, "{kernel}");
    }
}

#[test]
fn argmax_rows_picks_the_cpu_samplers_token_ties_infinities_and_nans_included() {
    let vocab = 1000;
    let ninf = f32::NEG_INFINITY;
    let mut rows: Vec<Vec<f32>> = Vec::new();
    let mut row = |edit: &dyn Fn(&mut Vec<f32>)| {
        let mut r = values(vocab, rows.len() as u64 + 40);
        edit(&mut r);
        rows.push(r);
    };
    // Equal largest values in different threads and warps of the block, and twice in one thread: the lowest index.
    row(&|r| [999, 300, 5, 261, 5 + 256].iter().for_each(|&i| r[i] = 2.0));
    row(&|r| [700, 999].iter().for_each(|&i| r[i] = 2.0));
    // The largest last, first, and a row of minus infinity but one.
    row(&|r| r[vocab - 1] = 2.0);
    row(&|r| r[0] = 2.0);
    row(&|r| {
        r.fill(ninf);
        r[517] = -1e30;
    });
    // All minus infinity; a NaN first (the CPU keeps index 0); NaNs elsewhere, never the largest; all NaN.
    row(&|r| r.fill(ninf));
    row(&|r| {
        r[0] = f32::NAN;
        r[10] = 2.0;
    });
    row(&|r| {
        r.iter_mut().skip(1).step_by(3).for_each(|v| *v = f32::NAN);
        // The first value of the thread that leads the largest value's warp.
        r[128] = f32::NAN;
        r[400] = 2.0;
    });
    row(&|r| r.fill(f32::NAN));
    let flat: Vec<f32> = rows.concat();
    let want: Vec<i32> = rows.iter().map(|r| engine::sampling::argmax(r) as i32).collect();
    assert_eq!(want[..7], [5, 700, 999, 0, 517, 0, 0], "the CPU's own picks");
    let mut top = vec![-1i32; rows.len()];
    launch("argmax_rows", (rows.len() as u32, 1), 256, 0, &[input(&flat), Arg::I32(vocab as i32), ptr(&mut top)]);
    assert_eq!(top, want);
}

#[test]
fn embedding_rms_norm_silu_and_the_residual_add_compute_what_the_cpu_engine_does() {
    // 300 values a row over 256 threads: some threads take two, and every warp's partial sum counts.
    let (d, rows, vocab) = (300, 3, 10);
    let table: Vec<u16> = values(vocab * d, 5).iter().map(|&v| f16::from_f32(v).to_bits()).collect();
    let mut tokens: Vec<u32> = vec![7, 0, 9];
    let mut x = vec![0f32; rows * d];
    let mut table_in = table.clone();
    launch(
        "embed_f16",
        (rows as u32, 1),
        256,
        0,
        &[ptr(&mut table_in), ptr(&mut tokens), ptr(&mut x), Arg::I32(d as i32)],
    );
    let want: Vec<f32> = tokens.iter().flat_map(|&t| to_f32(&table[t as usize * d..][..d])).collect();
    assert_eq!(x, want, "embedding rows");

    // RMSNorm, the block-wide sum through shuffles and shared memory.
    let mut w = values(d, 6);
    let (mut out, mut out16) = (vec![0f32; rows * d], vec![0u16; rows * d]);
    let eps = 1e-5f32;
    launch(
        "rms_norm",
        (rows as u32, 1),
        256,
        0,
        &[ptr(&mut x), ptr(&mut w), ptr(&mut out), ptr(&mut out16), Arg::I32(d as i32), Arg::F32(eps)],
    );
    let mut want = Vec::new();
    for r in x.chunks_exact(d) {
        let ss: f64 = r.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        let scale = (1.0 / (ss / d as f64 + f64::from(eps)).sqrt()) as f32;
        want.extend(r.iter().zip(&w).map(|(&v, &w)| v * scale * w));
    }
    assert_close(&out, &want, 1e-5, "rms_norm");
    assert_eq!(to_f32(&out16), out.iter().map(|&v| round_f16(v)).collect::<Vec<_>>(), "rms_norm's f16 copy");

    // SiLU(gate) · up into f16, and x += y.
    let n = 700;
    let (mut gate, mut up, mut act) =
        (values(n, 7).iter().map(|v| v * 6.0).collect::<Vec<_>>(), values(n, 8), vec![0u16; n]);
    launch("silu_mul", (1, 1), 1024, 0, &[ptr(&mut gate), ptr(&mut up), ptr(&mut act), Arg::I64(n as i64)]);
    let want: Vec<f32> = gate.iter().zip(&up).map(|(&g, &u)| g / (1.0 + (-g).exp()) * u).collect();
    assert_close(&to_f32(&act), &want, 2e-3, "silu_mul");
    let (mut a, mut b) = (values(n, 9), values(n, 10));
    let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    launch("add", (1, 1), 1024, 0, &[ptr(&mut a), ptr(&mut b), Arg::I64(n as i64)]);
    assert_eq!(a, want, "add");
    let mut h = vec![0u16; n];
    launch("to_f16", (1, 1), 1024, 0, &[ptr(&mut a), ptr(&mut h), Arg::I64(n as i64)]);
    assert_eq!(to_f32(&h), a.iter().map(|&v| round_f16(v)).collect::<Vec<_>>(), "to_f16");
}

/// A small paged cache: the CPU engine's block layout, `[layer][K, V][kv head][token][dim]` f16 per block.
struct Shape {
    layers: usize,
    n_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    block_tokens: usize,
}

impl Shape {
    fn block_elems(&self) -> usize {
        self.layers * 2 * self.kv_heads * self.block_tokens * self.head_dim
    }

    /// Where position `pos`'s K (part 0) or V (part 1) of `head` at `layer` lies, for a sequence of `table`.
    fn at(&self, table: &[i32], layer: usize, part: usize, head: usize, pos: usize) -> usize {
        let block = table[pos / self.block_tokens] as usize;
        block * self.block_elems()
            + ((layer * 2 + part) * self.kv_heads + head) * self.block_tokens * self.head_dim
            + (pos % self.block_tokens) * self.head_dim
    }
}

#[test]
fn rope_the_paged_store_and_attention_match_the_cpu_engines_formulas() {
    let s = Shape { layers: 2, n_heads: 4, kv_heads: 2, head_dim: 8, block_tokens: 16 };
    let (hd, pairs) = (s.head_dim, s.head_dim / 2);
    // Two sequences of 150 and 37 positions (more than the attention kernel's 128 threads), their blocks out of
    // order and interleaved; block 15 belongs to neither.
    let tables = [vec![12, 0, 7, 3, 9, 1, 5, 11, 2, 14], vec![4, 13, 6, 10]];
    let lens = [150usize, 37];
    let mut flat_tables: Vec<i32> = tables.iter().flatten().copied().collect();
    let layer = 1usize;
    // Every position of both sequences in one step (as a prefill of both): per row, its sequence and position.
    let rows: Vec<(usize, usize)> = (0..2).flat_map(|q| (0..lens[q]).map(move |p| (q, p))).collect();
    let n = rows.len();
    let mut positions: Vec<i32> = rows.iter().map(|&(_, p)| p as i32).collect();
    let mut table_of: Vec<i32> = rows.iter().map(|&(q, _)| if q == 0 { 0 } else { tables[0].len() as i32 }).collect();
    let mut slot_block: Vec<i32> = rows.iter().map(|&(q, p)| tables[q][p / s.block_tokens]).collect();
    let mut slot_pos: Vec<i32> = rows.iter().map(|&(_, p)| (p % s.block_tokens) as i32).collect();
    let mut rope_table: Vec<f32> = (0..lens[0])
        .flat_map(|pos| {
            (0..pairs).flat_map(move |i| {
                let a = pos as f64 * 10_000f64.powf(-(2.0 * i as f64) / hd as f64);
                [a.cos() as f32, a.sin() as f32]
            })
        })
        .collect();

    // RoPE on adjacent pairs, as the CPU engine's `rope`.
    let q0 = values(n * s.n_heads * hd, 11);
    let mut q = q0.clone();
    launch(
        "rope",
        (n as u32, 1),
        256,
        0,
        &[ptr(&mut q), ptr(&mut positions), ptr(&mut rope_table), Arg::I32(s.n_heads as i32), Arg::I32(hd as i32)],
    );
    let mut want = q0.clone();
    for (r, &(_, pos)) in rows.iter().enumerate() {
        for head in 0..s.n_heads {
            for i in 0..pairs {
                let at = (r * s.n_heads + head) * hd + 2 * i;
                let [c, sn] = [rope_table[(pos * pairs + i) * 2], rope_table[(pos * pairs + i) * 2 + 1]];
                let (a, b) = (q0[at], q0[at + 1]);
                want[at] = a * c - b * sn;
                want[at + 1] = a * sn + b * c;
            }
        }
    }
    assert_eq!(q, want, "rope");

    // K and V rows into the paged cache at `layer`.
    let kv_dim = s.kv_heads * hd;
    let (mut k, mut v) = (values(n * kv_dim, 12), values(n * kv_dim, 13));
    let mut cache = vec![0u16; 16 * s.block_elems()];
    launch(
        "store_kv",
        (n as u32, 1),
        256,
        0,
        &[
            ptr(&mut k),
            ptr(&mut v),
            ptr(&mut cache),
            ptr(&mut slot_block),
            ptr(&mut slot_pos),
            Arg::I32(layer as i32),
            Arg::I32(s.layers as i32),
            Arg::I32(s.kv_heads as i32),
            Arg::I32(hd as i32),
            Arg::I32(s.block_tokens as i32),
        ],
    );
    // Each row's K and V, as f16, where the layout puts them, and nothing anywhere else (the other layer, block 15).
    let mut want_cache = vec![0u16; cache.len()];
    for (r, &(q, pos)) in rows.iter().enumerate() {
        for head in 0..s.kv_heads {
            for (part, src) in [(0, &k), (1, &v)] {
                let at = s.at(&tables[q], layer, part, head, pos);
                for d in 0..hd {
                    want_cache[at + d] = f16::from_f32(src[r * kv_dim + head * hd + d]).to_bits();
                }
            }
        }
    }
    assert!(cache == want_cache, "the paged cache after store_kv");
    let stored = |q: usize, part: usize, head: usize, pos: usize| {
        let at = s.at(&tables[q], layer, part, head, pos);
        to_f32(&cache[at..at + hd])
    };

    // Causal attention over the cache, grouped query heads (two per KV head), as the CPU engine's.
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0f32; n * s.n_heads * hd];
    launch(
        "attention",
        (n as u32, s.n_heads as u32),
        128,
        (lens[0] * 4) as u32,
        &[
            ptr(&mut q),
            input(&cache),
            ptr(&mut flat_tables),
            ptr(&mut table_of),
            ptr(&mut positions),
            ptr(&mut out),
            Arg::I32(layer as i32),
            Arg::I32(s.layers as i32),
            Arg::I32(s.n_heads as i32),
            Arg::I32(s.kv_heads as i32),
            Arg::I32(hd as i32),
            Arg::I32(s.block_tokens as i32),
            Arg::F32(scale),
        ],
    );
    let group = s.n_heads / s.kv_heads;
    for (r, &(seq, pos)) in rows.iter().enumerate() {
        for head in 0..s.n_heads {
            let query = &q[(r * s.n_heads + head) * hd..][..hd];
            let scores: Vec<f64> = (0..=pos)
                .map(|j| {
                    let key = stored(seq, 0, head / group, j);
                    query.iter().zip(&key).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum::<f64>() * f64::from(scale)
                })
                .collect();
            let top = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - top).exp()).collect();
            let sum: f64 = weights.iter().sum();
            let want: Vec<f32> = (0..hd)
                .map(|d| {
                    (0..=pos).map(|j| weights[j] * f64::from(stored(seq, 1, head / group, j)[d])).sum::<f64>() / sum
                })
                .map(|x| x as f32)
                .collect();
            assert_close(
                &out[(r * s.n_heads + head) * hd..][..hd],
                &want,
                1e-5,
                &format!("attention row {r} head {head}"),
            );
        }
    }
}

#[test]
fn attend_rows_on_tensor_cores_computes_what_attend_rows_does() {
    // Nine query heads over three KV heads of 64 dims, blocks of 16 tokens in a shuffled table; a sequence whose
    // 40 rows at positions 37 to 76 are tiled as 16, 16 and 8 rows (the last tile partial, none starting on a
    // block), and a 3-row tile of another sequence at positions 0 to 2.
    let (n_heads, kv_heads, hd, bt, layers, layer) = (9usize, 3usize, 64usize, 16usize, 2usize, 1usize);
    let q_stride = (n_heads + 2 * kv_heads) * hd;
    let block_elems = layers * 2 * kv_heads * bt * hd;
    let blocks = 8;
    let cache: Vec<u16> = values(blocks * block_elems, 21).iter().map(|&v| f16::from_f32(v).to_bits()).collect();
    let tables: Vec<i32> = vec![5, 2, 7, 0, 3, 6, 1, 4];
    let rows = 43;
    let mut positions: Vec<i32> = (37..77).collect();
    positions.extend([0, 1, 2]);
    let table_of: Vec<i32> = (0..rows).map(|r| if r < 40 { 0 } else { 5 }).collect();
    let tiles: Vec<i32> = vec![0, 16, 16, 16, 32, 8, 40, 3];
    // Queries scaled up so that the weights are far from even.
    let q: Vec<f32> = values(rows * q_stride, 22).iter().map(|v| v * 4.0).collect();
    let scale = 1.0 / (hd as f32).sqrt();
    let run = |kernel: &str, threads: u32| {
        let mut out = vec![0u16; rows * n_heads * hd];
        let args = [
            input(&q),
            Arg::I32(q_stride as i32),
            input(&cache),
            input(&tables),
            input(&table_of),
            input(&positions),
            input(&tiles),
            ptr(&mut out),
            Arg::I32(layer as i32),
            Arg::I32(layers as i32),
            Arg::I32(n_heads as i32),
            Arg::I32(kv_heads as i32),
            Arg::I32(hd as i32),
            Arg::I32(bt as i32),
            Arg::F32(scale),
        ];
        launch(kernel, (tiles.len() as u32 / 2, n_heads as u32), threads, 0, &args);
        to_f32(&out)
    };
    let (want, got) = (run("attend_rows", 128), run("attend_rows_tc", 32));
    // Within what f16 queries and weights cost (attend_rows keeps both in f32).
    assert!(want.iter().all(|v| v.abs() > 0.0), "every row and head written");
    assert_close(&got, &want, 0.01, "attend_rows_tc");
}
