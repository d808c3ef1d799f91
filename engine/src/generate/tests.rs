//! The scheduler's own failure handling, driven step by step on sequences in states no request can reach from
//! outside (as a corrupt import or a bug elsewhere would leave them).

use std::num::NonZeroU32;

use super::{Engine, EngineConfig, FinishReason, Request};
use crate::kv::BlockId;

fn engine(config: EngineConfig) -> Engine {
    let model = crate::fetch::ensure_default_model(&crate::fetch::Quiet).expect("the embedded model");
    Engine::open(&model, EngineConfig { threads: std::num::NonZeroUsize::new(1), ..config }).expect("opens")
}

fn greedy(prompt: Vec<u32>, max_tokens: u32) -> Request {
    Request::greedy(prompt, NonZeroU32::new(max_tokens).expect("positive"))
}

#[test]
fn a_sequence_the_forward_pass_refuses_fails_alone_and_the_batch_goes_on() {
    let mut e = engine(EngineConfig::default());
    let good = e.new_seq(&greedy((100..140).collect(), 5), 0).expect("valid");
    let mut bad = e.new_seq(&greedy((200..240).collect(), 5), 1).expect("valid");
    // A token id outside the vocabulary, as a damaged import would leave behind.
    bad.tokens[7] = u32::MAX;
    let mut seqs = vec![good, bad];
    let mut steps = 0;
    while seqs.iter().any(|s| s.active()) {
        assert!(e.step(&mut seqs, &mut |_| {}).expect("the step itself does not fail"));
        steps += 1;
        assert!(steps < 50, "the good sequence finishes");
    }
    assert_eq!(seqs[0].failure, None);
    assert_eq!((seqs[0].finish, seqs[0].tokens.len() - seqs[0].prompt_len), (Some(FinishReason::Length), 5));
    let why = seqs[1].failure.as_ref().expect("the bad sequence failed").to_string();
    assert!(why.contains("outside the vocabulary"), "{why}");
    assert!(seqs[1].blocks.is_empty(), "its blocks went back at once");
    for s in &mut seqs {
        e.release_blocks(s).expect("released");
    }
    assert_eq!(e.kv_usage(kv_cache::events::Tier::Device).used, 0, "no block leaked");
}

#[test]
fn a_sequence_that_cannot_get_a_block_even_alone_fails_alone() {
    // 8 blocks (one whole 128-token sequence, as the configuration check demands), one sequence at a time.
    let config = EngineConfig { kv_blocks: 8, max_model_len: Some(128), max_num_seqs: 1, ..EngineConfig::default() };
    let mut e = engine(config);
    let long = e.new_seq(&greedy((100..200).collect(), 20), 0).expect("valid");
    let mut holder = e.new_seq(&greedy((300..310).collect(), 3), 1).expect("valid");
    // The second sequence waits behind the first while holding 7 of the 8 blocks (as blocks handed in with a
    // request are held until it runs): the first cannot get its blocks even with nothing else running.
    for _ in 0..7 {
        holder.pinned.push(BlockId(e.pool.allocate(&mut Vec::new()).expect("a block")));
    }
    let mut seqs = vec![long, holder];
    let mut steps = 0;
    while seqs.iter().any(|s| s.active()) {
        e.step(&mut seqs, &mut |_| {}).expect("the step itself does not fail");
        steps += 1;
        assert!(steps < 20, "both sequences end");
    }
    let why = seqs[0].failure.as_ref().expect("the first sequence failed alone").to_string();
    assert!(why.contains("out of KV capacity"), "{why}");
    // The second ran once the first was gone, its hold released at admission.
    assert_eq!((seqs[1].failure.as_ref(), seqs[1].finish), (None, Some(FinishReason::Length)));
    for s in &mut seqs {
        e.release_blocks(s).expect("released");
    }
    assert_eq!(e.kv_usage(kv_cache::events::Tier::Device).used, 0, "no block leaked");
}

#[test]
fn an_import_that_finds_no_free_device_block_queues_the_request_to_compute_instead() {
    let config = EngineConfig { kv_blocks: 8, max_model_len: Some(128), ..EngineConfig::default() };
    let mut e = engine(config);
    // Running sequences hold every device block.
    let held: Vec<BlockId> = (0..8).map(|_| BlockId(e.pool.allocate(&mut Vec::new()).expect("a block"))).collect();
    let bytes = vec![0u8; e.block_bytes()];
    let request = greedy((100..140).collect(), 3);
    let seq = e.prepare(&request, 0, false, &[(0, &bytes), (1, &bytes)]).expect("queued, not refused");
    assert!(seq.pinned.is_empty(), "nothing held for it");
    assert_eq!((e.counters().import_fallbacks, e.counters().imported_blocks), (1, 0));
    for b in held {
        e.pool.release(b.0).expect("released");
    }
    assert_eq!(e.kv_usage(kv_cache::events::Tier::Device).used, 0, "no block leaked");
}

#[test]
fn a_finished_sequence_leaves_the_device_last_block_first_so_its_prefix_stays_findable() {
    let config = EngineConfig { kv_blocks: 8, host_blocks: 0, max_model_len: Some(128), ..EngineConfig::default() };
    let mut e = engine(config);
    let prompt: Vec<u32> = (100..150).collect();
    let mut seqs = vec![e.new_seq(&greedy(prompt.clone(), 2), 0).expect("valid")];
    while seqs[0].active() {
        e.step(&mut seqs, &mut |_| {}).expect("steps");
    }
    e.release_blocks(&mut seqs[0]).expect("released");
    let hashes = kv_cache::block_hashes(&prompt, e.block_size(), None).seq;
    assert_eq!(e.lookup(&hashes).device, 3, "the prompt's three full blocks are cached");
    // Taking every free block, then one more, evicts one cached block: the chain's last, not its first (which
    // would leave the other two unreachable by any prefix).
    let free = e.kv_usage(kv_cache::events::Tier::Device).free;
    for _ in 0..=free {
        e.pool.allocate(&mut Vec::new()).expect("a block");
    }
    assert_eq!(e.lookup(&hashes).device, 2);
}
