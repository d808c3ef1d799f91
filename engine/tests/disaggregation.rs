//! Prefill on one engine, decode on another: engine A computes a prompt and exports its KV; engine B takes the
//! full blocks it lacks with the request and continues. The tokens equal a single engine's, bit for bit, and B computes only what
//! it was not given.

mod common;

use std::sync::atomic::AtomicBool;

use engine::generate::{EngineConfig, EngineHandle, ExportedKv, SeqEvent};
use kv_cache::{BlockSize, block_hashes};

async fn prefill(p: &EngineHandle, prompt: &[u32]) -> (u32, ExportedKv) {
    let mut s = p.submit_exporting(common::greedy(prompt.to_vec(), 1), None).await.expect("accepted");
    let (mut first, mut kv) = (None, None);
    while let Some(ev) = s.next().await {
        match ev {
            SeqEvent::Token { token, .. } => first = Some(token),
            SeqEvent::Exported(e) => kv = Some(e),
            SeqEvent::Finished(_) => break,
            other @ (SeqEvent::Failed(_) | SeqEvent::Refused(_) | SeqEvent::Expired) => {
                panic!("prefill failed: {other:?}")
            }
        }
    }
    (first.expect("a first token"), kv.expect("the prompt's KV"))
}

async fn decode(d: &EngineHandle, tokens: Vec<u32>, max_tokens: u32, blocks: Vec<(usize, bytes::Bytes)>) -> Vec<u32> {
    let mut s = d.submit_with_blocks(common::greedy(tokens, max_tokens), blocks, None).await.expect("accepted");
    let mut out = Vec::new();
    while let Some(ev) = s.next().await {
        match ev {
            SeqEvent::Token { token, .. } => out.push(token),
            SeqEvent::Finished(_) => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    out
}

/// A 70-token prompt (four full blocks and a partial one) made of `text`, and the `max_tokens` a single engine
/// answers it with: what the disaggregated runs must reproduce.
fn single_engine(text: &str, max_tokens: u32) -> (Vec<u32>, Vec<u32>) {
    let mut single = common::engine(EngineConfig::default());
    let mut prompt = single.tokenizer().encode(&[text; 4].join(" "));
    prompt.truncate(70);
    assert_eq!(prompt.len(), 70, "four full blocks and a partial one");
    let want = single
        .run(&[common::greedy(prompt.clone(), max_tokens)], &AtomicBool::new(false), |_| {})
        .expect("runs")
        .remove(0)
        .token_ids;
    (prompt, want)
}

#[tokio::test(flavor = "current_thread")]
async fn prefill_here_decode_there_gives_the_same_tokens() {
    let text = "Disaggregated serving runs the prompt on one machine and the answer on another. In one sentence, why";
    let (prompt, want) = single_engine(text, 12);

    let p = EngineHandle::start(common::engine(EngineConfig::default())).expect("prefill engine");
    let d = EngineHandle::start(common::engine(EngineConfig::default())).expect("decode engine");
    let (first, kv) = prefill(&p, &prompt).await;
    assert_eq!(first, want[0], "the prefill worker's first token");
    assert_eq!((kv.tokens, kv.len()), (70, 5));
    assert!(kv.metas[..4].iter().all(Option::is_some) && kv.metas[4].is_none());

    // The decode side holds nothing of this prompt yet, so it takes every full block.
    let hashes = block_hashes(&prompt, BlockSize::DEFAULT, None).seq;
    assert_eq!(d.lookup(hashes.clone()).await.expect("lookup").device, 0);
    let full: Vec<(usize, bytes::Bytes)> = (0..kv.len())
        .filter(|&i| kv.metas[i].is_some())
        .map(|i| (i, bytes::Bytes::copy_from_slice(kv.block(i))))
        .collect();
    let before = d.stats().counters;
    let rest = decode(&d, [prompt.clone(), vec![first]].concat(), 11, full.clone()).await;
    let after = d.stats().counters;
    assert_eq!(after.imported_blocks - before.imported_blocks, 4);
    assert_eq!(d.lookup(hashes).await.expect("lookup").device, 4);
    assert_eq!([vec![first], rest].concat(), want, "disaggregated tokens equal the single engine's");
    assert_eq!(after.cached_tokens[0] - before.cached_tokens[0], 64, "the imported blocks were used");
    // It computed the partial block's tokens plus the first token, then one per decode step.
    assert_eq!(after.prefill_tokens - before.prefill_tokens, (71 - 64) + 10);

    // Handing in what it already holds stores nothing; a block of the wrong size is refused.
    decode(&d, [prompt.clone(), vec![first]].concat(), 2, full).await;
    assert_eq!(d.stats().counters.imported_blocks, after.imported_blocks);
    let short = vec![(0, bytes::Bytes::from_static(b"short"))];
    assert!(d.submit_with_blocks(common::greedy(prompt.clone(), 2), short, None).await.is_err());
    p.shutdown(true).await;
    d.shutdown(true).await;
}

#[tokio::test(flavor = "current_thread")]
async fn an_export_holds_its_blocks_in_the_prefill_engine_until_its_last_reader_drops_it() {
    let p = EngineHandle::start(common::engine(EngineConfig::default())).expect("prefill engine");
    let prompt: Vec<u32> = (300..370).collect();
    let (_, kv) = prefill(&p, &prompt).await;
    let used = |p: &EngineHandle| p.stats().usage[0].used;
    assert_eq!(used(&p), 5, "the sequence ended, its five blocks stay pinned for readers");
    // Read from another thread while the engine computes another prompt.
    let slice = kv.shared_block(4);
    let reader = std::thread::spawn({
        let kv = kv.clone();
        move || (0..kv.len()).map(|i| kv.block(i).to_vec()).collect::<Vec<_>>()
    });
    let (_, again) = prefill(&p, &prompt[..40]).await;
    let read = reader.join().expect("read");
    assert!((0..kv.len()).all(|i| read[i] == kv.block(i)));
    assert_eq!(again.block(0), kv.block(0), "the shared prefix block, found cached");
    drop((kv, again));
    // The slice keeps its export's blocks pinned after every export is gone (the second prompt's own partial
    // block goes back); dropping it wakes the idle engine to take them back.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while used(&p) != 5 && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert_eq!(used(&p), 5);
    drop(slice);
    while used(&p) != 0 && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert_eq!(used(&p), 0, "every block back: none leaked");
    p.shutdown(false).await;
}

/// The full blocks of an export, by position, as a puller hands them over.
fn full_blocks(kv: &ExportedKv, from: usize) -> Vec<(usize, bytes::Bytes)> {
    (from..kv.len())
        .filter(|&i| kv.metas[i].is_some())
        .map(|i| (i, bytes::Bytes::copy_from_slice(kv.block(i))))
        .collect()
}

/// Streaming a prompt's KV: its leading piece is prefilled and imported into the decode engine's cache ahead of
/// the request, the whole prompt then prefilled (computing only what follows the piece); the decode engine takes
/// only the blocks it lacks and answers as a single engine does.
#[tokio::test(flavor = "current_thread")]
async fn a_leading_piece_imported_ahead_is_cached_and_the_answer_is_unchanged() {
    let text = "Streaming the cache while the prompt is still being computed hides the transfer. Say why in a word";
    let (prompt, want) = single_engine(text, 8);
    let p = EngineHandle::start(common::engine(EngineConfig::default())).expect("prefill engine");
    let d = EngineHandle::start(common::engine(EngineConfig::default())).expect("decode engine");
    let hashes = block_hashes(&prompt, BlockSize::DEFAULT, None).seq;

    // The piece: the first two blocks.
    let (_, piece) = prefill(&p, &prompt[..32]).await;
    assert_eq!((piece.tokens, piece.len()), (32, 2));
    // A block past the piece's full blocks, or of the wrong size, is refused and nothing is kept.
    let beyond = vec![(2, bytes::Bytes::copy_from_slice(piece.block(0)))];
    assert!(d.import(None, prompt[..32].to_vec(), beyond).await.is_err());
    let short = vec![(0, bytes::Bytes::from_static(b"short"))];
    assert!(d.import(None, prompt[..32].to_vec(), short).await.is_err());
    assert_eq!(d.lookup(hashes.clone()).await.expect("lookup").device, 0);
    let stored = d.import(None, prompt[..32].to_vec(), full_blocks(&piece, 0)).await.expect("imported");
    assert_eq!(stored, 2);
    assert_eq!(d.lookup(hashes.clone()).await.expect("lookup").device, 2, "cached ahead of any request");
    let usage = d.stats().usage[0];
    assert_eq!((usage.used, usage.cached), (0, 2), "cached, held by nothing: evictable as any cached block");
    // Again: already held, nothing stored.
    assert_eq!(d.import(None, prompt[..32].to_vec(), full_blocks(&piece, 0)).await.expect("imported"), 0);
    drop(piece);

    // The whole prompt: the prefill engine finds the piece cached.
    let before_p = p.stats().counters;
    let (first, kv) = prefill(&p, &prompt).await;
    assert_eq!(first, want[0]);
    assert_eq!(
        p.stats().counters.prefill_tokens - before_p.prefill_tokens,
        70 - 32,
        "the piece was not computed again"
    );
    // The decode engine is handed only the blocks it lacks.
    let before = d.stats().counters;
    let rest = decode(&d, [prompt.clone(), vec![first]].concat(), 7, full_blocks(&kv, 2)).await;
    let after = d.stats().counters;
    assert_eq!([vec![first], rest].concat(), want, "the streamed prompt answers as a single engine does");
    assert_eq!(after.imported_blocks - before.imported_blocks, 2);
    assert_eq!(after.cached_tokens[0] - before.cached_tokens[0], 64, "the piece imported ahead was used");
    p.shutdown(true).await;
    d.shutdown(true).await;
}
