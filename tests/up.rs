//! `tandem up` as a user runs it: a real process with a router and workers, driven by the official `openai`
//! Python client (`pip install -r scripts/e2e/requirements.txt`), answers equal to `tandem generate`'s.

use std::process::Command;

const PROMPT: &str = "What is the capital of France?";

#[test]
fn the_openai_client_gets_what_tandem_generate_gets() {
    let model = tandem_tests::model();
    let home = std::env::temp_dir().join(format!("tandem-up-test-{}", std::process::id()));
    let mut up = tandem_tests::Up::start(&["--prefill", "1", "--decode", "1"], &home);
    let url = up.url.clone();

    let want = Command::new(tandem_tests::binary("tandem", "tandem"))
        .args(["generate", "--chat", "--json", "--max-tokens", "20", "--model"])
        .arg(&model)
        .arg(PROMPT)
        .output()
        .expect("tandem generate runs");
    let want: serde_json::Value = serde_json::from_slice(&want.stdout).expect("generate --json");
    let want_text = want["text"].as_str().expect("text");

    let python = std::env::var("TANDEM_PYTHON").unwrap_or_else(|_| "python3".to_string());
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/e2e/openai_client.py");
    let out =
        Command::new(&python).arg(script).arg(format!("{url}/v1")).args([PROMPT, "20"]).output().expect("python runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the openai client failed (needs `pip install -r scripts/e2e/requirements.txt`): {stderr}"
    );
    let got: serde_json::Value = serde_json::from_slice(&out.stdout).expect("the script's JSON");

    assert_eq!(got["whole"], want_text, "{got}");
    assert_eq!(got["streamed"], want_text, "{got}");
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
    assert_eq!(got["models"][0], "smollm2-135m-instruct");

    // Ctrl-C stops the whole cluster cleanly.
    let status = Command::new("kill").args(["-INT", &up.child.id().to_string()]).status().expect("kill runs");
    assert!(status.success());
    let exit = up.child.wait().expect("tandem up exits");
    assert!(exit.success(), "{exit:?}");
    let _ = std::fs::remove_dir_all(&home);
}
