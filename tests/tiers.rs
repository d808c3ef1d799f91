//! Host and disk tiers seen by the router: a worker whose device tier is small evicts a prompt's blocks to host,
//! then to disk, and `/debug/route` shows the overlap on each tier (from the worker's KV events).

use std::time::Duration;

use engine::backend::mock::MockSettings;
use engine::generate::{BackendChoice, EngineConfig};
use engine::tokenizer::Tokenizer;
use kv_transfer::tls::DevCa;
use tandem_tests::*;
use worker::{Role, WorkerConfig};

/// A prompt of `blocks` 16-token blocks of word tokens, its own for each `seed`.
fn prompt(tok: &Tokenizer, words: &[u32], seed: usize, blocks: usize) -> String {
    let ids: Vec<u32> = (0..blocks * 16).map(|i| words[(seed * 7919 + i * 31) % words.len()]).collect();
    tok.decode(&ids)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicted_prefixes_show_as_host_then_disk_overlap() {
    let ca = DevCa::generate().expect("ca");
    let disk = std::env::temp_dir().join(format!("tandem-tiers-test-{}", std::process::id()));
    let mock = MockSettings { speedup: 100.0, context_len: 1024, ..MockSettings::gpu_default() };
    // Room for one 60-block prompt on the device, one on the host, and plenty on disk.
    let engine = EngineConfig {
        backend: BackendChoice::Mock(Box::new(mock)),
        kv_blocks: 64,
        host_blocks: 64,
        disk_blocks: 512,
        disk_dir: Some(disk.clone()),
        ..test_engine()
    };
    let (workers, router) = cluster_with(
        &ca,
        &[Role::Both],
        |c| WorkerConfig { engine: engine.clone(), ..c },
        |r| router::run::RouterConfig { max_model_len: Some(1024), ..r },
    )
    .await;
    let tok = Tokenizer::from_gguf(&engine::gguf::GgufFile::open(&model()).expect("opens")).expect("tokenizer");
    let words = tok.plain_words();
    let ask =
        |text: &str| serde_json::json!({"model": "smollm2-135m-instruct", "prompt": text, "max_tokens": 2}).to_string();
    let overlap = |explained: &serde_json::Value, tier: &str| {
        explained["decode"]["candidates"][0][format!("{tier}_blocks")].as_u64().expect("overlap")
    };
    let first = prompt(&tok, &words, 0, 60);
    assert_eq!(http(router.addr, "POST", "/v1/completions", &ask(&first), &[]).await.status, 200);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let explained = http(router.addr, "POST", "/debug/route", &ask(&first), &[]).await.json();
    assert!(overlap(&explained, "device") >= 50, "{explained}");

    // Each new prompt takes the whole device tier: the first one's blocks go down to host, then on to disk.
    let mut seen = [false; 2];
    for seed in 1..6 {
        let reply = http(router.addr, "POST", "/v1/completions", &ask(&prompt(&tok, &words, seed, 60)), &[]).await;
        assert_eq!(reply.status, 200, "{}", reply.body);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let explained = http(router.addr, "POST", "/debug/route", &ask(&first), &[]).await.json();
        seen[0] |= overlap(&explained, "host") > 0;
        seen[1] |= overlap(&explained, "disk") > 0;
    }
    assert_eq!(seen, [true, true], "the router saw the prompt's blocks on the host tier and on the disk tier");
    // And the worker serves them from there.
    let reply = http(router.addr, "POST", "/v1/completions", &ask(&first), &[]).await.json();
    let cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached");
    assert!(cached >= 16 * 32, "the prefix came back from the lower tiers: {reply}");
    stop(router, workers).await;
    let _ = std::fs::remove_dir_all(&disk);
}
