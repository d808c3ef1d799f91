//! The fused forward pass, over any [`Gpu`]: the mechanism (memory, copies, kernel launches, matmuls, recorded
//! steps) is the device's, the order of the work is here. Two devices implement it: CUDA (`backend::cuda`, the
//! feature `cuda`) and, in the tests, the same kernels compiled for the CPU (`engine/tests/cuda_host.rs`), so this
//! pass runs and is compared with the CPU engine on every CI run, without a GPU.
//!
//! Against the first CUDA forward (`backend::cuda::CudaBackend`), a layer is four matmuls and five kernels instead
//! of seven and ten: Q, K and V are one matmul over their stacked weights, as are gate and up; the residual add
//! goes with the next norm (`residual_norm`); RoPE goes with the K/V store (`rope_store`); attention reads Q where
//! the stacked matmul left it and writes f16 (`attend` for decode rows, its keys in tiles so that its launch does
//! not depend on the longest context; `attend_rows` for prompts, 16 rows sharing each key read). Its buffers
//! persist from step to step, and a step's indices go up in one copy. With recording on, a decode step of `n`
//! sequences is recorded once (a CUDA graph) and replayed after, one launch instead of about 270. With the
//! matrix-vector kernels on, steps of up to four rows skip cuBLAS: kernels that fold in the norm, RoPE and the K/V
//! store, the residual add and SiLU-multiply, with decode attention split over several blocks per head and merged
//! where the output projection reads it, five kernels a decode layer.

pub mod layout;

use std::collections::HashMap;

use layout::{IndexOffsets, Scratch, StepIndex};

use super::{Backend, Next, StepContext};
use crate::forward::{ForwardError, SeqChunk};
use crate::gguf::TensorType;
use crate::kv::{BlockId, KvLayout, KvStore};
use crate::model::{Matrix, Model, ModelConfig};

/// An address in the device's memory.
pub type DevicePtr = u64;

/// One kernel argument, as the kernel's signature takes it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arg {
    Ptr(DevicePtr),
    I32(i32),
    I64(i64),
    F32(f32),
}

impl Arg {
    /// The argument's value in the 8-byte slot a launch passes a pointer to (a 4-byte value at the slot's start:
    /// little-endian).
    pub fn slot(self) -> u64 {
        match self {
            Arg::Ptr(p) => p,
            Arg::I32(v) => u64::from(v as u32),
            Arg::I64(v) => v as u64,
            Arg::F32(v) => u64::from(v.to_bits()),
        }
    }
}

/// Threads per block of the row kernels.
const ROW_THREADS: u32 = 256;
/// Threads per block of the element-wise kernels.
const ELEM_THREADS: u32 = 256;
/// Threads per block of `attend` (its `ATTEND_TILE`) and of `attend_rows`.
const ATTEND_THREADS: u32 = 128;
/// The widest head `attend_rows` takes (`ROWS_MAX_HEAD_DIM`).
const ROWS_MAX_HEAD_DIM: usize = 128;
/// Decode steps of up to this many sequences are recorded, one recording per batch size.
pub const MAX_RECORDED_ROWS: usize = 256;
/// Steps of up to this many rows go through the matrix-vector kernels when they are on (`MV_MAX_ROWS` in
/// kernels.cu), and split their attention when they are decode steps.
pub const MATVEC_MAX_ROWS: usize = layout::SPLIT_MAX_ROWS;
/// Output rows per block of the matrix-vector kernels (a warp each: `MV_WARPS`).
const MATVEC_ROWS_PER_BLOCK: u32 = 8;
/// Dynamic shared memory every CUDA device gives a kernel without being asked for more (48 KiB); a launch asking
/// for more fails.
pub const SHARED_LIMIT: usize = 48 << 10;
/// What the matrix-vector kernels' staged inputs may take of [`SHARED_LIMIT`]: the rest is for their reductions'
/// own arrays.
const MATVEC_SHARED: usize = SHARED_LIMIT - 1024;

/// Whether a model shaped as `c` can take the matrix-vector kernels: at [`MATVEC_MAX_ROWS`] rows, the inputs they
/// stage in shared memory (a projection's input row, of the model's width, the feed-forward's or the attention's
/// output; or the split attention's partials, `combine_matvec_add`'s) fit [`MATVEC_SHARED`]. SmolLM2-135M's
/// widest, its 1,536-wide feed-forward, takes 24 KiB; a wider model's small steps go through the matmuls instead.
pub fn matvec_fits(c: &ModelConfig) -> bool {
    let partials = c.n_heads * (c.head_dim + layout::ATTEND_SPLITS + 1);
    let widest = [c.n_embd, c.n_ff, c.n_heads * c.head_dim, partials].into_iter().max().unwrap_or(0);
    MATVEC_MAX_ROWS * widest * 4 <= MATVEC_SHARED
}

/// How the fused forward runs, beyond its kernels.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Options {
    /// Decode steps recorded once per batch size and replayed (CUDA graphs), where the device records.
    pub record: bool,
    /// Steps of up to [`MATVEC_MAX_ROWS`] rows through matrix-vector kernels that also do the norm, the residual
    /// add and SiLU-multiply (no cuBLAS) instead of the matmuls; such decode steps split
    /// each row's keys over `ATTEND_SPLITS` thread blocks per head (`attend_split`), merged where the output
    /// projection reads them (`combine_matvec_add`). Only for models whose rows fit the kernels' shared memory
    /// ([`matvec_fits`]).
    pub matvec: bool,
    /// Prompts' attention on tensor cores (`attend_rows_tc`), where the device has them and heads are a multiple of
    /// 16 dims (of up to 128).
    pub tensor_cores: bool,
    /// The matrix-vector kernels read Q4_1 and Q8_0 weights as the file stores them (a decode step reads about a
    /// third of the f16 bytes), kept on the device beside the f16 copy the matmuls read.
    pub quantized: bool,
}

/// What the fused forward needs of a device. Work is issued in order; only [`Gpu::download`] waits for it.
pub trait Gpu: Send {
    /// A recorded sequence of work ([`Gpu::end_recording`]).
    type Recording: Send;
    /// `bytes` zeroed bytes, aligned to 256, until [`Gpu::free`] or the device's drop.
    fn alloc(&mut self, bytes: usize) -> Result<DevicePtr, ForwardError>;
    fn free(&mut self, at: DevicePtr);
    /// Copies `bytes` to `to`, in order with the work issued before and after.
    fn upload(&mut self, to: DevicePtr, bytes: &[u8]) -> Result<(), ForwardError>;
    /// Waits for the work issued so far, then copies from `from` into `bytes`.
    fn download(&mut self, from: DevicePtr, bytes: &mut [u8]) -> Result<(), ForwardError>;
    /// Runs `kernel` (a name from `kernels.cu`) over `grid` (x, y) blocks of `threads` threads with `shared`
    /// bytes of dynamic shared memory.
    fn launch(
        &mut self,
        kernel: &'static str,
        grid: (u32, u32),
        threads: u32,
        shared: u32,
        args: &[Arg],
    ) -> Result<(), ForwardError>;
    /// `y[n][rows] = x[n][cols] · w[rows][cols]ᵀ`: `w` and `x` f16, `y` f32, accumulated in f32.
    fn gemm(
        &mut self,
        w: DevicePtr,
        rows: usize,
        cols: usize,
        x: DevicePtr,
        n: usize,
        y: DevicePtr,
    ) -> Result<(), ForwardError>;
    /// A step of kind `label` begins (`prompt`, `decode-1`, `decode`): a device that profiles counts by it.
    fn begin_step(&mut self, _label: &'static str) {}
    /// Whether it runs the tensor-core kernels (`mma.sync` m16n8k16: compute capability 8.0 and later).
    fn tensor_cores(&self) -> bool;
    /// Starts recording the work issued from now instead of running it; false when this device does not record.
    fn begin_recording(&mut self) -> Result<bool, ForwardError>;
    fn end_recording(&mut self) -> Result<Self::Recording, ForwardError>;
    /// Issues a recording's work again, with whatever the memory it reads holds now.
    fn replay(&mut self, recording: &Self::Recording) -> Result<(), ForwardError>;
}

/// A weight matrix in device memory: `rows × cols` f16, row-major.
#[derive(Clone, Copy, Debug)]
struct DeviceMatrix {
    at: DevicePtr,
    rows: usize,
    cols: usize,
    /// The same rows as the file stores them, when every part is Q4_1 or every part Q8_0 and the matrix-vector
    /// kernels read them ([`Options::quantized`]): where, and the kernels' format (`W_Q4_1`, `W_Q8_0`).
    quantized: Option<(DevicePtr, i32)>,
}

/// The kernels' weight formats (`W_F16`, `W_Q4_1`, `W_Q8_0` in kernels.cu).
const W_F16: i32 = 0;
const W_Q4_1: i32 = 1;
const W_Q8_0: i32 = 2;

impl DeviceMatrix {
    /// A matrix-vector kernel's weight arguments: the rows and their format.
    fn rows_arg(&self) -> [Arg; 2] {
        match self.quantized {
            Some((at, format)) => [Arg::Ptr(at), Arg::I32(format)],
            None => [Arg::Ptr(self.at), Arg::I32(W_F16)],
        }
    }
}

#[derive(Debug)]
struct DeviceLayer {
    attn_norm: DevicePtr,
    /// Q, K and V's rows, stacked.
    qkv: DeviceMatrix,
    wo: DeviceMatrix,
    ffn_norm: DevicePtr,
    /// Gate's rows, then up's.
    gate_up: DeviceMatrix,
    down: DeviceMatrix,
}

/// Where a step's buffers and indices are.
#[derive(Clone, Copy, Debug)]
struct Pointers {
    scratch: DevicePtr,
    s: Scratch,
    index: DevicePtr,
    o: IndexOffsets,
}

impl Pointers {
    /// The scratch buffer at `offset`.
    fn at(&self, offset: usize) -> DevicePtr {
        self.scratch + offset as u64
    }

    fn buf(&self, offset: usize) -> Arg {
        Arg::Ptr(self.at(offset))
    }

    /// The index part starting at `offset` `i32`s.
    fn ints(&self, offset: usize) -> Arg {
        Arg::Ptr(self.index + 4 * offset as u64)
    }
}

/// A layer's attention over the paged cache, after its K/V are stored: `attend` for every row of a decode step,
/// else `attend` for the single-token chunks' rows and `attend_rows` for the tiles of the longer ones'; or, for a
/// small decode step, `attend_split`.
struct Attention<'a> {
    config: &'a ModelConfig,
    ix: &'a StepIndex,
    /// Prompts' tiles through `attend_rows_tc`.
    tensor_cores: bool,
    block_tokens: usize,
    cache: DevicePtr,
    rope: DevicePtr,
    p: Pointers,
}

impl Attention<'_> {
    /// The shape arguments that end the attention kernels' signatures, for `layer`.
    fn shape(&self, layer: usize) -> [Arg; 6] {
        let c = self.config;
        [
            Arg::I32(layer as i32),
            Arg::I32(c.n_layers as i32),
            Arg::I32(c.n_heads as i32),
            Arg::I32(c.n_kv_heads as i32),
            Arg::I32(c.head_dim as i32),
            Arg::I32(self.block_tokens as i32),
        ]
    }

    /// Where RoPE and the K/V store read and write: the row positions, the table, the cache and the rows' slots.
    fn store_args(&self) -> [Arg; 5] {
        let p = self.p;
        [p.ints(p.o.positions), Arg::Ptr(self.rope), Arg::Ptr(self.cache), p.ints(p.o.slot_block), p.ints(p.o.slot_pos)]
    }

    /// RoPE on Q and K where the stacked matmul left them, and K and V into the cache.
    fn store<G: Gpu>(&self, gpu: &mut G, layer: usize) -> Result<(), ForwardError> {
        let args = [&[self.p.buf(self.p.s.qkv)][..], &self.store_args(), &self.shape(layer)].concat();
        gpu.launch("rope_store", (self.ix.n as u32, 1), ROW_THREADS, 0, &args)
    }

    /// Attention into `attended`, or with `split` (a small decode step) into `partials`, for `combine_matvec_add`
    /// to merge.
    fn attend<G: Gpu>(&self, gpu: &mut G, layer: usize, split: bool) -> Result<(), ForwardError> {
        let (c, p, s, ix) = (self.config, self.p, self.p.s, self.ix);
        let n32 = ix.n as u32;
        let inputs = [
            p.buf(s.qkv),
            Arg::I32((c.n_embd + 2 * c.kv_dim()) as i32),
            Arg::Ptr(self.cache),
            p.ints(p.o.tables),
            p.ints(p.o.table_of),
            p.ints(p.o.positions),
        ];
        let tail = [&self.shape(layer)[..], &[Arg::F32(1.0 / (c.head_dim as f32).sqrt())]].concat();
        let heads = c.n_heads as u32;
        if split {
            let splits = (heads as usize * layout::ATTEND_SPLITS) as u32;
            let args = [&inputs[..], &[p.buf(s.partials)], &tail].concat();
            return gpu.launch("attend_split", (n32, splits), ATTEND_THREADS, 0, &args);
        }
        // `attend_rows` holds a tile's queries and keys in shared memory: heads of up to 128 dims, in eighths.
        let tiled = !ix.decode && c.head_dim <= ROWS_MAX_HEAD_DIM && c.head_dim % 8 == 0;
        let (rows, listed) = if tiled { (p.ints(p.o.singles), ix.singles as u32) } else { (Arg::Ptr(0), n32) };
        if listed > 0 {
            let args = [&inputs[..], &[rows, p.buf(s.attended)], &tail].concat();
            gpu.launch("attend", (listed, heads), ATTEND_THREADS, 0, &args)?;
        }
        if tiled && ix.tiles > 0 {
            let args = [&inputs[..], &[p.ints(p.o.tiles), p.buf(s.attended)], &tail].concat();
            if self.tensor_cores && c.head_dim % 16 == 0 {
                // One warp per tile and head.
                gpu.launch("attend_rows_tc", (ix.tiles as u32, heads), 32, 0, &args)?;
            } else {
                gpu.launch("attend_rows", (ix.tiles as u32, heads), ATTEND_THREADS, 0, &args)?;
            }
        }
        Ok(())
    }
}

/// Device memory that grows (by a new allocation) and says when it did.
#[derive(Debug, Default)]
struct Grown {
    at: DevicePtr,
    bytes: usize,
}

impl Grown {
    /// At least `bytes`; true when it moved.
    fn fit<G: Gpu>(&mut self, gpu: &mut G, bytes: usize) -> Result<bool, ForwardError> {
        if bytes <= self.bytes && self.at != 0 {
            return Ok(false);
        }
        if self.at != 0 {
            gpu.free(self.at);
        }
        self.at = gpu.alloc(bytes)?;
        self.bytes = bytes;
        Ok(true)
    }
}

/// The fused forward pass on device `G`.
pub struct GpuForward<G: Gpu> {
    /// Recorded decode steps by batch size; `None` when recording is off. (First: the recordings go before the
    /// device they were made on.)
    recorded: Option<HashMap<usize, G::Recording>>,
    gpu: G,
    name: &'static str,
    config: ModelConfig,
    embedding: DeviceMatrix,
    output: DeviceMatrix,
    layers: Vec<DeviceLayer>,
    output_norm: DevicePtr,
    rope: DevicePtr,
    /// The device's copy of the paged cache (allocated at the first step, when the store's size is known)…
    cache: Grown,
    /// …per block, the host store's generation it holds…
    seen: Vec<u64>,
    /// …and whether steps wrote it since the host's copy was last brought up to date ([`Backend::write_back`]):
    /// the K/V stay on the device until something else reads them.
    dirty: Vec<bool>,
    scratch: Grown,
    layout: Option<Scratch>,
    /// Small steps through the matrix-vector kernels ([`Options::matvec`]).
    matvec: bool,
    /// Prompts' attention on tensor cores ([`Options::tensor_cores`], where the device has them).
    tensor_cores: bool,
    index: Grown,
}

impl<G: Gpu> std::fmt::Debug for GpuForward<G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuForward").field("name", &self.name).finish_non_exhaustive()
    }
}

fn bytes_of<T: bytemuck::Pod>(v: &[T]) -> &[u8] {
    bytemuck::cast_slice(v)
}

impl<G: Gpu> GpuForward<G> {
    /// Uploads `model`'s weights to `gpu` (quantized matrices dequantized there). `name` is the backend's name.
    pub fn new(mut gpu: G, model: &Model, name: &'static str, options: Options) -> Result<GpuForward<G>, ForwardError> {
        let matvec = options.matvec && matvec_fits(&model.config);
        let keep = matvec && options.quantized;
        let mut layers = Vec::with_capacity(model.layers.len());
        for l in &model.layers {
            layers.push(DeviceLayer {
                attn_norm: upload_floats(&mut gpu, &l.attn_norm)?,
                qkv: upload_stacked(&mut gpu, &[&l.wq, &l.wk, &l.wv], keep)?,
                wo: upload_stacked(&mut gpu, &[&l.wo], keep)?,
                ffn_norm: upload_floats(&mut gpu, &l.ffn_norm)?,
                gate_up: upload_stacked(&mut gpu, &[&l.w_gate, &l.w_up], keep)?,
                down: upload_stacked(&mut gpu, &[&l.w_down], keep)?,
            });
        }
        // The embedding table is read a row at a time (f16); as the output projection, whole (quantized too).
        let embedding = upload_stacked(&mut gpu, &[&model.token_embd], keep)?;
        let output = if model.output.same_tensor(&model.token_embd) {
            embedding
        } else {
            upload_stacked(&mut gpu, &[&model.output], keep)?
        };
        let table: Vec<f32> = model.rope.iter().flat_map(|&[c, s]| [c, s]).collect();
        let gpu_tensor_cores = gpu.tensor_cores();
        Ok(GpuForward {
            output_norm: upload_floats(&mut gpu, &model.output_norm)?,
            rope: upload_floats(&mut gpu, &table)?,
            gpu,
            name,
            config: model.config.clone(),
            embedding,
            output,
            layers,
            cache: Grown::default(),
            seen: Vec::new(),
            dirty: Vec::new(),
            scratch: Grown::default(),
            layout: None,
            index: Grown::default(),
            recorded: options.record.then(HashMap::new),
            matvec,
            tensor_cores: options.tensor_cores && gpu_tensor_cores,
        })
    }

    /// The device.
    pub fn gpu(&self) -> &G {
        &self.gpu
    }

    /// Uploads the blocks the batch reads that the host store changed since the device last saw them; true when
    /// the device's copy was (re)allocated.
    fn sync_blocks(&mut self, kv: &KvStore, batch: &[SeqChunk<'_>]) -> Result<bool, ForwardError> {
        let layout = *kv.layout();
        let block_bytes = layout.block_elems() * 2;
        // It moves at the first step, or for a larger store than its own (a backend serves one store).
        let moved = self.cache.fit(&mut self.gpu, kv.capacity() * block_bytes)?;
        if moved {
            // Nothing is on the device yet: every block's first use uploads it.
            self.seen = vec![u64::MAX; kv.capacity()];
            self.dirty = vec![false; kv.capacity()];
        }
        for chunk in batch {
            let used = layout.blocks_for(chunk.start + chunk.tokens.len()).min(chunk.blocks.len());
            for &b in &chunk.blocks[..used] {
                let i = b.0 as usize;
                if self.seen[i] == kv.generation(b) {
                    continue;
                }
                let at = self.cache.at + (i * block_bytes) as u64;
                self.gpu.upload(at, bytes_of(kv.block(b)))?;
                self.seen[i] = kv.generation(b);
                self.dirty[i] = false;
            }
        }
        Ok(moved)
    }

    fn step(&mut self, kv: &mut KvStore, batch: &[SeqChunk<'_>], next: &mut Vec<Next>) -> Result<(), ForwardError> {
        let block_tokens = kv.layout().block_tokens;
        let ix = StepIndex::of(batch, block_tokens);
        if ix.n == 0 {
            return Ok(());
        }
        self.gpu.begin_step(match (ix.decode, ix.n) {
            (true, 1) => "decode-1",
            (true, _) => "decode",
            (false, _) => "prompt",
        });
        let mut moved = self.sync_blocks(kv, batch)?;
        let (rows, logit_rows) = (Scratch::rows_for(ix.n), Scratch::rows_for(ix.m));
        if self.layout.is_none_or(|s| s.rows < rows || s.logit_rows < logit_rows) {
            let old = self.layout.map_or((0, 0), |s| (s.rows, s.logit_rows));
            let s = Scratch::for_rows(&self.config, rows.max(old.0), logit_rows.max(old.1));
            moved |= self.scratch.fit(&mut self.gpu, s.bytes)?;
            self.layout = Some(s);
        }
        moved |= self.index.fit(&mut self.gpu, (ix.ints.len() * 4).next_power_of_two().max(4096))?;
        if moved {
            // The recordings read the old buffers (or none: the first step).
            if let Some(r) = self.recorded.as_mut() {
                r.clear();
            }
        }
        self.gpu.upload(self.index.at, bytes_of(&ix.ints))?;
        let replayable = ix.decode && ix.n <= MAX_RECORDED_ROWS && self.recorded.is_some();
        if !replayable {
            self.issue(&ix, block_tokens)?;
        } else if let Some(recording) = self.recorded.as_ref().and_then(|r| r.get(&ix.n)) {
            self.gpu.replay(recording)?;
        } else if self.gpu.begin_recording()? {
            // The recording ends whatever the issuing says: a device left recording would take no more work.
            let issued = self.issue(&ix, block_tokens);
            let recording = self.gpu.end_recording();
            issued?;
            let recording = recording?;
            self.gpu.replay(&recording)?;
            if let Some(r) = self.recorded.as_mut() {
                r.insert(ix.n, recording);
            }
        } else {
            // This device does not record: the work runs as it is issued, from now on.
            self.recorded = None;
            self.issue(&ix, block_tokens)?;
        }
        for r in 0..ix.n {
            self.dirty[ix.slot(r).0 as usize] = true;
        }
        self.read_back(&ix, next)
    }

    /// Issues a step of `n` rows of which `m` ask for logits, over the indices uploaded: through the matmuls, or
    /// for a small step with [`Options::matvec`], through the matrix-vector kernels; then the logit rows' top
    /// tokens.
    fn issue(&mut self, ix: &StepIndex, block_tokens: usize) -> Result<(), ForwardError> {
        let Some(s) = self.layout else { return Err(ForwardError::Device("no scratch laid out".into())) };
        let p = Pointers { scratch: self.scratch.at, s, index: self.index.at, o: ix.o };
        let args = [Arg::Ptr(self.embedding.at), p.ints(p.o.tokens), p.buf(s.x), Arg::I32(self.config.n_embd as i32)];
        self.gpu.launch("embed_f16", (ix.n as u32, 1), ROW_THREADS, 0, &args)?;
        if self.matvec && ix.n <= MATVEC_MAX_ROWS {
            self.issue_small(ix, block_tokens, &p)?;
        } else {
            self.issue_matmuls(ix, block_tokens, &p)?;
        }
        if ix.m > 0 {
            self.top_tokens(&p, ix.m)?;
        }
        Ok(())
    }

    /// The layers and the logits of a step of up to [`MATVEC_MAX_ROWS`] rows through the matrix-vector kernels.
    fn issue_small(&mut self, ix: &StepIndex, block_tokens: usize, p: &Pointers) -> Result<(), ForwardError> {
        let (c, s, n) = (&self.config, p.s, ix.n);
        let (d, ff) = (c.n_embd, c.n_ff);
        let (x, n_i, d_i, eps) = (p.buf(s.x), Arg::I32(n as i32), Arg::I32(d as i32), Arg::F32(c.rms_eps));
        let (tensor_cores, cache, rope) = (self.tensor_cores, self.cache.at, self.rope);
        let attention = Attention { config: c, ix, tensor_cores, block_tokens, cache, rope, p: *p };
        let gpu = &mut self.gpu;
        let shared = (n * d * 4) as u32;
        let blocks = |rows: usize| (rows as u32).div_ceil(MATVEC_ROWS_PER_BLOCK);
        let add = |w: DeviceMatrix, a: Arg| {
            let args = [&w.rows_arg()[..], &[Arg::I32(w.rows as i32), Arg::I32(w.cols as i32), a, n_i, x]].concat();
            ((blocks(w.rows), 1), (n * w.cols * 4) as u32, args)
        };
        for (li, l) in self.layers.iter().enumerate() {
            // The norm, the stacked Q/K/V projection, RoPE and the K/V store: a warp per rotary pair of rows.
            let args = [x, n_i, Arg::Ptr(l.attn_norm), d_i, eps];
            let args =
                [&args[..], &l.qkv.rows_arg(), &[p.buf(s.qkv)], &attention.store_args(), &attention.shape(li)].concat();
            let grid = ((l.qkv.rows as u32).div_ceil(2 * MATVEC_ROWS_PER_BLOCK), 1);
            gpu.launch("norm_qkv_rope", grid, ROW_THREADS, shared, &args)?;
            // A decode step's attention split over several blocks per head, merged where the output projection
            // reads it; another small step's through `attended`.
            attention.attend(gpu, li, ix.decode)?;
            if ix.decode {
                let (heads, hd) = (c.n_heads, c.head_dim);
                let args = [p.buf(s.partials), Arg::I32(heads as i32), Arg::I32(hd as i32)];
                let tail = [Arg::I32(l.wo.rows as i32), n_i, x];
                let bytes = (n * heads * (hd + layout::ATTEND_SPLITS + 1) * 4) as u32;
                let args = [&args[..], &l.wo.rows_arg(), &tail].concat();
                gpu.launch("combine_matvec_add", (blocks(l.wo.rows), 1), ROW_THREADS, bytes, &args)?;
            } else {
                let (grid, bytes, args) = add(l.wo, p.buf(s.attended));
                gpu.launch("matvec_add", grid, ROW_THREADS, bytes, &args)?;
            }
            let args = [x, n_i, Arg::Ptr(l.ffn_norm), d_i, eps];
            let args = [&args[..], &l.gate_up.rows_arg(), &[Arg::I32(ff as i32), p.buf(s.act)]].concat();
            gpu.launch("norm_swiglu", (blocks(ff), 1), ROW_THREADS, shared, &args)?;
            let (grid, bytes, args) = add(l.down, p.buf(s.act));
            gpu.launch("matvec_add", grid, ROW_THREADS, bytes, &args)?;
        }
        if ix.m > 0 {
            // The residual stream is whole already: the final norm and the logits in one kernel.
            let out = self.output;
            let args = [x, p.ints(p.o.logit_rows), Arg::I32(ix.m as i32), Arg::Ptr(self.output_norm), d_i, eps];
            let args = [&args[..], &out.rows_arg(), &[Arg::I32(out.rows as i32), p.buf(s.logits)]].concat();
            gpu.launch("norm_matvec", (blocks(out.rows), 1), ROW_THREADS, (ix.m * d * 4) as u32, &args)?;
        }
        Ok(())
    }

    /// The layers and the logits of a step through cuBLAS's matmuls and the fused kernels around them.
    fn issue_matmuls(&mut self, ix: &StepIndex, block_tokens: usize, p: &Pointers) -> Result<(), ForwardError> {
        let (c, s, n, m) = (&self.config, p.s, ix.n, ix.m);
        let ff = c.n_ff;
        let (x, d_i, eps) = (p.buf(s.x), Arg::I32(c.n_embd as i32), Arg::F32(c.rms_eps));
        let (tensor_cores, cache, rope) = (self.tensor_cores, self.cache.at, self.rope);
        let attention = Attention { config: c, ix, tensor_cores, block_tokens, cache, rope, p: *p };
        let gpu = &mut self.gpu;
        let (y, normed) = (p.buf(s.y), p.buf(s.normed));
        for (li, l) in self.layers.iter().enumerate() {
            // The residual of the last layer's down projection (none before the first), and this layer's norm.
            let residual = if li == 0 { Arg::Ptr(0) } else { y };
            let args = [x, residual, Arg::Ptr(l.attn_norm), normed, Arg::Ptr(0), d_i, eps];
            gpu.launch("residual_norm", (n as u32, 1), ROW_THREADS, 0, &args)?;
            gpu.gemm(l.qkv.at, l.qkv.rows, l.qkv.cols, p.at(s.normed), n, p.at(s.qkv))?;
            attention.store(gpu, li)?;
            attention.attend(gpu, li, false)?;
            gpu.gemm(l.wo.at, l.wo.rows, l.wo.cols, p.at(s.attended), n, p.at(s.y))?;
            let args = [x, y, Arg::Ptr(l.ffn_norm), normed, Arg::Ptr(0), d_i, eps];
            gpu.launch("residual_norm", (n as u32, 1), ROW_THREADS, 0, &args)?;
            gpu.gemm(l.gate_up.at, l.gate_up.rows, l.gate_up.cols, p.at(s.normed), n, p.at(s.gate_up))?;
            let elems = n * ff;
            let args = [p.buf(s.gate_up), p.buf(s.act), Arg::I32(ff as i32), Arg::I64(elems as i64)];
            gpu.launch("swiglu", ((elems as u32).div_ceil(ELEM_THREADS), 1), ELEM_THREADS, 0, &args)?;
            gpu.gemm(l.down.at, l.down.rows, l.down.cols, p.at(s.act), n, p.at(s.y))?;
        }
        if m > 0 {
            // The last residual and the final norm, over the logit rows only, then their logits.
            let args = [x, y, Arg::Ptr(self.output_norm), normed, p.ints(p.o.logit_rows), d_i, eps];
            gpu.launch("residual_norm", (m as u32, 1), ROW_THREADS, 0, &args)?;
            let out = self.output;
            gpu.gemm(out.at, out.rows, out.cols, p.at(s.normed), m, p.at(s.logits))?;
        }
        Ok(())
    }

    /// Every logit row's top token (whether its chunk asked for only that or not: a recorded step is the same for
    /// every mix of greedy and sampling sequences).
    fn top_tokens(&mut self, p: &Pointers, m: usize) -> Result<(), ForwardError> {
        let args = [p.buf(p.s.logits), Arg::I32(self.output.rows as i32), p.buf(p.s.top)];
        self.gpu.launch("argmax_rows", (m as u32, 1), ROW_THREADS, 0, &args)
    }

    /// The step's top tokens or logits to `next`. Its K/V stay on the device.
    fn read_back(&mut self, ix: &StepIndex, next: &mut Vec<Next>) -> Result<(), ForwardError> {
        let Some(s) = self.layout else { return Err(ForwardError::Device("no scratch laid out".into())) };
        let vocab = self.output.rows;
        let mut top = vec![0i32; ix.m];
        if ix.greedy.contains(&true) {
            self.gpu.download(self.scratch.at + s.top as u64, bytemuck::cast_slice_mut(&mut top))?;
        }
        // A greedy row's token, 4 bytes; another's logits straight into the vector its sampler gets, not through
        // one buffer for all and a copy per row: at batch 256 they are 50 MB a step.
        for (i, &greedy) in ix.greedy.iter().enumerate() {
            if greedy {
                next.push(Next::Token(top[i] as u32));
                continue;
            }
            let mut row = vec![0f32; vocab];
            let at = self.scratch.at + (s.logits + i * vocab * 4) as u64;
            self.gpu.download(at, bytemuck::cast_slice_mut(&mut row))?;
            next.push(Next::Logits(row));
        }
        Ok(())
    }
}

fn upload_floats<G: Gpu>(gpu: &mut G, v: &[f32]) -> Result<DevicePtr, ForwardError> {
    let at = gpu.alloc(v.len() * 4)?;
    gpu.upload(at, bytes_of(v))?;
    Ok(at)
}

/// The rows of `parts` (all of one width) one after the other as one f16 matrix: quantized ones go up as they are
/// and are dequantized on the device, others are converted here. With `keep`, when every part is Q4_1 or every part
/// Q8_0, the stacked quantized rows stay on the device too.
fn upload_stacked<G: Gpu>(gpu: &mut G, parts: &[&Matrix], keep: bool) -> Result<DeviceMatrix, ForwardError> {
    let cols = parts[0].cols;
    if parts.iter().any(|p| p.cols != cols) {
        return Err(ForwardError::Device("stacked matrices differ in width".into()));
    }
    let rows: usize = parts.iter().map(|p| p.rows).sum();
    let at = gpu.alloc(rows * cols * 2)?;
    let kernel = |ty| match ty {
        TensorType::Q8_0 => Some(("dequant_q8_0_f16", W_Q8_0)),
        TensorType::Q4_1 => Some(("dequant_q4_1_f16", W_Q4_1)),
        _ => None,
    };
    // Quantized parts of one type go up one after the other into one buffer (rows stay whole blocks), dequantized
    // from there; the buffer is freed, or kept when asked for.
    let format = kernel(parts[0].ty).filter(|_| parts.iter().all(|p| p.ty == parts[0].ty)).map(|(_, f)| f);
    let raw_bytes: usize = parts.iter().filter(|p| kernel(p.ty).is_some()).map(|p| p.bytes().len()).sum();
    let raw = if raw_bytes > 0 { gpu.alloc(raw_bytes)? } else { 0 };
    let (mut row, mut offset) = (0, 0);
    for m in parts {
        let elems = m.rows * m.cols;
        let to = at + (row * cols * 2) as u64;
        row += m.rows;
        let Some((name, _)) = kernel(m.ty) else {
            let mut values = vec![0f32; elems];
            crate::kernels::dequantize_row(m.ty, m.bytes(), &mut values);
            let host: Vec<half::f16> = values.iter().map(|&v| half::f16::from_f32(v)).collect();
            gpu.upload(to, bytes_of(&host))?;
            continue;
        };
        let src = raw + offset as u64;
        gpu.upload(src, m.bytes())?;
        offset += m.bytes().len();
        gpu.launch(
            name,
            ((elems as u32).div_ceil(ELEM_THREADS), 1),
            ELEM_THREADS,
            0,
            &[Arg::Ptr(src), Arg::Ptr(to), Arg::I64((elems / 32) as i64)],
        )?;
    }
    let quantized = match format {
        Some(f) if keep => Some((raw, f)),
        _ => {
            if raw != 0 {
                // Freed in order with the work (a device that frees at once has run it already).
                gpu.free(raw);
            }
            None
        }
    };
    Ok(DeviceMatrix { at, rows, cols, quantized })
}

impl<G: Gpu> Backend for GpuForward<G> {
    fn name(&self) -> &'static str {
        self.name
    }

    fn vocab(&self) -> usize {
        self.config.n_vocab
    }

    fn context_len(&self) -> usize {
        self.config.context_len
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
        self.step(kv, batch, next)
    }

    fn write_back(&mut self, kv: &mut KvStore, blocks: &[BlockId]) -> Result<(), ForwardError> {
        let block_elems = kv.layout().block_elems();
        let mut values = vec![half::f16::ZERO; block_elems];
        for &b in blocks {
            let i = b.0 as usize;
            if !self.dirty.get(i).copied().unwrap_or(false) {
                continue;
            }
            if self.seen[i] != kv.generation(b) {
                // The store wrote the block whole since (an import, an onboard into a block freed and taken
                // again): its copy is the newer one, and the next step that reads the block uploads it.
                self.dirty[i] = false;
                continue;
            }
            let at = self.cache.at + (i * block_elems * 2) as u64;
            self.gpu.download(at, bytemuck::cast_slice_mut(&mut values))?;
            kv.write_block_f16(b, &values);
            self.dirty[i] = false;
        }
        Ok(())
    }
}
