//! The router in front of a real prefill and decode worker: OpenAI requests in, the engine's tokens out.

use std::num::NonZeroU32;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use engine::chat::ChatMessage;
use engine::generate::{Engine, EngineConfig, Request};
use kv_transfer::tls::DevCa;
use router::run::RunningRouter;
use tandem_tests::fake::Behaviour::{NoPulls, StalledPulls};
use tandem_tests::*;
use worker::Role;

const MODEL: &str = "smollm2-135m-instruct";

/// The engine's own greedy answer: text and token count.
fn greedy_reply(messages: &[ChatMessage], max_tokens: u32) -> (String, usize) {
    let mut e = Engine::open(&model(), EngineConfig::default()).expect("engine");
    let prompt = e.tokenizer().encode(&e.render_chat(messages).expect("template"));
    let req = Request::greedy(prompt, NonZeroU32::new(max_tokens).expect("n"));
    let c = e.run(&[req], &AtomicBool::new(false), |_| {}).expect("runs").remove(0);
    (c.text, c.token_ids.len())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_through_the_router_matches_the_engine_and_reuses_the_prefix() {
    let ca = DevCa::generate().expect("ca");
    let (workers, router) = cluster(&ca, &[Role::Prefill, Role::Decode]).await;
    let (p, d) = (&workers[0], &workers[1]);
    let addr = router.addr;

    let system = "You are a careful assistant. Answer in one short sentence, and never use lists. ".repeat(3);
    let question = "What is the capital of France?";
    let (want, want_tokens) =
        greedy_reply(&[ChatMessage::new("system", &system), ChatMessage::new("user", question)], 12);
    let body = serde_json::json!({
        "model": MODEL, "max_tokens": 12, "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
    })
    .to_string();

    // The decision first, without running it: a cold prompt goes to the prefill worker.
    let explained = http(addr, "POST", "/debug/route", &body, &[]).await;
    assert_eq!(explained.status, 200, "{}", explained.body);
    let d_json = explained.json();
    assert_eq!(d_json["disaggregate"], true, "{d_json}");
    assert_eq!(d_json["prefill"]["worker"], p.grpc.to_string());
    assert_eq!(d_json["decode"]["worker"], d.grpc.to_string());

    let reply = http(addr, "POST", "/v1/chat/completions", &body, &[]).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let v = reply.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["content"], want.as_str(), "P + D through the router = one engine");
    assert_eq!(v["usage"]["completion_tokens"], want_tokens);
    let finish = if want_tokens < 12 { "stop" } else { "length" };
    assert_eq!(v["choices"][0]["finish_reason"], finish);
    assert!(d.pulled_blocks() > 0, "the KV came from the prefill worker");

    // The same prefix again, streamed with usage: P reports its cached tokens; the text is the same.
    tokio::time::sleep(Duration::from_millis(300)).await; // let P's events reach the index
    let explained = http(addr, "POST", "/debug/route", &body, &[]).await.json();
    let device_blocks = explained["prefill"]["candidates"][0]["device_blocks"].as_u64().expect("blocks");
    assert!(device_blocks >= 4, "the index knows P holds the prompt: {explained}");
    let streamed = serde_json::json!({
        "model": MODEL, "max_tokens": 12, "temperature": 0, "stream": true,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
    })
    .to_string();
    let reply = http(addr, "POST", "/v1/chat/completions", &streamed, &[]).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let events = reply.events();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<serde_json::Value> =
        events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).expect("json chunk")).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String =
        chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect::<Vec<_>>().concat();
    assert_eq!(text, want);
    let usage = &chunks.last().expect("usage chunk")["usage"];
    let cached = usage["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached tokens");
    assert!(cached >= 64, "the shared prefix was served from P's cache: {usage}");

    let metrics = http(addr, "GET", "/metrics", "", &[]).await.body;
    assert!(
        metrics.contains("tandem_router_requests_total{route=\"/v1/chat/completions\",status=\"200\"} 2"),
        "{metrics}"
    );
    assert!(metrics.contains("reason=\"prefill_remote\""), "{metrics}");
    // The value of the series `name` (its labels and the space after them included).
    let value = |name: &str| -> f64 {
        let v = metrics.lines().find_map(|l| l.strip_prefix(name)).unwrap_or_else(|| panic!("{name}: {metrics}"));
        v.parse().unwrap_or_else(|_| panic!("{name}: {v} is not a number"))
    };
    // The tokenizer's work: at least both chat requests' prompts (`/debug/route` tokenizes its own), in some time.
    let prompt_tokens = usage["prompt_tokens"].as_f64().expect("prompt tokens");
    assert!(value("tandem_router_tokenized_tokens_total ") >= 2.0 * prompt_tokens, "{metrics}");
    assert!(value("tandem_router_tokenize_seconds_total ") > 0.0, "{metrics}");
    // How stale the router's view of each worker may be: both signals are flowing, so both ages are fresh.
    for worker in [p.grpc.to_string(), d.grpc.to_string()] {
        for signal in ["load", "events"] {
            let series = format!("tandem_router_worker_signal_age_seconds{{worker=\"{worker}\",signal=\"{signal}\"}} ");
            let age = value(&series);
            assert!((0.0..30.0).contains(&age), "{series}{age}");
        }
    }
    // What the index holds per worker and tier: at least the prompt's blocks on P's device tier.
    let series = format!("tandem_router_worker_indexed_blocks{{worker=\"{}\",tier=\"device\"}} ", p.grpc);
    let held = value(&series);
    assert!(held >= device_blocks as f64, "{held} < {device_blocks}");
    stop(router, workers).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_errors_with_the_right_status() {
    let ca = DevCa::generate().expect("ca");
    let d = worker(&ca, Role::Decode, "decode-0").await;
    let mut config = router_config(&ca, vec![d.grpc]);
    config.tenants = router::tenants::Tenants::open(vec!["sk-test".into()]);
    let router = RunningRouter::start(config).await.expect("router");
    wait_for_workers(&router, 1).await;
    let addr = router.addr;
    let auth = [("authorization", "Bearer sk-test")];
    let chat = |extra: &str| format!(r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}]{extra}}}"#);
    /// (case, body, headers, status, a word the error must contain).
    type Case<'a> = (&'a str, String, &'a [(&'a str, &'a str)], u16, &'a str);
    let cases: Vec<Case> = vec![
        ("no key", chat(""), &[], 401, "invalid_api_key"),
        ("malformed JSON", "{\"model\":".into(), &auth, 400, "JSON"),
        (
            "unknown model",
            r#"{"model":"gpt-9","messages":[{"role":"user","content":"hi"}]}"#.into(),
            &auth,
            404,
            "gpt-9",
        ),
        ("bad temperature", chat(r#","temperature":-1"#), &auth, 400, "temperature"),
        ("bad top_p", chat(r#","top_p":1.5"#), &auth, 400, "top_p"),
        ("too long", chat(r#","max_tokens":100000"#), &auth, 400, "context_length_exceeded"),
    ];
    for (name, body, headers, status, needle) in cases {
        let r = http(addr, "POST", "/v1/chat/completions", &body, headers).await;
        assert_eq!(r.status, status, "{name}: {}", r.body);
        let e = &r.json()["error"];
        assert!(e["message"].is_string() && e["type"].is_string(), "{name}: {}", r.body);
        assert!(r.body.contains(needle), "{name}: {}", r.body);
    }
    let r = http(addr, "POST", "/v1/chat/completions", &chat(r#","max_tokens":100000"#), &auth).await;
    assert_eq!(r.json()["error"]["param"], "messages", "{}", r.body);
    // Each answer names its request, a refusal too: `x-request-id` is the response's id, and the client's own id
    // (OpenAI's `X-Client-Request-Id`) comes back.
    assert!(r.header("x-request-id").is_some_and(|id| id.starts_with("chatcmpl-")), "{:?}", r.headers);
    let mine = [auth[0], ("x-client-request-id", "run-7/req-1")];
    let r =
        http(addr, "POST", "/v1/completions", &format!(r#"{{"model":"{MODEL}","prompt":"hi","max_tokens":1}}"#), &mine)
            .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-request-id"), r.json()["id"].as_str());
    assert_eq!(r.header("x-client-request-id"), Some("run-7/req-1"));
    let long = "x".repeat(513);
    let r = http(addr, "POST", "/v1/chat/completions", &chat(""), &[auth[0], ("x-client-request-id", &long)]).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.json()["error"]["message"].as_str().is_some_and(|m| m.contains("x-client-request-id")), "{}", r.body);
    // An over-long prompt, not just an over-long budget: the error names the completions endpoint's field.
    let long = "word ".repeat(9000);
    let r = http(addr, "POST", "/v1/completions", &format!(r#"{{"model":"{MODEL}","prompt":"{long}"}}"#), &auth).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(
        (r.json()["error"]["code"].as_str(), r.json()["error"]["param"].as_str()),
        (Some("context_length_exceeded"), Some("prompt")),
        "{}",
        r.body
    );

    // Live config: read, change, refuse nonsense.
    let r = http(addr, "GET", "/admin/router-config", "", &auth).await;
    assert_eq!(r.json()["policy"], "kv");
    let r = http(addr, "PUT", "/admin/router-config", r#"{"policy":"round_robin","decay":0.5}"#, &auth).await;
    assert_eq!((r.status, r.json()["policy"].as_str()), (200, Some("round_robin")), "{}", r.body);
    let r = http(addr, "PUT", "/admin/router-config", r#"{"temperature":-2,"decay":-1}"#, &auth).await;
    assert_eq!(r.status, 400);
    assert!(r.body.contains("temperature") && r.body.contains("decay"), "{}", r.body);
    let r = http(addr, "PUT", "/admin/router-config", r#"{"overlap_weight":1}"#, &auth).await;
    assert_eq!(r.status, 400, "unknown fields are refused: {}", r.body);
    assert_eq!(http(addr, "GET", "/admin/router-config", "", &auth).await.json()["decay"], 0.5);

    // Models, health and readiness.
    let models = http(addr, "GET", "/v1/models", "", &auth).await.json();
    assert_eq!(models["data"][0]["id"], MODEL);
    assert_eq!(models["data"][0]["max_model_len"], 8192, "the context, as vLLM reports it: {models}");
    let one = http(addr, "GET", &format!("/v1/models/{MODEL}"), "", &auth).await;
    assert_eq!((one.status, one.json()), (200, models["data"][0].clone()), "OpenAI's retrieve call");
    let other = http(addr, "GET", "/v1/models/org/gpt-9", "", &auth).await;
    assert_eq!(
        (other.status, other.json()["error"]["code"].as_str()),
        (404, Some("model_not_found")),
        "{}",
        other.body
    );
    assert!(other.body.contains("org/gpt-9"), "{}", other.body);
    assert_eq!(http(addr, "GET", &format!("/v1/models/{MODEL}"), "", &[]).await.status, 401);
    assert_eq!(http(addr, "GET", "/health", "", &[]).await.status, 200);
    assert_eq!(http(addr, "GET", "/ready", "", &[]).await.status, 200);
    router.shutdown(Duration::from_secs(5)).await;
    d.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_prefix_goes_back_to_the_prefill_worker_that_holds_it() {
    let ca = DevCa::generate().expect("ca");
    let (workers, router) = cluster(&ca, &[Role::Prefill, Role::Prefill, Role::Decode]).await;
    let (p1, p2) = (&workers[0], &workers[1]);
    let addr = router.addr;
    // Always through a prefill worker, so that placement there is what is measured.
    let r = http(addr, "PUT", "/admin/router-config", r#"{"disaggregation":"always"}"#, &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);

    let system = "You answer questions about geography. Be precise, brief and friendly. ".repeat(5);
    let ask = |q: &str| {
        serde_json::json!({"model": MODEL, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]})
        .to_string()
    };
    let first = http(addr, "POST", "/v1/chat/completions", &ask("Where is Peru?"), &[]).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let holder = if p1.stats().counters.prefill_tokens > 0 { p1.grpc } else { p2.grpc };
    tokio::time::sleep(Duration::from_millis(300)).await;

    for q in ["Where is Chile?", "Where is Laos?", "Where is Mali?"] {
        let explained = http(addr, "POST", "/debug/route", &ask(q), &[]).await.json();
        assert_eq!(explained["prefill"]["worker"], holder.to_string(), "{explained}");
        let reply = http(addr, "POST", "/v1/chat/completions", &ask(q), &[]).await.json();
        let cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached");
        assert!(cached >= 64, "the shared system prompt came from the holder's cache: {reply}");
    }
    stop(router, workers).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_with_another_block_size_is_refused() {
    let ca = DevCa::generate().expect("ca");
    let d = worker(&ca, Role::Decode, "decode-0").await;
    let mut config = router_config(&ca, vec![d.grpc]);
    config.block_size = 32;
    let router = RunningRouter::start(config).await.expect("router");
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(router.state.cluster.up_members().is_empty(), "the worker's 16-token blocks do not match the router's 32");
    assert_eq!(http(router.addr, "GET", "/ready", "", &[]).await.status, 503);
    router.shutdown(Duration::from_secs(5)).await;
    d.shutdown(Duration::from_secs(5)).await;
}

/// A worker computing 64-token chunks: a prompt of a few hundred tokens takes several steps, so it streams in pieces.
fn chunked(c: worker::WorkerConfig) -> worker::WorkerConfig {
    worker::WorkerConfig { engine: EngineConfig { max_batched_tokens: 64, ..c.engine }, ..c }
}

/// A router that streams long prompts' KV (off by default).
fn streaming(r: router::run::RouterConfig) -> router::run::RouterConfig {
    router::run::RouterConfig { limits: router::state::Limits { stream_kv: true, ..r.limits }, ..r }
}

/// Waits (at most 2 s) for `done`: a release or cancellation that the request's answer does not wait for.
async fn settled(done: impl Fn() -> bool) {
    for _ in 0..40 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The value of an unlabelled series in a metrics text.
fn series(metrics: &str, name: &str) -> f64 {
    let line = metrics.lines().find_map(|l| l.strip_prefix(&format!("{name} ")));
    line.and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{name}: {metrics}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_prompt_streams_its_kv_piece_by_piece_and_answers_as_one_engine() {
    let ca = DevCa::generate().expect("ca");
    let (workers, router) = cluster_with(&ca, &[Role::Prefill, Role::Decode], chunked, streaming).await;
    let (p, d) = (&workers[0], &workers[1]);
    let system = "You answer questions about geography briefly and precisely, in plain words. ".repeat(30);
    let question = "Which river flows through Paris?";
    let messages = [ChatMessage::new("system", &system), ChatMessage::new("user", question)];
    let (want, _) = greedy_reply(&messages, 8);
    let body = serde_json::json!({
        "model": MODEL, "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
    })
    .to_string();
    let reply = http(router.addr, "POST", "/v1/chat/completions", &body, &[]).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let v = reply.json();
    assert_eq!(v["choices"][0]["message"]["content"], want.as_str(), "streamed P + D = one engine");
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().expect("prompt tokens");
    assert!(prompt_tokens > 4 * 64, "{prompt_tokens} tokens: several chunks");
    // The pieces were computed for this request: none of the prompt was served from cache.
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "{v}");

    let metrics = http(router.addr, "GET", "/metrics", "", &[]).await.body;
    let pieces = series(&metrics, "tandem_router_kv_stream_pieces_total");
    assert!(pieces >= 3.0, "the leading pieces were prefilled and pulled ahead: {pieces}");
    assert_eq!(series(&metrics, "tandem_router_kv_stream_piece_failures_total"), 0.0);
    // Every full block came over once: the pieces ahead, the rest with the request.
    assert_eq!(d.pulled_blocks(), prompt_tokens / 16, "no block pulled twice");
    // Each piece's lease and the whole prompt's were released by their pulls.
    settled(|| p.live_leases() == 0).await;
    assert_eq!(p.live_leases(), 0, "no lease left behind");
    stop(router, workers).await;
}

/// A real prefill worker in 64-token chunks and a fake decode worker of protocol `version` that never pulls KV
/// (`Prefetch` fails with `NoPulls`, never ends with `StalledPulls`; `Generate` answers one token), behind a
/// router that streams.
async fn behind_a_decode_worker_that_pulls_nothing(
    behaviour: tandem_tests::fake::Behaviour,
    version: u32,
) -> (worker::RunningWorker, tandem_tests::fake::FakeWorker, RunningRouter) {
    use tandem_tests::fake::FakeWorker;
    let ca = DevCa::generate().expect("ca");
    let p = worker_with(&ca, Role::Prefill, "prefill-0", chunked).await;
    let d = FakeWorker::speaking(&ca, proto::worker::Role::Decode, behaviour, vec![], version).await;
    let router = RunningRouter::start(streaming(router_config(&ca, vec![p.grpc, d.grpc]))).await.expect("router");
    wait_for_workers(&router, 2).await;
    (p, d, router)
}

/// Completes `prompt` with four tokens through `router` (expecting 200): the reply and the router's metrics after.
async fn complete_long(router: &RunningRouter, prompt: &str) -> (serde_json::Value, String) {
    let body = serde_json::json!({"model": MODEL, "max_tokens": 4, "temperature": 0, "prompt": prompt}).to_string();
    let reply = http(router.addr, "POST", "/v1/completions", &body, &[]).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    (reply.json(), http(router.addr, "GET", "/metrics", "", &[]).await.body)
}

/// Completes `prompt` through a router streaming to a fake decode worker of this build's protocol that behaves as
/// `behaviour`: the parties, the router's metrics after, and how many pieces it streamed (at least three).
async fn streamed_to_a_fake(
    behaviour: tandem_tests::fake::Behaviour,
    prompt: &str,
) -> (worker::RunningWorker, tandem_tests::fake::FakeWorker, RunningRouter, String, f64) {
    let (p, d, router) = behind_a_decode_worker_that_pulls_nothing(behaviour, worker::PROTOCOL_VERSION).await;
    let (reply, metrics) = complete_long(&router, prompt).await;
    assert_eq!(reply["usage"]["completion_tokens"], 2, "P's first token, then the fake decode worker's");
    let pieces = series(&metrics, "tandem_router_kv_stream_pieces_total");
    assert!(pieces >= 3.0, "{pieces}");
    (p, d, router, metrics, pieces)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_piece_its_decode_worker_cannot_pull_costs_nothing_but_the_pull() {
    // A decode worker whose every Prefetch fails.
    let prompt = "Streaming pieces of a prompt to a worker that cannot take them. ".repeat(30);
    let (p, _d, router, metrics, pieces) = streamed_to_a_fake(NoPulls, &prompt).await;
    assert_eq!(series(&metrics, "tandem_router_kv_stream_piece_failures_total"), pieces, "every piece's pull failed");
    // The router released each piece's lease when its pull failed; only the whole prompt's, which the fake never
    // pulls, waits for its expiry.
    settled(|| p.live_leases() == 1).await;
    assert_eq!(p.live_leases(), 1, "the pieces' leases went at once");
    stop(router, vec![p]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pulls_still_going_when_the_router_stops_waiting_are_cancelled_and_their_leases_released() {
    // A decode worker whose Prefetch never ends: the router waits its settle limit, then asks for the answer.
    let prompt = "Pieces of a prompt for a worker whose pulls never end. ".repeat(30);
    let (p, d, router, _, _) = streamed_to_a_fake(StalledPulls, &prompt).await;
    // The pull under way was cancelled (the decode worker saw its caller go), not left to run to its timeout, and
    // the pieces' leases went with it: only the whole prompt's, which the fake never pulls, waits for its expiry.
    settled(|| p.live_leases() == 1 && d.abandoned() == 1).await;
    assert_eq!(d.abandoned(), 1, "the stalled pull was cancelled; the ones queued behind it never started");
    assert_eq!(p.live_leases(), 1, "the pieces' leases went when the router stopped waiting");
    stop(router, vec![p]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_of_the_protocol_before_streaming_is_sent_the_whole_prompt_at_once() {
    use tandem_tests::fake::{Behaviour, FakeWorker};
    // A prefill worker one protocol version behind, computing 64-token chunks (so a long prompt would stream),
    // whose prefills fail: the decode worker then computes the prompt itself.
    let ca = DevCa::generate().expect("ca");
    let version = worker::STREAM_KV_PROTOCOL - 1;
    let p = FakeWorker::chunked(&ca, proto::worker::Role::Prefill, Behaviour::Fail, version, 64).await;
    let d = worker_with(&ca, Role::Decode, "decode-0", |c| c).await;
    let router = RunningRouter::start(streaming(router_config(&ca, vec![p.grpc, d.grpc]))).await.expect("router");
    wait_for_workers(&router, 2).await;
    let prompt = "A prefill worker one protocol version behind knows no pieces. ".repeat(30);
    let (reply, metrics) = complete_long(&router, &prompt).await;
    assert_eq!(reply["usage"]["completion_tokens"], 4, "answered by the decode worker: {reply}");
    assert_eq!(series(&metrics, "tandem_router_kv_stream_pieces_total"), 0.0, "nothing streamed from it");
    assert_eq!(p.calls(), 1, "the whole prompt's Prefill, no piece before it");
    stop(router, vec![d]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_of_the_protocol_before_streaming_is_sent_the_whole_prompt_at_once() {
    let (p, d, router) = behind_a_decode_worker_that_pulls_nothing(NoPulls, worker::STREAM_KV_PROTOCOL - 1).await;
    let prompt = "A worker one protocol version behind knows no Prefetch. ".repeat(30);
    let (_, metrics) = complete_long(&router, &prompt).await;
    assert_eq!(series(&metrics, "tandem_router_kv_stream_pieces_total"), 0.0, "nothing streamed to it");
    assert_eq!(d.calls(), 1, "one Generate, no Prefetch");
    stop(router, vec![p]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_no_decode_worker_needs_is_released_at_once() {
    let ca = DevCa::generate().expect("ca");
    let (workers, router) = cluster(&ca, &[Role::Prefill, Role::Decode]).await;
    let r = http(router.addr, "PUT", "/admin/router-config", r#"{"disaggregation":"always"}"#, &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    // One token: the prefill worker's answer is the whole answer, and its KV is never pulled.
    let body = format!(r#"{{"model":"{MODEL}","max_tokens":1,"prompt":"{}"}}"#, "One token only, please. ".repeat(8));
    let reply = http(router.addr, "POST", "/v1/completions", &body, &[]).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.json()["usage"]["completion_tokens"], 1);
    let p = &workers[0];
    let mut leases = p.live_leases();
    for _ in 0..40 {
        if leases == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        leases = p.live_leases();
    }
    assert_eq!(leases, 0, "the router released the lease instead of leaving it for 30 s");
    stop(router, workers).await;
}

/// A cluster of `roles` whose router breaks ties by hashing (two cold copies of one prompt on idle workers tie the
/// same way, so only a count of the first can send the second elsewhere), with `reserve_decode` as given.
async fn hashed_ties_cluster(roles: &[Role], reserve_decode: bool) -> (Vec<worker::RunningWorker>, RunningRouter) {
    use router::scheduler::config::{SchedulerConfig, Ties};
    let ca = DevCa::generate().expect("ca");
    cluster_with(
        &ca,
        roles,
        |c| c,
        |c| {
            let scheduler = SchedulerConfig { ties: Ties::Hashed, reserve_decode, ..c.scheduler };
            router::run::RouterConfig { scheduler, ..c }
        },
    )
    .await
}

/// One long chat prompt routed (and counted) but not started: as when many requests arrive at once.
async fn planned(router: &RunningRouter) -> router::http::completions::Routed {
    use router::http::completions::{Ident, plan};
    use router::http::openai::{Endpoint, check_chat};
    let body = serde_json::json!({
        "model": MODEL, "max_tokens": 4,
        "messages": [{"role": "user", "content": "Name three rivers of Europe and say where each one rises. ".repeat(8)}],
    })
    .to_string();
    let state = &router.state;
    let checked = check_chat(body.as_bytes(), Default::default()).expect("valid");
    plan(state, checked, Ident::new(state, Endpoint::Chat), None, true).await.expect("routed")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_routed_at_the_same_moment_see_each_others_prompts() {
    let (workers, router) = hashed_ties_cluster(&[Role::Prefill, Role::Prefill, Role::Decode], false).await;
    let state = &router.state;
    let prefill_worker = |r: &router::http::completions::Routed| {
        assert!(r.decision.disaggregate, "a cold prompt goes to a prefill worker: {:?}", r.decision);
        r.decision.prefill.as_ref().expect("prefill choice").id
    };
    let first = planned(&router).await;
    let second = planned(&router).await;
    assert_ne!(prefill_worker(&first), prefill_worker(&second), "the second saw the first's prompt queued");
    // A request that ends (here: one that never started) gives its count back.
    let chosen = prefill_worker(&first);
    assert_eq!(state.cluster.in_flight(chosen), 1);
    drop((first, second));
    assert_eq!(state.cluster.in_flight(chosen), 0, "no count is left behind");
    assert_eq!(prefill_worker(&planned(&router).await), chosen, "the same prompt on idle workers goes where it went");
    stop(router, workers).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_reserve_decode_a_routed_request_counts_on_its_decode_worker_from_the_decision() {
    let (workers, router) = hashed_ties_cluster(&[Role::Prefill, Role::Decode, Role::Decode], true).await;
    let state = &router.state;
    // Without the reservation both would see two idle decode workers and tie the same way.
    let (first, second) = (planned(&router).await, planned(&router).await);
    assert!(first.decision.disaggregate && second.decision.disaggregate, "{:?}", first.decision);
    let (d1, d2) = (first.decision.decode.id, second.decision.decode.id);
    assert_ne!(d1, d2, "the second saw the first's decode coming");
    assert_eq!((state.cluster.in_flight(d1), state.cluster.in_flight(d2)), (1, 1));
    drop((first, second));
    assert_eq!((state.cluster.in_flight(d1), state.cluster.in_flight(d2)), (0, 0), "no count is left behind");
    stop(router, workers).await;
}

/// API keys bound to tenants: the same prompt never reports cached tokens across tenants (prefix sharing shows in
/// the time to first token), `cache_salt` narrows within a tenant, and sharing across tenants is a setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_never_hit_each_others_cached_prompts() {
    let ca = DevCa::generate().expect("ca");
    let d = worker(&ca, Role::Both, "both-0").await;
    let prompt = "Tenants must not learn which prompts other tenants sent: a cache hit is visible as a shorter \
                  time to first token, so the router hashes each tenant's blocks apart from everyone else's.";
    let body = |salt: Option<&str>| {
        let mut b = serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0});
        if let Some(s) = salt {
            b["cache_salt"] = s.into();
        }
        b.to_string()
    };
    for share in [false, true] {
        let tenants = router::tenants::parse(&["team-a:sk-a".into(), "team-b:sk-b".into()]).expect("valid");
        let mut config = router_config(&ca, vec![d.grpc]);
        config.tenants = router::tenants::Tenants::new(vec!["sk-open".into()], tenants, share);
        let router = RunningRouter::start(config).await.expect("router");
        wait_for_workers(&router, 1).await;
        let cached = |key: &'static str, salt: Option<&'static str>| {
            let addr = router.addr;
            let body = body(salt);
            async move {
                let auth = format!("Bearer {key}");
                let r = http(addr, "POST", "/v1/completions", &body, &[("authorization", &auth)]).await;
                assert_eq!(r.status, 200, "{}", r.body);
                r.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached tokens")
            }
        };
        // A fresh salt per round keeps the rounds apart on the one worker.
        let (s, other) = if share { (Some("round-2"), Some("round-2-other")) } else { (None, Some("other")) };
        assert_eq!(cached("sk-a", s).await, 0, "share {share}: the first time anyone sends it");
        assert!(cached("sk-a", s).await > 0, "share {share}: the same tenant hits its own cache");
        let b = cached("sk-b", s).await;
        let open = cached("sk-open", s).await;
        if share {
            assert!(b > 0 && open > 0, "shared on purpose: {b} {open}");
        } else {
            assert_eq!((b, open), (0, 0), "another tenant, or a key of no tenant, finds nothing cached");
            assert!(cached("sk-b", s).await > 0, "team-b now hits its own");
        }
        assert_eq!(cached("sk-a", other).await, 0, "share {share}: a salt narrows within a tenant");
        let r = http(router.addr, "POST", "/v1/completions", &body(Some("a\0b")), &[("authorization", "Bearer sk-a")])
            .await;
        assert_eq!((r.status, r.json()["error"]["param"].clone()), (400, serde_json::json!("cache_salt")));
        let r = http(router.addr, "POST", "/v1/completions", &body(None), &[("authorization", "Bearer sk-c")]).await;
        assert_eq!(r.status, 401);
        // Stored responses are their tenant's alone, whether or not the cache is shared: read, gone on from and
        // deleted by that tenant's keys only.
        let auth = |key: &str| format!("Bearer {key}");
        let ask = serde_json::json!({"model": MODEL, "input": "Hi", "max_output_tokens": 2}).to_string();
        let r = http(router.addr, "POST", "/v1/responses", &ask, &[("authorization", &auth("sk-a"))]).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let id = r.json()["id"].as_str().expect("id").to_string();
        let path = format!("/v1/responses/{id}");
        for (key, status) in [("sk-a", 200), ("sk-b", 404), ("sk-open", 404)] {
            let got = http(router.addr, "GET", &path, "", &[("authorization", &auth(key))]).await;
            assert_eq!(got.status, status, "share {share}: {key}");
        }
        let follow =
            serde_json::json!({"model": MODEL, "input": "Hi", "max_output_tokens": 2, "previous_response_id": id});
        let b = auth("sk-b");
        let r = http(router.addr, "POST", "/v1/responses", &follow.to_string(), &[("authorization", &b)]).await;
        assert_eq!(r.status, 404, "share {share}");
        assert_eq!(http(router.addr, "DELETE", &path, "", &[("authorization", &auth("sk-b"))]).await.status, 404);
        assert_eq!(http(router.addr, "GET", &path, "", &[("authorization", &auth("sk-a"))]).await.status, 200);
        router.shutdown(std::time::Duration::from_secs(5)).await;
    }
    d.shutdown(std::time::Duration::from_secs(5)).await;
}

/// `prompt_cache_key`: an agent's prompts that share no prefix still go to the worker that computed the session's
/// last one (an affinity credit, shown in `/debug/route`); without the key, nothing holds them there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_with_the_same_prompt_cache_key_stay_on_one_worker() {
    let ca = DevCa::generate().expect("ca");
    let (workers, router) = cluster(&ca, &[Role::Both, Role::Both]).await;
    let addr = router.addr;
    let ask = |q: &str, key: Option<&str>| {
        // The question opens the prompt (as the system message), so no two prompts share a block: only the key
        // can hold them together.
        let mut b = serde_json::json!({"model": MODEL, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "system", "content": q}, {"role": "user", "content": "Go."}]});
        if let Some(k) = key {
            b["prompt_cache_key"] = k.into();
        }
        b.to_string()
    };
    let first = http(addr, "POST", "/v1/chat/completions", &ask("Plan a trip to Lima.", Some("agent-7")), &[]).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let holder = if workers[0].stats().counters.prefill_tokens > 0 { workers[0].grpc } else { workers[1].grpc };
    for q in ["Summarise the history of tea.", "Write a haiku on rain.", "List three prime numbers."] {
        let explained = http(addr, "POST", "/debug/route", &ask(q, Some("agent-7")), &[]).await.json();
        assert_eq!(explained["decode"]["worker"], holder.to_string(), "{explained}");
        let credits: Vec<(String, f64)> = explained["decode"]["candidates"]
            .as_array()
            .expect("candidates")
            .iter()
            .map(|c| (c["worker"].as_str().expect("name").to_string(), c["affinity_credit"].as_f64().expect("credit")))
            .collect();
        for (worker, credit) in credits {
            let want = if worker == holder.to_string() { 16.0 } else { 0.0 };
            assert_eq!(credit, want, "{explained}");
        }
        let r = http(addr, "POST", "/v1/chat/completions", &ask(q, Some("agent-7")), &[]).await;
        assert_eq!(r.status, 200, "{}", r.body);
        // Another key, or none, is not credited.
        let other = http(addr, "POST", "/debug/route", &ask(q, Some("agent-8")), &[]).await.json();
        assert!(
            other["decode"]["candidates"].as_array().expect("c").iter().all(|c| c["affinity_credit"] == 0.0),
            "{other}"
        );
    }
    let elsewhere = workers.iter().find(|w| w.grpc != holder).expect("the other worker");
    assert_eq!(elsewhere.stats().counters.prefill_tokens, 0, "the whole session stayed on one worker");
    stop(router, workers).await;
}

/// `n` samples compute their prompt once: the first goes through the prefill worker and its KV to the decode
/// worker, the others fork there once the KV has arrived and find the prompt in its pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_samples_compute_their_prompt_once() {
    let ca = DevCa::generate().expect("ca");
    let (workers, router) = cluster(&ca, &[Role::Prefill, Role::Decode]).await;
    let (p, d) = (&workers[0], &workers[1]);
    let r = http(router.addr, "PUT", "/admin/router-config", r#"{"disaggregation":"always"}"#, &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let prompt = "A long prompt that four samples share: ".repeat(24);
    let body = serde_json::json!({"model": MODEL, "prompt": prompt, "n": 4, "max_tokens": 4, "temperature": 1.0,
                                  "seed": 3, "ignore_eos": true});
    let r = http(router.addr, "POST", "/v1/completions", &body.to_string(), &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["choices"].as_array().map(Vec::len), Some(4), "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 16, "{v}");
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().expect("prompt tokens");
    let (on_p, on_d) = (p.stats().counters.prefill_tokens, d.stats().counters.prefill_tokens);
    assert!(on_p >= prompt_tokens && on_p < prompt_tokens + 16, "the prefill worker computed the prompt once: {on_p}");
    // The decode worker: the three forks' partial last block and every sample's decode steps, not three prompts.
    assert!(on_d < prompt_tokens, "the forks found the prompt in the decode worker's pool: {on_d} of {prompt_tokens}");
    stop(router, workers).await;
}
