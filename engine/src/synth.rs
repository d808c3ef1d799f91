//! Synthetic models: a GGUF with a real model's shapes, tensor types and tokenizer layout, and deterministic
//! pseudo-random weights. `tandem model synth --seed S` makes the same bytes on any machine (the generator and
//! the quantizers use only exactly rounded float operations), so a machine that cannot receive the 94 MB model
//! (the GPU machine: no network, 64 MiB carried) makes its own copy and checks kernels against logits computed
//! here. It is not a language model: its outputs mean nothing, but every kernel computes on realistic shapes
//! and value ranges.

use std::path::Path;

use half::f16;

use crate::gguf::{GgufWriter, MetaArray, MetaValue, TensorType, WriteError};
use crate::sampling::Rng;
use crate::tokenizer::bytes::byte_to_char;

/// The hyper-parameters of a synthetic Llama model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SynthShape {
    pub n_layers: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    /// At least [`MIN_VOCAB`].
    pub n_vocab: usize,
    pub context_len: usize,
}

impl SynthShape {
    /// The embedded model's shape (SmolLM2-135M).
    pub const SMOLLM2_135M: SynthShape = SynthShape {
        n_layers: 30,
        n_embd: 576,
        n_ff: 1536,
        n_heads: 9,
        n_kv_heads: 3,
        n_vocab: 49_152,
        context_len: 8192,
    };

    fn kv_dim(&self) -> usize {
        self.n_embd / self.n_heads * self.n_kv_heads
    }
}

/// Special tokens, 256 byte tokens and the merges between lowercase letters: the smallest vocabulary written.
pub const MIN_VOCAB: usize = SPECIALS.len() + 256 + 26 + 26 * 26;

const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
const TOKEN_NORMAL: i32 = 1;
const TOKEN_CONTROL: i32 = 3;

/// A ChatML template (the embedded model's format).
const CHAT_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + \
    message['content'] + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}\
    {% endif %}";

/// Why a synthetic model could not be made.
#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error("a synthetic model needs a vocabulary of at least {MIN_VOCAB} tokens, not {0}")]
    Vocab(usize),
    #[error("{0} heads, {1} KV heads and width {2} do not divide (and the head size must be even)")]
    Heads(usize, usize, usize),
    #[error("width {0} and feed-forward width {1} must be multiples of 32 (the quantization block)")]
    Width(usize, usize),
    #[error(transparent)]
    Tensor(#[from] WriteError),
    #[error("cannot write {path}: {source}")]
    Io { path: String, source: std::io::Error },
}

/// One tensor of the model: name, GGML dims (row length first) and type.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: TensorType,
}

/// The tensors of a model of `shape`, in the embedded model's order and with its types (embedding Q8_0, tied to
/// the output; norms F32; every other matrix Q4_1).
pub fn tensors(shape: &SynthShape) -> Vec<TensorSpec> {
    let s = shape;
    let spec =
        |name: String, dims: &[usize], ty| TensorSpec { name, dims: dims.iter().map(|&d| d as u64).collect(), ty };
    let mut out = vec![spec("token_embd.weight".into(), &[s.n_embd, s.n_vocab], TensorType::Q8_0)];
    for l in 0..s.n_layers {
        let p = |n: &str| format!("blk.{l}.{n}.weight");
        out.extend([
            spec(p("attn_norm"), &[s.n_embd], TensorType::F32),
            spec(p("ffn_down"), &[s.n_ff, s.n_embd], TensorType::Q4_1),
            spec(p("ffn_gate"), &[s.n_embd, s.n_ff], TensorType::Q4_1),
            spec(p("ffn_up"), &[s.n_embd, s.n_ff], TensorType::Q4_1),
            spec(p("ffn_norm"), &[s.n_embd], TensorType::F32),
            spec(p("attn_k"), &[s.n_embd, s.kv_dim()], TensorType::Q4_1),
            spec(p("attn_output"), &[s.n_embd, s.n_embd], TensorType::Q4_1),
            spec(p("attn_q"), &[s.n_embd, s.n_embd], TensorType::Q4_1),
            spec(p("attn_v"), &[s.n_embd, s.kv_dim()], TensorType::Q4_1),
        ]);
    }
    out.push(spec("output_norm.weight".into(), &[s.n_embd], TensorType::F32));
    out
}

/// The synthetic model of `shape` for `seed`, as a GGUF writer.
pub fn model(shape: &SynthShape, seed: u64) -> Result<GgufWriter, SynthError> {
    let s = shape;
    if s.n_vocab < MIN_VOCAB {
        return Err(SynthError::Vocab(s.n_vocab));
    }
    if s.n_heads == 0
        || s.n_kv_heads == 0
        || !s.n_embd.is_multiple_of(s.n_heads)
        || !s.n_heads.is_multiple_of(s.n_kv_heads)
        || !(s.n_embd / s.n_heads).is_multiple_of(2)
    {
        return Err(SynthError::Heads(s.n_heads, s.n_kv_heads, s.n_embd));
    }
    if !s.n_embd.is_multiple_of(32) || !s.n_ff.is_multiple_of(32) {
        return Err(SynthError::Width(s.n_embd, s.n_ff));
    }
    let mut w = GgufWriter::new();
    let u32_of = |n: usize| MetaValue::U32(n as u32);
    w.meta("general.architecture", MetaValue::String("llama".into()))
        .meta("general.name", MetaValue::String(format!("tandem synthetic llama (seed {seed})")))
        .meta("llama.block_count", u32_of(s.n_layers))
        .meta("llama.context_length", u32_of(s.context_len))
        .meta("llama.embedding_length", u32_of(s.n_embd))
        .meta("llama.feed_forward_length", u32_of(s.n_ff))
        .meta("llama.attention.head_count", u32_of(s.n_heads))
        .meta("llama.attention.head_count_kv", u32_of(s.n_kv_heads))
        .meta("llama.rope.freq_base", MetaValue::F32(100_000.0))
        .meta("llama.attention.layer_norm_rms_epsilon", MetaValue::F32(1e-5))
        .meta("llama.vocab_size", u32_of(s.n_vocab))
        .meta("llama.rope.dimension_count", u32_of(s.n_embd / s.n_heads));
    vocabulary(&mut w, s.n_vocab);
    for (index, t) in tensors(s).into_iter().enumerate() {
        let mut rng = SplitMix::new(seed, index as u64);
        let (cols, rows) = (t.dims[0] as usize, t.dims.get(1).copied().unwrap_or(1) as usize);
        let bytes = match t.ty {
            // Norm weights near 1, so that the multiply is exercised without scaling the stream away.
            TensorType::F32 => (0..cols).flat_map(|_| (1.0 + 0.1 * rng.uniform()).to_le_bytes()).collect(),
            ty => {
                // Embeddings small (logits of a few units); matrices at 1/sqrt(fan-in), so activations stay of
                // order one through 30 layers. A uniform of half-width sqrt(3)*sigma has standard deviation sigma.
                let sigma = if t.name == "token_embd.weight" { 0.05 } else { 1.0 / (cols as f32).sqrt() };
                let half_width = 1.732_050_8 * sigma;
                let mut row = vec![0f32; cols];
                let mut out = Vec::with_capacity(rows * cols / 32 * ty.block_bytes());
                for _ in 0..rows {
                    row.iter_mut().for_each(|x| *x = half_width * rng.uniform());
                    quantize_row(ty, &row, &mut out);
                }
                out
            }
        };
        w.tensor(&t.name, &t.dims, t.ty, bytes)?;
    }
    Ok(w)
}

/// Writes the synthetic model of `shape` for `seed` to `path`.
pub fn write(path: &Path, shape: &SynthShape, seed: u64) -> Result<(), SynthError> {
    model(shape, seed)?.write(path).map_err(|source| SynthError::Io { path: path.display().to_string(), source })
}

/// A byte-level BPE vocabulary of `n` tokens: the ChatML specials, the 256 bytes, merges of a space with a
/// lowercase letter and of two lowercase letters, then filler tokens no text encodes to.
fn vocabulary(w: &mut GgufWriter, n: usize) {
    let mut tokens: Vec<String> = SPECIALS.iter().map(|s| s.to_string()).collect();
    let mut types = vec![TOKEN_CONTROL; SPECIALS.len()];
    tokens.extend((0..=255u8).map(|b| byte_to_char(b).to_string()));
    let space = byte_to_char(b' ');
    let mut merges = Vec::new();
    for a in 'a'..='z' {
        merges.push(format!("{space} {a}"));
        tokens.push(format!("{space}{a}"));
    }
    for a in 'a'..='z' {
        for b in 'a'..='z' {
            merges.push(format!("{a} {b}"));
            tokens.push(format!("{a}{b}"));
        }
    }
    let filled = tokens.len();
    tokens.extend((filled..n).map(|i| format!("<synth_{i}>")));
    types.resize(tokens.len(), TOKEN_NORMAL);
    w.meta("tokenizer.ggml.model", MetaValue::String("gpt2".into()))
        .meta("tokenizer.ggml.pre", MetaValue::String("smollm".into()))
        .meta("tokenizer.ggml.tokens", MetaValue::Array(MetaArray::String(tokens)))
        .meta("tokenizer.ggml.token_type", MetaValue::Array(MetaArray::I32(types)))
        .meta("tokenizer.ggml.merges", MetaValue::Array(MetaArray::String(merges)))
        .meta("tokenizer.ggml.bos_token_id", MetaValue::U32(1))
        .meta("tokenizer.ggml.eos_token_id", MetaValue::U32(2))
        .meta("tokenizer.ggml.add_bos_token", MetaValue::Bool(false))
        .meta("tokenizer.chat_template", MetaValue::String(CHAT_TEMPLATE.into()));
}

/// The sampler's SplitMix64, one stream per tensor: integer arithmetic only.
struct SplitMix(Rng);

impl SplitMix {
    fn new(seed: u64, stream: u64) -> SplitMix {
        let mut s = SplitMix(Rng(seed ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03)));
        s.0.next_u64();
        s
    }

    /// Uniform in [-1, 1), exactly: 24 random bits scaled by a power of two.
    fn uniform(&mut self) -> f32 {
        (self.0.next_u64() >> 40) as f32 * (2.0 / 16_777_216.0) - 1.0
    }
}

/// Appends `x` (a multiple of 32 values) encoded as `ty` (Q8_0 or Q4_1, as GGML's reference quantizers do).
pub fn quantize_row(ty: TensorType, x: &[f32], out: &mut Vec<u8>) {
    for block in x.chunks_exact(32) {
        match ty {
            TensorType::Q8_0 => {
                let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_le_bytes());
                out.extend(block.iter().map(|v| (v * id).round() as i8 as u8));
            }
            TensorType::Q4_1 => {
                let min = block.iter().fold(f32::INFINITY, |m, &v| m.min(v));
                let max = block.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_le_bytes());
                out.extend(f16::from_f32(min).to_le_bytes());
                let q = |v: f32| (((v - min) * id + 0.5) as u8).min(15);
                out.extend((0..16).map(|j| q(block[j]) | (q(block[j + 16]) << 4)));
            }
            TensorType::F32 => out.extend(block.iter().flat_map(|v| v.to_le_bytes())),
            TensorType::F16 => out.extend(block.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes())),
            TensorType::Q4_0 => {
                // GGML's Q4_0: the value of largest magnitude maps to -8.
                let m = block.iter().fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
                let d = m / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_le_bytes());
                let q = |v: f32| ((v * id + 8.5) as u8).min(15);
                out.extend((0..16).map(|j| q(block[j]) | (q(block[j + 16]) << 4)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::dequantize_row_portable;

    #[test]
    fn quantized_rows_dequantize_within_half_a_step() {
        let mut rng = SplitMix::new(7, 0);
        let x: Vec<f32> = (0..256).map(|_| 0.3 * rng.uniform()).collect();
        for ty in [TensorType::Q8_0, TensorType::Q4_1, TensorType::Q4_0, TensorType::F16, TensorType::F32] {
            let mut bytes = Vec::new();
            quantize_row(ty, &x, &mut bytes);
            assert_eq!(bytes.len(), x.len() / ty.block_elems() * ty.block_bytes(), "{ty:?}");
            let mut back = vec![0f32; x.len()];
            dequantize_row_portable(ty, &bytes, &mut back);
            for (block, got) in x.chunks(32).zip(back.chunks(32)) {
                let lo = block.iter().fold(f32::INFINITY, |m, &v| m.min(v));
                let hi = block.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                let amax = lo.abs().max(hi.abs());
                // Half a quantization step, plus the f16 rounding of the scale (and offset); Q4_0 maps the largest
                // magnitude to -8, so a value of the other sign as large clips at +7: a whole step.
                let (step, steps) = match ty {
                    TensorType::Q8_0 => (amax / 127.0, 0.5),
                    TensorType::Q4_1 => ((hi - lo) / 15.0, 0.5),
                    TensorType::Q4_0 => (amax / 8.0, 1.0),
                    _ => (amax / 1024.0, 0.5),
                };
                for (a, b) in block.iter().zip(got) {
                    assert!((a - b).abs() <= steps * step + 2e-3 * amax + 1e-6, "{ty:?}: {a} -> {b}");
                }
            }
        }
    }

    #[test]
    fn the_uniform_draws_cover_the_interval_evenly() {
        let mut rng = SplitMix::new(1, 2);
        let draws: Vec<f32> = (0..100_000).map(|_| rng.uniform()).collect();
        assert!(draws.iter().all(|v| (-1.0..1.0).contains(v)));
        let mean = draws.iter().sum::<f32>() / draws.len() as f32;
        let below = draws.iter().filter(|&&v| v < -0.5).count();
        assert!(mean.abs() < 0.01, "{mean}");
        assert!((24_000..26_000).contains(&below), "{below}");
    }

    #[test]
    fn shapes_that_cannot_be_built_are_refused() {
        let small =
            SynthShape { n_layers: 1, n_embd: 64, n_ff: 64, n_heads: 4, n_kv_heads: 2, n_vocab: 100, context_len: 64 };
        assert!(matches!(model(&small, 0), Err(SynthError::Vocab(100))));
        let heads = SynthShape { n_heads: 3, n_vocab: MIN_VOCAB, ..small };
        assert!(matches!(model(&heads, 0), Err(SynthError::Heads(..))));
        let width = SynthShape { n_ff: 40, n_vocab: MIN_VOCAB, ..small };
        assert!(matches!(model(&width, 0), Err(SynthError::Width(64, 40))));
    }
}
