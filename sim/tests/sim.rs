//! The simulator on the real engine and router code: a scenario small enough to work out by hand, and the same
//! trace twice giving the same records.

mod common;

use common::{request, settings, settings_gpu, shared_prefixes};
use loadgen::schedule::{Arrivals, plan};
use router::scheduler::config::{Policy, SchedulerConfig};
use sim::{Settings, simulate};

#[test]
fn three_requests_on_two_workers_take_the_times_worked_out_by_hand() {
    // Prefill: 10 ms + 1 ms per token; decode: 5 ms per step; a step with both pays both.
    let profile = "[prefill]\nbase_ms = 10.0\nper_token_ms = 1.0\n[decode]\nbase_ms = 5.0\n";
    // No prefill workers: each request is prefilled and decoded on the decode worker round robin gives it.
    let s = settings(profile, 0, 2, Policy::RoundRobin);
    // A (100 tokens, 3 out) at 0 on worker 0; B (100, 1) at 1 ms on worker 1; C (50, 1) at 2 ms on worker 0.
    let trace = [request(0.0, 100, 3, 1), request(1.0, 100, 1, 2), request(2.0, 50, 1, 3)];
    let out = simulate(&s, &trace, &plan(&trace, &Arrivals::Trace { speedup: 1.0 })).expect("runs");
    let r = &out.records;
    assert_eq!(r.len(), 3);
    let ttft: Vec<f64> = r.iter().map(|r| r.time_to_first_token_ms.expect("a first token")).collect();
    let e2e: Vec<f64> = r.iter().map(|r| r.request_latency_ms).collect();
    // A: its prefill step 0 → 110 ms. B: 1 → 111 ms. C waits for A's step, then shares the next with A's first
    // decode: 10 + 50 + 5 = 65 ms, 110 → 175 ms (TTFT 173). A's last decode runs alone: 175 → 180 ms.
    let want_ttft = [110.0, 110.0, 173.0];
    let want_e2e = [180.0, 110.0, 173.0];
    for k in 0..3 {
        assert!((ttft[k] - want_ttft[k]).abs() < 1e-6, "TTFT of request {k}: {} (want {})", ttft[k], want_ttft[k]);
        assert!((e2e[k] - want_e2e[k]).abs() < 1e-6, "E2E of request {k}: {} (want {})", e2e[k], want_e2e[k]);
    }
    assert_eq!(r[0].inter_chunk_ms.len(), 2);
    assert!((r[0].inter_chunk_ms[0] - 65.0).abs() < 1e-6 && (r[0].inter_chunk_ms[1] - 5.0).abs() < 1e-6);
    assert_eq!(out.prefill_tokens_computed, 250);
    assert_eq!(out.decisions.get("no_prefill_workers"), Some(&3));
    // From the first arrival to the last response (not to the KV events published after it).
    assert!((out.duration_s - 0.180).abs() < 1e-9, "{}", out.duration_s);
}

#[test]
fn a_request_sent_during_a_step_is_taken_and_reported_when_the_step_ends() {
    // One worker; a prompt step costs 10 ms + 1 ms a token, a decode 5 ms more. A (256 tokens, 3 out) starts its
    // step at 0 (until 266 ms);
    // B (512 tokens, A's 256 first) is sent at 50 ms, C at 100 ms. A worker's engine takes B only when A's step
    // ends, so at C the last report is the one from A's admission (A's 256 tokens to compute) and B counts by
    // the router's own figure (all 512: nothing of A was stored yet): 768. Taken at once, B was reported with A's
    // blocks as its cache and A's prompt as done (256), which no real worker can say before the step's end.
    let profile = "[prefill]\nbase_ms = 10.0\nper_token_ms = 1.0\n[decode]\nbase_ms = 5.0\n";
    let s = Settings { trace_block: 256, record_candidates: true, ..settings(profile, 0, 1, Policy::RoundRobin) };
    let b = loadgen::trace::TraceRequest { hash_ids: vec![1, 2], ..request(50.0, 512, 1, 1) };
    let trace = [request(0.0, 256, 3, 1), b, request(100.0, 256, 1, 3)];
    let out = simulate(&s, &trace, &plan(&trace, &Arrivals::Trace { speedup: 1.0 })).expect("runs");
    let seen = |k: usize| {
        let p = out.placements[k].as_ref().expect("placed");
        p.candidates.as_ref().expect("candidates").decode[0].active_prefill_tokens
    };
    assert_eq!((seen(1), seen(2)), (256, 768));
    // B and C wait for A's step, then share one with A's first decode: B's 256 tokens A did not store and C's
    // 256, 10 + 512 + 5 ms from 266 ms.
    let ttft: Vec<f64> = out.records.iter().map(|r| r.time_to_first_token_ms.expect("a first token")).collect();
    let want = [266.0, 793.0 - 50.0, 793.0 - 100.0];
    assert!(ttft.iter().zip(want).all(|(t, w)| (t - w).abs() < 1e-6), "TTFTs {ttft:?}, want {want:?}");
}

#[test]
fn a_lease_that_ends_during_its_prefill_workers_step_shows_nothing_of_that_step() {
    // One prefill and one decode worker, every request disaggregated; a prompt step costs 10 ms + 1 ms a token.
    // A (256 tokens) is prefilled 0-266 ms; B (256 other tokens), sent at 100 ms, is computed 266-532 ms. A's
    // pull ends at about 268 ms, in B's step, and with it A's lease. The prefill worker takes the lease's end when
    // B's step ends, so C (B's prompt again) at 300 ms sees none of B's blocks there yet: they are stored only
    // when the step that computes them ends. (Taking the lease's end at once sent the router a report and B's
    // blocks from mid-step.)
    let profile = "[prefill]\nbase_ms = 10.0\nper_token_ms = 1.0\n[decode]\nbase_ms = 5.0\n";
    let mut s = Settings { trace_block: 256, record_candidates: true, ..settings(profile, 1, 1, Policy::Kv) };
    s.scheduler.disaggregation = router::scheduler::config::DisaggregationRule::Always;
    let trace = [request(0.0, 256, 2, 1), request(100.0, 256, 2, 2), request(300.0, 256, 2, 2)];
    let out = simulate(&s, &trace, &plan(&trace, &Arrivals::Trace { speedup: 1.0 })).expect("runs");
    assert!(out.placements.iter().flatten().all(|p| p.prefill.is_some()), "every request disaggregated");
    let c = out.placements[2].as_ref().and_then(|p| p.candidates.as_ref()).expect("C's candidates");
    assert_eq!(c.prefill[0].device_blocks, 0, "{:?}", c.prefill[0]);
    // C then finds B's blocks cached when it runs, after B's step.
    assert_eq!(out.records[2].cached_tokens, 240);
}

#[test]
fn a_streamed_prompt_leaves_only_its_last_pieces_blocks_to_pull_after_the_prefill() {
    // Prefill: 10 ms + 0.01 ms per token; a pull: 0.5 ms + 1 ms per block.
    let profile = "[prefill]\nbase_ms = 10.0\nper_token_ms = 0.01\n[decode]\nbase_ms = 5.0\n";
    let mut s = settings(profile, 1, 1, Policy::Kv);
    s.scheduler.disaggregation = router::scheduler::config::DisaggregationRule::Always;
    s.engine.max_batched_tokens = 256;
    s.transfer_bandwidth = s.transfer_block_bytes as f64 * 1000.0;
    // 960 tokens in chunks of 256: pieces end at 256, 512 and 768 tokens; the last piece adds 12 of the 60 blocks.
    let trace = [request(0.0, 960, 2, 1)];
    let run = |stream_kv| {
        let s = Settings { stream_kv, ..s.clone() };
        let out = simulate(&s, &trace, &plan(&trace, &Arrivals::Trace { speedup: 1.0 })).expect("runs");
        let r = &out.records[0];
        (r.time_to_first_token_ms.expect("a first token"), r.inter_chunk_ms[0], out.transfer_bytes)
    };
    let (ttft_off, gap_off, bytes_off) = run(false);
    let (ttft_on, gap_on, bytes_on) = run(true);
    assert!((ttft_on - ttft_off).abs() < 1e-9, "the prefill is the same: {ttft_on} vs {ttft_off}");
    // After the prefill: a pull of 60 blocks, or of the last piece's 12, then the decode step.
    assert!((gap_off - gap_on - 48.0).abs() < 1e-6, "{gap_off} ms against {gap_on} ms");
    assert_eq!(bytes_on, bytes_off, "the same blocks move, most of them earlier");
}

#[test]
fn a_modelled_router_tokenizer_delays_routing_by_the_prompt_and_queues_on_its_slots() {
    // As above, with the router tokenizing 1,000 tokens per second on one slot: A (100 tokens) is routed at 100 ms
    // and B (100 tokens, arriving at 1 ms) waits for the slot until 200 ms; each then prefills alone (110 ms) on
    // its own worker. TTFT counts from arrival.
    let profile = "[prefill]\nbase_ms = 10.0\nper_token_ms = 1.0\n[decode]\nbase_ms = 5.0\n";
    let s = Settings { router_tokens_per_s: 1000.0, router_slots: 1, ..settings(profile, 0, 2, Policy::RoundRobin) };
    let trace = [request(0.0, 100, 1, 1), request(1.0, 100, 1, 2)];
    let out = simulate(&s, &trace, &plan(&trace, &Arrivals::Trace { speedup: 1.0 })).expect("runs");
    let ttft: Vec<f64> = out.records.iter().map(|r| r.time_to_first_token_ms.expect("a first token")).collect();
    assert!((ttft[0] - 210.0).abs() < 1e-6 && (ttft[1] - 309.0).abs() < 1e-6, "{ttft:?}");
    // Two slots: B is tokenized alongside A.
    let two = Settings { router_slots: 2, ..s };
    let out = simulate(&two, &trace, &plan(&trace, &Arrivals::Trace { speedup: 1.0 })).expect("runs");
    assert!((out.records[1].time_to_first_token_ms.expect("a first token") - 210.0).abs() < 1e-6);
}

#[test]
fn past_the_routers_slots_requests_wait_in_order_and_past_its_queue_they_are_refused() {
    // One worker, prompts of 10 ms + 1 ms a token; the router holds one request at a time and lets one wait.
    let profile = "[prefill]\nbase_ms = 10.0\nper_token_ms = 1.0\n[decode]\nbase_ms = 5.0\n";
    let limits = sim::Limits { max_in_flight: 1, max_queue: 1, request_timeout: 1.0 };
    let s = Settings { admission: limits, ..settings(profile, 0, 1, Policy::RoundRobin) };
    // A (100 tokens) at 0 runs 0 → 110 ms. B (100) at 1 ms waits for A's slot and runs 110 → 220 ms. C at 2 ms
    // finds the queue full: 429 at once. D (50) at 150 ms waits for B's slot and runs 220 → 280 ms.
    let trace = [request(0.0, 100, 1, 1), request(1.0, 100, 1, 2), request(2.0, 50, 1, 3), request(150.0, 50, 1, 4)];
    let out = simulate(&s, &trace, &plan(&trace, &Arrivals::Trace { speedup: 1.0 })).expect("runs");
    let r = &out.records;
    let status: Vec<u16> = r.iter().map(|r| r.status).collect();
    assert_eq!(status, [200, 200, 429, 200]);
    let ttft: Vec<Option<f64>> = r.iter().map(|r| r.time_to_first_token_ms).collect();
    for (k, want) in [(0, 110.0), (1, 219.0), (3, 130.0)] {
        let got = ttft[k].expect("a first token");
        assert!((got - want).abs() < 1e-6, "TTFT of request {k}: {got} (want {want})");
    }
    assert_eq!((ttft[2], r[2].request_latency_ms), (None, 0.0));
    assert_eq!(out.decisions.get("overloaded"), Some(&1));
    assert!((out.duration_s - 0.280).abs() < 1e-9, "the run ends with D's response: {}", out.duration_s);

    // A wait longer than the request timeout (80 ms) ends in 504 and frees its place. The router tokenizes 1,000
    // tokens a second, and a request's own deadline runs from its routing: A (50 tokens) holds the slot from 0,
    // is routed at 50 ms and runs 50 → 110 ms, within its deadline (130 ms). B gives up waiting at 81 ms; C (50
    // tokens, at 90 ms) waits in its place for A's slot, is tokenized 110 → 160 ms and runs 160 → 220 ms.
    let limits = sim::Limits { request_timeout: 0.08, ..limits };
    let s = Settings { admission: limits, router_tokens_per_s: 1000.0, ..s };
    let trace = [request(0.0, 50, 1, 1), request(1.0, 50, 1, 2), request(90.0, 50, 1, 3)];
    let out = simulate(&s, &trace, &plan(&trace, &Arrivals::Trace { speedup: 1.0 })).expect("runs");
    let r = &out.records;
    assert_eq!(r.iter().map(|r| r.status).collect::<Vec<_>>(), [200, 504, 200]);
    assert!((r[0].time_to_first_token_ms.expect("a first token") - 110.0).abs() < 1e-6);
    assert!((r[1].request_latency_ms - 80.0).abs() < 1e-6, "{}", r[1].request_latency_ms);
    assert!((r[2].time_to_first_token_ms.expect("a first token") - 130.0).abs() < 1e-6);
    assert_eq!(out.decisions.get("deadline"), Some(&1));
}

/// A trace's `priority` (vLLM's, lower first) orders the router's queue, as the real router's: a later request of a
/// higher priority is served first, and a full queue refuses the last ranked one; and the engine's queue too.
#[test]
fn a_traces_priorities_order_the_routers_queue_and_the_engines() {
    let profile = "[prefill]\nbase_ms = 10.0\nper_token_ms = 1.0\n[decode]\nbase_ms = 5.0\n";
    let limits = sim::Limits { max_in_flight: 1, max_queue: 2, request_timeout: 1.0 };
    let s = Settings { admission: limits, ..settings(profile, 0, 1, Policy::RoundRobin) };
    let at = |ms, id, priority| loadgen::trace::TraceRequest { priority, ..request(ms, 100, 1, id) };
    // A at 0 runs 0 → 110 ms. B (priority 5) and C (0) wait; D (-1) at 3 ms finds the queue full and outranks B,
    // which is refused. Then D runs 110 → 220 ms, C 220 → 330 ms.
    let trace = [at(0.0, 1, 0), at(1.0, 2, 5), at(2.0, 3, 0), at(3.0, 4, -1)];
    let out = simulate(&s, &trace, &plan(&trace, &Arrivals::Trace { speedup: 1.0 })).expect("runs");
    let r = &out.records;
    assert_eq!(r.iter().map(|r| r.status).collect::<Vec<_>>(), [200, 429, 200, 200]);
    for (k, want) in [(0, 110.0), (3, 217.0), (2, 328.0)] {
        let got = r[k].time_to_first_token_ms.expect("a first token");
        assert!((got - want).abs() < 1e-6, "TTFT of request {k}: {got} (want {want})");
    }
    // No router queue, but an engine that runs one sequence at a time: the same order there.
    let mut s = Settings { admission: sim::Limits::default(), ..s };
    s.engine.max_num_seqs = 1;
    let trace = [at(0.0, 1, 0), at(1.0, 2, 5), at(2.0, 3, 0), at(3.0, 4, -1)];
    let out = simulate(&s, &trace, &plan(&trace, &Arrivals::Trace { speedup: 1.0 })).expect("runs");
    let first: Vec<f64> = out.records.iter().map(|r| r.time_to_first_token_ms.expect("a first token")).collect();
    let mut order: Vec<usize> = (0..4).collect();
    order.sort_by(|&a, &b| {
        (first[a] + trace[a].arrival_ms.unwrap_or(0.0)).total_cmp(&(first[b] + trace[b].arrival_ms.unwrap_or(0.0)))
    });
    assert_eq!(order, [0, 3, 2, 1], "first tokens by priority, then arrival: {first:?}");
}

#[test]
fn a_request_past_its_deadline_is_answered_504_and_its_work_dropped() {
    // One worker, prompts 10 ms + 1 ms a token, decode steps 5 ms, a request timeout of 200 ms. A (100 tokens, 100
    // out) makes its first token at 110 ms and one every 5 ms after: 18 by 195 ms. At 200 ms its deadline passes
    // while the step that would make the 19th runs: 504, with 18 tokens. The engine drops A when that step ends,
    // so B (50 tokens) at 300 ms prefills alone: 300 → 360 ms (A still decoding would add 5 ms to that step).
    let profile = "[prefill]\nbase_ms = 10.0\nper_token_ms = 1.0\n[decode]\nbase_ms = 5.0\n";
    let limits = sim::Limits { request_timeout: 0.2, ..sim::Limits::default() };
    let s = Settings { admission: limits, ..settings(profile, 0, 1, Policy::RoundRobin) };
    let trace = [request(0.0, 100, 100, 1), request(300.0, 50, 1, 2)];
    let out = simulate(&s, &trace, &plan(&trace, &Arrivals::Trace { speedup: 1.0 })).expect("runs");
    let (a, b) = (&out.records[0], &out.records[1]);
    assert_eq!((a.status, a.output_tokens), (504, 18));
    assert!((a.request_latency_ms - 200.0).abs() < 1e-6, "{}", a.request_latency_ms);
    assert_eq!(b.status, 200);
    assert!((b.time_to_first_token_ms.expect("a first token") - 60.0).abs() < 1e-6, "{b:?}");
    assert_eq!(out.decisions.get("deadline"), Some(&1));

    // Disaggregated, the deadline (80 ms) passes during A's prefill (0 → 110 ms). The prompt it exported at the
    // step's end is nobody's to pull: its 7 blocks must go back, or B (50 tokens, 4 blocks) would not fit in the
    // prefill worker's 8.
    let limits = sim::Limits { request_timeout: 0.08, ..sim::Limits::default() };
    let mut s = Settings { admission: limits, ..settings(profile, 1, 1, Policy::Kv) };
    (s.engine.kv_blocks, s.engine.host_blocks, s.engine.max_model_len, s.max_isl) = (8, 0, Some(128), 128);
    let trace = [request(0.0, 100, 3, 1), request(300.0, 50, 2, 2)];
    let out = simulate(&s, &trace, &plan(&trace, &Arrivals::Trace { speedup: 1.0 })).expect("runs");
    let (a, b) = (&out.records[0], &out.records[1]);
    assert_eq!((a.status, a.output_tokens), (504, 0));
    assert!((a.request_latency_ms - 80.0).abs() < 1e-6);
    assert_eq!(out.placements[1].as_ref().and_then(|p| p.prefill.as_deref()), Some("prefill-0"));
    assert_eq!((b.status, b.output_tokens), (200, 2), "{b:?}");
    assert!((b.time_to_first_token_ms.expect("a first token") - 60.0).abs() < 1e-6, "{b:?}");
}

fn failing(s: Settings, failures: &[(&str, f64)]) -> Settings {
    let failures = failures
        .iter()
        .map(|&(w, at)| sim::Failure { worker: w.to_string(), at, back: None, fault: sim::Fault::Crash })
        .collect();
    Settings { failures, ..s }
}

#[test]
fn a_lost_decode_resumes_on_the_least_loaded_decode_worker_with_the_tokens_sent_so_far() {
    // Prompts 10 ms + 1 ms a token, decode steps 5 ms. A (100 tokens, 10 out) on decode-0: its first token at
    // 110 ms, its second at 115; decode-0 fails at 117 ms, during the step that would have made the third. The
    // router resumes A on decode-1 with the prompt and the two tokens sent (102 tokens: 117 → 229 ms, the third
    // token), then the seven left, 5 ms each: done at 264 ms. Later arrivals go to decode-1 only.
    let profile = "[prefill]\nbase_ms = 10.0\nper_token_ms = 1.0\n[decode]\nbase_ms = 5.0\n";
    let s = failing(settings(profile, 0, 2, Policy::RoundRobin), &[("decode-0", 0.117)]);
    let trace = [request(0.0, 100, 10, 1), request(300.0, 50, 1, 2), request(310.0, 50, 1, 3)];
    let out = simulate(&s, &trace, &plan(&trace, &Arrivals::Trace { speedup: 1.0 })).expect("runs");
    let a = &out.records[0];
    assert_eq!((a.status, a.output_tokens), (200, 10));
    assert!((a.time_to_first_token_ms.expect("a first token") - 110.0).abs() < 1e-6);
    assert!((a.request_latency_ms - 264.0).abs() < 1e-6, "{}", a.request_latency_ms);
    let want_gaps = [5.0, 114.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0];
    assert_eq!(a.inter_chunk_ms.len(), want_gaps.len());
    for (got, want) in a.inter_chunk_ms.iter().zip(want_gaps) {
        assert!((got - want).abs() < 1e-6, "gaps {:?}", a.inter_chunk_ms);
    }
    for k in [1, 2] {
        assert_eq!(out.placements[k].as_ref().map(|p| p.decode.as_str()), Some("decode-1"), "request {k}");
        assert_eq!(out.records[k].status, 200);
    }
    assert_eq!(out.decisions.get("decode_resumed"), Some(&1));
    assert_eq!(out.decisions.get("worker_failed"), Some(&1));
}

fn hanging(s: Settings, worker: &str, at: f64) -> Settings {
    let failures = vec![sim::Failure { worker: worker.to_string(), at, back: None, fault: sim::Fault::Hang }];
    Settings { failures, ..s }
}

/// Three decode workers taken in turn (prompts 10 ms + 1 ms a token, decode steps 5 ms); decode-0 hangs at 117 ms
/// and goes on at `back`, if given.
fn decode_0_hangs(back: Option<f64>) -> Settings {
    let profile = "[prefill]\nbase_ms = 10.0\nper_token_ms = 1.0\n[decode]\nbase_ms = 5.0\n";
    let mut s = hanging(settings(profile, 0, 3, Policy::RoundRobin), "decode-0", 0.117);
    s.failures[0].back = back;
    s
}

fn assert_gaps(got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "gaps {got:?}");
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() < 1e-6, "gaps {got:?}, want {want:?}");
    }
}

#[test]
fn a_hung_decode_worker_keeps_its_requests_until_keepalive_closes_the_connection() {
    // Prompts 10 ms + 1 ms a token, decode steps 5 ms; three decode workers in turn. A (100 tokens, 10 out) on
    // decode-0: tokens at 110 and 115 ms; decode-0 hangs at 117 ms. B and C go to decode-1 and decode-2; D (50
    // tokens, 2 out) at 500 ms goes to decode-0, which the router does not know is hung. The watchdog drops it at
    // 10.117 s (E, at 11 s, goes elsewhere); the connection closes at 20.117 s (keepalive: a ping 10 s after the
    // last frame, unanswered for 10 s). A resumes on decode-1 (102 tokens: its third token at 20.229 s, then seven
    // more, 5 ms each), D on decode-2 (50 tokens: its first token at 20.177 s, its second at 20.182 s).
    let s = decode_0_hangs(None);
    let trace = [
        request(0.0, 100, 10, 1),
        request(300.0, 50, 1, 2),
        request(400.0, 50, 1, 3),
        request(500.0, 50, 2, 4),
        request(11_000.0, 50, 1, 5),
    ];
    let out = simulate(&s, &trace, &plan(&trace, &Arrivals::Trace { speedup: 1.0 })).expect("runs");
    let r = &out.records;
    assert!(r.iter().all(|r| r.status == 200), "{r:?}");
    let placed = |k: usize| out.placements[k].as_ref().map(|p| p.decode.clone()).expect("placed");
    assert_eq!([placed(1), placed(2), placed(3)], ["decode-1", "decode-2", "decode-0"]);
    assert_ne!(placed(4), "decode-0", "the watchdog dropped the hung worker");
    assert!((r[0].request_latency_ms - 20_264.0).abs() < 1e-6, "{}", r[0].request_latency_ms);
    assert_gaps(&r[0].inter_chunk_ms, &[5.0, 20_114.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0]);
    assert!((r[3].time_to_first_token_ms.expect("a first token") - 19_677.0).abs() < 1e-6, "{:?}", r[3]);
    assert!((r[3].request_latency_ms - 19_682.0).abs() < 1e-6, "{:?}", r[3]);
    assert_eq!(out.decisions.get("worker_hung"), Some(&1));
    assert_eq!(out.decisions.get("decode_resumed"), Some(&2));
    assert_eq!(out.decisions.get("worker_failed"), None);
}

#[test]
fn a_hung_worker_that_goes_on_before_the_watchdog_ends_its_step_and_reads_the_calls_that_waited() {
    // As above, but A makes 3 tokens (at 110 and 115 ms; the third's step, 115 -> 120 ms, is under way when
    // decode-0 hangs at 117 ms) and decode-0 goes on at 2 s, before the watchdog (10.117 s). Its step ends then:
    // A's third token at 2 s (gaps 5 and 1,885 ms). D, sent to it at 500 ms, waited unread; its engine takes it
    // after the step: 60 ms, first token at 2.06 s (TTFT 1,560 ms). The watchdog and keepalive of that hang do
    // nothing later: E, F and G (11 s on) go round decode-1, decode-2 and decode-0.
    let s = decode_0_hangs(Some(2.0));
    let trace = [
        request(0.0, 100, 3, 1),
        request(300.0, 50, 1, 2),
        request(400.0, 50, 1, 3),
        request(500.0, 50, 1, 4),
        request(11_000.0, 50, 1, 5),
        request(11_100.0, 50, 1, 6),
        request(11_200.0, 50, 1, 7),
    ];
    let out = simulate(&s, &trace, &plan(&trace, &Arrivals::Trace { speedup: 1.0 })).expect("runs");
    let r = &out.records;
    assert!(r.iter().all(|r| r.status == 200), "{r:?}");
    let placed = |k: usize| out.placements[k].as_ref().map(|p| p.decode.clone()).expect("placed");
    assert_eq!((3..7).map(placed).collect::<Vec<_>>(), ["decode-0", "decode-1", "decode-2", "decode-0"]);
    assert!((r[0].request_latency_ms - 2_000.0).abs() < 1e-6, "{}", r[0].request_latency_ms);
    assert_gaps(&r[0].inter_chunk_ms, &[5.0, 1_885.0]);
    assert!((r[3].time_to_first_token_ms.expect("a first token") - 1_560.0).abs() < 1e-6, "{:?}", r[3]);
    assert_eq!(out.decisions.get("worker_hung"), Some(&1));
    assert_eq!(out.decisions.get("worker_resumed"), Some(&1));
    assert_eq!(out.decisions.get("worker_rejoined"), None);
    assert_eq!(out.decisions.get("decode_resumed"), None, "nothing failed over");
}

#[test]
fn a_hung_worker_that_goes_on_after_its_connections_closed_drops_their_work_and_is_joined_again_with_its_blocks() {
    // The first test's hang, A making 3 tokens: the connection closes at 20.117 s and A resumes on decode-1 (102
    // tokens: its third token at 20.229 s), D on decode-2 (its first token at 20.177 s). decode-0 goes on at 30 s:
    // its step's token for A and D's call go nowhere, A leaves its engine, and the routers join it again with a
    // snapshot, and ramp its share up again over slow start (10 s): H (45 s), A's prompt again, sees A's six full
    // blocks cached there.
    let mut s = decode_0_hangs(Some(30.0));
    s.record_candidates = true;
    let trace = [
        request(0.0, 100, 3, 1),
        request(300.0, 50, 1, 2),
        request(400.0, 50, 1, 3),
        request(500.0, 50, 1, 4),
        request(45_000.0, 100, 1, 1),
    ];
    let out = simulate(&s, &trace, &plan(&trace, &Arrivals::Trace { speedup: 1.0 })).expect("runs");
    let r = &out.records;
    assert!(r.iter().all(|r| r.status == 200), "{r:?}");
    assert!((r[0].request_latency_ms - 20_229.0).abs() < 1e-6, "{}", r[0].request_latency_ms);
    assert!((r[3].time_to_first_token_ms.expect("a first token") - 19_677.0).abs() < 1e-6, "{:?}", r[3]);
    assert_eq!(out.decisions.get("decode_resumed"), Some(&2));
    assert_eq!(out.decisions.get("worker_resumed"), Some(&1));
    assert_eq!(out.decisions.get("worker_rejoined"), Some(&1));
    let h = out.placements[4].as_ref().and_then(|p| p.candidates.as_ref()).expect("H's candidates");
    let blocks = |name: &str| h.decode.iter().find(|c| c.worker == name).map(|c| c.device_blocks);
    assert_eq!(blocks("decode-0"), Some(6), "{h:?}");
}

#[test]
fn a_hung_worker_that_crashes_does_not_go_on_and_comes_back_as_a_new_process() {
    // decode-0 hangs at 117 ms (A's step under way) and would go on at 30 s, but its process dies at 5 s and a
    // new one starts at 40 s: the dead process does not go on, and the new one does not wait for the step the old
    // one hung in.
    let mut s = decode_0_hangs(Some(30.0));
    s.failures.push(sim::Failure { worker: "decode-0".into(), at: 5.0, back: Some(40.0), fault: sim::Fault::Crash });
    let trace = [request(0.0, 100, 3, 1), request(300.0, 50, 1, 2), request(400.0, 50, 1, 3)];
    let out = simulate(&s, &trace, &plan(&trace, &Arrivals::Trace { speedup: 1.0 })).expect("runs");
    assert!(out.records.iter().all(|r| r.status == 200), "{:?}", out.records);
    assert_eq!(out.decisions.get("worker_failed"), Some(&1));
    assert_eq!(out.decisions.get("worker_resumed"), None);
    assert_eq!(out.decisions.get("worker_back"), Some(&1));
}

#[test]
fn a_hung_prefill_worker_stalls_its_pulls_until_they_time_out_and_its_prefills_until_the_connection_closes() {
    // One prefill worker, two decode workers. A (100 tokens, 3 out) is prefilled by 110 ms; its six full blocks
    // take about 1 ms to pull (0.5 ms latency, 12.6 MB at 25 GB/s), and the prefill worker hangs at 110.2 ms, in
    // the middle. The pull gives up 10 s after it began (110 ms + 10 s): A resumes on the other decode worker,
    // which computes the prompt and the first token (101 tokens, 111 ms): its second token at 10.221 s, its third
    // at 10.226 s.
    let profile = "[prefill]\nbase_ms = 10.0\nper_token_ms = 1.0\n[decode]\nbase_ms = 5.0\n";
    let base = settings(profile, 1, 2, Policy::Kv);
    let trace = [request(0.0, 100, 3, 1)];
    let starts = plan(&trace, &Arrivals::Trace { speedup: 1.0 });
    let calm = simulate(&base, &trace, &starts).expect("runs");
    assert_eq!(calm.placements[0].as_ref().and_then(|p| p.prefill.as_deref()), Some("prefill-0"));
    let out = simulate(&hanging(base.clone(), "prefill-0", 0.1102), &trace, &starts).expect("runs");
    let a = &out.records[0];
    assert_eq!((a.status, a.output_tokens), (200, 3), "{a:?}");
    assert!((a.time_to_first_token_ms.expect("a first token") - 110.0).abs() < 1e-6);
    assert_gaps(&a.inter_chunk_ms, &[10_111.0, 5.0]);
    assert_eq!(out.decisions.get("decode_resumed"), Some(&1));
    // The same hang, over at 1 s: the pull ends then, and the decode worker computes the 5 tokens it did not pull
    // (15 ms, as in the calm run after its pull of about 1 ms): the second token at 1.015 s, the third 5 ms later.
    let mut resumed = hanging(base.clone(), "prefill-0", 0.1102);
    resumed.failures[0].back = Some(1.0);
    let out = simulate(&resumed, &trace, &starts).expect("runs");
    let a = &out.records[0];
    assert_eq!((a.status, a.output_tokens), (200, 3), "{a:?}");
    assert!((calm.records[0].inter_chunk_ms[0] - 16.0).abs() < 0.01, "{:?}", calm.records[0]);
    assert_gaps(&a.inter_chunk_ms, &[905.0, 5.0]);
    assert_eq!(out.decisions.get("decode_resumed"), None);

    // It hangs during A's prefill instead (at 50 ms): the prefill call waits for the connection to close (20.05
    // s), and with no other prefill candidate the decode worker prefills A itself (110 ms): first token at
    // 20.16 s, then two more, 5 ms each.
    let out = simulate(&hanging(base, "prefill-0", 0.05), &trace, &starts).expect("runs");
    let a = &out.records[0];
    assert_eq!((a.status, a.output_tokens), (200, 3), "{a:?}");
    assert!((a.time_to_first_token_ms.expect("a first token") - 20_160.0).abs() < 1e-6, "{a:?}");
    assert!((a.request_latency_ms - 20_170.0).abs() < 1e-6, "{a:?}");
    assert_eq!(out.decisions.get("local_prefill_after_failure"), Some(&1));
}

#[test]
fn a_worker_that_answers_with_errors_is_ejected_by_the_breaker_and_taken_back_once_it_answers() {
    // Two decode workers in turn; every 100 ms a request of 50 tokens and 1 out (60 ms). decode-0 breaks at 10 ms,
    // during request 0, which resumes on decode-1 (10 -> 70 ms). From then on each request the router sends
    // decode-0 fails at once and resumes on decode-1 (60 ms: decode-1 is idle at each arrival). The fifth failure
    // in a row ejects decode-0 for 5 s: nothing goes there until then; the first request after it fails again and
    // ejects it for 10 s, past the run's end.
    let profile = "[prefill]\nbase_ms = 10.0\nper_token_ms = 1.0\n[decode]\nbase_ms = 5.0\n";
    let trace: Vec<_> = (0..80).map(|k| request(100.0 * k as f64, 50, 1, k + 1)).collect();
    let starts = plan(&trace, &Arrivals::Trace { speedup: 1.0 });
    let erring = |back: Option<f64>| {
        let failures = vec![sim::Failure { worker: "decode-0".into(), at: 0.01, back, fault: sim::Fault::Errors }];
        let s = Settings { failures, ..settings(profile, 0, 2, Policy::RoundRobin) };
        simulate(&s, &trace, &starts).expect("runs")
    };
    let on_decode_0 = |out: &sim::Outcome| -> Vec<usize> {
        (0..trace.len()).filter(|&k| out.placements[k].as_ref().is_some_and(|p| p.decode == "decode-0")).collect()
    };
    let out = erring(None);
    assert!(out.records.iter().all(|r| r.status == 200), "every request answered");
    let latency = |k: usize| out.records.iter().find(|r| r.index == k).expect("a record").request_latency_ms;
    assert!((latency(0) - 70.0).abs() < 1e-6, "{}", latency(0));
    assert!((1..trace.len()).all(|k| (latency(k) - 60.0).abs() < 1e-6), "every other request took 60 ms");
    let sent = on_decode_0(&out);
    assert_eq!(sent.len(), 6, "five failures, then one after the ejection: {sent:?}");
    let at = |k: usize| 0.1 * k as f64;
    assert!(at(sent[5]) >= at(sent[4]) + 5.0 - 1e-9, "ejected for 5 s: {sent:?}");
    assert!(at(sent[5]) < at(sent[4]) + 5.0 + 0.2 + 1e-9, "then taken back at once: {sent:?}");
    assert_eq!(out.decisions.get("worker_ejected"), Some(&2));
    assert_eq!(out.decisions.get("decode_resumed"), Some(&6));

    // Healed at 3 s, during the ejection: the request after it succeeds there, the breaker closes, and decode-0
    // takes its turns again.
    let out = erring(Some(3.0));
    assert!(out.records.iter().all(|r| r.status == 200));
    let sent = on_decode_0(&out);
    assert!(at(sent[5]) >= at(sent[4]) + 5.0 - 1e-9, "{sent:?}");
    assert!(sent.len() > 5 + 8, "decode-0 takes about every other request after {}: {sent:?}", sent[5]);
    assert_eq!(out.decisions.get("worker_ejected"), Some(&1));
    assert_eq!(out.decisions.get("decode_resumed"), Some(&5));
}

#[test]
fn a_decode_worker_ejected_while_a_prompt_prefills_for_it_is_passed_over() {
    // One prefill worker, busy past 500 prompt tokens; two decode workers in turn. X (1,000 tokens, 2 out) at 0 is
    // sent to prefill-0 (idle) and decided to decode-0; its prefill runs 0 -> 1,010 ms. decode-0 breaks at 1 ms.
    // B1..B10 (10 tokens) arrive every 50 ms while prefill-0 is busy, so each is prefilled on its decode worker:
    // the even ones on decode-0, which fails each at once, and they resume on decode-1. The fifth failure (B10, at
    // 500 ms) ejects decode-0 while X still prefills, so X goes to decode-1 as its first attempt, pulling its KV:
    // five resumptions, not six.
    let profile = "[prefill]\nbase_ms = 10.0\nper_token_ms = 1.0\n[decode]\nbase_ms = 5.0\n";
    let failures = vec![sim::Failure { worker: "decode-0".into(), at: 0.001, back: None, fault: sim::Fault::Errors }];
    let mut s = Settings { failures, ..settings(profile, 1, 2, Policy::RoundRobin) };
    s.scheduler.busy_prefill_tokens = Some(500);
    let mut trace = vec![request(0.0, 1000, 2, 1)];
    trace.extend((1..=10).map(|k| request(50.0 * k as f64, 10, 1, k as u64 + 1)));
    let out = simulate(&s, &trace, &plan(&trace, &Arrivals::Trace { speedup: 1.0 })).expect("runs");
    assert!(out.records.iter().all(|r| r.status == 200), "every request answered");
    let x = out.placements[0].as_ref().expect("placed");
    assert_eq!((x.prefill.as_deref(), x.decode.as_str()), (Some("prefill-0"), "decode-0"), "{x:?}");
    let b_on_decode_0 = (1..=10).filter(|&k| out.placements[k].as_ref().is_some_and(|p| p.decode == "decode-0"));
    assert_eq!(b_on_decode_0.collect::<Vec<_>>(), [2, 4, 6, 8, 10]);
    let x_first = out.records.iter().find(|r| r.index == 0).and_then(|r| r.time_to_first_token_ms);
    assert!(x_first.is_some_and(|t| t > 1000.0), "X prefills past the ejection: {x_first:?}");
    assert_eq!(out.decisions.get("worker_ejected"), Some(&1));
    assert_eq!(out.decisions.get("decode_resumed"), Some(&5), "{:?}", out.decisions);
}

/// Six requests (100 tokens, 3 out) at 0, 0.5, 0.6, 1.5, 4 and 4.1 s, with their starts, and a profile whose prompt
/// step costs 10 ms + 1 ms a token and a decode step 5 ms.
fn six_requests_in_turn() -> (&'static str, Vec<loadgen::trace::TraceRequest>, Vec<loadgen::schedule::Start>) {
    let profile = "[prefill]\nbase_ms = 10.0\nper_token_ms = 1.0\n[decode]\nbase_ms = 5.0\n";
    let trace: Vec<_> = [0.0, 500.0, 600.0, 1500.0, 4000.0, 4100.0]
        .iter()
        .enumerate()
        .map(|(k, &at)| request(at, 100, 3, k as u64 + 1))
        .collect();
    let starts = plan(&trace, &Arrivals::Trace { speedup: 1.0 });
    (profile, trace, starts)
}

#[test]
fn a_worker_whose_engine_stalls_is_given_up_after_the_limit_and_taken_back_once_it_computes() {
    // Two decode workers in turn; a prompt step costs 10 ms + 1 ms a token, a decode 5 ms; reports take 1 ms to
    // arrive; a worker holding work for 1 s without computing is stalled. decode-0 gets stuck at 1 ms, while it
    // computes A's prompt (100 tokens, 3 out; the step began at 0 and does not end). B (at 500 ms) runs on
    // decode-1; C (at 600 ms) goes to decode-0, which is not yet known stuck, and waits there. At 1.001 s (the
    // report of its last progress, at 0, plus 1 s) the router finds it stalled: A and C resume on decode-1, A
    // first (1.001 -> 1.111 s: TTFT 1,111 ms), and D (at 1.5 s) goes to decode-1 as well.
    let (profile, trace, starts) = six_requests_in_turn();
    let stalling = |back: Option<f64>| {
        let failures = vec![sim::Failure { worker: "decode-0".into(), at: 0.001, back, fault: sim::Fault::Stall }];
        let s = Settings { failures, stall_after: 1.0, ..settings(profile, 0, 2, Policy::RoundRobin) };
        simulate(&s, &trace, &starts).expect("runs")
    };
    let out = stalling(None);
    assert!(out.records.iter().all(|r| r.status == 200), "every request answered");
    let record = |k: usize| out.records.iter().find(|r| r.index == k).expect("a record");
    let a_first = record(0).time_to_first_token_ms.expect("a first token");
    assert!((a_first - 1111.0).abs() < 1e-6, "{a_first}");
    let decode = |out: &sim::Outcome, k: usize| out.placements[k].as_ref().expect("placed").decode.clone();
    assert_eq!((decode(&out, 0), decode(&out, 2)), ("decode-0".into(), "decode-0".into()), "decided before");
    assert!((3..6).all(|k| decode(&out, k) == "decode-1"), "nothing more goes to a stalled worker");
    assert_eq!(out.decisions.get("stall_detected"), Some(&1));
    assert_eq!(out.decisions.get("decode_resumed"), Some(&2), "{:?}", out.decisions);

    // It computes again at 3 s: the step that hung ends (what it made for A goes nowhere), the router sees the
    // progress in the next report, and decode-0 takes its turns again.
    let out = stalling(Some(3.0));
    assert!(out.records.iter().all(|r| r.status == 200));
    assert!((4..6).any(|k| decode(&out, k) == "decode-0"), "taken back");
    assert_eq!(out.decisions.get("decode_resumed"), Some(&2));
}

#[test]
fn without_a_stall_limit_the_routers_timeouts_give_up_on_a_stalled_worker() {
    // The trace and the stall of the test above, the stall watch off, the router's prefill timeout 2 s. decode-0
    // stays a candidate: round robin sends it A (0), C (0.6 s) and E (4 s). Each call there gets no first token and
    // gives up 2 s after it began, resuming on decode-1, idle by then: A at 2 s (its prompt 2.0 -> 2.11 s), C at
    // 2.6 s, E at 6 s, each a TTFT of 2,110 ms. Three failures in a row do not eject decode-0 (five do).
    let (profile, trace, starts) = six_requests_in_turn();
    let failures = vec![sim::Failure { worker: "decode-0".into(), at: 0.001, back: None, fault: sim::Fault::Stall }];
    let timeouts = sim::CallTimeouts { prefill: 2.0, decode_idle: 0.5 };
    let s = Settings { failures, stall_after: 0.0, timeouts, ..settings(profile, 0, 2, Policy::RoundRobin) };
    let out = simulate(&s, &trace, &starts).expect("runs");
    assert!(out.records.iter().all(|r| r.status == 200), "every request answered");
    let ttft = |k: usize| out.records.iter().find(|r| r.index == k).and_then(|r| r.time_to_first_token_ms);
    for k in [0, 2, 4] {
        let t = ttft(k).expect("a first token");
        assert!((t - 2110.0).abs() < 1e-6, "request {k}: {t}");
    }
    for k in [1, 3, 5] {
        assert!((ttft(k).expect("a first token") - 110.0).abs() < 1e-6, "request {k} on decode-1 alone");
    }
    assert_eq!(out.decisions.get("prefill_timeout"), Some(&3), "{:?}", out.decisions);
    assert_eq!(out.decisions.get("decode_resumed"), Some(&3));
    assert_eq!(out.decisions.get("stall_detected"), None);
    assert_eq!(out.decisions.get("worker_ejected"), None);
}

#[test]
fn a_decode_stream_that_goes_silent_resumes_after_the_idle_timeout_with_what_it_had_made() {
    // One request (100 tokens, 100 out) on decode-0 of two: its prompt 0 -> 110 ms makes token 1, then a token
    // every 5 ms, token 19 at 200 ms. decode-0's engine hangs at 202.5 ms (the step from 200 ms never ends), the
    // stall watch off, the idle timeout 0.5 s: the stream gives up at 700 ms and resumes on decode-1 with the
    // prompt and its 19 tokens (119 tokens: 10 + 119 ms, token 20 at 829 ms), then 80 more at 5 ms: the last at
    // 1,229 ms, and the longest gap 629 ms.
    let profile = "[prefill]\nbase_ms = 10.0\nper_token_ms = 1.0\n[decode]\nbase_ms = 5.0\n";
    let trace = [request(0.0, 100, 100, 1)];
    let starts = plan(&trace, &Arrivals::Trace { speedup: 1.0 });
    let failures = vec![sim::Failure { worker: "decode-0".into(), at: 0.2025, back: None, fault: sim::Fault::Stall }];
    let timeouts = sim::CallTimeouts { prefill: 2.0, decode_idle: 0.5 };
    let s = Settings { failures, stall_after: 0.0, timeouts, ..settings(profile, 0, 2, Policy::RoundRobin) };
    let out = simulate(&s, &trace, &starts).expect("runs");
    let r = &out.records[0];
    assert_eq!((r.status, r.output_tokens), (200, 100), "{r:?}");
    assert!((r.request_latency_ms - 1229.0).abs() < 1e-6, "{}", r.request_latency_ms);
    let longest = r.inter_chunk_ms.iter().copied().fold(0.0, f64::max);
    assert!((longest - 629.0).abs() < 1e-6, "{longest}");
    assert_eq!(out.decisions.get("decode_idle_timeout"), Some(&1), "{:?}", out.decisions);
    assert_eq!(out.decisions.get("decode_resumed"), Some(&1));
}

#[test]
fn a_lost_prefill_goes_to_the_next_candidate_then_to_the_decode_worker_itself() {
    // Two prefill workers, one decode worker; A (100 tokens, 3 out) is prefilled on one of them (a tie: the
    // decision's). It fails at 50 ms: A is prefilled again on the other, 50 → 160 ms.
    let profile = "[prefill]\nbase_ms = 10.0\nper_token_ms = 1.0\n[decode]\nbase_ms = 5.0\n";
    let base = settings(profile, 2, 1, Policy::Kv);
    let trace = [request(0.0, 100, 3, 1)];
    let starts = plan(&trace, &Arrivals::Trace { speedup: 1.0 });
    let calm = simulate(&base, &trace, &starts).expect("runs");
    let chosen = calm.placements[0].as_ref().and_then(|p| p.prefill.clone()).expect("disaggregated");
    let out = simulate(&failing(base.clone(), &[(&chosen, 0.05)]), &trace, &starts).expect("runs");
    let a = &out.records[0];
    assert_eq!((a.status, a.output_tokens), (200, 3));
    assert!((a.time_to_first_token_ms.expect("a first token") - 160.0).abs() < 1e-6);
    assert_eq!(out.decisions.get("prefill_retried"), Some(&1));
    // Both fail at 50 ms: after the second attempt is lost too, the decode worker prefills A itself (50 → 160 ms)
    // and makes the other two tokens (165, 170 ms).
    let out = simulate(&failing(base, &[("prefill-0", 0.05), ("prefill-1", 0.05)]), &trace, &starts).expect("runs");
    let a = &out.records[0];
    assert_eq!((a.status, a.output_tokens), (200, 3));
    assert!((a.time_to_first_token_ms.expect("a first token") - 160.0).abs() < 1e-6);
    assert!((a.request_latency_ms - 170.0).abs() < 1e-6, "{}", a.request_latency_ms);
    assert_eq!(out.decisions.get("local_prefill_after_failure"), Some(&1));
}

#[test]
fn a_resumed_request_keeps_the_cached_tokens_its_prefill_worker_reported() {
    // A leaves its prompt on the prefill worker; B (the same 100 tokens, 10 out) finds 96 of them cached there and
    // is decoded on one of the two decode workers, which fails mid-decode: B resumes on the other, which computes
    // the whole prompt again, but the client was told of 96 cached tokens, and its record says so.
    let profile = "[prefill]\nbase_ms = 10.0\nper_token_ms = 1.0\n[decode]\nbase_ms = 5.0\n";
    let base = settings(profile, 1, 2, Policy::Kv);
    let trace = [request(0.0, 100, 1, 1), request(200.0, 100, 10, 1)];
    let starts = plan(&trace, &Arrivals::Trace { speedup: 1.0 });
    let calm = simulate(&base, &trace, &starts).expect("runs");
    assert_eq!(calm.records[1].cached_tokens, 96);
    let decoder = calm.placements[1].as_ref().map(|p| p.decode.clone()).expect("placed");
    let out = simulate(&failing(base, &[(&decoder, 0.25)]), &trace, &starts).expect("runs");
    let b = &out.records[1];
    assert_eq!((b.status, b.output_tokens, b.cached_tokens), (200, 10, 96));
    assert_eq!(out.decisions.get("decode_resumed"), Some(&1));
}

#[test]
fn a_worker_that_comes_back_starts_empty_and_takes_a_ramped_share() {
    // One decode worker holding A's prompt fails at 200 ms and comes back at 1 s: B, between, finds no decode
    // worker; C, A's prompt again, finds nothing cached on the new process and computes it all (110 ms, not 14).
    let profile = "[prefill]\nbase_ms = 10.0\nper_token_ms = 1.0\n[decode]\nbase_ms = 5.0\n";
    let back = |s: Settings, at: f64, back: f64| Settings {
        failures: vec![sim::Failure { worker: "decode-0".into(), at, back: Some(back), fault: sim::Fault::Crash }],
        ..s
    };
    let s = back(settings(profile, 0, 1, Policy::RoundRobin), 0.2, 1.0);
    let trace = [request(0.0, 100, 1, 1), request(500.0, 50, 1, 2), request(1500.0, 100, 1, 1)];
    let out = simulate(&s, &trace, &plan(&trace, &Arrivals::Trace { speedup: 1.0 })).expect("runs");
    let r = &out.records;
    assert_eq!(r.iter().map(|r| r.status).collect::<Vec<_>>(), [200, 503, 200]);
    assert_eq!(r[2].cached_tokens, 0);
    assert!((r[2].time_to_first_token_ms.expect("a first token") - 110.0).abs() < 1e-6);
    assert_eq!((out.decisions.get("worker_failed"), out.decisions.get("worker_back")), (Some(&1), Some(&1)));
    assert_eq!(out.prefill_tokens_computed, 200, "the failed engine's work counts too");

    // Two decode workers, decode-0 down from 100 ms and back at 1 s; from 2 s, forty requests 10 ms apart (after
    // one at 0 that starts the clock). The router keeps a worker that joined 1 s ago among the candidates a tenth
    // of the time (slow start over 10 s): it takes far fewer of the forty than with slow start off.
    let first = std::iter::once(request(0.0, 10, 1, 99));
    let trace: Vec<_> = first.chain((0..40).map(|k| request(2000.0 + 10.0 * k as f64, 50, 1, 100 + k))).collect();
    let starts = plan(&trace, &Arrivals::Trace { speedup: 1.0 });
    let on_back = |slow_start_secs: f64| {
        let scheduler = SchedulerConfig { slow_start_secs, ..SchedulerConfig::default() };
        let s = back(Settings { scheduler, ..settings(profile, 0, 2, Policy::Kv) }, 0.1, 1.0);
        let out = simulate(&s, &trace, &starts).expect("runs");
        out.placements.iter().skip(1).flatten().filter(|p| p.decode == "decode-0").count()
    };
    let (ramped, even) = (on_back(10.0), on_back(0.0));
    assert!(2 * ramped < even && even >= 15, "decode-0 took {ramped} ramped, {even} without slow start");
}

#[test]
fn with_no_decode_worker_left_a_request_fails_after_its_attempts_and_later_ones_are_refused() {
    // As above with one decode worker, which fails at 117 ms: each resumption finds no other worker and fails at
    // once, and after three attempts (the router's limit) A fails with the two tokens it had. B, at 200 ms, finds
    // no decode worker.
    let profile = "[prefill]\nbase_ms = 10.0\nper_token_ms = 1.0\n[decode]\nbase_ms = 5.0\n";
    let s = failing(settings(profile, 0, 1, Policy::RoundRobin), &[("decode-0", 0.117)]);
    let trace = [request(0.0, 100, 10, 1), request(200.0, 50, 1, 2)];
    let out = simulate(&s, &trace, &plan(&trace, &Arrivals::Trace { speedup: 1.0 })).expect("runs");
    let (a, b) = (&out.records[0], &out.records[1]);
    assert_eq!((a.status, a.output_tokens), (502, 2));
    assert_eq!(a.error.as_deref(), Some("no decode worker finished the request after 3 attempts"));
    assert!((a.request_latency_ms - 117.0).abs() < 1e-6);
    assert_eq!(out.decisions.get("decode_resumed"), Some(&2));
    assert_eq!(b.status, 503);
    // A name that is no worker's is refused before the run.
    let unknown = failing(s, &[("decode-7", 1.0)]);
    let err = simulate(&unknown, &trace, &plan(&trace, &Arrivals::Trace { speedup: 1.0 })).expect_err("no such worker");
    assert!(err.to_string().contains("decode-7"), "{err}");
}

#[test]
fn workers_sharing_one_core_slow_each_other_down() {
    // The first scenario on one shared core. A's prefill (110 ms of work) runs alone for 1 ms; from B's start both
    // run at half speed, so A ends at 1 + 2 × 109 = 219 ms and B, with 1 ms left then, at 221 (TTFT 220). A's next
    // step (C's 50 tokens and A's decode: 65 ms) starts at 219, at half speed until B ends (1 ms of work done),
    // then alone: 221 + 64 = 285 ms (C's TTFT 283). A's last decode runs alone: 285 → 290 ms.
    let profile = "[prefill]\nbase_ms = 10.0\nper_token_ms = 1.0\n[decode]\nbase_ms = 5.0\n";
    let s = Settings { host_cores: 1, ..settings(profile, 0, 2, Policy::RoundRobin) };
    let trace = [request(0.0, 100, 3, 1), request(1.0, 100, 1, 2), request(2.0, 50, 1, 3)];
    let out = simulate(&s, &trace, &plan(&trace, &Arrivals::Trace { speedup: 1.0 })).expect("runs");
    let ttft: Vec<f64> = out.records.iter().map(|r| r.time_to_first_token_ms.expect("a first token")).collect();
    let e2e: Vec<f64> = out.records.iter().map(|r| r.request_latency_ms).collect();
    for (got, want) in ttft.iter().zip([219.0, 220.0, 283.0]).chain(e2e.iter().zip([290.0, 220.0, 283.0])) {
        assert!((got - want).abs() < 1e-6, "TTFT {ttft:?}, E2E {e2e:?}");
    }
    // Two cores for two workers: nobody waits, the times of the first scenario.
    let two = Settings { host_cores: 2, ..s };
    let out = simulate(&two, &trace, &plan(&trace, &Arrivals::Trace { speedup: 1.0 })).expect("runs");
    let ttft: Vec<f64> = out.records.iter().map(|r| r.time_to_first_token_ms.expect("a first token")).collect();
    assert!(ttft.iter().zip([110.0, 110.0, 173.0]).all(|(g, w)| (g - w).abs() < 1e-6), "{ttft:?}");
}

#[test]
fn the_same_trace_and_seed_give_the_same_records_and_shared_prefixes_are_cached() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/traces/mooncake_conversation_1k.jsonl");
    let mut trace = loadgen::trace::read(&path).expect("the committed sample");
    trace.truncate(40);
    for r in &mut trace {
        // Small enough for the test's workers: the first 600 tokens of each prompt, 8 tokens out.
        r.input_length = r.input_length.min(600);
        r.output_length = 8;
    }
    let starts = plan(&trace, &Arrivals::Trace { speedup: 1.0 });
    let s = settings_gpu();
    let a = simulate(&s, &trace, &starts).expect("runs");
    let b = simulate(&s, &trace, &starts).expect("runs again");
    assert_eq!(a, b);
    assert_eq!(a.records.len(), 40);
    assert!(a.records.iter().all(|r| r.status == 200), "{:?}", a.records.iter().find(|r| r.status != 200));
    assert!(a.records.iter().map(|r| r.cached_tokens).sum::<u64>() > 0, "shared prefixes are reused");
    assert!(a.transfer_bytes > 0, "disaggregated requests move KV");
    assert_eq!(a.balance.samples, 40);

    // Three router replicas, each with its own view: still deterministic, still every request served.
    let s3 = Settings { routers: 3, ..s };
    let c = simulate(&s3, &trace, &starts).expect("runs with three routers");
    assert_eq!(c, simulate(&s3, &trace, &starts).expect("and again"));
    assert!(c.records.iter().all(|r| r.status == 200));
}

#[test]
fn on_shared_prefixes_at_an_open_loop_rate_kv_computes_less_prompt_than_round_robin() {
    // 60 requests over 16 system prompts of 256 tokens, Poisson at 20 per second, 2 + 2 workers. (Over 4, both
    // policies soon have every prompt on both decode workers, which compute most of these short prompts.)
    let (trace, starts) = shared_prefixes(60, 16, 20.0, 3);
    let run = |policy| {
        let s = settings_gpu();
        let s = Settings { scheduler: SchedulerConfig { policy, ..s.scheduler.clone() }, ..s };
        simulate(&s, &trace, &starts).expect("runs")
    };
    let (kv, rr) = (run(Policy::Kv), run(Policy::RoundRobin));
    assert!(kv.records.iter().chain(&rr.records).all(|r| r.status == 200));
    let cached = |o: &sim::Outcome| o.records.iter().map(|r| r.cached_tokens).sum::<u64>();
    assert!(cached(&kv) > cached(&rr), "kv {} vs round robin {}", cached(&kv), cached(&rr));
    assert!(kv.prefill_tokens_computed < rr.prefill_tokens_computed);
}

#[test]
fn replaying_a_runs_own_decisions_gives_back_the_same_run() {
    // 40 requests over shared prefixes through kv routing; then the same arrivals with each request's workers
    // forced to where kv sent it, as a router recording would state them: the same records, request by request.
    let (trace, starts) = shared_prefixes(40, 3, 30.0, 9);
    let s = settings_gpu();
    let kv = simulate(&s, &trace, &starts).expect("runs");
    let recorded: Vec<loadgen::trace::TraceRequest> = trace
        .iter()
        .zip(&kv.placements)
        .map(|(r, p)| {
            let p = p.clone().expect("every request placed");
            let decision = loadgen::trace::RecordedDecision {
                disaggregate: p.prefill.is_some(),
                prefill: p.prefill,
                decode: Some(p.decode),
                ..Default::default()
            };
            loadgen::trace::TraceRequest {
                recorded: Some(Box::new(loadgen::trace::Recorded { namespace: None, decision, ended: None })),
                ..r.clone()
            }
        })
        .collect();
    assert!(kv.placements.iter().flatten().any(|p| p.prefill.is_some()), "some requests were disaggregated");
    let replay = simulate(&Settings { replay: true, ..s }, &recorded, &starts).expect("replays");
    assert_eq!(replay.records, kv.records);
    let workers = |o: &sim::Outcome| -> Vec<_> {
        o.placements.iter().map(|p| p.as_ref().map(|p| (p.prefill.clone(), p.decode.clone()))).collect()
    };
    assert_eq!(workers(&replay), workers(&kv));
}

#[test]
fn a_replayed_prefill_that_fails_moves_on_through_its_recorded_candidates() {
    // A (100 tokens, 3 out) on one of two prefill workers, which fails at 50 ms. Replayed from a recording with
    // the decision's candidates, A moves on to the other prefill worker, as the router would have; from one
    // without them, the replay knows no other candidate and the decode worker prefills A itself.
    let profile = "[prefill]\nbase_ms = 10.0\nper_token_ms = 1.0\n[decode]\nbase_ms = 5.0\n";
    let base = Settings { record_candidates: true, ..settings(profile, 2, 1, Policy::Kv) };
    let trace = [request(0.0, 100, 3, 1)];
    let starts = plan(&trace, &Arrivals::Trace { speedup: 1.0 });
    let calm = simulate(&base, &trace, &starts).expect("runs");
    let placed = calm.placements[0].clone().expect("placed");
    let chosen = placed.prefill.clone().expect("disaggregated");
    // The candidates as a recording writes them (`router::record`), read back as a replay reads them.
    let candidates = placed.candidates.as_ref().map(|c| serde_json::to_value(c).expect("serializes"));
    let replay = |candidates: Option<serde_json::Value>| {
        let decision = loadgen::trace::RecordedDecision {
            disaggregate: true,
            prefill: Some(chosen.clone()),
            decode: Some(placed.decode.clone()),
            candidates: candidates.map(|c| serde_json::from_value(c).expect("a recording's candidates parse")),
            ..Default::default()
        };
        let recorded = loadgen::trace::Recorded { namespace: None, decision, ended: None };
        let trace = [loadgen::trace::TraceRequest { recorded: Some(Box::new(recorded)), ..trace[0].clone() }];
        let s = failing(Settings { replay: true, record_candidates: false, ..base.clone() }, &[(&chosen, 0.05)]);
        simulate(&s, &trace, &starts).expect("replays")
    };
    let out = replay(candidates);
    let a = &out.records[0];
    assert_eq!((a.status, a.output_tokens), (200, 3));
    assert!((a.time_to_first_token_ms.expect("a first token") - 160.0).abs() < 1e-6);
    assert_eq!(out.decisions.get("prefill_retried"), Some(&1));
    let out = replay(None);
    assert_eq!(out.records[0].status, 200);
    assert_eq!(out.decisions.get("prefill_retried"), None);
    assert_eq!(out.decisions.get("local_prefill_after_failure"), Some(&1));
}

#[test]
fn placements_explain_their_decisions_only_when_asked_and_change_nothing() {
    let (trace, starts) = shared_prefixes(40, 3, 30.0, 9);
    let s = settings_gpu();
    let plain = simulate(&s, &trace, &starts).expect("runs");
    let explained = simulate(&Settings { record_candidates: true, ..s.clone() }, &trace, &starts).expect("runs");
    assert_eq!(explained.records, plain.records);
    assert!(plain.placements.iter().flatten().all(|p| p.candidates.is_none()));
    for (p, q) in explained.placements.iter().flatten().zip(plain.placements.iter().flatten()) {
        let c = p.candidates.as_ref().expect("candidates");
        assert_eq!((c.prefill.len(), c.decode.len()), (s.prefill, s.decode), "every worker a candidate");
        // The chosen worker is the cheapest, and its margin is the runner-up's extra cost.
        let chosen = p.prefill.as_ref().map_or(&c.decode, |_| &c.prefill);
        let name = p.prefill.as_ref().unwrap_or(&p.decode);
        let best = chosen.iter().map(|x| x.cost).fold(f64::INFINITY, f64::min);
        assert!(chosen.iter().any(|x| &x.worker == name && x.cost == best), "{name}: {chosen:?}");
        assert_eq!((&p.prefill, &p.decode, p.margin), (&q.prefill, &q.decode, q.margin));
    }
}

#[test]
fn a_disk_tier_serves_what_the_upper_tiers_lost_and_its_files_go_with_the_run() {
    // 2 + 2 workers with 256 device and 32 host blocks each: 48 system prompts of 16 blocks (plus 4 of each
    // request's own) do not fit in them, and come back from disk.
    let mut s = settings_gpu();
    (s.engine.kv_blocks, s.engine.host_blocks, s.engine.disk_blocks) = (256, 32, 2048);
    let (trace, starts) = shared_prefixes(150, 48, 5.0, 4);
    let before: Vec<_> = tandem_sim_dirs();
    let out = simulate(&s, &trace, &starts).expect("runs");
    assert!(out.records.iter().all(|r| r.status == 200), "{:?}", out.decisions);
    assert!(out.cached_tokens_by_tier[2] > 0, "hits by tier: {:?}", out.cached_tokens_by_tier);
    assert_eq!(tandem_sim_dirs(), before, "the run's disk directory is removed");
    let without = simulate(&Settings { engine: without_disk(&s), ..s.clone() }, &trace, &starts).expect("runs");
    assert!(without.prefill_tokens_computed > out.prefill_tokens_computed);
}

fn without_disk(s: &Settings) -> engine::generate::EngineConfig {
    engine::generate::EngineConfig { disk_blocks: 0, ..s.engine.clone() }
}

/// This process's simulator scratch directories.
fn tandem_sim_dirs() -> Vec<std::path::PathBuf> {
    let prefix = format!("tandem-sim-{}-", std::process::id());
    let mut dirs: Vec<_> = std::fs::read_dir(std::env::temp_dir())
        .map(|d| d.filter_map(Result::ok).map(|e| e.path()).collect())
        .unwrap_or_default();
    dirs.retain(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(&prefix)));
    dirs.sort();
    dirs
}

#[test]
fn a_prefill_past_its_workers_lease_room_is_refused_and_computed_elsewhere() {
    // Prefill: 10 ms + 1 ms per token; decode: 5 ms per step. A worker's device tier has 256 blocks, so 128 of
    // them may be reserved or leased: two 1,000-token prompts (63 blocks each). A, B and C (1,000 tokens each, 2
    // out) arrive together and the router sends all three to the only prefill worker, which takes A and B and
    // refuses C: with no other prefill candidate, the decode worker computes C itself, idle until then (0 → 1,010
    // ms, then one decode step), while B waits for A's step (1,010 → 2,020 ms). D, at 3 s, finds the room back:
    // A's and B's leases ended when the decode worker's engine took their pulled blocks.
    let profile = "[prefill]\nbase_ms = 10.0\nper_token_ms = 1.0\n[decode]\nbase_ms = 5.0\n";
    let s = settings(profile, 1, 1, Policy::Kv);
    let at_once = |id| request(0.0, 1000, 2, id);
    let trace = [at_once(1), at_once(2), at_once(3), request(3000.0, 1000, 2, 4)];
    let out = simulate(&s, &trace, &plan(&trace, &Arrivals::Trace { speedup: 1.0 })).expect("runs");
    assert_eq!(out.decisions.get("prefill_refused"), Some(&1), "{:?}", out.decisions);
    assert_eq!(out.decisions.get("local_prefill_after_failure"), Some(&1));
    let ttft: Vec<f64> = out.records.iter().map(|r| r.time_to_first_token_ms.expect("a first token")).collect();
    for (k, want) in [1010.0, 2020.0, 1010.0, 1010.0].into_iter().enumerate() {
        assert!((ttft[k] - want).abs() < 1e-6, "TTFT of request {k}: {} (want {want})", ttft[k]);
    }
    assert!((out.records[2].request_latency_ms - 1015.0).abs() < 1e-6, "{}", out.records[2].request_latency_ms);
    assert!(out.records.iter().all(|r| r.status == 200 && r.output_tokens == 2));
}
