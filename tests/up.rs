//! `tandem up` as a user runs it: a real process with a router and workers, driven by the official `openai`
//! Python client (`pip install -r scripts/e2e/requirements.txt`), answers equal to `tandem generate`'s.

use std::process::Command;

const PROMPT: &str = "What is the capital of France?";

#[test]
fn the_openai_client_gets_what_tandem_generate_gets() {
    let model = tandem_tests::model();
    let home = std::env::temp_dir().join(format!("tandem-up-test-{}", std::process::id()));
    let mut up = tandem_tests::Up::start(
        &["--prefill", "1", "--decode", "1", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"],
        &home,
    );
    let url = up.url.clone();

    let want = Command::new(tandem_tests::binary("tandem", "tandem"))
        .args(["generate", "--chat", "--json", "--max-tokens", "20", "--logprobs", "3", "--model"])
        .arg(&model)
        .arg(PROMPT)
        .output()
        .expect("tandem generate runs");
    let want: serde_json::Value = serde_json::from_slice(&want.stdout).expect("generate --json");
    let want_text = want["text"].as_str().expect("text");

    let python = std::env::var("TANDEM_PYTHON").unwrap_or_else(|_| "python3".to_string());
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/e2e/openai_client.py");
    let text_model = engine::text::TextModel::open(&model).expect("model");
    let tokenizer = text_model.tokenizer();
    let ids = serde_json::to_string(&tokenizer.encode("The capital of France is")).expect("ids");
    let out = Command::new(&python)
        .arg(script)
        .arg(format!("{url}/v1"))
        .args([PROMPT, "20", &ids])
        .output()
        .expect("python runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the openai client failed (needs `pip install -r scripts/e2e/requirements.txt`): {stderr}"
    );
    let got: serde_json::Value = serde_json::from_slice(&out.stdout).expect("the script's JSON");

    assert_eq!(got["whole"], want_text, "{got}");
    assert_eq!(got["streamed"], want_text, "{got}");
    // The Responses API, through the client's own types: the same answer, whole and from its events.
    let responses = &got["responses"];
    assert_eq!((&responses["whole"], &responses["streamed"]), (&got["whole"], &got["whole"]), "{responses}");
    assert!(
        ["response.completed", "response.incomplete"].contains(&responses["last"].as_str().unwrap_or("")),
        "{responses}"
    );
    assert_eq!(responses["usage"][1], got["streamed_usage"]["completion_tokens"], "{responses}");
    assert_eq!(responses["retrieved"], got["whole"], "{responses}");
    assert_eq!(responses["followed"], serde_json::json!([true, true]), "{responses}");
    assert_eq!(responses["deleted"], "NotFoundError", "{responses}");
    let n = want["token_ids"].as_array().map_or(0, Vec::len);
    assert_eq!(got["whole_usage"]["completion_tokens"], n);
    assert_eq!(got["streamed_usage"]["completion_tokens"], n);
    assert_eq!(got["whole_usage"]["prompt_tokens"], want["prompt_ids"].as_array().map_or(0, Vec::len));
    assert!(
        got["streamed_usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().is_some_and(|c| c > 0),
        "the second identical prompt was served partly from cache: {got}"
    );
    assert_eq!(got["whole_finish"], want["finish_reason"]);
    assert!(got["completion"].as_str().is_some_and(|t| !t.is_empty()));
    assert_eq!(got["unknown_model"], "NotFoundError");

    // Log-probabilities through the prefill worker (the first token) and the decode worker (the rest) are the
    // single engine's, whole and streamed; each token is named by its text and bytes.
    let want_ids: Vec<u32> =
        want["token_ids"].as_array().expect("ids").iter().map(|v| v.as_u64().expect("id") as u32).collect();
    let want_lp = want["logprobs"].as_array().expect("generate --logprobs");
    let whole = got["whole_logprobs"].as_array().expect("whole logprobs");
    assert_eq!(whole.len(), want_ids.len(), "one entry per completion token: {got}");
    let close = |a: &serde_json::Value, b: &serde_json::Value| {
        (a.as_f64().expect("a logprob") - b.as_f64().expect("a logprob")).abs() < 1e-4
    };
    for ((entry, id), w) in whole.iter().zip(&want_ids).zip(want_lp) {
        let bytes: Vec<u8> =
            entry["bytes"].as_array().expect("bytes").iter().map(|b| b.as_u64().expect("byte") as u8).collect();
        assert_eq!(bytes, tokenizer.token_bytes(*id), "{entry}");
        assert!(close(&entry["logprob"], &w["logprob"]), "{entry} against {w}");
        let top = entry["top"].as_array().expect("top");
        let want_top = w["top"].as_array().expect("top");
        assert_eq!(top.len(), 3, "{entry}");
        for (alt, w_alt) in top.iter().zip(want_top) {
            let w_id = w_alt[0].as_u64().expect("id") as u32;
            assert_eq!(alt[0].as_str().expect("token").as_bytes(), tokenizer.token_bytes(w_id), "{entry}");
            assert!(close(&alt[1], &w_alt[1]), "{entry} against {w}");
        }
    }
    assert_eq!(got["streamed_logprobs"], got["whole_logprobs"], "streamed as whole");
    assert_ne!(got["penalized"], got["unpenalized"], "frequency and presence penalties change the greedy answer");
    // A prompt as token ids is the same prompt as its text; completions' log-probabilities in their own shape.
    let by_ids = &got["by_ids"];
    assert_eq!(by_ids["text"], got["completion"], "{by_ids}");
    let tokens = by_ids["tokens"].as_array().expect("tokens");
    assert!(!tokens.is_empty() && tokens.len() <= 4, "{by_ids}");
    for list in ["token_logprobs", "top_logprobs", "text_offset"] {
        assert_eq!(by_ids[list].as_array().map(Vec::len), Some(tokens.len()), "{list}: {by_ids}");
    }
    assert!(
        by_ids["top_logprobs"].as_array().expect("top").iter().all(|m| m.as_object().is_some_and(|m| m.len() <= 2))
    );
    assert_eq!(by_ids["text_offset"][0], 0);
    // Scored as lm-evaluation-harness scores text: `echo` with `logprobs` and `max_tokens` 0 gives the prompt's
    // tokens, the first without a log-probability, and generates nothing.
    let scored = &got["scored"];
    let prompt_ids: Vec<u32> = serde_json::from_str(&ids).expect("ids");
    assert_eq!(scored["text"], tokenizer.decode(&prompt_ids), "{scored}");
    assert_eq!(
        (&scored["finish"], &scored["completion_tokens"]),
        (&serde_json::json!("length"), &serde_json::json!(0))
    );
    let lps = scored["token_logprobs"].as_array().expect("token_logprobs");
    assert_eq!(lps.len(), prompt_ids.len(), "{scored}");
    assert!(lps[0].is_null() && scored["top_logprobs"][0].is_null(), "{scored}");
    assert!(lps[1..].iter().all(|l| l.as_f64().is_some_and(|l| l <= 0.0)), "{scored}");
    // A prompt over the context: the client's BadRequestError, with OpenAI's code.
    assert_eq!(got["too_long"], serde_json::json!(["BadRequestError", "context_length_exceeded"]), "{got}");
    // n = 2 samples of a JSON schema's output, each valid.
    let structured = got["structured"].as_array().expect("structured");
    assert_eq!(structured.len(), 2, "{got}");
    for s in structured {
        let v: serde_json::Value = serde_json::from_str(s.as_str().expect("text")).expect("JSON");
        assert!(v["city"].as_str().is_some_and(|c| c.chars().count() <= 12), "{v}");
        assert!(v["rank"].as_u64().is_some_and(|r| (1..=9).contains(&r)), "{v}");
    }
    // A forced tool call through the client's own types: one call of the function, its arguments JSON under the
    // function's schema, streamed pieces adding up to the whole; `required` without parallel calls: one call.
    let tool = &got["tool_call"];
    assert_eq!((&tool["finish"], &tool["content"]), (&serde_json::json!("stop"), &serde_json::Value::Null), "{tool}");
    let call = &tool["calls"][0];
    assert!(call[0].as_str().is_some_and(|id| id.starts_with("call_")) && call[1] == "function", "{tool}");
    assert_eq!(call[2], "weather", "{tool}");
    let args: serde_json::Value = serde_json::from_str(call[3].as_str().expect("arguments")).expect("JSON");
    assert!(args["city"].as_str().is_some_and(|c| c.chars().count() <= 16), "{tool}");
    assert_eq!(tool["streamed"], serde_json::json!([[call[2], call[3]]]), "streamed as whole: {tool}");
    let required = &tool["required"];
    assert_eq!(required[0], "tool_calls", "{tool}");
    assert_eq!(required[1].as_array().map(Vec::len), Some(1), "parallel_tool_calls false: {tool}");
    assert_eq!(required[1][0][0], "weather", "{tool}");
    // `auto` with `--tool-call-parser hermes`: the call parsed out of the text, the words before it the content.
    let auto = serde_json::json!(["tool_calls", "Sure. ", [["weather", r#"{"city":"Paris"}"#]]]);
    assert_eq!(tool["auto"], auto, "{tool}");
    // `--reasoning-parser qwen3`: the thinking apart from the answer, as the client reads it, whole and streamed;
    // the regular expression holds the answer after it.
    let reasoning = &got["reasoning"];
    assert_eq!(reasoning["whole"], reasoning["streamed"], "{reasoning}");
    let thought = reasoning["whole"][0].as_str().unwrap_or_else(|| panic!("thinking: {reasoning}"));
    assert!(!thought.trim().is_empty() && !thought.contains("think>"), "{reasoning}");
    assert_eq!(reasoning["whole"][1].as_str().map(str::trim), Some("France."), "{reasoning}");
    assert_eq!(got["models"][0], "smollm2-135m-instruct");
    assert_eq!(got["retrieved"], "smollm2-135m-instruct", "client.models.retrieve");

    // Ctrl-C stops the whole cluster cleanly.
    let status = Command::new("kill").args(["-INT", &up.child.id().to_string()]).status().expect("kill runs");
    assert!(status.success());
    let exit = up.child.wait().expect("tandem up exits");
    assert!(exit.success(), "{exit:?}");
    let _ = std::fs::remove_dir_all(&home);
}

/// A router port already taken is the first thing `tandem up` says, before any worker starts.
#[test]
fn a_taken_port_is_refused_before_the_workers_start() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
    let port = taken.local_addr().expect("addr").port().to_string();
    let home = std::env::temp_dir().join(format!("tandem-up-taken-{}", std::process::id()));
    let out = Command::new(tandem_tests::binary("tandem", "tandem"))
        .args(["up", "--engine", "mock", "--prefill", "1", "--decode", "1", "--port", &port, "--model"])
        .arg(tandem_tests::model())
        .env("TANDEM_HOME", &home)
        .output()
        .expect("tandem up runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains(&format!("router address 127.0.0.1:{port}")), "{err}");
    assert!(!err.contains("grpc"), "no worker started: {err}");
    let _ = std::fs::remove_dir_all(home);
}
