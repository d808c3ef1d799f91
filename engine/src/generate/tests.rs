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

/// Eight device blocks, no host tier.
fn small() -> EngineConfig {
    EngineConfig { kv_blocks: 8, host_blocks: 0, max_model_len: Some(128), ..EngineConfig::default() }
}

/// Runs `prompt` for `max_tokens` alone, stepped to its end; its blocks kept for export when `keep_blocks`.
fn ran(e: &mut Engine, prompt: &[u32], max_tokens: u32, keep_blocks: bool) -> super::sequence::Seq {
    let mut seqs = vec![e.new_seq(greedy(prompt.to_vec(), max_tokens), 0).expect("valid")];
    seqs[0].keep_blocks = keep_blocks;
    while seqs[0].active() {
        e.step(&mut seqs, &mut |_| {}).expect("steps");
    }
    seqs.remove(0)
}

#[test]
fn a_sequence_the_forward_pass_refuses_fails_alone_and_the_batch_goes_on() {
    let mut e = engine(EngineConfig::default());
    let good = e.new_seq(greedy((100..140).collect(), 5), 0).expect("valid");
    let mut bad = e.new_seq(greedy((200..240).collect(), 5), 1).expect("valid");
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
    let long = e.new_seq(greedy((100..200).collect(), 20), 0).expect("valid");
    let mut holder = e.new_seq(greedy((300..310).collect(), 3), 1).expect("valid");
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
    let blocks: &[(usize, &[u8])] = &[(0, &bytes), (1, &bytes)];
    let seq = e.prepare(request, 0, false, &blocks).expect("queued, not refused");
    assert!(seq.pinned.is_empty(), "nothing held for it");
    assert_eq!((e.counters().import_fallbacks, e.counters().imported_blocks), (1, 0));
    for b in held {
        e.pool.release(b.0).expect("released");
    }
    assert_eq!(e.kv_usage(kv_cache::events::Tier::Device).used, 0, "no block leaked");
}

/// Blocks by position, with their bytes.
type Owned = Vec<(usize, Vec<u8>)>;

/// Pulled blocks whose check fails for one of them, recording every copy it was shown.
struct Checked {
    blocks: Owned,
    bad: usize,
    seen: std::sync::Arc<std::sync::Mutex<Owned>>,
}

impl super::PulledBlocks for Checked {
    fn count(&self) -> usize {
        self.blocks.len()
    }

    fn block(&self, k: usize) -> (usize, usize) {
        (self.blocks[k].0, self.blocks[k].1.len())
    }

    fn copy_into(&self, k: usize, copy: &mut [u8]) -> Result<(), String> {
        copy.copy_from_slice(&self.blocks[k].1);
        self.seen.lock().expect("not poisoned").push((k, copy.to_vec()));
        if k == self.bad { Err("checksum mismatch".into()) } else { Ok(()) }
    }
}

#[test]
fn pulled_blocks_are_checked_in_the_device_block_and_a_failed_check_keeps_none() {
    let mut e = engine(EngineConfig { kv_blocks: 16, max_model_len: Some(128), ..EngineConfig::default() });
    let prompt: Vec<u32> = (100..160).collect();
    let hashes = kv_cache::block_hashes(&prompt, e.block_size(), None).seq;
    let block_bytes = e.block_bytes();
    let block = |fill: u8| vec![fill; block_bytes];
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let pulled = |bad| Checked {
        blocks: vec![(0, block(1)), (1, block(2)), (2, block(3))],
        bad,
        seen: std::sync::Arc::clone(&seen),
    };
    let refused = e.prepare(greedy(prompt.clone(), 3), 0, false, &pulled(1));
    assert!(matches!(refused, Err(super::EngineError::Import(ref why)) if why.contains("block 1")), "{refused:?}");
    assert_eq!(e.lookup(&hashes).device, 0, "no block of the failed import is findable");
    assert_eq!(e.kv_usage(kv_cache::events::Tier::Device).used, 0, "none leaked");
    assert!(e.take_kv_events().expect("events").is_empty(), "nothing announced");
    // Each check saw the block's copy, and none was shown after the failure.
    let shown = std::mem::take(&mut *seen.lock().expect("not poisoned"));
    assert_eq!(shown, vec![(0, block(1)), (1, block(2))]);

    let seq = e.prepare(greedy(prompt, 3), 1, false, &pulled(usize::MAX)).expect("imported");
    assert_eq!(seq.pinned.len(), 3, "the three blocks held for the sequence");
    assert_eq!(e.lookup(&hashes).device, 3);
    for (k, &b) in seq.pinned.iter().enumerate() {
        assert_eq!(bytemuck::cast_slice::<_, u8>(e.stores.device.block(b)), &block(k as u8 + 1)[..]);
    }
}

#[test]
fn an_admitted_pulled_prompt_takes_over_the_blocks_held_for_it() {
    let mut e = engine(EngineConfig { kv_blocks: 16, max_model_len: Some(128), ..EngineConfig::default() });
    let prompt: Vec<u32> = (100..160).collect();
    let bt = e.config.block_tokens;
    let block_bytes = e.block_bytes();
    let pulled = Checked {
        blocks: (0..3).map(|k| (k, vec![k as u8; block_bytes])).collect(),
        bad: usize::MAX,
        seen: std::sync::Arc::default(),
    };
    let seq = e.prepare(greedy(prompt, 3), 0, false, &pulled).expect("imported");
    let held = seq.pinned.clone();
    assert_eq!(held.len(), 3);
    assert_eq!(seq.cached_hint, 3 * bt, "the whole reusable prefix is held, so cached");
    let mut seqs = vec![seq];
    e.admit(&mut seqs);
    let s = &seqs[0];
    assert!(s.running && s.pinned.is_empty());
    assert_eq!(&s.blocks[..], &held[..], "the held blocks became the prefix, in order");
    for b in &held {
        assert_eq!(e.pool.references(b.0), 1, "one reference each: the hold passed to the sequence");
    }
    assert_eq!((s.computed, s.cached_tokens), (3 * bt, 3 * bt));
    assert_eq!(e.counters().cached_tokens[0], (3 * bt) as u64, "counted as device hits");
    e.release_blocks(&mut seqs[0]).expect("released");
    assert_eq!(e.kv_usage(kv_cache::events::Tier::Device).used, 0, "no block leaked");
}

#[test]
fn a_finished_sequence_leaves_the_device_last_block_first_so_its_prefix_stays_findable() {
    let mut e = engine(small());
    let prompt: Vec<u32> = (100..150).collect();
    let mut seq = ran(&mut e, &prompt, 2, false);
    e.release_blocks(&mut seq).expect("released");
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

#[test]
fn an_export_reads_the_engines_own_blocks_and_holds_them_against_eviction_until_dropped() {
    let mut e = engine(small());
    let prompt: Vec<u32> = (100..150).collect();
    let seq = ran(&mut e, &prompt, 1, true);
    let blocks = seq.blocks[..4].to_vec();
    let (kv, end) = e.retire(seq, true, std::time::Instant::now());
    end.expect("finished");
    let kv = kv.expect("exported");
    assert_eq!(kv.len(), 4, "three full blocks and the partial one");
    for (k, &b) in blocks.iter().enumerate() {
        // The very bytes of the engine's store: nothing was copied out.
        let own: &[u8] = bytemuck::cast_slice(e.stores.device.block(b));
        assert_eq!(kv.block(k).as_ptr(), own.as_ptr());
        assert!(e.stores.device.pinned(b));
    }
    let usage = |e: &Engine| e.kv_usage(kv_cache::events::Tier::Device);
    assert_eq!(usage(&e).used, 4, "the export holds the prompt's blocks");
    // Taking every other block cannot evict them: they are not cached, they are in use.
    let hashes = kv_cache::block_hashes(&prompt, e.block_size(), None).seq;
    let mut taken = Vec::new();
    while let Ok(b) = e.pool.allocate(&mut Vec::new()) {
        taken.push(b);
    }
    assert_eq!((taken.len(), e.lookup(&hashes).device), (4, 3));
    for b in taken {
        e.pool.release(b).expect("in use");
    }
    // One slice outliving the export keeps the pin; when it goes too, the engine takes the blocks back.
    let slice = kv.shared_block(0);
    drop(kv);
    e.reclaim_pinned();
    assert_eq!(usage(&e).used, 4);
    drop(slice);
    e.reclaim_pinned();
    assert_eq!((usage(&e).used, usage(&e).cached, e.lookup(&hashes).device), (0, 3, 3));
    assert!(blocks.iter().all(|&b| !e.stores.device.pinned(b)));
}

#[test]
fn the_device_store_lives_in_the_file_asked_for_or_says_why_not() {
    let path = std::env::temp_dir().join(format!("tandem-engine-store-{}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let config = small();
    let e = engine(EngineConfig { device_file: Some(path.clone()), ..config.clone() });
    assert_eq!((e.device_file(), e.device_file_refused()), (Some(path.as_path()), None));
    let bytes = std::fs::metadata(&path).expect("the store's file").len();
    assert_eq!(bytes, 8 * e.block_bytes() as u64);
    drop(e);
    assert!(!path.exists(), "the file goes with the engine");
    let nowhere = std::env::temp_dir().join("tandem-no-such-dir").join("store");
    let e = engine(EngineConfig { device_file: Some(nowhere), ..config });
    assert_eq!(e.device_file(), None);
    assert!(
        e.device_file_refused().is_some_and(|why| why.contains("tandem-no-such-dir")),
        "{:?}",
        e.device_file_refused()
    );
}

#[test]
fn a_prompt_with_ids_outside_the_vocabulary_is_refused_naming_the_first() {
    let e = engine(small());
    let vocab = e.backend.vocab() as u32;
    let prompt = vec![1, vocab + 5, 2, u32::MAX, vocab];
    let Err(refused) = e.new_seq(greedy(prompt, 3), 0) else { panic!("refused before any compute") };
    assert!(
        matches!(refused, super::EngineError::Forward(crate::forward::ForwardError::TokenOutOfRange(t)) if t == vocab + 5)
    );
    assert!(e.new_seq(greedy(vec![0, vocab - 1], 3), 0).is_ok(), "the last id is in the vocabulary");
    assert_eq!(crate::forward::first_out_of_vocab(&[], 10), None);
    assert_eq!(crate::forward::first_out_of_vocab(&[3, 9, 12, 4, 15], 10), Some(12));
}

#[test]
fn the_published_state_counts_the_blocks_prompts_will_still_take() {
    // One sequence at a time, prompts computed 16 tokens a step: B waits while A is in prefill.
    let config = EngineConfig {
        prefill_chunk: std::num::NonZeroUsize::new(16),
        max_num_seqs: 1,
        ..EngineConfig { kv_blocks: 16, ..small() }
    };
    let mut e = engine(config);
    let mut seqs = vec![
        e.new_seq(greedy((100..140).collect(), 2), 0).expect("valid"),
        e.new_seq(greedy((200..220).collect(), 2), 1).expect("valid"),
    ];
    let state = |e: &Engine, seqs: &[super::sequence::Seq]| {
        let s = e.stats_of(seqs);
        (s.usage[0].used, s.blocks_to_come)
    };
    // Nothing held yet: A's 40 tokens take 3 blocks, B's 20 take 2.
    assert_eq!(state(&e, &seqs), (0, 5));
    e.step(&mut seqs, &mut |_| {}).expect("steps");
    assert_eq!(state(&e, &seqs), (1, 4), "A's first chunk holds a block, two more to come");
    e.step(&mut seqs, &mut |_| {}).expect("steps");
    e.step(&mut seqs, &mut |_| {}).expect("steps");
    assert_eq!(seqs[0].remaining(), 1, "A decodes");
    assert_eq!(state(&e, &seqs), (3, 2), "A holds its prompt; its growth while decoding is not counted ahead");
    while seqs.iter().any(|s| s.active()) {
        e.step(&mut seqs, &mut |_| {}).expect("steps");
    }
    assert_eq!(state(&e, &seqs), (0, 0));
}

/// The CPU backend, answering chunks that ask only for their top token with that token, as a GPU backend does.
#[derive(Debug)]
struct TopOnly {
    cpu: crate::backend::cpu::CpuBackend,
    /// Chunks answered with their top token, and with their logits.
    answered: std::sync::Arc<std::sync::Mutex<[usize; 2]>>,
}

impl crate::backend::Backend for TopOnly {
    fn name(&self) -> &'static str {
        "top-only"
    }

    fn vocab(&self) -> usize {
        self.cpu.vocab()
    }

    fn context_len(&self) -> usize {
        self.cpu.context_len()
    }

    fn kv_layout(&self, block_tokens: usize) -> crate::kv::KvLayout {
        self.cpu.kv_layout(block_tokens)
    }

    fn threads(&self) -> usize {
        self.cpu.threads()
    }

    fn forward_into(
        &mut self,
        kv: &mut crate::kv::KvStore,
        batch: &[crate::forward::SeqChunk<'_>],
        context: crate::backend::StepContext,
        next: &mut Vec<crate::backend::Next>,
    ) -> Result<(), crate::forward::ForwardError> {
        use crate::backend::Next;
        let mut answers = Vec::new();
        self.cpu.forward_into(kv, batch, context, &mut answers)?;
        let asked = batch.iter().filter(|c| c.logits && !c.tokens.is_empty());
        let mut answered = self.answered.lock().expect("not poisoned");
        for (chunk, answer) in asked.zip(answers) {
            match answer {
                Next::Logits(l) if chunk.greedy => {
                    answered[0] += 1;
                    next.push(Next::Token(crate::sampling::argmax(&l)));
                }
                other => {
                    answered[1] += 1;
                    next.push(other);
                }
            }
        }
        Ok(())
    }
}

#[test]
fn greedy_sequences_take_a_backends_top_token_and_the_others_still_get_their_logits() {
    use crate::sampling::{LogitsRules, RawSampling, SamplingParams};
    let sampling = |raw: RawSampling| SamplingParams::new(RawSampling { max_tokens: 6, ..raw }).expect("valid");
    let prompt = |k: u32| (100 + 40 * k..130 + 40 * k).collect::<Vec<u32>>();
    let request =
        |k: u32, raw: RawSampling| Request { prompt: prompt(k), sampling: sampling(raw), ..greedy(vec![], 1) };
    let greedy_by_k = RawSampling { temperature: 1.0, top_k: Some(1), seed: Some(3), ..RawSampling::default() };
    let penalized = LogitsRules { repetition_penalty: 1.3, ..LogitsRules::default() };
    let requests = [
        // Greedy: the top token is all they take.
        request(0, RawSampling::default()),
        request(1, greedy_by_k),
        // Greedy but reporting log-probabilities, greedy over penalized logits, greedy under a grammar, sampled.
        request(2, RawSampling { logprobs: Some(2), ..RawSampling::default() }),
        request(3, RawSampling { logits: penalized, ..RawSampling::default() }),
        request(
            4,
            RawSampling { grammar: Some(crate::grammar::Grammar::Regex("[a-z ]+".into())), ..Default::default() },
        ),
        request(5, RawSampling { temperature: 0.9, seed: Some(11), ..RawSampling::default() }),
    ];
    let cancel = std::sync::atomic::AtomicBool::new(false);
    let want = engine(EngineConfig::default()).run(&requests, &cancel, |_| {}).expect("runs");

    let path = crate::fetch::ensure_default_model(&crate::fetch::Quiet).expect("the embedded model");
    let file = crate::gguf::GgufFile::open(&path).expect("opens");
    let text = std::sync::Arc::new(crate::text::TextModel::from_gguf(&file).expect("a text model"));
    let team = crate::team::Team::new(1, "test").expect("a team");
    let cpu = crate::backend::cpu::CpuBackend::new(crate::model::Model::load(&file).expect("loads"), team);
    let config = EngineConfig { threads: std::num::NonZeroUsize::new(1), ..EngineConfig::default() };
    let answered = std::sync::Arc::default();
    let backend = Box::new(TopOnly { cpu, answered: std::sync::Arc::clone(&answered) });
    let mut e = Engine::with_backend(backend, text, config).expect("opens");
    let got = e.run(&requests, &cancel, |_| {}).expect("runs");
    for (k, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!((&g.token_ids, &g.text, g.finish_reason), (&w.token_ids, &w.text, w.finish_reason), "request {k}");
        assert_eq!(g.logprobs, w.logprobs, "request {k}");
    }
    assert_eq!(got[2].logprobs.len(), got[2].token_ids.len(), "log-probabilities came with every token");
    // One answer per generated token: the first two requests' as tokens, every other request's as logits.
    let generated = |ks: &[usize]| ks.iter().map(|&k| got[k].token_ids.len()).sum::<usize>();
    assert_eq!(*answered.lock().expect("not poisoned"), [generated(&[0, 1]), generated(&[2, 3, 4, 5])]);
}
