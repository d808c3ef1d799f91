//! `tandem tune` end to end: a search on the committed trace sample, its table written as a router TOML file
//! that `tandem sim` reads back, and `--apply` changing a real router's settings with its admin key (and refused
//! without it).

use std::process::Command;
use std::time::Duration;

use kv_transfer::tls::DevCa;
use router::run::RunningRouter;
use tandem_tests::{binary, http, router_config};

const TRACE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../data/traces/mooncake_conversation_1k.jsonl");

fn tune(extra: &[&str], out: &std::path::Path) -> std::process::Output {
    Command::new(binary("tandem", "tandem"))
        .args(["tune", "--trace", TRACE, "--max-requests", "60", "--prefill", "1", "--decode", "1"])
        .args(["--samples", "5", "--rounds", "2", "--seeds", "1", "--min-window", "10", "--objective", "ttft_p90"])
        .arg("--out")
        .arg(out)
        .args(extra)
        .output()
        .expect("tandem tune runs")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tuned_settings_are_written_read_back_and_applied_with_the_admin_key() {
    let ca = DevCa::generate().expect("ca");
    let mut config = router_config(&ca, Vec::new());
    config.admin_key = Some("admin-secret".into());
    let router = RunningRouter::start(config).await.expect("router");
    let url = format!("http://{}", router.addr);
    let dir = std::env::temp_dir().join(format!("tandem-tune-test-{}", std::process::id()));

    let refused = tune(&["--apply", &url, "--admin-key", "wrong"], &dir);
    assert!(!refused.status.success(), "a wrong admin key is refused");
    assert!(String::from_utf8_lossy(&refused.stderr).contains("401"), "{}", String::from_utf8_lossy(&refused.stderr));

    let out = tune(&["--apply", &url, "--admin-key", "admin-secret", "--json"], &dir);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("--json");
    assert_eq!(report["candidates"], 6, "five drawn and the current settings");
    assert_eq!((report["train_requests"].as_u64(), report["test_requests"].as_u64()), (Some(42), Some(18)));
    for name in ["tuned", "defaults", "round_robin"] {
        assert!(report["held_out"][name]["mean"].is_number(), "{name}: {report}");
    }
    let best = &report["best"]["scheduler"];
    let auth = [("authorization", "Bearer admin-secret")];
    let live = http(router.addr, "GET", "/admin/router-config", "", &auth).await.json();
    assert_eq!(&live, best, "the router now runs the tuned settings");

    // The TOML table replays in the simulator, and the search and its chart were written.
    let toml = dir.join("tuned.toml");
    let sim = Command::new(binary("tandem", "tandem"))
        .args(["sim", "--trace", TRACE, "--max-requests", "5", "--prefill", "1", "--decode", "1", "--policies", "kv"])
        .arg("--config")
        .arg(&toml)
        .output()
        .expect("tandem sim runs");
    assert!(sim.status.success(), "{}", String::from_utf8_lossy(&sim.stderr));
    let lines = std::fs::read_to_string(dir.join("search.jsonl")).expect("search.jsonl");
    assert_eq!(lines.lines().count() as u64, report["evaluations"].as_u64().expect("a count"));
    assert!(std::fs::read_to_string(dir.join("search.svg")).expect("search.svg").starts_with("<svg"));
    router.shutdown(Duration::from_secs(5)).await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn tune_refuses_failures_and_sim_names_a_worker_it_cannot_fail() {
    let dir = std::env::temp_dir().join(format!("tandem-tune-fail-test-{}", std::process::id()));
    let refused = tune(&["--fail", "decode-0@5"], &dir);
    assert!(!refused.status.success(), "tune does not take --fail");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("--fail, --hang and --errors are for tandem sim"), "{stderr}");
    let refused = tune(&["--hang", "decode-0@5"], &dir);
    assert!(!refused.status.success(), "tune does not take --hang");
    let sim = |fail: &str| {
        Command::new(binary("tandem", "tandem"))
            .args(["sim", "--trace", TRACE, "--max-requests", "20", "--prefill", "1", "--decode", "2"])
            .args(["--policies", "kv", "--json", "--fail", fail])
            .output()
            .expect("tandem sim runs")
    };
    let unknown = sim("decode-2@1");
    assert!(!unknown.status.success());
    let stderr = String::from_utf8_lossy(&unknown.stderr);
    assert!(stderr.contains("no worker decode-2"), "{stderr}");
    let bad = sim("decode-1");
    assert!(String::from_utf8_lossy(&bad.stderr).contains("NAME@SECONDS"), "{}", String::from_utf8_lossy(&bad.stderr));
    let ok = sim("decode-1@10");
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    let report: serde_json::Value = serde_json::from_slice(&ok.stdout).expect("--json");
    let kv = &report["policies"]["kv"];
    assert_eq!(kv["decisions"]["worker_failed"], 1, "{kv}");
    assert_eq!(kv["requests"], 20, "every request answered: {kv}");
    let _ = std::fs::remove_dir_all(&dir);
}
