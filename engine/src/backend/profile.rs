//! A timing profile: how long a modelled engine takes for a step, an onboard and a transfer. The mock backend
//! sleeps for these durations; the simulator advances virtual time by them.
//!
//! Every duration is in milliseconds and is a sum of terms whose coefficients the profile gives (absent terms are
//! zero). For a step whose prompt chunks hold `T` new tokens in all, each chunk `i` having `n_i` new tokens after
//! `c_i` already in the cache, and whose decode rows are `B` sequences reading `K` KV tokens in all out of a
//! device tier of `capacity` tokens:
//!
//! ```text
//! prefill = base + per_token·T + per_token_sq·T² + per_context_ktoken·Σ(n_i·c_i)/1000        (when T > 0)
//! decode  = max(min, base + rows(B) + per_kv_ktoken·K/1000 + Σ_j utilization[j]·u^j), rows(B) = per_seq·B +
//!           per_seq_sq·B² (held at its peak past it when per_seq_sq < 0)
//!           (when B > 0), with u = KV tokens of the batch / capacity
//! mixed   = mixed_ms                                                         (when T > 0 and B > 0)
//! onboard = host_ms_per_block·(blocks from host) + disk_ms_per_block·(blocks from disk)
//! step    = prefill + decode + mixed + onboard
//! ```
//!
//! `mixed_ms` corrects a step that holds both: one forward pass reads the weights once, so it is usually negative,
//! about minus the smaller base.
//!
//! A transfer of `n` blocks of the modelled `block_bytes` takes `latency_ms + n·block_bytes / bandwidth`.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// Dynamo's mocker polynomial, standing for one GPU worker.
pub const GPU_DEFAULT: &str = include_str!("../../profiles/gpu-default.toml");
/// Fitted to this engine on CPU with SmolLM2-135M by `tandem bench engine --fit-profile` (two threads).
pub const CPU_SMOLLM2: &str = include_str!("../../profiles/cpu-smollm2.toml");
/// The same on one thread: a worker of `tandem up` on a machine with no more cores than workers.
pub const CPU_SMOLLM2_1T: &str = include_str!("../../profiles/cpu-smollm2-1t.toml");

/// The profiles that ship with Tandem, by name.
pub const BUILT_IN: [(&str, &str); 3] =
    [("gpu-default", GPU_DEFAULT), ("cpu-smollm2", CPU_SMOLLM2), ("cpu-smollm2-1t", CPU_SMOLLM2_1T)];

/// Step and transfer times of a modelled engine.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimingProfile {
    /// What the profile stands for.
    #[serde(default)]
    pub description: String,
    /// How the profile was produced (for a fitted one, the command to re-fit it).
    #[serde(default)]
    pub source: String,
    /// Device tier of the modelled worker in blocks, for a worker not told its size.
    #[serde(default)]
    pub device_blocks: Option<usize>,
    #[serde(default)]
    pub prefill: PrefillTerms,
    #[serde(default)]
    pub decode: DecodeTerms,
    /// Added to a step that has both prompt chunks and decode rows.
    #[serde(default)]
    pub mixed_ms: f64,
    #[serde(default)]
    pub tiers: TierTerms,
    #[serde(default)]
    pub transfer: TransferTerms,
}

/// Prompt-chunk terms of a step (ms).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefillTerms {
    #[serde(default)]
    pub base_ms: f64,
    #[serde(default)]
    pub per_token_ms: f64,
    #[serde(default)]
    pub per_token_sq_ms: f64,
    /// Per thousand (new token × cached-context token) pairs: attention over what is already cached.
    #[serde(default)]
    pub per_context_ktoken_ms: f64,
}

/// Decode-row terms of a step (ms).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecodeTerms {
    #[serde(default)]
    pub base_ms: f64,
    #[serde(default)]
    pub per_seq_ms: f64,
    /// Per decode row squared (negative when batching amortises more as the batch grows).
    #[serde(default)]
    pub per_seq_sq_ms: f64,
    /// Per thousand KV tokens read by the batch's decode rows.
    #[serde(default)]
    pub per_kv_ktoken_ms: f64,
    /// Coefficients of a polynomial in KV utilisation `u` (index = power), as Dynamo's mocker models decode.
    #[serde(default)]
    pub utilization_ms: Vec<f64>,
    /// Floor of the decode part.
    #[serde(default)]
    pub min_ms: f64,
}

impl DecodeTerms {
    /// `per_seq·B + per_seq_sq·B²`, held at its peak past it when the square term is negative (a fit over small
    /// batches must not make larger batches cheaper than smaller ones).
    pub fn rows_ms(&self, b: f64) -> f64 {
        let at = |b: f64| self.per_seq_ms * b + self.per_seq_sq_ms * b * b;
        if self.per_seq_sq_ms < 0.0 {
            let peak = -self.per_seq_ms / (2.0 * self.per_seq_sq_ms);
            if peak > 0.0 && b > peak {
                return at(peak);
            }
        }
        at(b)
    }
}

/// Bringing cached blocks back to the device (ms per block).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TierTerms {
    #[serde(default)]
    pub host_ms_per_block: f64,
    #[serde(default)]
    pub disk_ms_per_block: f64,
}

/// Moving KV between workers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransferTerms {
    #[serde(default)]
    pub latency_ms: f64,
    /// Bytes per second of one worker's link.
    pub bandwidth_bytes_per_s: f64,
    /// Bytes of one KV block of the modelled model (what a transfer is charged for).
    pub block_bytes: u64,
}

impl Default for TransferTerms {
    fn default() -> Self {
        TransferTerms { latency_ms: 0.0, bandwidth_bytes_per_s: 1e10, block_bytes: 0 }
    }
}

/// The shape of one step, as the timing model sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepShape {
    /// New prompt tokens over all prompt chunks.
    pub prefill_tokens: usize,
    /// Σ new tokens × cached tokens before them, over prompt chunks.
    pub prefill_context_pairs: u64,
    /// Decode rows.
    pub decode_seqs: usize,
    /// KV tokens the decode rows read.
    pub decode_kv_tokens: usize,
    /// KV tokens of the whole batch (for utilisation).
    pub batch_kv_tokens: usize,
    /// Device tier size in tokens.
    pub capacity_tokens: usize,
    /// Blocks brought up from host and from disk in this step.
    pub onboarded: [u64; 2],
}

/// Why a profile could not be had.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("reading timing profile {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("timing profile {name}: {why}")]
    Invalid { name: String, why: String },
}

impl TimingProfile {
    /// A built-in profile by name (`gpu-default`, `cpu-smollm2`, `cpu-smollm2-1t`) or a TOML file at that path.
    pub fn load(name_or_path: &str) -> Result<TimingProfile, ProfileError> {
        if let Some((_, text)) = BUILT_IN.iter().find(|(n, _)| *n == name_or_path) {
            return TimingProfile::parse(name_or_path, text);
        }
        let text = std::fs::read_to_string(Path::new(name_or_path))
            .map_err(|source| ProfileError::Read { path: name_or_path.to_string(), source })?;
        TimingProfile::parse(name_or_path, &text)
    }

    /// Parses and checks a profile's TOML.
    pub fn parse(name: &str, text: &str) -> Result<TimingProfile, ProfileError> {
        let invalid = |why: String| ProfileError::Invalid { name: name.to_string(), why };
        let p: TimingProfile = toml::from_str(text).map_err(|e| invalid(e.to_string()))?;
        p.check().map_err(invalid)?;
        Ok(p)
    }

    /// Rejects what would give negative or unbounded times.
    fn check(&self) -> Result<(), String> {
        let t = &self.transfer;
        if !(t.bandwidth_bytes_per_s.is_finite() && t.bandwidth_bytes_per_s > 0.0) {
            return Err("transfer.bandwidth_bytes_per_s must be positive".into());
        }
        let all = [
            self.prefill.base_ms,
            self.prefill.per_token_ms,
            self.prefill.per_token_sq_ms,
            self.prefill.per_context_ktoken_ms,
            self.decode.base_ms,
            self.decode.per_seq_ms,
            self.decode.per_seq_sq_ms,
            self.decode.per_kv_ktoken_ms,
            self.mixed_ms,
            self.decode.min_ms,
            self.tiers.host_ms_per_block,
            self.tiers.disk_ms_per_block,
            t.latency_ms,
        ];
        if all.iter().chain(&self.decode.utilization_ms).any(|v| !v.is_finite()) {
            return Err("every coefficient must be a finite number".into());
        }
        if self.decode.min_ms < 0.0 || t.latency_ms < 0.0 {
            return Err("decode.min_ms and transfer.latency_ms must not be negative".into());
        }
        Ok(())
    }

    /// Modelled duration of one step in milliseconds (never negative).
    pub fn step_ms(&self, s: &StepShape) -> f64 {
        let mut ms = 0.0;
        if s.prefill_tokens > 0 {
            let (p, t) = (&self.prefill, s.prefill_tokens as f64);
            ms += p.base_ms
                + p.per_token_ms * t
                + p.per_token_sq_ms * t * t
                + p.per_context_ktoken_ms * s.prefill_context_pairs as f64 / 1000.0;
        }
        if s.decode_seqs > 0 {
            let d = &self.decode;
            let u = s.batch_kv_tokens as f64 / s.capacity_tokens.max(1) as f64;
            let poly: f64 = d.utilization_ms.iter().rev().fold(0.0, |acc, c| acc * u + c);
            let raw = d.base_ms
                + d.rows_ms(s.decode_seqs as f64)
                + d.per_kv_ktoken_ms * s.decode_kv_tokens as f64 / 1000.0
                + poly;
            ms += raw.max(d.min_ms);
        }
        if s.prefill_tokens > 0 && s.decode_seqs > 0 {
            ms += self.mixed_ms;
        }
        ms +=
            self.tiers.host_ms_per_block * s.onboarded[0] as f64 + self.tiers.disk_ms_per_block * s.onboarded[1] as f64;
        ms.max(0.0)
    }

    /// Modelled duration of moving `blocks` blocks between workers, in milliseconds.
    pub fn transfer_ms(&self, blocks: u64) -> f64 {
        let t = &self.transfer;
        t.latency_ms + (blocks * t.block_bytes) as f64 / t.bandwidth_bytes_per_s * 1000.0
    }

    /// Modelled bytes of `blocks` blocks.
    pub fn transfer_bytes(&self, blocks: u64) -> u64 {
        blocks * self.transfer.block_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn built_in_profiles_parse() {
        for (name, _) in BUILT_IN {
            TimingProfile::load(name).expect(name);
        }
    }

    #[test]
    fn gpu_default_is_dynamos_mocker_polynomial() {
        let p = TimingProfile::load("gpu-default").expect("parses");
        let prefill = StepShape { prefill_tokens: 1000, ..StepShape::default() };
        // 4.21e-7·1000² + 1.52e-2·1000 + 16.5
        assert!((p.step_ms(&prefill) - (0.421 + 15.2 + 16.5)).abs() < 1e-9);
        let half = StepShape { decode_seqs: 8, batch_kv_tokens: 500, capacity_tokens: 1000, ..StepShape::default() };
        // −25.74·0.25 + 54.01·0.5 + 5.74
        assert!((p.step_ms(&half) - (-25.74 * 0.25 + 54.01 * 0.5 + 5.74)).abs() < 1e-9);
        let idle = StepShape { decode_seqs: 1, batch_kv_tokens: 0, capacity_tokens: 1000, ..StepShape::default() };
        assert!((p.step_ms(&idle) - 5.74).abs() < 1e-9);
    }

    #[test]
    fn a_bad_profile_names_its_problem() {
        let e =
            TimingProfile::parse("x", "[transfer]\nbandwidth_bytes_per_s = 0\nblock_bytes = 1\n").expect_err("refused");
        assert!(e.to_string().contains("bandwidth"), "{e}");
        let e = TimingProfile::parse("x", "[prefil]\nbase_ms = 1\n").expect_err("refused");
        assert!(e.to_string().contains("prefil"), "{e}");
        assert!(matches!(TimingProfile::load("/nonexistent/p.toml"), Err(ProfileError::Read { .. })));
    }

    #[test]
    fn a_negative_square_term_never_makes_a_larger_batch_cheaper() {
        let d = DecodeTerms { per_seq_ms: 10.0, per_seq_sq_ms: -0.25, ..DecodeTerms::default() };
        // Peak at B = 20 (100 ms): held there beyond.
        assert_eq!((d.rows_ms(4.0), d.rows_ms(20.0), d.rows_ms(64.0)), (36.0, 100.0, 100.0));
    }

    #[test]
    fn transfer_time_follows_the_modelled_size() {
        let p = TimingProfile::parse(
            "x",
            "[transfer]\nlatency_ms = 2\nbandwidth_bytes_per_s = 1e9\nblock_bytes = 1000000\n",
        )
        .expect("parses");
        assert!((p.transfer_ms(10) - 12.0).abs() < 1e-9);
        assert_eq!(p.transfer_bytes(10), 10_000_000);
    }
}
