//! `tandem bench serve` against `tandem up --engine mock` with four prefill and four decode workers, both as real
//! processes: a slice of the committed Mooncake sample is replayed, and the records and summary are checked (not
//! timed: what a run measures depends on the machine).

use std::path::Path;
use std::process::Command;

const REQUESTS: usize = 30;

#[test]
fn a_trace_replays_through_a_mock_cluster_with_cache_hits_and_ordered_percentiles() {
    let tandem = tandem_tests::binary("tandem", "tandem");
    let model = tandem_tests::model();
    let home = std::env::temp_dir().join(format!("tandem-bench-serve-{}", std::process::id()));
    let up =
        tandem_tests::Up::start(&["--engine", "mock", "--prefill", "4", "--decode", "4", "--speedup", "10"], &home);
    let url = up.url.clone();

    let trace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/traces/mooncake_conversation_1k.jsonl");
    let out = home.join("run");
    let bench = Command::new(&tandem)
        .args(["bench", "serve", "--url", &url, "--speedup", "20", "--json", "--quiet", "--ignore-eos"])
        .args(["--max-requests", &REQUESTS.to_string(), "--slo", "ttft_ms=60000"])
        .arg("--trace")
        .arg(&trace)
        .arg("--out")
        .arg(&out)
        .arg("--tokenizer-model")
        .arg(&model)
        .output()
        .expect("tandem bench serve runs");
    assert!(bench.status.success(), "bench serve failed: {}", String::from_utf8_lossy(&bench.stderr));
    let printed: serde_json::Value = serde_json::from_slice(&bench.stdout).expect("--json prints the summary");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).expect("summary.json")).expect("json");
    assert_eq!(printed, summary);

    let records: Vec<serde_json::Value> = std::fs::read_to_string(out.join("records.jsonl"))
        .expect("records.jsonl")
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON record"))
        .collect();
    assert_eq!(records.len(), REQUESTS);
    assert_eq!(summary["requests"], REQUESTS);
    assert_eq!(summary["failed"], 0, "{summary}");
    for r in &records {
        assert_eq!(r["status"], 200, "{r}");
        assert_eq!(r["finish_reason"], "length", "the mock never ends early: {r}");
    }
    // Every request of the sample begins with trace block 0: from the second on, prefixes are cached.
    let cached: u64 = records.iter().map(|r| r["cached_tokens"].as_u64().expect("cached_tokens")).sum();
    assert!(cached > 0, "no prompt token came from cache");
    assert!(summary["cached_token_fraction"].as_f64().is_some_and(|f| f > 0.0));
    for key in ["time_to_first_token_ms", "time_per_output_token_ms", "inter_token_latency_ms", "request_latency_ms"] {
        let d = &summary[key];
        let q: Vec<f64> =
            ["min", "p50", "p90", "p95", "p99", "max"].iter().map(|p| d[p].as_f64().expect("a number")).collect();
        assert!(q.windows(2).all(|w| w[0] <= w[1]), "{key} percentiles out of order: {d}");
        assert!(d["count"].as_u64().is_some_and(|c| c > 0), "{key}: {d}");
    }
    assert!(summary["output_tokens_per_s"].as_f64().is_some_and(|x| x > 0.0));
    let overrun = &summary["step_overrun_p99"];
    assert!(overrun.is_number() || overrun == "+Inf", "the mock workers report their pacing: {summary}");
    drop(up);
    let _ = std::fs::remove_dir_all(&home);
}

/// `tandem bench router` measures both paths at every level it is given (what they measure is not checked: it
/// depends on the machine).
#[test]
fn the_router_benchmark_measures_both_paths_at_each_level() {
    let tandem = tandem_tests::binary("tandem", "tandem");
    let _ = tandem_tests::model();
    let out = std::process::Command::new(&tandem)
        .args(["bench", "router", "--concurrency", "1,4", "--requests", "40", "--prompt-tokens", "32", "--json"])
        .output()
        .expect("tandem runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let levels = v["levels"].as_array().expect("levels");
    assert_eq!(levels.iter().map(|l| l["concurrency"].as_u64().expect("c")).collect::<Vec<_>>(), [1, 4]);
    for l in levels {
        for k in ["direct_p50_ms", "direct_p99_ms", "router_p50_ms", "router_p99_ms"] {
            assert!(l[k].as_f64().is_some_and(|x| x > 0.0), "{k}: {l}");
        }
        assert!(l["direct_p50_ms"].as_f64() <= l["direct_p99_ms"].as_f64(), "{l}");
        // The router runs on threads of its own, whose processor time is read apart from the client's and the
        // worker's: the path through it keeps them busier than the direct one does (their background work).
        let cpu = |k: &str| l[k].as_f64().unwrap_or_else(|| panic!("{k}: {l}"));
        let (through, beside) =
            (cpu("router_router_threads_cpu_us_per_request"), cpu("direct_router_threads_cpu_us_per_request"));
        assert!(through > beside && beside >= 0.0, "{l}");
        assert!((cpu("router_own_cpu_us_per_request") - (through - beside)).abs() < 1e-6, "{l}");
    }
}

/// `tandem bench transfer` reports every transport, the decode worker's shared-memory path through a real engine
/// included (the engine checks the import's block count itself), with its ratio to the plain socket.
#[test]
fn the_transfer_benchmark_measures_the_import_into_a_real_engine() {
    let tandem = tandem_tests::binary("tandem", "tandem");
    let _ = tandem_tests::model();
    let out = std::process::Command::new(&tandem)
        .args(["bench", "transfer", "--mib", "2", "--runs", "1", "--json"])
        .output()
        .expect("tandem runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let names: Vec<&str> = v["transports"]
        .as_array()
        .expect("transports")
        .iter()
        .map(|t| t["transport"].as_str().expect("name"))
        .collect();
    assert_eq!(
        names,
        [
            "quic",
            "shm",
            "shm_fresh_buffers",
            "tcp",
            "shm_into_engine",
            "shm_copied_then_engine",
            "quic_into_engine",
            "quic_gathered_then_engine"
        ]
    );
    for t in v["transports"].as_array().expect("transports") {
        assert!(t["gb_per_s"].as_f64().is_some_and(|x| x > 0.0), "{t}");
    }
    assert!(v["shm_into_engine_vs_tcp"].as_f64().is_some_and(|x| x > 0.0), "{v}");
    assert!(v["quic_into_engine_vs_tcp"].as_f64().is_some_and(|x| x > 0.0), "{v}");
}

/// `tandem bench leases` times prefills at each level of live leases it is given, the leases piling up (what the
/// times are is not checked: it depends on the machine).
#[test]
fn the_lease_benchmark_times_prefills_as_leases_pile_up() {
    let tandem = tandem_tests::binary("tandem", "tandem");
    let _ = tandem_tests::model();
    let out = std::process::Command::new(&tandem)
        .args(["bench", "leases", "--leases", "1,4", "--samples", "2", "--prompt-tokens", "20", "--json"])
        .output()
        .expect("tandem runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let levels = v["levels"].as_array().expect("levels");
    // 1 (the warm-up's), then 4 once three more piled up; the two timed at 1 stay live too.
    let leases: Vec<u64> = levels.iter().map(|l| l["leases"].as_u64().expect("leases")).collect();
    assert_eq!(leases, [1, 4]);
    for l in levels {
        assert!(l["leased_bytes"].as_u64().is_some_and(|b| b > 0), "{l}");
        assert!(l["p50_ms"].as_f64().is_some_and(|x| x > 0.0) && l["p50_ms"].as_f64() <= l["max_ms"].as_f64(), "{l}");
    }
}
