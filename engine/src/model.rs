//! A Llama-family model loaded from GGUF: hyper-parameters from the metadata and weights left quantized in the
//! memory-mapped file.

use std::path::Path;
use std::sync::Arc;

use crate::gguf::{GgufError, GgufFile, TensorInfo, TensorType};

/// The hyper-parameters the forward pass needs.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub n_layers: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub rope_base: f64,
    pub rms_eps: f32,
    pub n_vocab: usize,
    pub context_len: usize,
}

impl ModelConfig {
    /// Width of the K (and V) projection: all KV heads together.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    fn from_gguf(file: &GgufFile) -> Result<ModelConfig, GgufError> {
        let meta = file.metadata();
        let arch = meta.get("general.architecture").and_then(|v| v.as_str()).unwrap_or("(missing)");
        if arch != "llama" {
            return Err(file.malformed(format!("architecture {arch:?} is not supported (only `llama` is)")));
        }
        let get = |key: &str| meta.get(&format!("llama.{key}"));
        let int = |key: &str| -> Result<usize, GgufError> {
            get(key)
                .and_then(|v| v.as_u64())
                .and_then(|v| usize::try_from(v).ok())
                .filter(|&v| v > 0)
                .ok_or_else(|| file.malformed(format!("metadata llama.{key} is missing or not a positive integer")))
        };
        let n_embd = int("embedding_length")?;
        let n_heads = int("attention.head_count")?;
        let n_kv_heads =
            if get("attention.head_count_kv").is_some() { int("attention.head_count_kv")? } else { n_heads };
        if n_embd % n_heads != 0 || n_heads % n_kv_heads != 0 {
            return Err(
                file.malformed(format!("{n_heads} heads, {n_kv_heads} KV heads and width {n_embd} do not divide"))
            );
        }
        let head_dim = n_embd / n_heads;
        if get("rope.dimension_count").is_some() && int("rope.dimension_count")? != head_dim {
            return Err(
                file.malformed("partial rotary embeddings (rope.dimension_count != head size) are not supported")
            );
        }
        let n_vocab = meta
            .get("tokenizer.ggml.tokens")
            .and_then(|v| v.as_array())
            .map(|a| a.len())
            .filter(|&n| n > 0)
            .ok_or_else(|| file.malformed("metadata tokenizer.ggml.tokens is missing"))?;
        Ok(ModelConfig {
            n_layers: int("block_count")?,
            n_embd,
            n_ff: int("feed_forward_length")?,
            n_heads,
            n_kv_heads,
            head_dim,
            // llama.cpp's defaults when a file leaves these out.
            rope_base: get("rope.freq_base").and_then(|v| v.as_f64()).unwrap_or(10_000.0),
            rms_eps: get("attention.layer_norm_rms_epsilon").and_then(|v| v.as_f64()).unwrap_or(1e-5) as f32,
            n_vocab,
            context_len: int("context_length")?,
        })
    }
}

/// A weight matrix of `rows` rows of `cols` elements, left in the file's encoding.
#[derive(Debug, Clone)]
pub struct Matrix {
    pub ty: TensorType,
    pub rows: usize,
    pub cols: usize,
    start: usize,
    row_bytes: usize,
    map: Arc<memmap2::Mmap>,
}

impl Matrix {
    /// The encoded bytes of row `r`.
    pub fn row(&self, r: usize) -> &[u8] {
        let s = self.start + r * self.row_bytes;
        &self.map[s..s + self.row_bytes]
    }

    /// All rows' encoded bytes, in order.
    pub fn bytes(&self) -> &[u8] {
        &self.map[self.start..self.start + self.rows * self.row_bytes]
    }

    /// Whether `other` is this same tensor of the same file (a model whose output is tied to its embedding).
    pub fn same_tensor(&self, other: &Matrix) -> bool {
        Arc::ptr_eq(&self.map, &other.map) && self.start == other.start
    }
}

/// One transformer block's weights.
#[derive(Debug)]
pub struct Layer {
    pub attn_norm: Vec<f32>,
    pub wq: Matrix,
    pub wk: Matrix,
    pub wv: Matrix,
    pub wo: Matrix,
    pub ffn_norm: Vec<f32>,
    pub w_gate: Matrix,
    pub w_up: Matrix,
    pub w_down: Matrix,
}

/// A loaded model: configuration, weights, and the rotary table.
#[derive(Debug)]
pub struct Model {
    pub config: ModelConfig,
    pub token_embd: Matrix,
    pub layers: Vec<Layer>,
    pub output_norm: Vec<f32>,
    /// The output projection; the embedding matrix itself when the model ties them.
    pub output: Matrix,
    /// `cos` and `sin` of every (position, pair), `[pos][pair][cos, sin]`.
    pub(crate) rope: Vec<[f32; 2]>,
    /// How matmuls over quantized weights compute (the reference precision unless told).
    pub precision: crate::forward::Precision,
}

impl Model {
    /// Loads the model in `file`.
    pub fn load(file: &GgufFile) -> Result<Model, GgufError> {
        let config = ModelConfig::from_gguf(file)?;
        let c = &config;
        let map = file.mapping();
        let tensor = |name: &str| file.tensor(name).ok_or_else(|| file.malformed(format!("tensor {name} is missing")));
        let matrix = |name: &str, rows: usize, cols: usize| -> Result<Matrix, GgufError> {
            let t = tensor(name)?;
            check_shape(file, t, &[cols, rows])?;
            let row_bytes = cols / t.ty.block_elems() * t.ty.block_bytes();
            Ok(Matrix { ty: t.ty, rows, cols, start: t.start, row_bytes, map: Arc::clone(&map) })
        };
        let vector = |name: &str, len: usize| -> Result<Vec<f32>, GgufError> {
            let t = tensor(name)?;
            check_shape(file, t, &[len])?;
            let mut out = vec![0f32; len];
            crate::kernels::dequantize_row(t.ty, file.bytes(t), &mut out);
            Ok(out)
        };
        let mut layers = Vec::with_capacity(c.n_layers);
        for l in 0..c.n_layers {
            let p = |s: &str| format!("blk.{l}.{s}.weight");
            layers.push(Layer {
                attn_norm: vector(&p("attn_norm"), c.n_embd)?,
                wq: matrix(&p("attn_q"), c.n_embd, c.n_embd)?,
                wk: matrix(&p("attn_k"), c.kv_dim(), c.n_embd)?,
                wv: matrix(&p("attn_v"), c.kv_dim(), c.n_embd)?,
                wo: matrix(&p("attn_output"), c.n_embd, c.n_embd)?,
                ffn_norm: vector(&p("ffn_norm"), c.n_embd)?,
                w_gate: matrix(&p("ffn_gate"), c.n_ff, c.n_embd)?,
                w_up: matrix(&p("ffn_up"), c.n_ff, c.n_embd)?,
                w_down: matrix(&p("ffn_down"), c.n_embd, c.n_ff)?,
            });
        }
        let token_embd = matrix("token_embd.weight", c.n_vocab, c.n_embd)?;
        let output = match file.tensor("output.weight") {
            Some(_) => matrix("output.weight", c.n_vocab, c.n_embd)?,
            None => token_embd.clone(),
        };
        let rope = rope_table(c);
        Ok(Model {
            output_norm: vector("output_norm.weight", c.n_embd)?,
            token_embd,
            layers,
            output,
            rope,
            config,
            precision: crate::forward::Precision::Reference,
        })
    }

    /// Opens and loads the model at `path`.
    pub fn open(path: &Path) -> Result<Model, GgufError> {
        Model::load(&GgufFile::open(path)?)
    }
}

fn check_shape(file: &GgufFile, t: &TensorInfo, want: &[usize]) -> Result<(), GgufError> {
    let want64: Vec<u64> = want.iter().map(|&d| d as u64).collect();
    if t.dims != want64 {
        return Err(file.malformed(format!("tensor {} has shape {:?}, expected {:?}", t.name, t.dims, want)));
    }
    Ok(())
}

/// Rotation angles `pos * base^(-2i/d)` computed in f64 (as the reference does), stored as f32 cos/sin.
fn rope_table(c: &ModelConfig) -> Vec<[f32; 2]> {
    let pairs = c.head_dim / 2;
    let mut out = Vec::with_capacity(c.context_len * pairs);
    for pos in 0..c.context_len {
        for i in 0..pairs {
            let inv = c.rope_base.powf(-(2.0 * i as f64) / c.head_dim as f64);
            let a = pos as f64 * inv;
            out.push([a.cos() as f32, a.sin() as f32]);
        }
    }
    out
}
