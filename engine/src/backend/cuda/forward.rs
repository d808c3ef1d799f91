//! The forward pass on a CUDA device: weights dequantized to f16 in device memory at load, matmuls through
//! cuBLAS (f16 inputs, f32 accumulation and output), everything else in the kernels of `kernels.cu`, K/V in a
//! device copy of the engine's paged cache.
//!
//! First correct, then fast. The engine's `KvStore` in host memory stays the cache the pool, the tiers and KV
//! export read and write; the device holds a mirror. Before a step, every block the batch reads that the host side
//! changed since the device last saw it (an import, an onboard from host or disk: `KvStore::generation`) is
//! uploaded; after the step, the K/V rows the step computed are written back to the host store. Sampling runs on
//! the CPU over copied logits.
//!
//! Checked against the CPU engine's logits on an H100 (`tandem model parity`, docs/cuda.md); the launches per step,
//! the per-step allocations and the attention kernel are the first version's, not yet fast.

#![allow(unsafe_code)]

use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};

use super::{CudaError, DeviceInfo, fail, runtime};
use crate::backend::{Backend, Next, StepContext};
use crate::forward::{ForwardError, SeqChunk};
use crate::gguf::TensorType;
use crate::kv::{KvLayout, KvPart, KvStore};
use crate::model::{Matrix, Model, ModelConfig};

/// Threads per block of the row kernels.
const ROW_THREADS: u32 = 256;
/// Threads per block of the attention kernel.
const ATTENTION_THREADS: u32 = 128;
/// The longest sequence this pass attends over: the `attention` kernel keeps a row's scores, a float per
/// position, in the shared memory a device gives unasked, next to its own 256 bytes of reductions. Longer
/// sequences are refused before they run ([`Backend::context_len`]) instead of failing every launch.
const MAX_POSITIONS: usize = (crate::backend::gpu::SHARED_LIMIT - 1024) / 4;
const _: () = assert!(MAX_POSITIONS * 4 + 256 <= crate::backend::gpu::SHARED_LIMIT);

struct Kernels {
    dequant_q8_0: CudaFunction,
    dequant_q4_1: CudaFunction,
    embed: CudaFunction,
    rms_norm: CudaFunction,
    rope: CudaFunction,
    store_kv: CudaFunction,
    attention: CudaFunction,
    silu_mul: CudaFunction,
    add: CudaFunction,
    to_f16: CudaFunction,
}

impl Kernels {
    fn load(module: &Arc<CudaModule>) -> Result<Kernels, CudaError> {
        let f = |name: &str| module.load_function(name).map_err(|e| CudaError::Runtime(format!("kernel {name}: {e}")));
        Ok(Kernels {
            dequant_q8_0: f("dequant_q8_0_f16")?,
            dequant_q4_1: f("dequant_q4_1_f16")?,
            embed: f("embed_f16")?,
            rms_norm: f("rms_norm")?,
            rope: f("rope")?,
            store_kv: f("store_kv")?,
            attention: f("attention")?,
            silu_mul: f("silu_mul")?,
            add: f("add")?,
            to_f16: f("to_f16")?,
        })
    }
}

/// A weight matrix in device memory: `rows × cols` f16, row-major (GGUF's order).
struct DeviceMatrix {
    rows: usize,
    cols: usize,
    data: CudaSlice<u16>,
}

struct DeviceLayer {
    attn_norm: CudaSlice<f32>,
    wq: DeviceMatrix,
    wk: DeviceMatrix,
    wv: DeviceMatrix,
    wo: DeviceMatrix,
    ffn_norm: CudaSlice<f32>,
    w_gate: DeviceMatrix,
    w_up: DeviceMatrix,
    w_down: DeviceMatrix,
}

/// Computes steps with the real model on a CUDA device.
pub struct CudaBackend {
    config: ModelConfig,
    info: DeviceInfo,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    kernels: Kernels,
    embedding: DeviceMatrix,
    /// The output projection when the model does not tie it to the embedding.
    output: Option<DeviceMatrix>,
    layers: Vec<DeviceLayer>,
    output_norm: CudaSlice<f32>,
    /// The CPU engine's rotary table, `[pos][pair][cos, sin]`.
    rope: CudaSlice<f32>,
    /// The device mirror of the paged cache, allocated at the first step (when the store's size is known).
    cache: Option<CudaSlice<u16>>,
    /// Per block, the host store's generation the mirror holds.
    seen: Vec<u64>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend").field("device", &self.info).finish_non_exhaustive()
    }
}

/// Launches kernel `$f` on `$stream` with `$cfg` and the arguments in its signature's order.
macro_rules! launch {
    ($stream:expr, $f:expr, $cfg:expr; $($arg:expr),* $(,)?) => {{
        let mut b = $stream.launch_builder($f);
        $( b.arg($arg); )*
        // SAFETY: the arguments are pushed in the kernel's signature order with its types (kernels.cu), and every
        // buffer is sized by the caller from the same model config the kernel indexes with.
        unsafe { b.launch($cfg) }.map(|_| ()).map_err(fail)
    }};
}

/// One thread block per row.
fn per_row(rows: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (ROW_THREADS, 1, 1), shared_mem_bytes: 0 }
}

/// One thread per element.
fn per_elem(n: usize) -> LaunchConfig {
    LaunchConfig::for_num_elems(n as u32)
}

impl CudaBackend {
    /// Opens device `ordinal`, compiles the kernels for it and uploads `model`'s weights.
    pub fn new(model: &Model, ordinal: usize) -> Result<CudaBackend, CudaError> {
        let (ctx, info) = super::open(ordinal)?;
        let ptx = super::compile(&super::arch(info.compute_capability))?;
        let module = ctx.load_module(ptx).map_err(runtime)?;
        let kernels = Kernels::load(&module)?;
        let stream = ctx.default_stream();
        if !super::cublas_present() {
            return Err(CudaError::NoCublas);
        }
        let blas = CudaBlas::new(Arc::clone(&stream)).map_err(runtime)?;
        let up = Uploader { stream: &stream, kernels: &kernels };
        let mut layers = Vec::with_capacity(model.layers.len());
        for l in &model.layers {
            layers.push(DeviceLayer {
                attn_norm: up.floats(&l.attn_norm)?,
                wq: up.matrix(&l.wq)?,
                wk: up.matrix(&l.wk)?,
                wv: up.matrix(&l.wv)?,
                wo: up.matrix(&l.wo)?,
                ffn_norm: up.floats(&l.ffn_norm)?,
                w_gate: up.matrix(&l.w_gate)?,
                w_up: up.matrix(&l.w_up)?,
                w_down: up.matrix(&l.w_down)?,
            });
        }
        let embedding = up.matrix(&model.token_embd)?;
        let output = if model.output.same_tensor(&model.token_embd) { None } else { Some(up.matrix(&model.output)?) };
        let table: Vec<f32> = model.rope.iter().flat_map(|&[c, s]| [c, s]).collect();
        let backend = CudaBackend {
            config: model.config.clone(),
            info,
            output_norm: up.floats(&model.output_norm)?,
            rope: up.floats(&table)?,
            stream,
            blas,
            kernels,
            embedding,
            output,
            layers,
            cache: None,
            seen: Vec::new(),
        };
        backend.stream.synchronize().map_err(runtime)?;
        Ok(backend)
    }

    pub fn device(&self) -> &DeviceInfo {
        &self.info
    }

    /// `y[n][out] = x[n][in] · w[out][in]ᵀ`: cuBLAS is column-major, so this is `yᵀ = wᵀᵀ · xᵀ` with `w` read
    /// transposed.
    fn gemm(
        &self,
        w: &DeviceMatrix,
        x: &impl DevicePtr<u16>,
        n: usize,
        y: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), ForwardError> {
        let (wp, _w) = w.data.device_ptr(&self.stream);
        let (xp, _x) = x.device_ptr(&self.stream);
        let (yp, _y) = y.device_ptr_mut(&self.stream);
        super::device::gemm(&self.blas, wp, w.rows, w.cols, xp, n, yp)
    }

    /// Uploads the blocks the batch reads that the host store changed since the mirror last saw them.
    fn sync_blocks(&mut self, kv: &KvStore, batch: &[SeqChunk<'_>]) -> Result<(), ForwardError> {
        let layout = *kv.layout();
        let be = layout.block_elems();
        if self.cache.is_none() {
            let cache = self.stream.alloc_zeros::<u16>(kv.capacity() * be).map_err(fail)?;
            self.cache = Some(cache);
            // Nothing is mirrored yet: every block's first use uploads it.
            self.seen = vec![u64::MAX; kv.capacity()];
        }
        let Some(cache) = self.cache.as_mut() else { return Err(fail("no cache")) };
        for chunk in batch {
            let used = layout.blocks_for(chunk.start + chunk.tokens.len()).min(chunk.blocks.len());
            for &b in &chunk.blocks[..used] {
                let i = b.0 as usize;
                if self.seen[i] == kv.generation(b) {
                    continue;
                }
                let host: &[u16] = bytemuck::cast_slice(kv.block(b));
                self.stream.memcpy_htod(host, &mut cache.slice_mut(i * be..(i + 1) * be)).map_err(fail)?;
                self.seen[i] = kv.generation(b);
            }
        }
        Ok(())
    }

    fn step(&mut self, kv: &mut KvStore, batch: &[SeqChunk<'_>]) -> Result<Vec<Next>, ForwardError> {
        self.sync_blocks(kv, batch)?;
        let c = self.config.clone();
        let layout = *kv.layout();
        let (d, kv_dim, ff, hd) = (c.n_embd, c.kv_dim(), c.n_ff, c.head_dim);
        let bt = layout.block_tokens;
        // Per row: token, position, where its K/V go; per sequence: its block table.
        let (mut tokens, mut positions, mut slot_block, mut slot_pos, mut table_of) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut tables, mut logit_rows) = (Vec::new(), Vec::new());
        let mut longest = 0usize;
        for chunk in batch {
            let at = tables.len() as i32;
            tables.extend(chunk.blocks.iter().map(|b| b.0 as i32));
            for (k, &t) in chunk.tokens.iter().enumerate() {
                let pos = chunk.start + k;
                tokens.push(t);
                positions.push(pos as i32);
                slot_block.push(chunk.blocks[pos / bt].0 as i32);
                slot_pos.push((pos % bt) as i32);
                table_of.push(at);
                longest = longest.max(pos + 1);
            }
            if chunk.logits {
                logit_rows.push(tokens.len() - 1);
            }
        }
        let n = tokens.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        let s = Arc::clone(&self.stream);
        let dev = |v: &[i32]| s.clone_htod(v).map_err(fail);
        let (positions_d, slot_block_d, slot_pos_d, table_of_d, tables_d) =
            (dev(&positions)?, dev(&slot_block)?, dev(&slot_pos)?, dev(&table_of)?, dev(&tables)?);
        let tokens_d = s.clone_htod(&tokens[..]).map_err(fail)?;
        let f32s = |len: usize| s.alloc_zeros::<f32>(len).map_err(fail);
        let f16s = |len: usize| s.alloc_zeros::<u16>(len).map_err(fail);
        let (mut x, mut xn, mut xn16) = (f32s(n * d)?, f32s(n * d)?, f16s(n * d)?);
        let (mut q, mut attn, mut attn16, mut tmp) = (f32s(n * d)?, f32s(n * d)?, f16s(n * d)?, f32s(n * d)?);
        let (mut gate, mut upv, mut act16) = (f32s(n * ff)?, f32s(n * ff)?, f16s(n * ff)?);
        // This step's K and V rows for every layer, `[layer][row][kv_dim]` each: written back to the host store.
        let (mut step_k, mut step_v) = (f32s(c.n_layers * n * kv_dim)?, f32s(c.n_layers * n * kv_dim)?);
        let Some(cache) = self.cache.as_ref() else { return Err(fail("no cache")) };
        let k = &self.kernels;
        let (d_i, eps) = (d as i32, c.rms_eps);
        launch!(s, &k.embed, per_row(n); &self.embedding.data, &tokens_d, &mut x, &d_i)?;
        let (heads_i, kv_heads_i, hd_i, bt_i, layers_i) =
            (c.n_heads as i32, c.n_kv_heads as i32, hd as i32, bt as i32, c.n_layers as i32);
        let scale = 1.0f32 / (hd as f32).sqrt();
        let (nd, nff) = ((n * d) as i64, (n * ff) as i64);
        for (li, l) in self.layers.iter().enumerate() {
            let layer_i = li as i32;
            launch!(s, &k.rms_norm, per_row(n); &x, &l.attn_norm, &mut xn, &mut xn16, &d_i, &eps)?;
            self.gemm(&l.wq, &xn16, n, &mut q)?;
            let rows = li * n * kv_dim..(li + 1) * n * kv_dim;
            let (mut kr, mut vr) = (step_k.slice_mut(rows.clone()), step_v.slice_mut(rows));
            self.gemm(&l.wk, &xn16, n, &mut kr)?;
            self.gemm(&l.wv, &xn16, n, &mut vr)?;
            launch!(s, &k.rope, per_row(n); &mut q, &positions_d, &self.rope, &heads_i, &hd_i)?;
            launch!(s, &k.rope, per_row(n); &mut kr, &positions_d, &self.rope, &kv_heads_i, &hd_i)?;
            launch!(s, &k.store_kv, per_row(n);
                &mut kr, &mut vr, cache, &slot_block_d, &slot_pos_d, &layer_i, &layers_i, &kv_heads_i, &hd_i, &bt_i)?;
            let cfg = LaunchConfig {
                grid_dim: (n as u32, c.n_heads as u32, 1),
                block_dim: (ATTENTION_THREADS, 1, 1),
                shared_mem_bytes: (longest * 4) as u32,
            };
            // The scores of the longest row fit the shared memory asked for (longest * 4 bytes).
            launch!(s, &k.attention, cfg;
                &q, cache, &tables_d, &table_of_d, &positions_d, &mut attn, &layer_i, &layers_i, &heads_i,
                &kv_heads_i, &hd_i, &bt_i, &scale)?;
            launch!(s, &k.to_f16, per_elem(n * d); &attn, &mut attn16, &nd)?;
            self.gemm(&l.wo, &attn16, n, &mut tmp)?;
            launch!(s, &k.add, per_elem(n * d); &mut x, &tmp, &nd)?;
            launch!(s, &k.rms_norm, per_row(n); &x, &l.ffn_norm, &mut xn, &mut xn16, &d_i, &eps)?;
            self.gemm(&l.w_gate, &xn16, n, &mut gate)?;
            self.gemm(&l.w_up, &xn16, n, &mut upv)?;
            launch!(s, &k.silu_mul, per_elem(n * ff); &gate, &upv, &mut act16, &nff)?;
            self.gemm(&l.w_down, &act16, n, &mut tmp)?;
            launch!(s, &k.add, per_elem(n * d); &mut x, &tmp, &nd)?;
        }
        // Logits for the rows that ask for them: their final norm, gathered, times the output matrix.
        let m = logit_rows.len();
        let mut logits_out = Vec::with_capacity(m);
        if m > 0 {
            launch!(s, &k.rms_norm, per_row(n); &x, &self.output_norm, &mut xn, &mut xn16, &d_i, &eps)?;
            let mut picked = f16s(m * d)?;
            for (i, &r) in logit_rows.iter().enumerate() {
                s.memcpy_dtod(&xn16.slice(r * d..(r + 1) * d), &mut picked.slice_mut(i * d..(i + 1) * d))
                    .map_err(fail)?;
            }
            let out = self.output.as_ref().unwrap_or(&self.embedding);
            let mut logits = f32s(m * out.rows)?;
            self.gemm(out, &picked, m, &mut logits)?;
            let host = s.clone_dtoh(&logits).map_err(fail)?;
            logits_out.extend(host.chunks_exact(out.rows).map(|r| Next::Logits(r.to_vec())));
        }
        // The step's K/V rows into the host store (f32 to f16 rounds to nearest even there as on the device),
        // without marking the blocks changed: the mirror has them already.
        let (ks, vs) = (s.clone_dtoh(&step_k).map_err(fail)?, s.clone_dtoh(&step_v).map_err(fail)?);
        // Copies into pageable memory return when done, but the rows are read only after the stream is.
        s.synchronize().map_err(fail)?;
        for layer in 0..c.n_layers {
            for (part, rows) in [(KvPart::K, &ks), (KvPart::V, &vs)] {
                let base = layer * n * kv_dim;
                for r in 0..n {
                    let block = crate::kv::BlockId(slot_block[r] as u32);
                    for h in 0..c.n_kv_heads {
                        let at = base + r * kv_dim + h * hd;
                        kv.write(block, layer, part, h, slot_pos[r] as usize, &rows[at..at + hd]);
                    }
                }
            }
        }
        Ok(logits_out)
    }
}

/// Uploads weights: quantized matrices go up as they are and are dequantized to f16 on the device.
struct Uploader<'a> {
    stream: &'a Arc<CudaStream>,
    kernels: &'a Kernels,
}

impl Uploader<'_> {
    fn floats(&self, v: &[f32]) -> Result<CudaSlice<f32>, CudaError> {
        self.stream.clone_htod(v).map_err(runtime)
    }

    fn matrix(&self, m: &Matrix) -> Result<DeviceMatrix, CudaError> {
        let elems = m.rows * m.cols;
        let mut data = self.stream.alloc_zeros::<u16>(elems).map_err(runtime)?;
        let f = match m.ty {
            TensorType::Q8_0 => &self.kernels.dequant_q8_0,
            TensorType::Q4_1 => &self.kernels.dequant_q4_1,
            other => {
                // Other encodings are converted on the host (rare in the files the engine loads).
                let mut values = vec![0f32; elems];
                crate::kernels::dequantize_row(other, m.bytes(), &mut values);
                let host: Vec<u16> = values.iter().map(|&v| half::f16::from_f32(v).to_bits()).collect();
                self.stream.memcpy_htod(&host, &mut data).map_err(runtime)?;
                return Ok(DeviceMatrix { rows: m.rows, cols: m.cols, data });
            }
        };
        let src = self.stream.clone_htod(m.bytes()).map_err(runtime)?;
        let blocks = (elems / 32) as i64;
        let cfg = LaunchConfig::for_num_elems(elems as u32);
        let mut b = self.stream.launch_builder(f);
        b.arg(&src).arg(&mut data).arg(&blocks);
        // SAFETY: `src` holds `blocks` encoded blocks and `data` their 32 values each.
        unsafe { b.launch(cfg) }.map_err(runtime)?;
        Ok(DeviceMatrix { rows: m.rows, cols: m.cols, data })
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn vocab(&self) -> usize {
        self.config.n_vocab
    }

    fn context_len(&self) -> usize {
        self.config.context_len.min(MAX_POSITIONS)
    }

    fn kv_layout(&self, block_tokens: usize) -> KvLayout {
        KvLayout::for_model(&self.config, block_tokens)
    }

    fn threads(&self) -> usize {
        1
    }

    fn forward_into(
        &mut self,
        kv: &mut KvStore,
        batch: &[SeqChunk<'_>],
        _: StepContext,
        next: &mut Vec<Next>,
    ) -> Result<(), ForwardError> {
        next.extend(self.step(kv, batch)?);
        Ok(())
    }
}
