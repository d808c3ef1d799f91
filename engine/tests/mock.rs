//! The mock backend under the real scheduler: prompts far past the model's trained context, output that is
//! reproducible from the seed and never ends early, prefix caching and events as on a computing engine, and steps
//! that take the profile's time.

mod common;

use std::sync::atomic::AtomicBool;
use std::time::Instant;

use engine::backend::TimingProfile;
use engine::backend::mock::MockSettings;
use engine::generate::{BackendChoice, EngineConfig, FinishReason, Request};
use engine::sampling::{RawSampling, SamplingParams};

fn mock(profile: &str, speedup: f64, kv_blocks: usize) -> EngineConfig {
    let profile = TimingProfile::parse("test", profile).expect("profile parses");
    // The device tier must hold one sequence of the whole context.
    let context_len = (kv_blocks * 16).min(131_072);
    EngineConfig {
        backend: BackendChoice::Mock(Box::new(MockSettings {
            profile,
            speedup,
            context_len,
            ..MockSettings::gpu_default()
        })),
        kv_blocks,
        ..EngineConfig::default()
    }
}

fn request(prompt: Vec<u32>, max_tokens: u32, seed: u64) -> Request {
    let raw = RawSampling { max_tokens, seed: Some(seed), temperature: 1.0, ..RawSampling::default() };
    Request { prompt, sampling: SamplingParams::new(raw).expect("valid"), namespace: None, deadline: None, priority: 0 }
}

#[test]
fn long_prompts_run_and_output_is_reproducible_from_the_seed() {
    let mut engine = common::engine(mock("", 1.0, 8192));
    assert_eq!(engine.backend_name(), "mock");
    assert_eq!(engine.max_model_len(), 131_072);
    // 60k tokens: eight times SmolLM2's trained context.
    let prompt: Vec<u32> = (0..60_000).map(|i| 1000 + (i % 5000)).collect();
    let cancel = AtomicBool::new(false);
    let a = engine.run(&[request(prompt.clone(), 50, 7)], &cancel, |_| {}).expect("runs");
    let b = engine.run(&[request(prompt.clone(), 50, 7)], &cancel, |_| {}).expect("runs");
    let c = engine.run(&[request(prompt, 50, 8)], &cancel, |_| {}).expect("runs");
    assert_eq!(a[0].token_ids.len(), 50, "no early end of generation");
    assert_eq!(a[0].finish_reason, FinishReason::Length);
    assert_eq!(a[0].token_ids, b[0].token_ids, "same seed, same tokens");
    assert_ne!(a[0].token_ids, c[0].token_ids);
    assert_eq!(b[0].cached_tokens, 59_984, "the second run reuses the first one's blocks");
    let tok = engine.tokenizer();
    assert!(a[0].token_ids.iter().all(|&t| !tok.is_end_of_generation(t)));
    assert_eq!(tok.encode(&a[0].text), a[0].token_ids, "the text is ordinary words");
}

#[test]
fn steps_take_the_modelled_time() {
    // 100 ms per prompt step at speed-up 4: 25 ms; decode 40 ms / 4 = 10 ms per token.
    let mut engine = common::engine(mock("[prefill]\nbase_ms = 100\n[decode]\nbase_ms = 40\n", 4.0, 64));
    let started = Instant::now();
    let out = engine.run(&[request(vec![1000; 100], 5, 1)], &AtomicBool::new(false), |_| {}).expect("runs");
    let took = started.elapsed().as_secs_f64();
    // One prompt step, then four decode steps.
    assert!(took >= 0.025 + 4.0 * 0.010, "took {took} s");
    let pacing = engine.pacing().expect("a mock paces");
    assert_eq!(pacing.steps, 5);
    assert_eq!(pacing.modelled_nanos, 65_000_000);
    assert_eq!(out[0].token_ids.len(), 5);
}

#[test]
fn a_mock_refuses_bad_settings_at_start() {
    let mut config = mock("", 1.0, 64);
    if let BackendChoice::Mock(m) = &mut config.backend {
        m.block_bytes = 100;
    }
    let e = engine::generate::Engine::open(&common::model_path(), config).expect_err("refused");
    assert!(e.to_string().contains("block bytes"), "{e}");
}

/// Prompts are computed in the order they arrived, also after an earlier sequence has finished and left: the
/// scheduler plans prompt chunks in its sequences' order, which retiring one must not reshuffle.
#[test]
fn prompts_waiting_for_the_token_budget_are_computed_in_arrival_order() {
    use engine::generate::{Output, Stepper};
    // 64 tokens a step: one prompt chunk at a time.
    let config = EngineConfig { max_batched_tokens: 64, ..mock("", 1.0, 256) };
    let mut stepper = Stepper::new(common::engine(config));
    let none: &[(usize, &[u8])] = &[];
    // A: a short prompt that ends with its first token; B and C: four chunks each, B first.
    for (id, len, max) in [(0u64, 16u32, 1u32), (1, 256, 2), (2, 256, 2)] {
        let prompt: Vec<u32> = (0..len).map(|i| 1000 + id as u32 * 300 + i).collect();
        stepper.submit(id, request(prompt, max, id), false, &none).expect("queued");
    }
    let mut first_tokens = Vec::new();
    while stepper.busy() {
        for out in stepper.step().outputs {
            if let Output::Token { id, .. } = out
                && !first_tokens.contains(&id)
            {
                first_tokens.push(id);
            }
        }
    }
    assert_eq!(first_tokens, vec![0, 1, 2], "B arrived before C, so its prompt is done first");
}

/// Finishing order of requests `(id, prompt length, max tokens, priority)` on a stepper; `first` run one step
/// alone before the others are submitted (running when they arrive).
fn finishing_order(
    config: EngineConfig,
    first: (u64, u32, u32, i32),
    rest: &[(u64, u32, u32, i32)],
) -> (Vec<u64>, u64) {
    use engine::generate::{Output, Stepper};
    let mut stepper = Stepper::new(common::engine(config));
    let none: &[(usize, &[u8])] = &[];
    let submit = |stepper: &mut Stepper, (id, len, max, priority): (u64, u32, u32, i32)| {
        let prompt: Vec<u32> = (0..len).map(|i| 1000 + id as u32 * 300 + i).collect();
        let r = Request { priority, ..request(prompt, max, id) };
        stepper.submit(id, r, false, &none).expect("queued");
    };
    submit(&mut stepper, first);
    let mut finished = Vec::new();
    let mut record = |outputs: Vec<Output>| {
        for out in outputs {
            match out {
                Output::Finished { id, .. } => finished.push(id),
                Output::Failed { why, .. } => panic!("{why}"),
                Output::Token { .. } => {}
            }
        }
    };
    record(stepper.step().outputs);
    for &r in rest {
        submit(&mut stepper, r);
    }
    while stepper.busy() {
        record(stepper.step().outputs);
    }
    (finished, stepper.engine().counters().preemptions)
}

/// vLLM's priority scheduling: a waiting request of a lower value is admitted before others whatever its arrival,
/// equal ones in arrival order; a running request is not preempted for a waiting one.
#[test]
fn waiting_requests_are_admitted_by_priority_then_arrival() {
    let config = EngineConfig { max_num_seqs: 1, ..mock("", 1.0, 256) };
    let rest = [(1, 20, 3, 5), (2, 20, 3, -1), (3, 20, 3, 5), (4, 20, 3, -1), (5, 20, 3, 0)];
    let (order, preemptions) = finishing_order(config, (0, 20, 3, 7), &rest);
    assert_eq!(order, vec![0, 2, 4, 5, 1, 3]);
    assert_eq!(preemptions, 0);
}

/// When device blocks run out, the running sequence of the lowest priority is preempted, even when it is the older
/// one; among equal priorities the newest is, as before priorities.
#[test]
fn out_of_blocks_the_lowest_priority_is_preempted_before_the_newest() {
    // Eight blocks of 16 tokens: each request alone (40 + 60 tokens, seven blocks) fits, the two together do not.
    let config = || EngineConfig { max_num_seqs: 4, ..mock("", 1.0, 8) };
    let (order, preemptions) = finishing_order(config(), (0, 40, 60, 3), &[(1, 40, 60, 0)]);
    assert_eq!(order, vec![1, 0], "the older request of the lower priority made room");
    assert!(preemptions >= 1);
    let (order, preemptions) = finishing_order(config(), (0, 40, 60, 0), &[(1, 40, 60, 0)]);
    assert_eq!(order, vec![0, 1], "equal priorities: the newest made room");
    assert!(preemptions >= 1);
}

/// A caller that keeps one output buffer from step to step (the simulator) sees what `step` returns: the buffer is
/// appended to, never cleared or reordered by the step.
#[test]
fn stepping_into_a_kept_buffer_gives_what_step_returns() {
    use engine::generate::Stepper;
    let run = |into: bool| {
        let mut config = EngineConfig { max_batched_tokens: 64, ..mock("[decode]\nbase_ms = 3\n", 1.0, 256) };
        // Modelled seconds, so that both runs' steps take the same time.
        if let BackendChoice::Mock(m) = &mut config.backend {
            m.virtual_time = true;
        }
        let mut stepper = Stepper::new(common::engine(config));
        let none: &[(usize, &[u8])] = &[];
        for id in 0..3u64 {
            let prompt: Vec<u32> = (0..40 + 30 * id as u32).map(|i| 1000 + i).collect();
            stepper.submit(id, request(prompt, 4, id), false, &none).expect("queued");
        }
        let (mut steps, mut buffer) = (Vec::new(), vec![]);
        while stepper.busy() {
            if into {
                let secs = stepper.step_into(&mut buffer);
                steps.push((secs, buffer.clone()));
                buffer.clear();
            } else {
                let s = stepper.step();
                steps.push((s.secs, s.outputs));
            }
        }
        steps
    };
    let (kept, fresh) = (run(true), run(false));
    assert!(kept.len() > 3, "several steps: {}", kept.len());
    assert_eq!(kept, fresh);
}

/// A prompt handed over with its hashes (the simulator hashes it once, for its router and its engines) runs as the
/// same prompt submitted bare: the same tokens, the same blocks cached and the same events; hashes made in another
/// block size are not used.
#[test]
fn a_prompt_submitted_with_its_hashes_runs_as_one_submitted_bare() {
    use engine::generate::{Output, Stepper};
    use kv_cache::{BlockSize, CacheNamespace, HashedTokens};
    let run = |hashed: Option<u32>| {
        let mut stepper = Stepper::new(common::engine(EngineConfig { max_batched_tokens: 64, ..mock("", 1.0, 256) }));
        let none: &[(usize, &[u8])] = &[];
        let mut outputs = Vec::new();
        // The second prompt shares the first one's leading 48 tokens; each is in a namespace of its own but the last.
        let prompts: [(Vec<u32>, Option<&str>); 3] = [
            ((1000..1100).collect(), None),
            ((1000..1048).chain(2000..2030).collect(), None),
            ((1000..1100).collect(), Some("tenant")),
        ];
        for (id, (prompt, ns)) in prompts.into_iter().enumerate() {
            let id = id as u64;
            let ns = ns.map(CacheNamespace::new);
            let mut bare = request(prompt.clone(), 3, id);
            match hashed {
                Some(size) => {
                    let tokens = HashedTokens::new(prompt, BlockSize::new(size).expect("non-zero"), ns);
                    stepper.submit_hashed(id, tokens, bare.sampling, 0, false, &none).expect("queued");
                }
                None => {
                    bare.namespace = ns;
                    stepper.submit(id, bare, false, &none).expect("queued");
                }
            }
            while stepper.busy() {
                for out in stepper.step().outputs {
                    outputs.push(match out {
                        Output::Token { id, token } => (id, token, None),
                        Output::Finished { id, completion, .. } => (id, 0, Some(completion.cached_tokens)),
                        Output::Failed { why, .. } => panic!("{why}"),
                    });
                }
            }
        }
        (outputs, stepper.take_kv_events().expect("every event kept"))
    };
    let bare = run(None);
    assert!(!bare.1.is_empty());
    assert_eq!(run(Some(16)), bare, "hashed in the engine's block size");
    assert_eq!(run(Some(8)), bare, "hashed in another block size: hashed again");
}

/// A mock engine of 64 blocks, and the switches that break its stand-in device.
fn faulty_engine() -> (engine::generate::Engine, engine::backend::mock::DeviceFault) {
    let config = mock("", 1.0, 64);
    let BackendChoice::Mock(settings) = &config.backend else { unreachable!("a mock config") };
    let fault = settings.fault.clone();
    (common::engine(config), fault)
}

#[test]
fn a_broken_device_fails_every_sequence_until_mended_and_keeps_no_block() {
    let (mut engine, fault) = faulty_engine();
    let free = engine.free_blocks();
    fault.set_broken(true);
    let broken = engine.run(&[request(vec![1000; 100], 5, 1)], &AtomicBool::new(false), |_| {});
    let why = broken.expect_err("a broken device fails the request").to_string();
    assert!(why.contains("the mock device is broken"), "{why}");
    assert_eq!(engine.free_blocks(), free, "the failed sequence's blocks are back");
    fault.set_broken(false);
    let out = engine.run(&[request(vec![1000; 100], 5, 1)], &AtomicBool::new(false), |_| {}).expect("mended");
    assert_eq!(out[0].token_ids.len(), 5);
}

#[test]
fn a_stuck_device_holds_its_step_until_unstuck() {
    let (mut engine, fault) = faulty_engine();
    fault.set_stuck(true);
    let (tx, rx) = std::sync::mpsc::channel();
    let worker = std::thread::spawn(move || {
        let out = engine.run(&[request(vec![1000; 100], 5, 1)], &AtomicBool::new(false), |_| {});
        tx.send(out.map(|o| o[0].token_ids.len()).map_err(|e| e.to_string())).expect("sent");
    });
    assert!(rx.recv_timeout(std::time::Duration::from_millis(300)).is_err(), "no step ends while stuck");
    fault.set_stuck(false);
    let tokens = rx.recv_timeout(std::time::Duration::from_secs(30)).expect("unstuck, it ends");
    assert_eq!(tokens, Ok(5), "and nothing was lost");
    worker.join().expect("joined");
}

#[test]
fn prompt_log_probabilities_are_refused_by_name_since_the_mock_computes_no_logits() {
    let mut engine = common::engine(mock("", 1.0, 64));
    let raw = RawSampling { max_tokens: 2, prompt_logprobs: Some(1), ..RawSampling::default() };
    let request = Request::new(vec![1000, 1001, 1002], SamplingParams::new(raw).expect("valid"));
    let err = engine.run(&[request], &AtomicBool::new(false), |_| {}).expect_err("refused");
    assert_eq!(err.to_string(), "the mock backend does not compute prompt log-probabilities");
}
