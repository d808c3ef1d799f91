//! The engine over the fused forward (`GpuForward` on the host build of the kernels): its steps leave their K/V on
//! the device, so whatever else reads a device block (a copy to the host tier, an export) must get the device's
//! values handed back first (`Backend::write_back`).

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use engine::backend::gpu::{GpuForward, Options};
use engine::generate::{Completion, Engine, EngineConfig, EngineHandle, Request, SeqEvent};
use engine::model::Model;
use engine::sampling::{RawSampling, SamplingParams};
use engine::text::TextModel;

use super::forward::{HostGpu, synthetic};

/// An engine over the fused forward, decode steps recorded. (Through the matmuls: the matrix-vector kernels reach a
/// barrier per shuffle, dear on the host's fibers, and write the device's copy as the others do.)
fn fused_engine(path: &std::path::Path, config: EngineConfig) -> Engine {
    let model = Model::open(path).expect("loads");
    let options = Options { record: true, ..Options::default() };
    let backend = GpuForward::new(HostGpu::default(), &model, "host", options).expect("weights up");
    let text = Arc::new(TextModel::open(path).expect("a text model"));
    Engine::with_backend(Box::new(backend), text, config).expect("opens")
}

/// Greedy with each token's log-probability: the logits themselves, compared to the last bit.
fn request(prompt: Vec<u32>) -> Request {
    let sampling = SamplingParams::new(RawSampling { max_tokens: 3, logprobs: Some(0), ..RawSampling::default() });
    Request { prompt, sampling: sampling.expect("valid"), namespace: None, deadline: None, priority: 0 }
}

fn each_alone(e: &mut Engine, requests: &[Request]) -> Vec<Completion> {
    let cancel = AtomicBool::new(false);
    requests.iter().map(|r| e.run(std::slice::from_ref(r), &cancel, |_| {}).expect("runs").remove(0)).collect()
}

#[test]
fn blocks_offloaded_to_the_host_tier_carry_what_the_device_computed() {
    let path = synthetic(10);
    let prompt = |s: u32, len: u32| (0..len).map(|i| 300 + (i * 7 + s * 131) % 700).collect::<Vec<u32>>();
    // A 64-token prompt (four blocks), two others that push its blocks out of eight device blocks, then the first
    // prompt's 48 leading tokens with another ending: its three shared blocks come back from the host tier.
    let shared = prompt(1, 64);
    let again = [&shared[..48], &prompt(4, 20)[..]].concat();
    let requests = [request(shared.clone()), request(prompt(2, 64)), request(prompt(3, 64)), request(again)];
    let config = |kv_blocks, host_blocks| EngineConfig {
        kv_blocks,
        host_blocks,
        max_model_len: Some(128),
        ..EngineConfig::default()
    };
    let mut roomy = fused_engine(&path, config(64, 0));
    let want = each_alone(&mut roomy, &requests);
    let mut tiered = fused_engine(&path, config(8, 32));
    let got = each_alone(&mut tiered, &requests);
    let counters = tiered.counters();
    assert!(counters.offloads[1] >= 3 && counters.onboards[1] >= 3, "offloaded and onboarded: {counters:?}");
    assert_eq!((got[3].cached_tokens, want[3].cached_tokens), (48, 48), "the shared blocks were reused both ways");
    for (k, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!((&g.token_ids, &g.logprobs), (&w.token_ids, &w.logprobs), "request {k}");
    }
    std::fs::remove_file(path).ok();
}

#[tokio::test(flavor = "current_thread")]
async fn an_exported_prompt_carries_what_the_device_computed() {
    let path = synthetic(11);
    let prompt: Vec<u32> = (0..40).map(|i| 200 + i * 13).collect();
    let mut exported = Vec::new();
    let cpu = Engine::open(&path, EngineConfig::default()).expect("the CPU engine");
    for engine in [cpu, fused_engine(&path, EngineConfig::default())] {
        let handle = EngineHandle::start(engine).expect("starts");
        let greedy = Request::greedy(prompt.clone(), std::num::NonZeroU32::MIN);
        let mut stream = handle.submit_exporting(greedy, None).await.expect("accepted");
        while let Some(event) = stream.next().await {
            match event {
                SeqEvent::Exported(kv) => exported.push(kv),
                SeqEvent::Finished(_) => break,
                SeqEvent::Token { .. } => {}
                other => panic!("{other:?}"),
            }
        }
    }
    let [cpu, fused] = &exported[..] else { panic!("two exports") };
    assert_eq!((fused.tokens, fused.len()), (40, 3));
    // Every block within 1% of its largest value of the CPU engine's (the device's matmuls read f16 inputs).
    for i in 0..cpu.len() {
        let values = |b: &[u8]| bytemuck::cast_slice::<u8, half::f16>(b).iter().map(|v| v.to_f32()).collect::<Vec<_>>();
        let (want, got) = (values(cpu.block(i)), values(fused.block(i)));
        let largest = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = want.iter().zip(&got).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(largest > 0.0 && worst <= 0.01 * largest, "block {i}: off by {worst} of {largest}");
    }
    std::fs::remove_file(path).ok();
}
