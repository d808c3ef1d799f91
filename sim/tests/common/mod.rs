//! The simulated cluster the simulator's tests share.

#![allow(dead_code)]

use engine::backend::TimingProfile;
use engine::backend::mock::MockSettings;
use engine::generate::{BackendChoice, EngineConfig};
use loadgen::trace::TraceRequest;
use router::scheduler::config::{Policy, SchedulerConfig};
use sim::Settings;

/// `prefill` + `decode` workers of the given timing profile (TOML), 256 device and 256 host blocks each.
pub fn settings(profile: &str, prefill: usize, decode: usize, policy: Policy) -> Settings {
    let model = engine::fetch::ensure_default_model(&engine::fetch::Quiet).expect("the embedded model");
    let profile = TimingProfile::parse("test", profile).expect("profile parses");
    let mock =
        MockSettings { profile, block_bytes: 0, context_len: 1024, virtual_time: true, ..MockSettings::gpu_default() };
    Settings {
        model,
        prefill,
        decode,
        engine: EngineConfig {
            backend: BackendChoice::Mock(Box::new(mock)),
            kv_blocks: 256,
            host_blocks: 256,
            max_model_len: Some(1024),
            ..EngineConfig::default()
        },
        scheduler: SchedulerConfig { policy, ..SchedulerConfig::default() },
        event_delay: 0.001,
        report_delay: 0.001,
        transfer_latency: 0.0005,
        transfer_bandwidth: 25e9,
        transfer_block_bytes: 2 << 20,
        trace_block: 512,
        max_isl: 1024,
        routers: 1,
        prefill_speedups: Vec::new(),
        replay: false,
        record_candidates: false,
        stall_after: router::resilience::stall_defaults::AFTER.as_secs_f64(),
        timeouts: sim::CallTimeouts::default(),
        router_tokens_per_s: 0.0,
        host_cores: 0,
        router_slots: 1,
        stream_kv: false,
        admission: sim::Limits::default(),
        failures: Vec::new(),
        seed: 7,
    }
}

pub fn request(at_ms: f64, input: usize, output: usize, id: u64) -> TraceRequest {
    TraceRequest {
        arrival_ms: Some(at_ms),
        input_length: input,
        output_length: output,
        hash_ids: vec![id],
        ..TraceRequest::default()
    }
}

/// The `gpu-default` profile in virtual time, for runs that need realistic proportions.
pub fn settings_gpu() -> Settings {
    let mut s = settings("", 2, 2, Policy::Kv);
    let profile = TimingProfile::load("gpu-default").expect("gpu-default ships");
    let mock =
        MockSettings { profile, block_bytes: 0, context_len: 1024, virtual_time: true, ..MockSettings::gpu_default() };
    s.engine.backend = BackendChoice::Mock(Box::new(mock));
    // Room for every request of the test at once: refusals are not what it checks.
    (s.engine.kv_blocks, s.engine.host_blocks) = (4096, 4096);
    s
}

/// `requests` requests over `prefixes` system prompts of 256 tokens (Zipf 1), each with its own 64 tokens and 4 to
/// write, arriving as a Poisson process at `rate` per second.
pub fn shared_prefixes(
    requests: usize,
    prefixes: usize,
    rate: f64,
    seed: u64,
) -> (Vec<TraceRequest>, Vec<loadgen::schedule::Start>) {
    let spec = loadgen::synthetic::SyntheticSpec {
        requests,
        prefixes,
        prefix_len: 256,
        suffix_len: 64,
        output_len: 4,
        zipf: 1.0,
        turns: 1,
        turn_delay_ms: 0.0,
        seed,
    };
    let trace = spec.generate(512);
    let arrivals = loadgen::schedule::Arrivals::Rate { rate, burstiness: 1.0, seed };
    let starts = loadgen::schedule::plan(&trace, &arrivals);
    (trace, starts)
}
