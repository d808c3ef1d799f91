//! The engine against the float64 numpy oracle on the committed golden prompts (`tests/data/golden.json`, made
//! by `scripts/reference/golden.py`): first-position logits within [`LOGIT_TOLERANCE`], and identical greedy
//! tokens up to the first step whose oracle margin is too small to call.

mod common;

use std::num::NonZeroU32;
use std::sync::atomic::AtomicBool;

use engine::forward::{LOGIT_TOLERANCE, SeqChunk};
use engine::generate::{Engine, EngineConfig, Request};
use engine::kv::{BlockId, KvLayout, KvStore};
use engine::model::Model;
use engine::sampling::TokenLogprobs;
use engine::team::Team;

#[test]
fn matches_the_oracle() {
    let golden = common::data("golden.json");
    let prompts = golden["prompts"].as_array().expect("prompts");
    assert!(prompts.len() >= 5);
    let model = Model::open(&common::model_path()).expect("model");
    let team = Team::new(2, "test").expect("team");
    let mut engine = Engine::open(&common::model_path(), EngineConfig::default()).expect("engine");
    let mut worst = 0f32;
    let mut compared = 0;
    for p in prompts {
        let name = p["name"].as_str().expect("name");
        let prompt = common::ids(&p["prompt_ids"]);
        // First-position logits.
        let layout = KvLayout::for_model(&model.config, 16);
        let blocks: Vec<BlockId> = (0..layout.blocks_for(prompt.len()) as u32).map(BlockId).collect();
        let mut kv = KvStore::new(layout, blocks.len());
        let step = SeqChunk { tokens: &prompt, start: 0, blocks: &blocks, logits: true, greedy: false, scored: None };
        let logits = model.forward(&team, &mut kv, &[step]).expect("forward").remove(0);
        for pair in p["first_logits"].as_array().expect("logits") {
            let (id, want) = (pair[0].as_u64().expect("id") as usize, pair[1].as_f64().expect("logit") as f32);
            let diff = (logits[id] - want).abs();
            worst = worst.max(diff);
            assert!(diff <= LOGIT_TOLERANCE, "{name}: logit {id} is {}, the oracle's {want}", logits[id]);
        }
        // Greedy tokens, as far as the oracle's margins allow.
        let want = common::ids(&p["generated_ids"]);
        let margins: Vec<f64> =
            p["margins"].as_array().expect("margins").iter().map(|m| m.as_f64().expect("m")).collect();
        let callable = margins.iter().position(|&m| m < 2.0 * f64::from(LOGIT_TOLERANCE)).unwrap_or(want.len());
        let max_tokens = NonZeroU32::new(want.len() as u32).expect("steps");
        let request = Request::greedy(prompt, max_tokens);
        let got = engine.run(&[request], &AtomicBool::new(false), |_| {}).expect("runs").remove(0).token_ids;
        let n = callable.min(got.len());
        assert_eq!(got[..n], want[..n], "{name}: greedy tokens differ within the callable {callable} steps");
        assert!(n == callable || engine.tokenizer().is_end_of_generation(got[n - 1]), "{name}: stopped early");
        compared += n;
    }
    eprintln!("worst first-position logit difference {worst:.4}; {compared} greedy tokens compared");
    assert!(compared >= 60, "the golden prompts exercise enough decoding ({compared} tokens)");
}

/// How far a reported log-probability may be from the oracle's (nats).
const LOGPROB_TOLERANCE: f32 = 0.02;

/// Each greedy step's top-5 log-probabilities (log-softmax over the whole vocabulary) against the oracle's, as far
/// as the greedy tokens agree: every token we name is in the oracle's top 10 with the same log-probability within
/// [`LOGPROB_TOLERANCE`], and no token the oracle ranks clearly above our fifth is missing.
#[test]
fn logprobs_match_the_oracle() {
    let golden = common::data("golden.json");
    let mut engine = Engine::open(&common::model_path(), EngineConfig::default()).expect("engine");
    let (mut worst, mut compared) = (0f32, 0);
    for p in golden["prompts"].as_array().expect("prompts") {
        let name = p["name"].as_str().expect("name");
        let want = common::ids(&p["generated_ids"]);
        let margins: Vec<f64> =
            p["margins"].as_array().expect("margins").iter().map(|m| m.as_f64().expect("m")).collect();
        let callable = margins.iter().position(|&m| m < 2.0 * f64::from(LOGIT_TOLERANCE)).unwrap_or(want.len());
        let raw = engine::sampling::RawSampling {
            max_tokens: want.len() as u32,
            logprobs: Some(5),
            ..engine::sampling::RawSampling::default()
        };
        let sampling = engine::sampling::SamplingParams::new(raw).expect("valid");
        let request = Request::new(common::ids(&p["prompt_ids"]), sampling);
        let got = engine.run(&[request], &AtomicBool::new(false), |_| {}).expect("runs").remove(0);
        assert_eq!(got.logprobs.len(), got.token_ids.len(), "{name}: one entry per token");
        let steps = p["top_logprobs"].as_array().expect("top_logprobs");
        // The oracle's steps follow its own greedy tokens: compare while ours are the same.
        let n = callable.min(got.token_ids.len());
        for (step, (mine, oracle)) in got.logprobs.iter().zip(steps).take(n).enumerate() {
            worst = worst.max(check_step(&format!("{name} step {step}"), mine, got.token_ids[step], oracle));
            compared += 1;
        }
    }
    eprintln!("worst log-probability difference {worst:.4} nats over {compared} steps");
    assert!(compared >= 60, "the golden prompts exercise enough steps ({compared})");
}

/// One position's log-probabilities (`mine`, of token `chosen` with five alternatives) against the oracle's top
/// list there: every token we name is in the oracle's top 10 with the same log-probability within
/// [`LOGPROB_TOLERANCE`], and no token the oracle ranks clearly above our fifth is missing. The largest difference.
fn check_step(at: &str, mine: &TokenLogprobs, chosen: u32, oracle: &serde_json::Value) -> f32 {
    let oracle: Vec<(u32, f32)> = oracle
        .as_array()
        .expect("step")
        .iter()
        .map(|e| (e[0].as_u64().expect("id") as u32, e[1].as_f64().expect("lp") as f32))
        .collect();
    let of = |id: u32| oracle.iter().find(|(i, _)| *i == id).map(|(_, lp)| *lp);
    assert_eq!(mine.top.len(), 5, "{at}");
    let mut worst = 0f32;
    for &(id, lp) in mine.top.iter().chain([&(chosen, mine.logprob)]) {
        let want = of(id).unwrap_or_else(|| panic!("{at}: token {id} is not in the oracle's top"));
        let diff = (lp - want).abs();
        worst = worst.max(diff);
        assert!(diff <= LOGPROB_TOLERANCE, "{at}: token {id} has {lp}, the oracle {want}");
    }
    let fifth = mine.top[4].1;
    for &(id, lp) in &oracle[..5] {
        assert!(
            lp < fifth + 2.0 * LOGPROB_TOLERANCE || mine.top.iter().any(|(i, _)| *i == id),
            "{at}: the oracle's token {id} ({lp}) is missing from ours"
        );
    }
    worst
}

/// The prompt's log-probabilities (vLLM's `prompt_logprobs`, OpenAI's `echo` with `logprobs`) against the oracle:
/// each golden prompt followed by the oracle's own greedy tokens is scored, and the positions of those tokens must
/// match the oracle's log-probabilities there, every step (teacher-forced, so no margin limits the comparison).
#[test]
fn prompt_logprobs_match_the_oracle() {
    let golden = common::data("golden.json");
    // Chunks of 7 tokens: scores cross chunk boundaries (a chunk's last row scores the next chunk's first token).
    let config = EngineConfig { prefill_chunk: std::num::NonZeroUsize::new(7), ..EngineConfig::default() };
    let mut engine = Engine::open(&common::model_path(), config).expect("engine");
    let (mut worst, mut compared) = (0f32, 0);
    for p in golden["prompts"].as_array().expect("prompts") {
        let name = p["name"].as_str().expect("name");
        let mut prompt = common::ids(&p["prompt_ids"]);
        let asked = prompt.len();
        let generated = common::ids(&p["generated_ids"]);
        prompt.extend(&generated);
        let raw = engine::sampling::RawSampling {
            max_tokens: 1,
            prompt_logprobs: Some(5),
            ..engine::sampling::RawSampling::default()
        };
        let sampling = engine::sampling::SamplingParams::new(raw).expect("valid");
        let request = Request::new(prompt.clone(), sampling);
        let got = engine.run(&[request], &AtomicBool::new(false), |_| {}).expect("runs").remove(0);
        assert_eq!(got.prompt_logprobs.len(), prompt.len() - 1, "{name}: one entry per prompt token but the first");
        assert_eq!(got.cached_tokens, 0, "{name}: a scored prompt is computed, not taken from the cache");
        let steps = p["top_logprobs"].as_array().expect("top_logprobs");
        for (j, oracle) in steps.iter().enumerate().take(generated.len()) {
            let mine = &got.prompt_logprobs[asked - 1 + j];
            worst = worst.max(check_step(&format!("{name} prompt position {}", asked + j), mine, generated[j], oracle));
            compared += 1;
        }
    }
    eprintln!("worst prompt log-probability difference {worst:.4} nats over {compared} positions");
    assert!(compared >= 200, "every golden step is compared ({compared})");
}
