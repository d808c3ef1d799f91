//! Recording a real router's traffic: the file is a trace with the router's decisions, re-keyed block hashes (no
//! text, no public hashes) and each request's actual output, started from the configuration or the admin API, and
//! `tandem sim` replays it, the recorded decisions next to each policy.

use std::process::Command;

use kv_transfer::tls::DevCa;
use tandem_tests::{Streaming, binary, cluster_with, http, stop};
use worker::Role;

const MODEL: &str = "smollm2-135m-instruct";
const WORD: &str = "lighthouse";

fn completion(words: usize) -> String {
    let prompt = format!("{WORD} keepers log the weather every hour. ").repeat(words);
    format!(r#"{{"model":"{MODEL}","prompt":"{prompt}","max_tokens":3}}"#)
}

/// The request lines and the output lines of a recording, after its header.
fn split(lines: &[serde_json::Value]) -> (Vec<&serde_json::Value>, Vec<&serde_json::Value>) {
    lines[1..].iter().partition(|l| l.get("tandem_output").is_none())
}

/// An output line says what its request generated: at most its budget of 3, all of it when the budget ended it.
fn check_output(o: &serde_json::Value, requests: u64) {
    let out = &o["tandem_output"];
    assert!(out["request"].as_u64().is_some_and(|r| r < requests), "{o}");
    let (tokens, finish) = (out["output_tokens"].as_u64().expect("tokens"), out["finish_reason"].as_str());
    assert!((1..=3).contains(&tokens) && matches!(finish, Some("stop" | "length")), "{o}");
    assert!(finish != Some("length") || tokens == 3, "{o}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_records_a_replayable_trace_without_text() {
    let ca = DevCa::generate().expect("ca");
    let dir = std::env::temp_dir().join(format!("tandem-record-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    let boot = dir.join("boot.jsonl");
    let (workers, router) = cluster_with(
        &ca,
        &[Role::Prefill, Role::Decode],
        |w| w,
        |r| router::run::RouterConfig { record_trace: Some(boot.clone()), ..r },
    )
    .await;
    let addr = router.addr;
    for words in [6, 6, 12] {
        let r = http(addr, "POST", "/v1/completions", &completion(words), &[]).await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let status = http(addr, "GET", "/admin/recording", "", &[]).await.json();
    assert_eq!((status["recording"].as_bool(), status["requests"].as_u64()), (Some(true), Some(3)), "{status}");
    let stopped = http(addr, "DELETE", "/admin/recording", "", &[]).await.json();
    assert_eq!(stopped["stopped"], true);

    // Started again through the admin API, to a new file only, this time with each decision's candidates.
    let second = dir.join("second.jsonl");
    let bad = format!(r#"{{"file":"{}","candidates":"yes"}}"#, second.display());
    assert_eq!(http(addr, "POST", "/admin/recording", &bad, &[]).await.status, 400, "candidates is a boolean");
    let body = format!(r#"{{"file":"{}","candidates":true}}"#, second.display());
    assert_eq!(http(addr, "POST", "/admin/recording", &body, &[]).await.status, 200);
    assert_eq!(http(addr, "POST", "/admin/recording", &body, &[]).await.status, 400, "one recording at a time");
    let streamed = completion(4).replace(r#""max_tokens":3"#, r#""max_tokens":3,"stream":true"#);
    assert_eq!(http(addr, "POST", "/v1/completions", &streamed, &[]).await.status, 200);
    // A streamed request whose client leaves after its first event: recorded with the tokens it had.
    let leaving = completion(4).replace(r#""max_tokens":3"#, r#""max_tokens":200,"ignore_eos":true,"stream":true"#);
    let mut client = Streaming::open(addr, "/v1/completions", &leaving).await;
    client.until(1).await;
    assert!(!client.events().is_empty(), "the stream ended before its first event");
    drop(client);
    let outputs_written =
        || std::fs::read_to_string(&second).map_or(0, |t| t.lines().filter(|l| l.contains("tandem_output")).count());
    for _ in 0..100 {
        if outputs_written() == 2 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(http(addr, "DELETE", "/admin/recording", "", &[]).await.json()["requests"], 2);
    let again = format!(r#"{{"file":"{}"}}"#, boot.display());
    assert_eq!(http(addr, "POST", "/admin/recording", &again, &[]).await.status, 400, "an existing file is kept");
    let decode_addr = workers[1].grpc.to_string();
    stop(router, workers).await;

    let text = std::fs::read_to_string(&boot).expect("the recording");
    assert!(!text.contains(WORD), "no prompt text in the recording");
    let all: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).expect("JSON lines")).collect();
    assert_eq!(all[0]["tandem_recording"]["block_size"], 16);
    let (lines, outputs) = split(&all);
    assert_eq!((lines.len(), outputs.len()), (3, 3), "three requests, each with its output: {text}");
    let mut ended: Vec<u64> =
        outputs.iter().map(|o| o["tandem_output"]["request"].as_u64().expect("a number")).collect();
    ended.sort_unstable();
    assert_eq!(ended, [0, 1, 2]);
    outputs.iter().for_each(|o| check_output(o, 3));
    for l in &lines {
        let input = l["input_length"].as_u64().expect("a length");
        assert_eq!(l["hash_ids"].as_array().map(Vec::len), Some(input as usize / 16), "{l}");
        assert_eq!(l["output_length"], 3);
        let decode = l["tandem"]["decision"]["decode"].as_str().expect("the decode worker");
        assert_eq!(decode, decode_addr, "workers are named by the address the router knows");
    }
    assert!(lines[0]["tandem"]["decision"].get("candidates").is_none(), "candidates only when asked for");
    let second_lines: Vec<serde_json::Value> = std::fs::read_to_string(&second)
        .expect("second")
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON lines"))
        .collect();
    let (requests, outputs) = split(&second_lines);
    assert_eq!((requests.len(), outputs.len()), (2, 2), "the streamed requests and their outputs");
    check_output(outputs[0], 2);
    let left = &outputs[1]["tandem_output"];
    assert_eq!((left["request"].as_u64(), left["finish_reason"].as_str()), (Some(1), Some("incomplete")), "{left}");
    assert!(left["output_tokens"].as_u64().is_some_and(|t| (1..200).contains(&t)), "{left}");
    let explained = requests[0];
    let candidates = &explained["tandem"]["decision"]["candidates"];
    assert_eq!(candidates["decode"][0]["worker"], decode_addr.as_str(), "{explained}");
    assert!(candidates["decode"][0]["cost"].is_number(), "{explained}");
    assert_eq!(candidates["prefill"].as_array().map(Vec::len), Some(1), "{explained}");
    // The two equal prompts have equal ids, and the longer one shares their start.
    assert_eq!(lines[0]["hash_ids"], lines[1]["hash_ids"]);
    assert_eq!(lines[2]["hash_ids"][0], lines[0]["hash_ids"][0]);

    // Replayed: the recorded decisions as a row of their own, next to a policy (a recording with candidates too).
    for (file, requests) in [(&boot, 3), (&second, 2)] {
        let out = Command::new(binary("tandem", "tandem"))
            .args(["sim", "--prefill", "1", "--decode", "1", "--policies", "kv", "--json", "--trace"])
            .arg(file)
            .output()
            .expect("tandem sim runs");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let sim: serde_json::Value = serde_json::from_slice(&out.stdout).expect("--json");
        for row in ["recorded", "kv"] {
            assert_eq!(sim["policies"][row]["requests"], requests, "{row}: {sim}");
            assert_eq!(sim["policies"][row]["failed"], 0, "{row}: {sim}");
        }
    }
    // Too few workers for the names it recorded: a clear error.
    let out = Command::new(binary("tandem", "tandem"))
        .args(["sim", "--prefill", "0", "--decode", "1", "--policies", "kv", "--trace"])
        .arg(&boot)
        .output()
        .expect("tandem sim runs");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("1 prefill and 1 decode"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}
