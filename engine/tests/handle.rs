//! The engine driven from async code: concurrent submissions stream the same tokens as a direct run, a dropped
//! stream cancels its sequence and frees its blocks, shutdown either finishes or cancels in-flight work, and the
//! published state names the tagged sequences its figures count.

mod common;

use std::sync::atomic::AtomicBool;
use std::time::Duration;

use engine::generate::{EngineConfig, EngineHandle, FinishReason, Request, SeqEvent, SubmitError};

/// Reads a stream to its end: the tokens, the streamed text, and the last message.
async fn drain(mut s: engine::generate::SeqStream) -> (Vec<u32>, String, SeqEvent) {
    let (mut tokens, mut text) = (Vec::new(), String::new());
    while let Some(ev) = s.next().await {
        match ev {
            SeqEvent::Token { token, text: t, .. } => {
                tokens.push(token);
                text.push_str(&t);
            }
            last => return (tokens, text, last),
        }
    }
    panic!("the stream ended without a last message");
}

#[tokio::test(flavor = "current_thread")]
async fn concurrent_submissions_stream_what_a_direct_run_gives() {
    let mut direct = common::engine(EngineConfig::default());
    let prompts: Vec<Vec<u32>> =
        ["The sea is", "Rust is a language that", "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"]
            .iter()
            .map(|p| direct.tokenizer().encode(p))
            .collect();
    let requests: Vec<Request> = prompts.iter().map(|p| common::greedy(p.clone(), 10)).collect();
    let want = direct.run(&requests, &AtomicBool::new(false), |_| {}).expect("runs");
    let handle = EngineHandle::start(common::engine(EngineConfig::default())).expect("starts");
    let mut streams = Vec::new();
    for r in &requests {
        streams.push(handle.submit(r.clone()).await.expect("accepted"));
    }
    for (s, w) in streams.into_iter().zip(&want) {
        let (tokens, text, last) = drain(s).await;
        assert_eq!(tokens, w.token_ids);
        let SeqEvent::Finished(c) = last else { panic!("finished expected, got {last:?}") };
        assert_eq!((c.token_ids, c.text, text), (w.token_ids.clone(), w.text.clone(), w.text.clone()));
    }
    // A bad request is refused at once, and the engine keeps going.
    assert!(matches!(handle.submit(common::greedy(vec![], 4)).await, Err(SubmitError::Invalid(_))));
    handle.shutdown(true).await;
}

#[tokio::test(flavor = "current_thread")]
async fn dropping_a_stream_cancels_and_frees_its_blocks() {
    let handle = EngineHandle::start(common::engine(EngineConfig::default())).expect("starts");
    let idle = handle.stats();
    let mut s = handle.submit(common::greedy(vec![100; 40], 2000)).await.expect("accepted");
    assert!(matches!(s.next().await, Some(SeqEvent::Token { .. })));
    let busy = handle.stats();
    assert!(busy.usage[0].used > 0 && busy.running == 1);
    drop(s);
    let mut freed = false;
    for _ in 0..200 {
        let now = handle.stats();
        if now.usage[0].used == 0 && now.running == 0 {
            assert_eq!(now.usage[0].free + now.usage[0].cached, idle.usage[0].free + idle.usage[0].cached);
            freed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(freed, "the abandoned sequence's blocks came back");
    handle.shutdown(false).await;
}

#[tokio::test(flavor = "current_thread")]
async fn shutdown_cancels_or_finishes_in_flight_work() {
    let handle = EngineHandle::start(common::engine(EngineConfig::default())).expect("starts");
    let long = handle.submit(common::greedy(vec![100; 20], 2000)).await.expect("accepted");
    let short = handle.submit(common::greedy(vec![200; 20], 3)).await.expect("accepted");
    handle.shutdown(false).await;
    for s in [long, short] {
        let (_, _, last) = drain(s).await;
        match last {
            SeqEvent::Finished(c) => assert!(matches!(c.finish_reason, FinishReason::Cancelled | FinishReason::Length)),
            other => panic!("unexpected {other:?}"),
        }
    }
    let handle = EngineHandle::start(common::engine(EngineConfig::default())).expect("starts");
    let s = handle.submit(common::greedy(vec![300; 20], 5)).await.expect("accepted");
    handle.shutdown(true).await;
    let (tokens, _, last) = drain(s).await;
    assert!(matches!(last, SeqEvent::Finished(ref c) if c.finish_reason != FinishReason::Cancelled), "{last:?}");
    assert!(!tokens.is_empty());
}

#[tokio::test(flavor = "current_thread")]
async fn the_state_is_readable_while_a_step_runs_long() {
    let handle = EngineHandle::start(common::engine(EngineConfig::default())).expect("starts");
    let hold = handle.hold_steps();
    let s = handle.submit(common::greedy(vec![100; 40], 5)).await.expect("accepted");
    // The engine is stopped before its step; what it holds is published all the same.
    let state = handle.stats();
    assert_eq!((state.running, state.waiting, state.prefill_tokens_pending), (0, 1, 40));
    assert!(handle.is_running());
    drop(hold);
    let (tokens, _, last) = drain(s).await;
    assert_eq!(tokens.len(), 5, "{last:?}");
    let state = handle.stats();
    assert_eq!((state.running, state.waiting, state.prefill_tokens_pending), (0, 0, 0));
    assert_eq!(state.counters.prefill_tokens, 40 + 4);
    handle.shutdown(true).await;
}

#[tokio::test(flavor = "current_thread")]
async fn the_published_state_names_the_tagged_sequences_it_counts() {
    let handle = EngineHandle::start(common::engine(EngineConfig::default())).expect("starts");
    let none = Vec::<(usize, bytes::Bytes)>::new;
    let a = handle.submit_with_blocks(common::greedy(vec![100; 40], 2000), none(), Some(7)).await.expect("accepted");
    let b = handle.submit(common::greedy(vec![200; 20], 2000)).await.expect("accepted");
    let c = handle.submit_with_blocks(common::greedy(vec![300; 24], 2000), none(), Some(3)).await.expect("accepted");
    // One copy holds the figures and the tags of what they count (the untagged one counted, not named).
    let state = handle.stats();
    assert_eq!((state.running + state.waiting, state.tags.as_slice()), (3, [3, 7].as_slice()));
    drop(a);
    let mut left = false;
    for _ in 0..200 {
        let now = handle.stats();
        if now.running + now.waiting == 2 {
            assert_eq!(now.tags, vec![3], "a cancelled sequence leaves the tags with its figures");
            left = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(left, "the cancelled sequence ended");
    drop((b, c));
    handle.shutdown(false).await;
}
