//! A GGUF Llama model written as a Hugging Face model directory (`config.json`, `model.safetensors` in f16, and
//! the tokenizer files), so that transformers and PyTorch run the same weights as the engine: the GPU check
//! compares the CUDA backend's speed with PyTorch's on the synthetic model this way.
//!
//! GGUF stores the Q and K projections with each head's rows interleaved for rotary embedding on adjacent pairs
//! (llama.cpp's converter permutes Hugging Face's rows, which rotate the two halves of a head): the export undoes
//! that permutation, so that Hugging Face's `rotate_half` sees the pairs the engine rotates.

use std::io::Write;
use std::path::Path;

use half::f16;
use serde_json::{Value, json};

use crate::gguf::{GgufFile, TensorInfo};
use crate::model::{Model, ModelConfig};

/// Why the export failed.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error(transparent)]
    Model(#[from] crate::gguf::GgufError),
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
}

/// Writes `file` (a Llama GGUF the engine loads) into `dir` as a Hugging Face model directory in f16.
pub fn export(file: &GgufFile, dir: &Path) -> Result<(), ExportError> {
    let model = Model::load(file)?;
    let c = &model.config;
    let io = |path: &Path| {
        let path = path.display().to_string();
        move |source| ExportError::Io { path: path.clone(), source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let tensors = hf_tensors(file, c)?;
    let out = dir.join("model.safetensors");
    write_safetensors(&out, &tensors).map_err(io(&out))?;
    let (tokenizer, tokenizer_config) = crate::tokenizer::export::hugging_face_files(file)?;
    let meta = file.metadata();
    let id = |k: &str| meta.get(k).and_then(|v| v.as_u64());
    let config = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": c.n_embd,
        "intermediate_size": c.n_ff,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.context_len,
        "rms_norm_eps": c.rms_eps,
        "rope_theta": c.rope_base,
        "vocab_size": c.n_vocab,
        "tie_word_embeddings": file.tensor("output.weight").is_none(),
        "attention_bias": false,
        "mlp_bias": false,
        "torch_dtype": "float16",
        "bos_token_id": id("tokenizer.ggml.bos_token_id"),
        "eos_token_id": id("tokenizer.ggml.eos_token_id"),
    });
    for (name, value) in
        [("config.json", config), ("tokenizer.json", tokenizer), ("tokenizer_config.json", tokenizer_config)]
    {
        let path = dir.join(name);
        std::fs::write(&path, value.to_string()).map_err(io(&path))?;
    }
    Ok(())
}

/// One exported tensor: Hugging Face name, shape (rows first) and f16 values in row-major order.
struct HfTensor {
    name: String,
    shape: Vec<usize>,
    data: Vec<f16>,
}

fn hf_tensors(file: &GgufFile, c: &ModelConfig) -> Result<Vec<HfTensor>, ExportError> {
    let get = |gguf: &str, hf: String, heads: Option<usize>| -> Result<HfTensor, ExportError> {
        let t = file.tensor(gguf).ok_or_else(|| file.malformed(format!("tensor {gguf} is missing")))?;
        let (cols, rows) = (t.dims[0] as usize, t.dims.get(1).copied().unwrap_or(1) as usize);
        let values = dequantize(file, t, rows, cols);
        let data = match heads {
            Some(h) => unpermute_rows(&values, h, rows / h, cols),
            None => values,
        };
        let shape = if t.dims.len() == 1 { vec![cols] } else { vec![rows, cols] };
        Ok(HfTensor { name: hf, shape, data: data.into_iter().map(f16::from_f32).collect() })
    };
    let mut out = vec![get("token_embd.weight", "model.embed_tokens.weight".into(), None)?];
    for l in 0..c.n_layers {
        let g = |s: &str| format!("blk.{l}.{s}.weight");
        let h = |s: &str| format!("model.layers.{l}.{s}.weight");
        out.extend([
            get(&g("attn_norm"), h("input_layernorm"), None)?,
            get(&g("attn_q"), h("self_attn.q_proj"), Some(c.n_heads))?,
            get(&g("attn_k"), h("self_attn.k_proj"), Some(c.n_kv_heads))?,
            get(&g("attn_v"), h("self_attn.v_proj"), None)?,
            get(&g("attn_output"), h("self_attn.o_proj"), None)?,
            get(&g("ffn_norm"), h("post_attention_layernorm"), None)?,
            get(&g("ffn_gate"), h("mlp.gate_proj"), None)?,
            get(&g("ffn_up"), h("mlp.up_proj"), None)?,
            get(&g("ffn_down"), h("mlp.down_proj"), None)?,
        ]);
    }
    out.push(get("output_norm.weight", "model.norm.weight".into(), None)?);
    if file.tensor("output.weight").is_some() {
        out.push(get("output.weight", "lm_head.weight".into(), None)?);
    }
    Ok(out)
}

fn dequantize(file: &GgufFile, t: &TensorInfo, rows: usize, cols: usize) -> Vec<f32> {
    // Rows are whole quantization blocks laid end to end, so the tensor decodes as one long row.
    let mut out = vec![0f32; rows * cols];
    crate::kernels::dequantize_row(t.ty, file.bytes(t), &mut out);
    out
}

/// GGUF's Q/K rows back into Hugging Face's order: within each head of `head_dim` rows, GGUF row `2i + half` is
/// Hugging Face row `half * head_dim / 2 + i`.
fn unpermute_rows(values: &[f32], heads: usize, head_dim: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; values.len()];
    let half_dim = head_dim / 2;
    for h in 0..heads {
        for i in 0..half_dim {
            for half in 0..2 {
                let from = (h * head_dim + 2 * i + half) * cols;
                let to = (h * head_dim + half * half_dim + i) * cols;
                out[to..to + cols].copy_from_slice(&values[from..from + cols]);
            }
        }
    }
    out
}

/// The safetensors format: an 8-byte little-endian header length, a JSON header (padded with spaces to 8 bytes)
/// naming each tensor's dtype, shape and byte range, then the bytes.
fn write_safetensors(path: &Path, tensors: &[HfTensor]) -> std::io::Result<()> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut offset = 0usize;
    for t in tensors {
        let len = t.data.len() * 2;
        header
            .insert(t.name.clone(), json!({"dtype": "F16", "shape": t.shape, "data_offsets": [offset, offset + len]}));
        offset += len;
    }
    let mut text = Value::Object(header).to_string();
    text.extend(std::iter::repeat_n(' ', (8 - text.len() % 8) % 8));
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    f.write_all(&(text.len() as u64).to_le_bytes())?;
    f.write_all(text.as_bytes())?;
    for t in tensors {
        f.write_all(bytemuck::cast_slice(&t.data))?;
    }
    f.into_inner().map_err(|e| e.into_error())?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermuting_inverts_llama_cpps_permutation() {
        // llama.cpp's converter: per head, rows (half, i) become (i, half).
        let (heads, head_dim, cols) = (3, 8, 2);
        let hf: Vec<f32> = (0..heads * head_dim * cols).map(|v| v as f32).collect();
        let mut gguf = vec![0f32; hf.len()];
        for h in 0..heads {
            for half in 0..2 {
                for i in 0..head_dim / 2 {
                    let from = (h * head_dim + half * head_dim / 2 + i) * cols;
                    let to = (h * head_dim + 2 * i + half) * cols;
                    gguf[to..to + cols].copy_from_slice(&hf[from..from + cols]);
                }
            }
        }
        assert_ne!(gguf, hf);
        assert_eq!(unpermute_rows(&gguf, heads, head_dim, cols), hf);
    }
}
