//! Sampling parameters (validated once, at the edge) and the per-sequence sampler.

use std::num::NonZeroU32;

/// Why sampling parameters were refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    #[error("temperature must be a number >= 0, got {0}")]
    Temperature(f32),
    #[error("top_p must be in (0, 1], got {0}")]
    TopP(f32),
    #[error("top_k must be at least 1")]
    TopK,
    #[error("max_tokens must be at least 1")]
    MaxTokens,
    #[error("stop strings must not be empty")]
    EmptyStop,
    #[error("stop strings need the text: they cannot be used with detokenize off")]
    StopWithoutText,
}

/// How to pick tokens and when to stop: valid by construction.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    temperature: f32,
    top_p: f32,
    top_k: Option<NonZeroU32>,
    seed: Option<u64>,
    max_tokens: NonZeroU32,
    stop: Vec<String>,
    ignore_eos: bool,
    detokenize: bool,
}

/// Sampling parameters as a user gives them, before validation.
#[derive(Clone, Debug, PartialEq)]
pub struct RawSampling {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: Option<u32>,
    pub seed: Option<u64>,
    pub max_tokens: u32,
    pub stop: Vec<String>,
    /// Keep generating past end-of-generation tokens (benchmarks, as vLLM's `ignore_eos`).
    pub ignore_eos: bool,
    /// Make the output's text (as vLLM's `detokenize`); off, only token ids come out, and no time goes into
    /// decoding them (the simulator, which counts tokens and never reads them).
    pub detokenize: bool,
}

impl Default for RawSampling {
    /// Greedy, 256 tokens: deterministic output unless a user asks otherwise.
    fn default() -> Self {
        RawSampling {
            temperature: 0.0,
            top_p: 1.0,
            top_k: None,
            seed: None,
            max_tokens: 256,
            stop: Vec::new(),
            ignore_eos: false,
            detokenize: true,
        }
    }
}

impl SamplingParams {
    /// Validates `raw`.
    pub fn new(raw: RawSampling) -> Result<SamplingParams, SamplingError> {
        if !(raw.temperature >= 0.0 && raw.temperature.is_finite()) {
            return Err(SamplingError::Temperature(raw.temperature));
        }
        if !(raw.top_p > 0.0 && raw.top_p <= 1.0) {
            return Err(SamplingError::TopP(raw.top_p));
        }
        let top_k = match raw.top_k {
            None => None,
            Some(k) => Some(NonZeroU32::new(k).ok_or(SamplingError::TopK)?),
        };
        let max_tokens = NonZeroU32::new(raw.max_tokens).ok_or(SamplingError::MaxTokens)?;
        if raw.stop.iter().any(String::is_empty) {
            return Err(SamplingError::EmptyStop);
        }
        if !raw.detokenize && !raw.stop.is_empty() {
            return Err(SamplingError::StopWithoutText);
        }
        Ok(SamplingParams {
            temperature: raw.temperature,
            top_p: raw.top_p,
            top_k,
            seed: raw.seed,
            max_tokens,
            stop: raw.stop,
            ignore_eos: raw.ignore_eos,
            detokenize: raw.detokenize,
        })
    }

    /// Greedy decoding of at most `max_tokens` tokens.
    pub fn greedy(max_tokens: NonZeroU32) -> SamplingParams {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: None,
            seed: None,
            max_tokens,
            stop: Vec::new(),
            ignore_eos: false,
            detokenize: true,
        }
    }

    pub fn max_tokens(&self) -> u32 {
        self.max_tokens.get()
    }

    pub fn stop(&self) -> &[String] {
        &self.stop
    }

    pub fn ignore_eos(&self) -> bool {
        self.ignore_eos
    }

    pub fn detokenize(&self) -> bool {
        self.detokenize
    }

    pub fn seed(&self) -> Option<u64> {
        self.seed
    }
}

/// SplitMix64: small, fast, and reproducible from a seed.
#[derive(Clone, Debug)]
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// Picks tokens for one sequence.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
}

impl Sampler {
    /// A sampler seeded with the request's seed, or with `fallback_seed` when it has none.
    pub fn new(params: SamplingParams, fallback_seed: u64) -> Sampler {
        let seed = params.seed.unwrap_or(fallback_seed);
        Sampler { params, rng: Rng(seed) }
    }

    /// The next token for `logits`.
    /// Draws one of `tokens` uniformly with the sampler's own generator (a backend that computes no logits).
    pub fn draw(&mut self, tokens: &[u32]) -> u32 {
        if tokens.is_empty() {
            return 0;
        }
        tokens[(self.rng.next_u64() % tokens.len() as u64) as usize]
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        if p.temperature == 0.0 || p.top_k.is_some_and(|k| k.get() == 1) {
            return argmax(logits);
        }
        // Candidates by descending logit (ties: lower id first), cut to top-k.
        let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
        let by_logit = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
        if let Some(k) = p.top_k {
            let k = (k.get() as usize).min(ids.len());
            if k < ids.len() {
                ids.select_nth_unstable_by(k - 1, by_logit);
                ids.truncate(k);
            }
        }
        ids.sort_unstable_by(by_logit);
        let max = logits[ids[0] as usize];
        let inv_t = 1.0 / f64::from(p.temperature);
        let mut probs: Vec<f64> =
            ids.iter().map(|&i| ((f64::from(logits[i as usize]) - f64::from(max)) * inv_t).exp()).collect();
        let total: f64 = probs.iter().sum();
        // Nucleus: the smallest prefix whose probability reaches top_p.
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = probs.len();
            for (i, pr) in probs.iter().enumerate() {
                acc += pr / total;
                if acc >= f64::from(p.top_p) {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep);
        }
        let total: f64 = probs.iter().sum();
        let mut u = self.rng.next_f64() * total;
        for (i, pr) in probs.iter().enumerate() {
            if u < *pr {
                return ids[i];
            }
            u -= pr;
        }
        ids[probs.len() - 1]
    }
}

/// Index of the largest logit; the lowest index wins ties.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_p: f32, top_k: Option<u32>, seed: u64) -> SamplingParams {
        SamplingParams::new(RawSampling { temperature, top_p, top_k, seed: Some(seed), ..RawSampling::default() })
            .expect("valid")
    }

    #[test]
    fn bad_values_are_refused() {
        let raw = RawSampling::default;
        assert_eq!(
            SamplingParams::new(RawSampling { temperature: -0.1, ..raw() }),
            Err(SamplingError::Temperature(-0.1))
        );
        assert!(SamplingParams::new(RawSampling { temperature: f32::NAN, ..raw() }).is_err());
        assert_eq!(SamplingParams::new(RawSampling { top_p: 0.0, ..raw() }), Err(SamplingError::TopP(0.0)));
        assert_eq!(SamplingParams::new(RawSampling { top_p: 1.5, ..raw() }), Err(SamplingError::TopP(1.5)));
        assert_eq!(SamplingParams::new(RawSampling { top_k: Some(0), ..raw() }), Err(SamplingError::TopK));
        assert_eq!(SamplingParams::new(RawSampling { max_tokens: 0, ..raw() }), Err(SamplingError::MaxTokens));
        let no_text = RawSampling { detokenize: false, stop: vec!["x".into()], ..raw() };
        assert_eq!(SamplingParams::new(no_text), Err(SamplingError::StopWithoutText));
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
    }

    #[test]
    fn a_seed_reproduces_and_top_k_and_top_p_restrict() {
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.7).sin() * 3.0).collect();
        let draw = |p: SamplingParams| {
            let mut s = Sampler::new(p, 0);
            (0..200).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(params(1.0, 1.0, None, 7)), draw(params(1.0, 1.0, None, 7)));
        assert_ne!(draw(params(1.0, 1.0, None, 7)), draw(params(1.0, 1.0, None, 8)));
        let mut order: Vec<u32> = (0..100).collect();
        order.sort_by(|a, b| logits[*b as usize].total_cmp(&logits[*a as usize]));
        let top3 = &order[..3];
        assert!(draw(params(1.0, 1.0, Some(3), 1)).iter().all(|t| top3.contains(t)));
        // A tiny nucleus keeps only the most likely token.
        assert!(draw(params(1.0, 1e-6, None, 1)).iter().all(|&t| t == order[0]));
    }
}
