//! What computes a step. The scheduler above (admission, batching, chunked prefill, the tiered pool, preemption,
//! export and import) is the same whatever the backend: [`cpu`] runs the model's forward pass; [`mock`] computes
//! nothing and takes the time a [`TimingProfile`] gives, so that many workers on one machine behave like GPU
//! workers for routing experiments.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod fit;
pub mod gpu;
pub mod mock;
pub mod profile;

use std::sync::Arc;
use std::time::Instant;

pub use profile::{StepShape, TimingProfile};

use crate::forward::{ForwardError, SeqChunk};
use crate::kv::{KvLayout, KvStore};
use crate::sampling::TokenLogprobs;

/// What a step gives for a chunk that asked for its next token.
#[derive(Clone, Debug)]
pub enum Next {
    /// Logits over the vocabulary: the sequence's sampler picks.
    Logits(Vec<f32>),
    /// No logits: the sequence's sampler draws uniformly from these tokens with its own seeded generator, so the
    /// output is reproducible from the request's seed.
    Draw(Arc<[u32]>),
    /// The largest logit's token (the lowest among equal ones), for a chunk that asked for no more
    /// ([`SeqChunk::greedy`]).
    Token(u32),
}

/// What the scheduler knows of a step beyond its chunks.
#[derive(Clone, Copy, Debug)]
pub struct StepContext {
    /// When the step began (admission and block allocation included).
    pub started: Instant,
    /// Blocks brought to the device from host and from disk during the step.
    pub onboarded: [u64; 2],
}

/// Runs steps over the paged KV store.
pub trait Backend: Send + std::fmt::Debug {
    /// `cpu` or `mock`.
    fn name(&self) -> &'static str;
    /// Tokens in the vocabulary.
    fn vocab(&self) -> usize;
    /// Longest sequence the backend can hold.
    fn context_len(&self) -> usize;
    /// The KV block shape for blocks of `block_tokens` tokens.
    fn kv_layout(&self, block_tokens: usize) -> KvLayout;
    /// Compute threads.
    fn threads(&self) -> usize;
    /// What [`forward`](Self::forward) would refuse of one chunk, checked before the batch runs.
    fn check_chunk(&self, kv: &KvStore, chunk: &SeqChunk<'_>) -> Result<(), ForwardError> {
        crate::forward::check_chunk(kv, chunk, self.vocab(), self.context_len())
    }
    /// Runs one step: fills the chunks' KV and appends to `next` one [`Next`] per chunk that asked for it, in batch
    /// order. (The engine keeps `next` from step to step: a step of a modelled backend costs less than an
    /// allocation.)
    fn forward_into(
        &mut self,
        kv: &mut KvStore,
        batch: &[SeqChunk<'_>],
        context: StepContext,
        next: &mut Vec<Next>,
    ) -> Result<(), ForwardError>;
    /// Whether [`forward_scored`](Self::forward_scored) computes prompt log-probabilities.
    fn scores_prompts(&self) -> bool {
        false
    }
    /// [`forward_into`](Self::forward_into), also appending to `scores` one [`TokenLogprobs`] per row the chunks
    /// score ([`SeqChunk::scored`]), in batch order. A backend that does not compute them
    /// ([`scores_prompts`](Self::scores_prompts) false) refuses a batch that asks, before any compute.
    fn forward_scored(
        &mut self,
        kv: &mut KvStore,
        batch: &[SeqChunk<'_>],
        context: StepContext,
        next: &mut Vec<Next>,
        _scores: &mut Vec<TokenLogprobs>,
    ) -> Result<(), ForwardError> {
        if batch.iter().any(|c| c.scored.is_some_and(|s| !s.targets.is_empty())) {
            return Err(ForwardError::NoPromptScores(self.name()));
        }
        self.forward_into(kv, batch, context, next)
    }
    /// [`forward_into`](Self::forward_into) a vector of its own.
    fn forward(
        &mut self,
        kv: &mut KvStore,
        batch: &[SeqChunk<'_>],
        context: StepContext,
    ) -> Result<Vec<Next>, ForwardError> {
        let mut next = Vec::new();
        self.forward_into(kv, batch, context, &mut next)?;
        Ok(next)
    }
    /// Brings `blocks` up to date in `kv` where this backend keeps newer K/V of its own (a GPU's copy of the store,
    /// which its steps write): the engine calls it before anything else reads those blocks (a copy to another
    /// tier, an export). A backend that computes into `kv` itself has nothing to do. A backend serves one store:
    /// the `kv` of its steps.
    fn write_back(&mut self, _kv: &mut KvStore, _blocks: &[crate::kv::BlockId]) -> Result<(), ForwardError> {
        Ok(())
    }
    /// Step timing against the profile, for a modelled backend.
    fn pacing(&self) -> Option<Pacing> {
        None
    }
    /// For a backend that keeps virtual time: the modelled duration of its last step, in seconds. The step took
    /// no real time; the caller's clock advances by this.
    fn virtual_step_secs(&self) -> Option<f64> {
        None
    }
}

/// How closely a modelled backend kept to its profile (totals since it started).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pacing {
    pub steps: u64,
    /// Modelled step time (after the speed-up).
    pub modelled_nanos: u64,
    /// Steps by overrun (actual / modelled duration), bucketed at [`OVERRUN_BOUNDS`].
    pub overrun_buckets: [u64; OVERRUN_BOUNDS.len() + 1],
}

/// Upper bounds of the overrun buckets (the last bucket is everything above the last bound).
pub const OVERRUN_BOUNDS: [f64; 8] = [1.01, 1.02, 1.05, 1.1, 1.25, 1.5, 2.0, 4.0];

impl Pacing {
    /// Counts one step that was modelled at `modelled` seconds and took `actual`.
    pub fn record(&mut self, modelled: f64, actual: f64) {
        self.steps += 1;
        self.modelled_nanos += (modelled * 1e9) as u64;
        let ratio = if modelled > 0.0 { actual / modelled } else { 1.0 };
        let b = OVERRUN_BOUNDS.iter().position(|&u| ratio <= u).unwrap_or(OVERRUN_BOUNDS.len());
        self.overrun_buckets[b] += 1;
    }
}

/// Where the model computes: `cpu`, or `cuda` / `cuda:N` (device N; 0 when not given).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Device {
    #[default]
    Cpu,
    Cuda(usize),
}

impl std::str::FromStr for Device {
    type Err = String;

    fn from_str(s: &str) -> Result<Device, String> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => match s.strip_prefix("cuda:").map(str::parse) {
                Some(Ok(n)) => Ok(Device::Cuda(n)),
                _ => Err(format!("unknown device {s:?}: expected cpu, cuda or cuda:N")),
            },
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl Device {
    /// Checks that this machine and build can compute on the device, before anything is loaded: `Err` is one
    /// sentence for the user.
    pub fn check(self) -> Result<(), String> {
        match self {
            Device::Cpu => Ok(()),
            Device::Cuda(n) => cuda_check(n),
        }
    }
}

#[cfg(feature = "cuda")]
fn cuda_check(ordinal: usize) -> Result<(), String> {
    cuda::open(ordinal).map(|_| ()).map_err(|e| e.to_string())
}

#[cfg(not(feature = "cuda"))]
fn cuda_check(_ordinal: usize) -> Result<(), String> {
    Err(NO_CUDA.to_string())
}

#[cfg(not(feature = "cuda"))]
const NO_CUDA: &str = "this build has no CUDA support: build with `cargo build --release -p tandem --features cuda`, or compute on \
     the CPU (--device cpu; --engine cpu for workers)";

/// The CUDA backend for `model` on device `ordinal`; `Err` is one sentence.
#[cfg(feature = "cuda")]
pub fn open_cuda(model: &crate::model::Model, ordinal: usize) -> Result<Box<dyn Backend>, String> {
    let options = match cuda::ForwardKind::from_env()? {
        cuda::ForwardKind::Plain => {
            return cuda::CudaBackend::new(model, ordinal)
                .map(|b| Box::new(b) as Box<dyn Backend>)
                .map_err(|e| e.to_string());
        }
        cuda::ForwardKind::Fused => gpu::Options::default(),
        cuda::ForwardKind::Graphs => gpu::Options { record: true, ..gpu::Options::default() },
        cuda::ForwardKind::GraphsMatvec => {
            gpu::Options { record: true, matvec: true, tensor_cores: false, quantized: true }
        }
        cuda::ForwardKind::GraphsMatvecTensorCores => {
            gpu::Options { record: true, matvec: true, tensor_cores: true, quantized: true }
        }
    };
    let gpu = cuda::CudaGpu::open(ordinal).map_err(|e| e.to_string())?;
    let forward = gpu::GpuForward::new(gpu, model, "cuda", options).map_err(|e| e.to_string())?;
    Ok(Box::new(forward))
}

/// Without the `cuda` feature: the sentence saying so.
#[cfg(not(feature = "cuda"))]
pub fn open_cuda(_model: &crate::model::Model, _ordinal: usize) -> Result<Box<dyn Backend>, String> {
    Err(NO_CUDA.to_string())
}

/// Whether a CUDA driver could be used (always false without the feature).
pub fn cuda_driver_present() -> bool {
    #[cfg(feature = "cuda")]
    {
        cuda::driver_present()
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

#[cfg(test)]
mod device_tests {
    use super::Device;

    #[test]
    fn devices_parse_and_print_back() {
        for (text, device) in [("cpu", Device::Cpu), ("cuda", Device::Cuda(0)), ("cuda:3", Device::Cuda(3))] {
            assert_eq!(text.parse::<Device>(), Ok(device));
        }
        assert_eq!(Device::Cuda(3).to_string(), "cuda:3");
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", "CPU"] {
            assert!(bad.parse::<Device>().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_cuda_device_is_refused_with_one_sentence_where_it_cannot_run() {
        assert_eq!(Device::Cpu.check(), Ok(()));
        // Without the feature, or without a driver: one sentence naming the way out. (On a GPU machine with the
        // feature, device 0 opens: `tests/cuda.rs` covers that side.)
        if !cfg!(feature = "cuda") || !super::cuda_driver_present() {
            let why = Device::Cuda(0).check().expect_err("no CUDA here");
            assert!(!why.contains('\n') && why.contains("--device cpu"), "{why}");
        }
    }
}
