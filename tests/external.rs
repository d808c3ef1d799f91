//! Tandem's router in front of an engine it does not own: two llama.cpp `llama-server` processes on the embedded
//! model (built by `scripts/llama-cpp.sh llama-server`), which publish no KV events. Requests that share a prefix
//! land on the server that served it first (seen in llama.cpp's own counts: its cache hits and the prompt tokens
//! each server computed), and a server killed before its first token costs no request.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kv_transfer::tls::DevCa;
use router::external::{Engine, EngineKind, ExternalSettings};
use router::run::{RouterConfig, RunningRouter};
use tandem_tests::*;

const MODEL: &str = "smollm2-135m-instruct";

/// A llama-server process, killed when dropped.
struct Server {
    child: Child,
    addr: SocketAddr,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    async fn start(bin: &PathBuf) -> Server {
        // A free port, given to the server (it cannot report one it chose).
        let port = std::net::TcpListener::bind("127.0.0.1:0").expect("binds").local_addr().expect("addr").port();
        let child = Command::new(bin)
            .args(["-m", model().to_str().expect("utf-8 path"), "--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["-c", "8192", "-np", "1", "-t", "1", "--metrics"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("llama-server starts");
        let server = Server { child, addr: SocketAddr::from(([127, 0, 0, 1], port)) };
        let started = Instant::now();
        while http_maybe(server.addr, "/health").await != Some(200) {
            assert!(started.elapsed() < Duration::from_secs(60), "llama-server did not become healthy");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        server
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Prompt tokens this server has computed (not served from its cache), as its `/metrics` says.
    async fn prompt_tokens_computed(&self) -> f64 {
        let body = http(self.addr, "GET", "/metrics", "", &[]).await.body;
        body.lines()
            .find_map(|l| l.strip_prefix("llamacpp:prompt_tokens_total "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no llamacpp:prompt_tokens_total in {body}"))
    }
}

/// The status of a GET, or `None` when nothing answers.
async fn http_maybe(addr: SocketAddr, path: &str) -> Option<u16> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut sock = tokio::net::TcpStream::connect(addr).await.ok()?;
    sock.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes()).await.ok()?;
    let mut raw = Vec::new();
    sock.read_to_end(&mut raw).await.ok()?;
    parse_reply(&String::from_utf8_lossy(&raw)).map(|r| r.status)
}

fn chat(system: &str, user: &str, max_tokens: u32, stream: bool) -> String {
    serde_json::json!({"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
                       "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]})
    .to_string()
}

/// A system prompt of a few hundred tokens that every request shares.
fn shared_prefix() -> String {
    (0..40).map(|i| format!("Rule {i}: answer politely, briefly and in plain words about topic {i}. ")).collect()
}

async fn router_for(ca: &DevCa, servers: &[&Server]) -> RunningRouter {
    let config = RouterConfig {
        external: servers.iter().map(|s| Engine::new(&s.url(), EngineKind::LlamaServer).expect("url")).collect(),
        external_settings: ExternalSettings { health_period: Duration::from_millis(200), ..Default::default() },
        ..router_config(ca, Vec::new())
    };
    let router = RunningRouter::start(config).await.expect("router starts");
    wait_for_workers(&router, servers.len()).await;
    router
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_prefix_goes_back_to_the_llama_server_that_cached_it_and_a_killed_one_fails_over() {
    let bin = llama_server();
    let ca = DevCa::generate().expect("ca");
    let servers = [Server::start(&bin).await, Server::start(&bin).await];
    let router = router_for(&ca, &[&servers[0], &servers[1]]).await;
    let system = shared_prefix();

    let first = http(router.addr, "POST", "/v1/chat/completions", &chat(&system, "Say hi.", 4, false), &[]).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let computed = [servers[0].prompt_tokens_computed().await, servers[1].prompt_tokens_computed().await];
    let home = usize::from(computed[1] > 0.0);
    assert!(computed[1 - home] == 0.0 && computed[home] > 300.0, "one server computed the prompt: {computed:?}");

    // The same system prompt again: the router predicts it on `home`, and llama.cpp serves it from its cache.
    for (i, question) in ["What is a block?", "Name a colour.", "Count to three."].iter().enumerate() {
        let r = http(router.addr, "POST", "/v1/chat/completions", &chat(&system, question, 4, false), &[]).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached tokens");
        assert!(cached as f64 > computed[home] * 0.8, "request {i}: llama.cpp served {cached} tokens from cache");
    }
    assert_eq!(servers[1 - home].prompt_tokens_computed().await, 0.0, "nothing went to the other server");

    // A long new question after the shared prefix goes to `home` too; kill it before its first token.
    let long: String = (0..300).map(|i| format!("item {i}, ")).collect();
    let mut stream = Streaming::open(router.addr, "/v1/chat/completions", &chat(&system, &long, 8, true)).await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    let [a, b] = servers;
    let (killed, survivor) = if home == 0 { (a, b) } else { (b, a) };
    drop(killed);
    let events = stream.finish().await;
    assert!(events.last().is_some_and(|e| e == "[DONE]"), "the stream finished: {events:?}");
    assert!(!events.iter().any(|e| e.contains("\"error\"")), "no error: {events:?}");
    assert!(!streamed_text(&events).is_empty(), "{events:?}");
    assert!(router.state.metrics.decode_resumptions.load(Ordering::Relaxed) >= 1, "the request moved to the survivor");
    assert!(survivor.prompt_tokens_computed().await > 0.0);

    // Afterwards every request goes to the survivor.
    for question in ["One more?", "And another?"] {
        let r = http(router.addr, "POST", "/v1/chat/completions", &chat(&system, question, 4, false), &[]).await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    // llama-server takes the penalties and biases in its own terms; what it cannot do is refused by name.
    let sea = engine::text::TextModel::open(&model()).expect("model").tokenizer().encode(" sea")[0];
    let with = |extra: serde_json::Value| {
        let mut b: serde_json::Value = serde_json::from_str(&chat(&system, "Say hi.", 3, false)).expect("json");
        for (k, v) in extra.as_object().expect("object") {
            b[k] = v.clone();
        }
        b.to_string()
    };
    let biased = with(serde_json::json!({"logit_bias": {sea.to_string(): 100}, "frequency_penalty": 0.5,
                                          "repetition_penalty": 1.1, "ignore_eos": true}));
    let r = http(router.addr, "POST", "/v1/chat/completions", &biased, &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["choices"][0]["message"]["content"].as_str().map(str::trim), Some("sea sea sea"), "{}", r.body);
    let r = http(router.addr, "POST", "/v1/chat/completions", &with(serde_json::json!({"min_tokens": 2})), &[]).await;
    assert!(r.status == 400 && r.body.contains("min_tokens"), "{}", r.body);
    // Log-probabilities are relayed from llama-server, by token id: each token's and its alternatives' are what the
    // server itself reports for the same prompt (its cache may compute the last prompt token alone: near, not equal).
    let asked = with(serde_json::json!({"logprobs": true, "top_logprobs": 2, "ignore_eos": true}));
    let r = http(router.addr, "POST", "/v1/chat/completions", &asked, &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let content = r.json()["choices"][0]["logprobs"]["content"].as_array().expect("logprobs").clone();
    assert_eq!(content.len(), 3, "one entry per token: {content:?}");
    let body: serde_json::Value = serde_json::from_str(&asked).expect("json");
    let tokens =
        http(router.addr, "POST", "/tokenize", &serde_json::json!({"messages": body["messages"]}).to_string(), &[])
            .await
            .json()["tokens"]
            .clone();
    let direct = serde_json::json!({"prompt": tokens, "n_predict": 3, "n_probs": 2, "temperature": 0,
                                    "return_tokens": true, "ignore_eos": true});
    let own = http(survivor.addr, "POST", "/completion", &direct.to_string(), &[]).await.json();
    let own = own["completion_probabilities"].as_array().expect("the server's own").clone();
    for (ours, theirs) in content.iter().zip(&own) {
        let near = |a: &serde_json::Value, b: &serde_json::Value| {
            (a.as_f64().expect("logprob") - b.as_f64().expect("logprob")).abs() < 0.05
        };
        assert!(near(&ours["logprob"], &theirs["logprob"]), "{ours} / {theirs}");
        let alternatives = ours["top_logprobs"].as_array().expect("alternatives");
        assert_eq!(alternatives.len(), 2, "{ours}");
        for (a, b) in alternatives.iter().zip(theirs["top_logprobs"].as_array().expect("theirs")) {
            assert_eq!(a["token"], b["token"], "{ours} / {theirs}");
            assert!(near(&a["logprob"], &b["logprob"]), "{ours} / {theirs}");
        }
    }
    // Structured outputs go to llama-server as its own JSON schemas: the answer is valid under the schema, whole and
    // as a forced tool call.
    let schema = serde_json::json!({"type": "object", "properties": {"colour": {"type": "string", "maxLength": 12},
        "count": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["colour", "count"],
        "additionalProperties": false});
    let format = serde_json::json!({"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}});
    let r = http(
        router.addr,
        "POST",
        "/v1/chat/completions",
        &with(serde_json::json!({"response_format": format,
        "max_tokens": 40})),
        &[],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let answer = r.json()["choices"][0]["message"]["content"].as_str().expect("content").to_string();
    let v: serde_json::Value = serde_json::from_str(&answer).unwrap_or_else(|e| panic!("{e}: {answer}"));
    assert!(v["colour"].is_string() && v["count"].as_u64().is_some_and(|c| c <= 99), "{v}");
    assert_eq!(v.as_object().map(|o| o.len()), Some(2), "{v}");
    let tools = serde_json::json!([{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": false}}}]);
    let forced = serde_json::json!({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "weather"}},
        "max_tokens": 30});
    let r = http(router.addr, "POST", "/v1/chat/completions", &with(forced), &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let call = &r.json()["choices"][0]["message"]["tool_calls"][0]["function"];
    assert_eq!(call["name"], "weather", "{}", r.body);
    let args: serde_json::Value = serde_json::from_str(call["arguments"].as_str().expect("arguments")).expect("JSON");
    assert!(args["city"].is_string() && args.as_object().map(|o| o.len()) == Some(1), "{args}");
    // A GBNF grammar goes to llama-server as its own: the answer is a sentence of it.
    let gbnf = "root ::= (\"yes\" | \"no\") \", \" [0-9]{2}";
    let r = http(
        router.addr,
        "POST",
        "/v1/chat/completions",
        &with(serde_json::json!({"guided_grammar": gbnf, "max_tokens": 12})),
        &[],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let answer = r.json()["choices"][0]["message"]["content"].as_str().expect("content").to_string();
    assert!(regex::Regex::new("^(yes|no), [0-9]{2}$").expect("regex").is_match(&answer), "{answer:?}");
    // llama-server takes no regular expression: with only llama-servers up, a 400 says what would serve it.
    let r = http(
        router.addr,
        "POST",
        "/v1/completions",
        &serde_json::json!({"model": MODEL, "prompt": "Digits:",
        "max_tokens": 4, "structured_outputs": {"regex": "[0-9]+"}})
        .to_string(),
        &[],
    )
    .await;
    assert!(r.status == 400 && r.body.contains("regular expression"), "{}", r.body);
    router.shutdown(Duration::from_secs(5)).await;
}

/// llama-server has no cache salt: while the router keeps tenants apart, it reuses no cached prompt for anyone (a
/// tenant's prompt left in a slot would show in another's time to first token), and predicts none; with tenants
/// sharing, a request of no namespace is served from the cache again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_do_not_share_a_llama_servers_cache() {
    let bin = llama_server();
    let ca = DevCa::generate().expect("ca");
    let server = Server::start(&bin).await;
    let system = shared_prefix();
    for share in [false, true] {
        let tenants = router::tenants::parse(&["team-a:sk-a".into(), "team-b:sk-b".into()]).expect("valid");
        let mut config = RouterConfig {
            external: vec![Engine::new(&server.url(), EngineKind::LlamaServer).expect("url")],
            external_settings: ExternalSettings { health_period: Duration::from_millis(200), ..Default::default() },
            ..router_config(&ca, Vec::new())
        };
        config.tenants = router::tenants::Tenants::new(vec!["sk-open".into()], tenants, share);
        let router = RunningRouter::start(config).await.expect("router starts");
        wait_for_workers(&router, 1).await;
        let mut seen = Vec::new();
        // Each key sends the same prompt twice; the tenants' keys first, then the key of no tenant.
        for key in ["sk-a", "sk-a", "sk-b", "sk-open", "sk-open"] {
            let auth = format!("Bearer {key}");
            let r = http(
                router.addr,
                "POST",
                "/v1/chat/completions",
                &chat(&system, "Say hi.", 2, false),
                &[("authorization", &auth)],
            )
            .await;
            assert_eq!(r.status, 200, "{}", r.body);
            seen.push(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached tokens"));
        }
        if share {
            // Sharing: everyone after the first is served from the cache.
            assert!(seen[1..].iter().all(|&c| c > 300), "{seen:?}");
        } else {
            assert_eq!(seen, [0, 0, 0, 0, 0], "nothing is served from llama-server's cache while tenants are apart");
        }
        router.shutdown(Duration::from_secs(5)).await;
    }
}
