//! Synthetic models (`tandem model synth`): the real model's shapes and types, the same bytes for the same seed,
//! and a file the engine loads and runs like any model.

mod common;

use std::sync::atomic::AtomicBool;

use engine::forward::SeqChunk;
use engine::generate::{Engine, EngineConfig};
use engine::gguf::GgufFile;
use engine::kv::{BlockId, KvLayout, KvStore};
use engine::model::Model;
use engine::synth::{self, SynthShape};
use engine::team::Team;

#[test]
fn the_synthetic_model_has_the_real_models_shapes_types_and_config() {
    let path = temp_file("synth.gguf");
    synth::write(&path, &SynthShape::SMOLLM2_135M, 1).expect("written");
    let (real, made) = (common::model_file(), GgufFile::open(&path).expect("opens"));
    // The same tensors (the real file orders layers by name: 0, 1, 10, ...).
    let layout = |f: &GgufFile| {
        let mut l: Vec<_> = f.tensors().iter().map(|t| (t.name.clone(), t.dims.clone(), t.ty)).collect();
        l.sort_by(|a, b| a.0.cmp(&b.0));
        l
    };
    let (made_layout, real_layout) = (layout(&made), layout(&real));
    assert_eq!(made_layout.len(), real_layout.len());
    for (m, r) in made_layout.iter().zip(&real_layout) {
        assert_eq!(m, r);
    }
    assert_eq!(
        made.tensors().iter().map(|t| t.len).sum::<usize>(),
        real.tensors().iter().map(|t| t.len).sum::<usize>()
    );
    let model = Model::load(&made).expect("loads");
    assert_eq!(model.config, Model::load(&real).expect("loads").config);
    // Thirty layers of its weights keep the logits finite and of a few units: kernels compared on it see
    // realistic magnitudes, not overflow or a flat line.
    let layout = KvLayout::for_model(&model.config, 16);
    let mut kv = KvStore::new(layout, 2);
    let tokens: Vec<u32> = (0..20).map(|i| 300 + 37 * i).collect();
    let chunk = SeqChunk {
        tokens: &tokens,
        start: 0,
        blocks: &[BlockId(0), BlockId(1)],
        logits: true,
        greedy: false,
        scored: None,
    };
    let logits = model.forward(&Team::serial(), &mut kv, &[chunk]).expect("forward").remove(0);
    let mean = logits.iter().sum::<f32>() / logits.len() as f32;
    let sd = (logits.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / logits.len() as f32).sqrt();
    assert!(logits.iter().all(|x| x.is_finite()) && (0.3..10.0).contains(&sd), "logit sd {sd}");
    for key in ["tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.pre"] {
        assert_eq!(made.metadata().get(key), real.metadata().get(key), "{key}");
    }
}

#[test]
fn the_same_seed_gives_the_same_bytes_and_another_seed_other_weights() {
    let shape = small();
    let a = synth::model(&shape, 42).expect("built").to_bytes();
    assert_eq!(a, synth::model(&shape, 42).expect("built").to_bytes());
    let b = synth::model(&shape, 43).expect("built").to_bytes();
    assert_eq!(a.len(), b.len());
    assert_ne!(a, b);
    // A pinned digest: the generator and the quantizers must not drift, or a GPU machine's copy would differ
    // from the one its reference logits were computed on.
    assert_eq!(format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&a)), PINNED_SMALL_SEED_42);
}

const PINNED_SMALL_SEED_42: &str = "34e87414a2b7fcc4";

#[test]
fn the_engine_runs_a_synthetic_model_reproducibly() {
    let path = temp_file("small.gguf");
    synth::write(&path, &small(), 7).expect("written");
    let mut engine = Engine::open(&path, EngineConfig::default()).expect("opens");
    let t = engine.tokenizer();
    // Its vocabulary is byte-level BPE with the lowercase pairs merged, and the ChatML specials.
    let ids = t.encode("ab cd<|im_end|>");
    assert_eq!(ids.len(), 4, "{ids:?}");
    assert_eq!(t.decode(&ids), "ab cd<|im_end|>");
    assert!(t.is_end_of_generation(2));
    let prompt = t.encode("the quick brown fox jumps over the lazy dog");
    let run = |e: &mut Engine| {
        let done = e.run(&[common::greedy(prompt.clone(), 8)], &AtomicBool::new(false), |_| {}).expect("runs");
        done[0].token_ids.clone()
    };
    let first = run(&mut engine);
    assert!(!first.is_empty() && first.iter().all(|&id| (id as usize) < small().n_vocab), "{first:?}");
    assert_eq!(run(&mut Engine::open(&path, EngineConfig::default()).expect("opens")), first);
}

#[test]
fn the_hugging_face_export_holds_the_same_weights_in_hugging_faces_order() {
    let shape = small();
    let path = temp_file("export.gguf");
    synth::write(&path, &shape, 3).expect("written");
    let file = GgufFile::open(&path).expect("opens");
    let dir = path.with_extension("hf");
    engine::hf::export(&file, &dir).expect("exported");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).expect("config")).expect("json");
    assert_eq!(config["num_key_value_heads"], 2);
    assert_eq!(config["tie_word_embeddings"], true);
    assert!(dir.join("tokenizer.json").exists());
    // safetensors: header length, JSON header, then the f16 bytes.
    let bytes = std::fs::read(dir.join("model.safetensors")).expect("safetensors");
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    assert_eq!((8 + n) % 8, 0);
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).expect("header");
    let data = &bytes[8 + n..];
    assert_eq!(header.as_object().expect("map").len(), 1 + 1 + 9 * shape.n_layers + 1);
    let row = |name: &str, r: usize| -> Vec<f32> {
        let t = &header[name];
        assert_eq!(t["dtype"], "F16", "{name}");
        let cols = t["shape"][1].as_u64().expect("2-d") as usize;
        let start = t["data_offsets"][0].as_u64().expect("offset") as usize + r * cols * 2;
        data[start..start + cols * 2].chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect()
    };
    let gguf_row = |name: &str, r: usize| -> Vec<f32> {
        let t = file.tensor(name).expect("tensor");
        let cols = t.dims[0] as usize;
        let row_bytes = t.len / t.dims[1] as usize;
        let mut out = vec![0f32; cols];
        engine::kernels::dequantize_row_portable(t.ty, &file.bytes(t)[r * row_bytes..(r + 1) * row_bytes], &mut out);
        out.into_iter().map(|v| half::f16::from_f32(v).to_f32()).collect()
    };
    assert_eq!(header["model.embed_tokens.weight"]["shape"], serde_json::json!([shape.n_vocab, shape.n_embd]));
    assert_eq!(row("model.embed_tokens.weight", 700), gguf_row("token_embd.weight", 700));
    assert_eq!(row("model.layers.1.mlp.down_proj.weight", 5), gguf_row("blk.1.ffn_down.weight", 5));
    // Q and K: within each head, Hugging Face row half * head_dim / 2 + i is GGUF row 2i + half.
    let head_dim = shape.n_embd / shape.n_heads;
    for (h, i, half) in [(0, 0, 0), (0, 0, 1), (1, 3, 1), (3, 7, 0)] {
        let (hf_r, gguf_r) = (h * head_dim + half * head_dim / 2 + i, h * head_dim + 2 * i + half);
        assert_eq!(row("model.layers.0.self_attn.q_proj.weight", hf_r), gguf_row("blk.0.attn_q.weight", gguf_r));
    }
    // K heads alike: Hugging Face row 9 of a 16-row head is its second half's second row, GGUF's row 2 * 1 + 1.
    assert_eq!(row("model.layers.1.self_attn.k_proj.weight", 9), gguf_row("blk.1.attn_k.weight", 3));
}

#[test]
fn the_parity_steps_on_the_cpu_reference_agree_with_themselves_and_tell_steps_apart() {
    let path = temp_file("parity.gguf");
    synth::write(&path, &small(), 5).expect("written");
    let model = || Model::open(&path).expect("loads");
    let cpu = |m: Model| {
        let team = Team::serial();
        engine::backend::cpu::CpuBackend::new(m, team)
    };
    let first = engine::parity::run(&mut cpu(model())).expect("runs");
    let names: Vec<&str> = first.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names.len(), 19, "{names:?}");
    // The CPU engine is bit-identical across chunking, so the chunked prefill's logits are the whole one's.
    let by = |n: &str| &first.iter().find(|l| l.name == n).expect(n).values;
    assert_eq!(by("chunked/600"), by("prefill/600"));
    assert_ne!(by("prefill/600"), by("prefill/129"));
    // Run again: identical, and a file round trip compares as zero error.
    let again = engine::parity::run(&mut cpu(model())).expect("runs");
    let file = temp_file("parity.bin");
    engine::parity::write(&file, &first).expect("written");
    let compared = engine::parity::compare(&engine::parity::read(&file).expect("read"), &again).expect("same steps");
    assert!(compared.iter().all(|c| c.max_abs == 0.0 && c.same_top1), "{compared:?}");
}

/// A fresh path under the temporary directory, unique to this process and test.
fn temp_file(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("tandem-synth-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir.join(name)
}

/// A small model of the same structure, for fast tests.
fn small() -> SynthShape {
    SynthShape { n_layers: 2, n_embd: 64, n_ff: 128, n_heads: 4, n_kv_heads: 2, n_vocab: 1024, context_len: 1024 }
}

/// A backend that counts the steps of each size it is asked for, around the CPU's.
#[derive(Debug)]
struct Counting {
    inner: engine::backend::cpu::CpuBackend,
    /// (rows, chunks) of every step, in order.
    steps: Vec<(usize, usize)>,
}

impl engine::backend::Backend for Counting {
    fn name(&self) -> &'static str {
        "counting"
    }
    fn vocab(&self) -> usize {
        self.inner.vocab()
    }
    fn context_len(&self) -> usize {
        self.inner.context_len()
    }
    fn kv_layout(&self, block_tokens: usize) -> KvLayout {
        self.inner.kv_layout(block_tokens)
    }
    fn threads(&self) -> usize {
        1
    }
    fn forward_into(
        &mut self,
        kv: &mut KvStore,
        batch: &[SeqChunk<'_>],
        context: engine::backend::StepContext,
        next: &mut Vec<engine::backend::Next>,
    ) -> Result<(), engine::forward::ForwardError> {
        self.steps.push((batch.iter().map(|c| c.tokens.len()).sum(), batch.len()));
        self.inner.forward_into(kv, batch, context, next)
    }
}

/// `bench engine` through a backend (the CUDA one's path) runs each timed shape once untimed first: the whole
/// prompt, and one decode step of each batch, so that a GPU backend's one-time work for a shape (its buffers,
/// cuBLAS's choice, a graph recorded) is not in the figures.
#[test]
fn a_backends_bench_runs_each_timed_shape_once_before_timing_it() {
    let path = temp_file("bench.gguf");
    synth::write(&path, &small(), 6).expect("written");
    let inner = engine::backend::cpu::CpuBackend::new(Model::open(&path).expect("loads"), Team::serial());
    let mut counting = Counting { inner, steps: Vec::new() };
    let spec =
        engine::bench::BenchSpec { prompt_tokens: 40, decode_prompt_tokens: 8, decode_tokens: 3, batches: vec![1, 2] };
    let report = engine::bench::run_backend(&mut counting, &spec).expect("runs");
    assert!(report.prefill_tokens_per_s > 0.0 && report.decode.iter().all(|d| d.tokens_per_s > 0.0));
    let mut want = vec![(40, 1), (40, 1), (40, 1)];
    for batch in [1, 2] {
        want.push((8 * batch, batch));
        want.extend(std::iter::repeat_n((batch, batch), 1 + 3));
    }
    assert_eq!(counting.steps, want, "the short warm-up (the whole 40 here), the prompt twice, then per batch");
}
