//! The engine's promises on the real model: chunking and batching do not change a sequence's result, sampling
//! is reproducible, stop conditions and cancellation behave, and bad requests fail before any compute.

mod common;

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicBool, Ordering};

use engine::forward::SeqChunk;
use engine::generate::{Engine, EngineConfig, EngineError, FinishReason, Request};
use engine::kv::{BlockId, KvLayout, KvStore};
use engine::model::Model;
use engine::sampling::{RawSampling, SamplingParams};
use engine::team::Team;

fn run(engine: &mut Engine, requests: &[Request]) -> Vec<Vec<u32>> {
    let done = engine.run(requests, &AtomicBool::new(false), |_| {}).expect("runs");
    done.into_iter().map(|c| c.token_ids).collect()
}

const PROMPT: &str = "Prefill reads the whole prompt at once; decode then makes one token at a time. Which phase";

#[test]
fn prefill_chunking_is_bit_identical() {
    let model = Model::open(&common::model_path()).expect("model");
    let e = common::engine(EngineConfig::default());
    let prompt = e.tokenizer().encode(PROMPT);
    assert!(prompt.len() > 16, "the prompt spans blocks");
    let layout = KvLayout::for_model(&model.config, 16);
    let blocks: Vec<BlockId> = (0..8).map(BlockId).collect();
    // The whole prompt on three threads, the chunks on one: the threads take a step's parts in any order, and no
    // element depends on which thread computes it.
    let (three, one) = (Team::new(3, "test").expect("team"), Team::serial());
    let logits_with_chunk = |chunk: usize| {
        let team = if chunk == prompt.len() { &three } else { &one };
        let mut kv = KvStore::new(layout, 8);
        let mut last = Vec::new();
        for (i, piece) in prompt.chunks(chunk).enumerate() {
            let step = SeqChunk {
                tokens: piece,
                start: i * chunk,
                blocks: &blocks,
                logits: true,
                greedy: false,
                scored: None,
            };
            last = model.forward(team, &mut kv, &[step]).expect("forward").remove(0);
        }
        last
    };
    let whole = logits_with_chunk(prompt.len());
    for chunk in [1, 7, 16] {
        let got = logits_with_chunk(chunk);
        assert!(got.iter().zip(&whole).all(|(a, b)| a.to_bits() == b.to_bits()), "chunk {chunk}: logits differ");
    }
    // And through the engine's scheduler, end to end.
    let want = run(&mut common::engine(EngineConfig::default()), &[common::greedy(prompt.clone(), 12)]);
    for chunk in [1, 7, 16] {
        let config = EngineConfig { prefill_chunk: NonZeroUsize::new(chunk), ..EngineConfig::default() };
        assert_eq!(run(&mut common::engine(config), &[common::greedy(prompt.clone(), 12)]), want, "chunk {chunk}");
    }
}

/// A chunk without tokens in a step computes nothing for its sequence and leaves the rest of the step as it would be
/// without it.
#[test]
fn a_chunk_without_tokens_leaves_the_step_unchanged() {
    let model = Model::open(&common::model_path()).expect("model");
    let layout = KvLayout::for_model(&model.config, 16);
    let tokens: Vec<u32> = (0..20).map(|i| 300 + 37 * i).collect();
    let (a, b) = ([BlockId(0), BlockId(1)], [BlockId(2)]);
    let step = SeqChunk { tokens: &tokens, start: 0, blocks: &a, logits: true, greedy: false, scored: None };
    let empty = SeqChunk { tokens: &[], start: 0, blocks: &b, logits: false, greedy: false, scored: None };
    let team = Team::new(2, "test").expect("team");
    let alone = model.forward(&team, &mut KvStore::new(layout, 3), &[step]).expect("forward");
    let with_empty = model.forward(&team, &mut KvStore::new(layout, 3), &[empty, step]).expect("forward");
    assert_eq!(alone.len(), 1);
    assert!(alone[0].iter().zip(&with_empty[0]).all(|(x, y)| x.to_bits() == y.to_bits()));
}

#[test]
fn batched_sequences_match_each_alone() {
    let mut e = common::engine(EngineConfig::default());
    let prompts = [
        "The capital of Japan is",
        "def add(a, b):\n    return",
        "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
        "Once upon a time, in a city built on a river of light, there lived a clockmaker who",
    ];
    let requests: Vec<Request> = prompts.iter().map(|p| common::greedy(e.tokenizer().encode(p), 10)).collect();
    let together = run(&mut e, &requests);
    for (r, t) in requests.iter().zip(&together) {
        assert_eq!(&run(&mut e, std::slice::from_ref(r))[0], t);
    }
    // Also with a tight step budget, so prompts are split across steps and mixed with decodes.
    let config = EngineConfig { max_batched_tokens: 9, ..EngineConfig::default() };
    assert_eq!(run(&mut common::engine(config), &requests), together);
}

#[test]
fn seeded_sampling_is_reproducible() {
    let mut e = common::engine(EngineConfig::default());
    let prompt = e.tokenizer().encode("Write a short poem about rivers:");
    let sampled = |seed| {
        let raw = RawSampling {
            temperature: 0.9,
            top_p: 0.95,
            top_k: Some(40),
            seed: Some(seed),
            max_tokens: 16,
            stop: vec![],
            ignore_eos: false,
            detokenize: true,
            ..RawSampling::default()
        };
        Request::new(prompt.clone(), SamplingParams::new(raw).expect("valid"))
    };
    let a = run(&mut e, &[sampled(7)]);
    assert_eq!(run(&mut e, &[sampled(7)]), a);
    let others: Vec<_> = (8..12).map(|s| run(&mut e, &[sampled(s)])).collect();
    assert!(others.iter().any(|o| *o != a), "different seeds give different samples");
}

#[test]
fn stop_strings_and_end_of_generation_end_the_sequence() {
    let mut e = common::engine(EngineConfig::default());
    let prompt =
        e.tokenizer().encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n");
    let done = e.run(&[common::greedy(prompt.clone(), 32)], &AtomicBool::new(false), |_| {}).expect("runs").remove(0);
    assert_eq!(done.token_ids, [504, 3575, 282, 4649, 314, 7042, 30, 2]);
    assert_eq!((done.text.as_str(), done.finish_reason), ("The capital of France is Paris.", FinishReason::Stop));
    let raw = RawSampling { max_tokens: 32, stop: vec!["Paris".into()], ..RawSampling::default() };
    let request = Request::new(prompt.clone(), SamplingParams::new(raw).expect("valid"));
    let mut streamed = String::new();
    let done = e
        .run(&[request], &AtomicBool::new(false), |engine::generate::Event::Token { text, .. }| streamed.push_str(text))
        .expect("runs")
        .remove(0);
    assert_eq!((done.text.as_str(), done.finish_reason), ("The capital of France is ", FinishReason::Stop));
    assert_eq!(streamed, done.text, "streamed text never shows the stop string");
    let done = e.run(&[common::greedy(prompt.clone(), 3)], &AtomicBool::new(false), |_| {}).expect("runs").remove(0);
    assert_eq!((done.token_ids.len(), done.finish_reason), (3, FinishReason::Length));
    // Without text, the same tokens and the same end; no text, streamed or whole.
    let raw = RawSampling { max_tokens: 32, detokenize: false, ..RawSampling::default() };
    let request = Request::new(prompt, SamplingParams::new(raw).expect("valid"));
    let mut streamed = String::new();
    let done = e
        .run(&[request], &AtomicBool::new(false), |engine::generate::Event::Token { text, .. }| streamed.push_str(text))
        .expect("runs")
        .remove(0);
    assert_eq!(done.token_ids, [504, 3575, 282, 4649, 314, 7042, 30, 2]);
    assert_eq!((done.text.as_str(), streamed.as_str(), done.finish_reason), ("", "", FinishReason::Stop));
}

#[test]
fn cancellation_stops_and_frees_every_block() {
    let mut e = common::engine(EngineConfig::default());
    let free = e.free_blocks();
    let prompt = e.tokenizer().encode("Count from one to one hundred: one, two, three,");
    let cancel = AtomicBool::new(false);
    let mut seen = 0;
    let done = e
        .run(&[common::greedy(prompt.clone(), 200), common::greedy(prompt, 200)], &cancel, |_| {
            seen += 1;
            if seen == 6 {
                cancel.store(true, Ordering::Relaxed);
            }
        })
        .expect("runs");
    assert!(done.iter().all(|c| c.finish_reason == FinishReason::Cancelled && c.token_ids.len() == 3));
    assert_eq!(e.free_blocks(), free);
}

#[test]
fn bad_requests_fail_before_compute_and_lose_nothing() {
    let config = EngineConfig { kv_blocks: 4, max_model_len: Some(64), ..EngineConfig::default() };
    let mut e = common::engine(config);
    let free = e.free_blocks();
    let too_long = common::greedy(vec![100; 64], 1);
    let err = e.run(&[too_long], &AtomicBool::new(false), |_| panic!("no token may be made")).expect_err("too long");
    assert!(matches!(err, EngineError::PromptTooLong { prompt: 64, context: 64 }), "{err}");
    assert!(matches!(
        e.run(&[common::greedy(vec![], 1)], &AtomicBool::new(false), |_| {}),
        Err(EngineError::EmptyPrompt)
    ));
    assert_eq!(e.free_blocks(), free);
}

#[test]
fn impossible_configurations_fail_at_start_up_with_every_reason() {
    let config = EngineConfig { kv_blocks: 4, max_num_seqs: 0, disk_blocks: 8, ..EngineConfig::default() };
    let err = Engine::open(&common::model_path(), config).expect_err("refused").to_string();
    for reason in ["cannot hold one sequence", "max_num_seqs", "needs disk_dir"] {
        assert!(err.contains(reason), "{err}");
    }
    let config = EngineConfig { kv_blocks: 0, ..EngineConfig::default() };
    assert!(Engine::open(&common::model_path(), config).is_err());
    let unwritable = EngineConfig {
        disk_blocks: 8,
        disk_dir: Some("/proc/tandem-cannot-write-here".into()),
        ..EngineConfig::default()
    };
    let err = Engine::open(&common::model_path(), unwritable).expect_err("refused").to_string();
    assert!(err.contains("/proc/tandem-cannot-write-here"), "{err}");
}
