//! The scheduler over the tiered block pool, on the real model: prefix reuse computes only what is new and
//! changes no token; concurrency and preemption change no token; host and disk hits onboard exactly; a corrupt
//! disk block is caught and recomputed; cancellation returns every block.

mod common;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

use engine::generate::{Engine, EngineConfig, FinishReason, Request};
use kv_cache::events::{KvEvent, Tier};

fn run(e: &mut Engine, requests: &[Request]) -> Vec<Vec<u32>> {
    e.run(requests, &AtomicBool::new(false), |_| {}).expect("runs").into_iter().map(|c| c.token_ids).collect()
}

/// Tokens of the model's own text, so prompts look like language.
fn text_tokens(e: &Engine, seed: usize, len: usize) -> Vec<u32> {
    let words =
        ["river", "cache", "block", "token", "route", "worker", "light", "stone", "prefill", "decode", "the", "of"];
    let text: Vec<&str> = (0..len * 2).map(|i| words[(i * 7 + seed * 5 + i / 3) % words.len()]).collect();
    let mut ids = e.tokenizer().encode(&text.join(" "));
    ids.truncate(len);
    assert_eq!(ids.len(), len);
    ids
}

/// What a fresh engine with plenty of room generates for each request alone.
fn cold(requests: &[Request]) -> Vec<Vec<u32>> {
    requests
        .iter()
        .map(|r| run(&mut common::engine(EngineConfig::default()), std::slice::from_ref(r))[0].clone())
        .collect()
}

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tandem-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn a_shared_prefix_is_computed_once_and_changes_no_token() {
    let mut e = common::engine(EngineConfig::default());
    let prefix = text_tokens(&e, 1, 200);
    let with = |suffix: &[u32]| common::greedy([prefix.as_slice(), suffix].concat(), 6);
    let first = with(&text_tokens(&e, 2, 30));
    let second = with(&text_tokens(&e, 3, 25));
    run(&mut e, std::slice::from_ref(&first));
    let before = e.counters();
    let got = run(&mut e, std::slice::from_ref(&second));
    let after = e.counters();
    let reused = 200 / 16 * 16;
    assert_eq!(after.cached_tokens[0] - before.cached_tokens[0], reused as u64, "the shared whole blocks are reused");
    // Only the suffix after the shared blocks, then one token per decode step (the last sampled one is not run).
    let computed = (second.prompt.len() - reused) + (got[0].len() - 1);
    assert_eq!(after.prefill_tokens - before.prefill_tokens, computed as u64);
    assert_eq!(got, cold(std::slice::from_ref(&second)), "cached and cold runs give the same tokens");
}

fn sixteen(e: &Engine) -> Vec<Request> {
    (0..16).map(|i| common::greedy(text_tokens(e, 10 + i, 20 + i % 7), 12)).collect()
}

#[test]
fn sixteen_concurrent_requests_match_each_alone() {
    let mut e = common::engine(EngineConfig::default());
    let requests = sixteen(&e);
    let together = run(&mut e, &requests);
    assert_eq!(together, cold(&requests));
}

#[test]
fn preemption_under_a_small_device_tier_changes_no_token() {
    let config = EngineConfig { kv_blocks: 8, max_model_len: Some(64), ..EngineConfig::default() };
    let mut e = common::engine(config);
    let requests = sixteen(&e);
    let got = run(&mut e, &requests);
    assert!(e.counters().preemptions > 0, "the device tier is too small for all sixteen at once");
    assert_eq!(e.kv_usage(Tier::Device).used, 0, "every block was released");
    assert_eq!(got, cold(&requests));
}

/// A device tier that fits one 96-token sequence, so each new prompt pushes the previous one down the tiers.
fn tiered(host: usize, disk: usize, dir: &std::path::Path) -> Engine {
    common::engine(EngineConfig {
        kv_blocks: 6,
        host_blocks: host,
        disk_blocks: disk,
        disk_dir: Some(dir.to_path_buf()),
        max_model_len: Some(96),
        ..EngineConfig::default()
    })
}

#[test]
fn prefixes_offloaded_to_host_and_disk_onboard_exactly() {
    let dir = temp_dir("tiers");
    let mut e = tiered(4, 16, &dir);
    let p = common::greedy(text_tokens(&e, 40, 64), 4);
    let fillers: Vec<Request> = (0..2).map(|i| common::greedy(text_tokens(&e, 50 + i, 64), 4)).collect();
    let want = cold(std::slice::from_ref(&p));
    assert_eq!(run(&mut e, std::slice::from_ref(&p)), want);
    // One filler pushes the prompt's blocks to the host tier.
    run(&mut e, &fillers[..1]);
    let before = e.counters();
    assert_eq!(run(&mut e, std::slice::from_ref(&p)), want);
    let c = e.counters();
    // Chains leave the device last block first: the filler's five blocks took three of the prompt's four, so its
    // first block is still on the device and the next two come back from the host.
    let reused = |c: &engine::generate::Counters, t: usize| c.cached_tokens[t] - before.cached_tokens[t];
    assert_eq!((reused(&c, 0), reused(&c, 1)), (16, 32), "three whole blocks reused, two onboarded from host");
    assert!(c.onboards[1] > before.onboards[1] && c.offloads[1] > 0);
    // Two more fillers push them on to disk.
    run(&mut e, &fillers);
    let before = e.counters();
    assert_eq!(run(&mut e, std::slice::from_ref(&p)), want);
    let c = e.counters();
    let reused = |c: &engine::generate::Counters, t: usize| c.cached_tokens[t] - before.cached_tokens[t];
    // Now the first block is the one on the host, and the two after it went on to disk.
    assert_eq!((reused(&c, 0), reused(&c, 1), reused(&c, 2)), (0, 16, 32), "one block from host, two from disk");
    assert!(c.offloads[2] > 0 && c.onboards[2] > before.onboards[2]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_corrupt_disk_block_is_dropped_and_recomputed() {
    let dir = temp_dir("corrupt");
    let mut e = tiered(4, 16, &dir);
    let p = common::greedy(text_tokens(&e, 40, 64), 4);
    let fillers: Vec<Request> = (0..3).map(|i| common::greedy(text_tokens(&e, 60 + i, 64), 4)).collect();
    let want = cold(std::slice::from_ref(&p));
    run(&mut e, std::slice::from_ref(&p));
    run(&mut e, &fillers);
    let disk_blocks = e.kv_usage(Tier::Disk).cached;
    assert!(disk_blocks > 0, "the prompt's blocks reached the disk tier");
    // Damage every block file: flip a byte in the payload of half of them, truncate the others.
    let files = std::fs::read_dir(&dir).expect("dir").map(|e| e.expect("entry").path());
    // (The directory's lock file is not a block.)
    for (i, path) in files.filter(|p| p.extension().is_some_and(|x| x == "kvblock")).enumerate() {
        let mut bytes = std::fs::read(&path).expect("read");
        if i % 2 == 0 {
            let mid = bytes.len() / 2;
            bytes[mid] ^= 0xFF;
        } else {
            bytes.truncate(bytes.len() / 3);
        }
        std::fs::write(&path, bytes).expect("write");
    }
    let last = e.kv_snapshot().as_of;
    let before = e.counters();
    assert_eq!(run(&mut e, std::slice::from_ref(&p)), want, "recomputed, not read from the damaged file");
    let c = e.counters();
    assert_eq!(c.corrupt_disk_blocks - before.corrupt_disk_blocks, 1);
    assert_eq!(c.cached_tokens[2], before.cached_tokens[2], "nothing was taken from disk");
    let removed_from_disk = e
        .kv_events_after(last)
        .expect("kept")
        .iter()
        .any(|(_, ev)| matches!(ev, KvEvent::Removed { tier: Tier::Disk, .. }));
    assert!(removed_from_disk, "the bad block left the disk tier with an event");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn cancelling_returns_every_block() {
    let mut e = common::engine(EngineConfig::default());
    let free = e.free_blocks();
    let requests: Vec<Request> = (0..3).map(|i| common::greedy(text_tokens(&e, 70 + i, 40), 500)).collect();
    let cancel = AtomicBool::new(false);
    let mut tokens = 0;
    let done = e
        .run(&requests, &cancel, |_| {
            tokens += 1;
            if tokens == 9 {
                cancel.store(true, Ordering::Relaxed);
            }
        })
        .expect("runs");
    assert!(done.iter().all(|c| c.finish_reason == FinishReason::Cancelled));
    assert_eq!(e.kv_usage(Tier::Device).used, 0);
    assert_eq!(e.free_blocks(), free);
}

/// A request for the prompt's log-probabilities (and `alternatives`), greedy, `max_tokens` tokens.
fn scored(prompt: Vec<u32>, max_tokens: u32, alternatives: u32) -> Request {
    let raw = engine::sampling::RawSampling {
        max_tokens,
        prompt_logprobs: Some(alternatives),
        ..engine::sampling::RawSampling::default()
    };
    let sampling = engine::sampling::SamplingParams::new(raw).expect("valid");
    Request { prompt, sampling, namespace: None, deadline: None, priority: 0 }
}

fn prompt_logprobs(e: &mut Engine, requests: &[Request]) -> Vec<Vec<engine::sampling::TokenLogprobs>> {
    let done = e.run(requests, &AtomicBool::new(false), |_| {}).expect("runs");
    done.into_iter().map(|c| c.prompt_logprobs).collect()
}

#[test]
fn a_prompts_log_probabilities_are_its_generated_tokens_own_when_fed_back() {
    let mut e = common::engine(EngineConfig::default());
    let prompt = text_tokens(&e, 3, 40);
    let raw = engine::sampling::RawSampling { max_tokens: 10, logprobs: Some(3), ..Default::default() };
    let sampling = engine::sampling::SamplingParams::new(raw).expect("valid");
    let request = Request::new(prompt.clone(), sampling);
    let generated = e.run(&[request], &AtomicBool::new(false), |_| {}).expect("runs").remove(0);
    assert_eq!(generated.prompt_logprobs, [], "not asked for, not computed");
    let mut fed_back = prompt.clone();
    fed_back.extend(&generated.token_ids);
    let scores = prompt_logprobs(&mut e, &[scored(fed_back.clone(), 1, 3)]).remove(0);
    assert_eq!(scores.len(), fed_back.len() - 1);
    // The reference precision computes a row the same whatever shares its step: the prompt's rows scored in one
    // chunk say exactly what the decode steps said of the same tokens.
    assert_eq!(scores[prompt.len() - 1..], generated.logprobs[..]);
}

#[test]
fn a_scored_prompt_is_computed_whole_whatever_is_cached_and_however_it_is_chunked_or_preempted() {
    let mut e = common::engine(EngineConfig::default());
    let prompts: Vec<Vec<u32>> = (0..6).map(|i| text_tokens(&e, 60 + i, 30 + 3 * i)).collect();
    let alone: Vec<_> = prompts.iter().map(|p| prompt_logprobs(&mut e, &[scored(p.clone(), 1, 2)]).remove(0)).collect();
    // Cached now: scored again, the prompts are computed again (a cached token has no logits), the same; unscored,
    // they are taken from the cache as before.
    let again = e.run(&[scored(prompts[0].clone(), 1, 2)], &AtomicBool::new(false), |_| {}).expect("runs");
    assert_eq!((again[0].cached_tokens, &again[0].prompt_logprobs), (0, &alone[0]));
    let plain = e.run(&[common::greedy(prompts[0].clone(), 1)], &AtomicBool::new(false), |_| {}).expect("runs");
    assert!(plain[0].cached_tokens > 0, "the cache still serves unscored requests");
    // Chunks of 5 tokens, and a device tier of 8 blocks for six prompts generating 20 tokens each: preempted and
    // recomputed, every row is reported once and the same.
    let config = EngineConfig {
        kv_blocks: 8,
        max_model_len: Some(128),
        prefill_chunk: std::num::NonZeroUsize::new(5),
        ..EngineConfig::default()
    };
    let mut small = common::engine(config);
    let requests: Vec<Request> = prompts.iter().map(|p| scored(p.clone(), 20, 2)).collect();
    let together = prompt_logprobs(&mut small, &requests);
    assert!(small.counters().preemptions > 0, "the device tier is too small for all six at once");
    assert_eq!(together, alone);
    assert_eq!(small.kv_usage(Tier::Device).used, 0, "every block was released");
}
