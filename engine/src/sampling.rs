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
    #[error("min_p must be in [0, 1], got {0}")]
    MinP(f32),
    #[error("max_tokens must be at least 1")]
    MaxTokens,
    #[error("stop strings must not be empty")]
    EmptyStop,
    #[error("stop strings need the text: they cannot be used with detokenize off")]
    StopWithoutText,
    #[error("{0} must be in [-2, 2], got {1}")]
    Penalty(&'static str, f32),
    #[error("repetition_penalty must be a number > 0, got {0}")]
    RepetitionPenalty(f32),
    #[error("a logit_bias value must be in [-100, 100], got {1} for token {0}")]
    LogitBias(u32, f32),
    #[error("at most {MAX_TOP_LOGPROBS} alternatives per token can be asked for, got {0}")]
    Logprobs(u32),
}

/// The most alternatives per token [`RawSampling::logprobs`] may ask for (OpenAI's `top_logprobs` limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// How to pick tokens and when to stop: valid by construction.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    temperature: f32,
    top_p: f32,
    top_k: Option<NonZeroU32>,
    min_p: f32,
    seed: Option<u64>,
    max_tokens: NonZeroU32,
    stop: Vec<String>,
    ignore_eos: bool,
    detokenize: bool,
    logits: LogitsRules,
    logprobs: Option<u32>,
    prompt_logprobs: Option<u32>,
    grammar: Option<crate::grammar::Grammar>,
    thinking: crate::grammar::Thinking,
}

/// What changes the logits before sampling (all off by default).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LogitsRules {
    /// Added to the token's logit (OpenAI's `logit_bias`), sorted by token.
    pub logit_bias: Vec<(u32, f32)>,
    /// OpenAI's: subtracted once per occurrence of the token in the generated text.
    pub frequency_penalty: f32,
    /// OpenAI's: subtracted once if the token occurs in the generated text.
    pub presence_penalty: f32,
    /// vLLM's and Hugging Face's: a token seen in the prompt or the output has a positive logit divided by it and a
    /// negative one multiplied by it (1: off).
    pub repetition_penalty: f32,
    /// End-of-generation and stop tokens are impossible until this many tokens are generated.
    pub min_tokens: u32,
    /// Tokens that end generation like end-of-generation does (vLLM's `stop_token_ids`; not part of the output).
    pub stop_token_ids: Vec<u32>,
    /// Tokens at the end of the prompt that were generated earlier: the first token a prefill worker sampled, or
    /// the tokens a stream had sent before it resumed elsewhere. They count as generated for the penalties and
    /// `min_tokens`, so a continued sequence samples as it would have in one place.
    pub prior_generated: u32,
    /// vLLM's `allowed_token_ids`: only these tokens can be sampled (sorted, no repeats; empty: any).
    pub allowed_token_ids: Vec<u32>,
    /// vLLM's `bad_words`, as token sequences: a sequence's last token is impossible where the generated text ends
    /// with the rest of it (a one-token sequence, everywhere), so the output never holds one.
    pub bad_words: Vec<Vec<u32>>,
}

impl LogitsRules {
    /// Whether any rule changes the logits.
    pub fn active(&self) -> bool {
        !self.logit_bias.is_empty()
            || self.frequency_penalty != 0.0
            || self.presence_penalty != 0.0
            || self.repetition_penalty != 1.0
            || self.min_tokens > 0
            || !self.allowed_token_ids.is_empty()
            || !self.bad_words.is_empty()
    }

    /// Applies the rules to `logits` for a sequence of `tokens` whose generated part starts at `generated_from`,
    /// in vLLM's order: `allowed_token_ids`, `min_tokens`, `bad_words`, then `logit_bias`, then the penalties.
    /// `end_of_generation` names the tokens `min_tokens` holds back (with `stop_token_ids`). Tokens outside the
    /// vocabulary are ignored.
    pub fn apply(
        &self,
        logits: &mut [f32],
        tokens: &[u32],
        generated_from: usize,
        end_of_generation: &dyn Fn(u32) -> bool,
    ) {
        let generated = &tokens[generated_from.min(tokens.len())..];
        if !self.allowed_token_ids.is_empty() {
            let mut allowed = self.allowed_token_ids.iter().peekable();
            for (id, l) in logits.iter_mut().enumerate() {
                if allowed.next_if_eq(&&(id as u32)).is_none() {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        if (generated.len() as u64) < u64::from(self.min_tokens) {
            for (id, l) in logits.iter_mut().enumerate() {
                if end_of_generation(id as u32) || self.stop_token_ids.contains(&(id as u32)) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        for word in &self.bad_words {
            if let Some((&last, before)) = word.split_last()
                && generated.ends_with(before)
                && let Some(l) = logits.get_mut(last as usize)
            {
                *l = f32::NEG_INFINITY;
            }
        }
        for &(id, bias) in &self.logit_bias {
            if let Some(l) = logits.get_mut(id as usize) {
                *l += bias;
            }
        }
        if self.repetition_penalty != 1.0 {
            let mut seen = vec![false; logits.len()];
            for &t in tokens {
                if let Some(l) = logits.get_mut(t as usize)
                    && !std::mem::replace(&mut seen[t as usize], true)
                {
                    *l = if *l > 0.0 { *l / self.repetition_penalty } else { *l * self.repetition_penalty };
                }
            }
        }
        if self.frequency_penalty != 0.0 || self.presence_penalty != 0.0 {
            let mut counts: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
            for &t in generated {
                *counts.entry(t).or_default() += 1;
            }
            for (t, c) in counts {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= c as f32 * self.frequency_penalty + self.presence_penalty;
                }
            }
        }
    }
}

/// Sampling parameters as a user gives them, before validation.
#[derive(Clone, Debug, PartialEq)]
pub struct RawSampling {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: Option<u32>,
    /// vLLM's, SGLang's and llama.cpp's: tokens whose probability (after temperature) is under this fraction of the
    /// most likely token's are left out; 0 is off.
    pub min_p: f32,
    pub seed: Option<u64>,
    pub max_tokens: u32,
    pub stop: Vec<String>,
    /// Keep generating past end-of-generation tokens (benchmarks, as vLLM's `ignore_eos`).
    pub ignore_eos: bool,
    /// Make the output's text (as vLLM's `detokenize`); off, only token ids come out, and no time goes into
    /// decoding them (the simulator, which counts tokens and never reads them).
    pub detokenize: bool,
    /// Biases, penalties, `min_tokens` and stop token ids.
    pub logits: LogitsRules,
    /// Report each sampled token's log-probability and this many most likely alternatives (at most
    /// [`MAX_TOP_LOGPROBS`]); `None`: no log-probabilities.
    pub logprobs: Option<u32>,
    /// Report each prompt token's log-probability (from the second on: the first has no context) and this many most
    /// likely alternatives at its position (at most [`MAX_TOP_LOGPROBS`]), as vLLM's `prompt_logprobs`; `None`:
    /// none. The prompt is then computed whole, not taken from the prefix cache, since cached tokens have no logits.
    pub prompt_logprobs: Option<u32>,
    /// What the output must match (structured outputs); compiled when the sequence is created.
    pub grammar: Option<crate::grammar::Grammar>,
    /// The thinking that comes before what `grammar` holds (none without a grammar).
    pub thinking: crate::grammar::Thinking,
}

impl Default for RawSampling {
    /// Greedy, 256 tokens: deterministic output unless a user asks otherwise.
    fn default() -> Self {
        RawSampling {
            temperature: 0.0,
            top_p: 1.0,
            top_k: None,
            min_p: 0.0,
            seed: None,
            max_tokens: 256,
            stop: Vec::new(),
            ignore_eos: false,
            detokenize: true,
            logits: LogitsRules { repetition_penalty: 1.0, ..LogitsRules::default() },
            logprobs: None,
            prompt_logprobs: None,
            grammar: None,
            thinking: crate::grammar::Thinking::None,
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
        if !(0.0..=1.0).contains(&raw.min_p) {
            return Err(SamplingError::MinP(raw.min_p));
        }
        let max_tokens = NonZeroU32::new(raw.max_tokens).ok_or(SamplingError::MaxTokens)?;
        if raw.stop.iter().any(String::is_empty) {
            return Err(SamplingError::EmptyStop);
        }
        if !raw.detokenize && !raw.stop.is_empty() {
            return Err(SamplingError::StopWithoutText);
        }
        let r = &raw.logits;
        for (name, v) in [("frequency_penalty", r.frequency_penalty), ("presence_penalty", r.presence_penalty)] {
            if !(v.is_finite() && (-2.0..=2.0).contains(&v)) {
                return Err(SamplingError::Penalty(name, v));
            }
        }
        if !(r.repetition_penalty.is_finite() && r.repetition_penalty > 0.0) {
            return Err(SamplingError::RepetitionPenalty(r.repetition_penalty));
        }
        if let Some(&(t, b)) = r.logit_bias.iter().find(|(_, b)| !(b.is_finite() && (-100.0..=100.0).contains(b))) {
            return Err(SamplingError::LogitBias(t, b));
        }
        if let Some(n) = raw.logprobs.filter(|&n| n > MAX_TOP_LOGPROBS) {
            return Err(SamplingError::Logprobs(n));
        }
        if let Some(n) = raw.prompt_logprobs.filter(|&n| n > MAX_TOP_LOGPROBS) {
            return Err(SamplingError::Logprobs(n));
        }
        let mut logits = raw.logits;
        logits.logit_bias.sort_by_key(|(t, _)| *t);
        logits.allowed_token_ids.sort_unstable();
        logits.allowed_token_ids.dedup();
        logits.bad_words.retain(|w| !w.is_empty());
        Ok(SamplingParams {
            temperature: raw.temperature,
            top_p: raw.top_p,
            top_k,
            min_p: raw.min_p,
            seed: raw.seed,
            max_tokens,
            stop: raw.stop,
            ignore_eos: raw.ignore_eos,
            detokenize: raw.detokenize,
            logits,
            logprobs: raw.logprobs,
            prompt_logprobs: raw.prompt_logprobs,
            grammar: raw.grammar,
            thinking: raw.thinking,
        })
    }

    /// Greedy decoding of at most `max_tokens` tokens.
    pub fn greedy(max_tokens: NonZeroU32) -> SamplingParams {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: None,
            min_p: 0.0,
            seed: None,
            max_tokens,
            stop: Vec::new(),
            ignore_eos: false,
            detokenize: true,
            logits: LogitsRules { repetition_penalty: 1.0, ..LogitsRules::default() },
            logprobs: None,
            prompt_logprobs: None,
            grammar: None,
            thinking: crate::grammar::Thinking::None,
        }
    }

    pub fn logits(&self) -> &LogitsRules {
        &self.logits
    }

    /// How many alternatives each token's log-probabilities name; `None`: none are computed.
    pub fn logprobs(&self) -> Option<u32> {
        self.logprobs
    }

    /// How many alternatives each prompt token's log-probabilities name; `None`: the prompt's are not computed.
    pub fn prompt_logprobs(&self) -> Option<u32> {
        self.prompt_logprobs
    }

    /// What the output must match, if anything.
    pub fn grammar(&self) -> Option<&crate::grammar::Grammar> {
        self.grammar.as_ref()
    }

    /// The thinking that comes before what the grammar holds.
    pub fn thinking(&self) -> crate::grammar::Thinking {
        self.thinking
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

/// SplitMix64: small, fast, and reproducible from a seed (also the synthetic models' weights, `crate::synth`).
#[derive(Clone, Debug)]
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next_u64(&mut self) -> u64 {
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

    /// The next token for `logits` after the sampling rules ([`LogitsRules`]) for a sequence of `tokens` whose
    /// generated part starts at `generated_from`; `None` when the rules (with whatever mask `logits` already holds,
    /// a grammar's) leave no token possible: every logit at −∞.
    pub fn sample_in(
        &mut self,
        logits: &[f32],
        tokens: &[u32],
        generated_from: usize,
        end_of_generation: &dyn Fn(u32) -> bool,
    ) -> Option<u32> {
        let possible = |logits: &[f32]| logits.iter().any(|&l| l > f32::NEG_INFINITY);
        if !self.params.logits.active() {
            return possible(logits).then(|| self.sample(logits));
        }
        let mut processed = logits.to_vec();
        self.params.logits.apply(&mut processed, tokens, generated_from, end_of_generation);
        possible(&processed).then(|| self.sample(&processed))
    }

    /// The sampler's parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Whether every token it picks is the largest logit's ([`argmax`]) and nothing else of the logits is needed:
    /// greedy, no rule over the logits, no log-probabilities.
    pub fn takes_the_top(&self) -> bool {
        let p = &self.params;
        (p.temperature == 0.0 || p.top_k.is_some_and(|k| k.get() == 1)) && !p.logits.active() && p.logprobs.is_none()
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
        // Min-p, before top-p as in vLLM: relative to the most likely token, whose weight here is exactly 1 (the
        // candidates are in descending order, so those kept are a prefix).
        if p.min_p > 0.0 {
            let keep = probs.iter().take_while(|&&w| w >= f64::from(p.min_p)).count().max(1);
            probs.truncate(keep);
        }
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

/// A sampled token's log-probability and the most likely tokens' at that position.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    /// The token's rank in the vocabulary by probability, 1 for the most likely: how many tokens are at least as
    /// likely as it, itself included (vLLM's rank, ties counted against it).
    pub rank: u32,
    /// Most likely first (ties: lower id first).
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprobs {
    /// Log-softmax of `logits` over the whole vocabulary (in f64): the chosen `token`'s and the `top` most likely
    /// ones. These are the model's own probabilities, before any sampling rule (penalties, bias, temperature,
    /// top-k/p), as vLLM reports them by default.
    pub fn of(logits: &[f32], token: u32, top: usize) -> TokenLogprobs {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let max = f64::from(max);
        let sum: f64 = logits.iter().map(|&l| (f64::from(l) - max).exp()).sum();
        let log_z = max + sum.ln();
        let lp = |id: u32| logits.get(id as usize).map_or(f32::NEG_INFINITY, |&l| (f64::from(l) - log_z) as f32);
        let rank = match logits.get(token as usize) {
            Some(&mine) => logits.iter().filter(|&&l| l >= mine).count() as u32,
            None => logits.len() as u32 + 1,
        };
        if top == 0 {
            return TokenLogprobs { logprob: lp(token), rank, top: Vec::new() };
        }
        TokenLogprobs {
            logprob: lp(token),
            rank,
            top: most_likely(logits, top).into_iter().map(|id| (id, lp(id))).collect(),
        }
    }

    /// For a backend that draws `token` uniformly from `words` (the mock engine): each distinct word's share.
    pub fn uniform(words: &[u32], token: u32, top: usize) -> TokenLogprobs {
        let mut distinct: Vec<(u32, usize)> = Vec::new();
        let mut sorted = words.to_vec();
        sorted.sort_unstable();
        for w in sorted {
            match distinct.last_mut() {
                Some((last, n)) if *last == w => *n += 1,
                _ => distinct.push((w, 1)),
            }
        }
        let total = words.len().max(1) as f64;
        let lp = |n: usize| (n as f64 / total).ln() as f32;
        let mine = distinct.iter().find(|(w, _)| *w == token).map(|&(_, n)| n);
        let logprob = mine.map_or(f32::NEG_INFINITY, lp);
        // Words drawn as often or more, itself included; a token never drawn ranks after every word.
        let rank = match mine {
            Some(m) => distinct.iter().filter(|&&(_, n)| n >= m).count() as u32,
            None => distinct.len() as u32 + 1,
        };
        distinct.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        TokenLogprobs { logprob, rank, top: distinct.into_iter().take(top).map(|(w, n)| (w, lp(n))).collect() }
    }
}

/// The `k` largest logits' ids, largest first, the lower id first among equal ones: one pass that keeps the best
/// `k` so far in order (at most [`MAX_TOP_LOGPROBS`] in practice), rather than sorting the vocabulary.
fn most_likely(logits: &[f32], k: usize) -> Vec<u32> {
    let k = k.min(logits.len());
    let mut best: Vec<u32> = Vec::with_capacity(k + 1);
    for (id, l) in logits.iter().enumerate() {
        // Scanned in id order, an equal logit never displaces the lower id already kept.
        if best.len() == k && best.last().is_none_or(|&w| l.total_cmp(&logits[w as usize]).is_le()) {
            continue;
        }
        let at = best.partition_point(|&b| logits[b as usize].total_cmp(l).is_ge());
        best.insert(at, id as u32);
        best.truncate(k);
    }
    best
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
        let too_many = RawSampling { prompt_logprobs: Some(MAX_TOP_LOGPROBS + 1), ..raw() };
        assert_eq!(SamplingParams::new(too_many), Err(SamplingError::Logprobs(MAX_TOP_LOGPROBS + 1)));
        let most = SamplingParams::new(RawSampling { prompt_logprobs: Some(MAX_TOP_LOGPROBS), ..raw() });
        assert_eq!(most.map(|p| p.prompt_logprobs()), Ok(Some(MAX_TOP_LOGPROBS)));
        let no_text = RawSampling { detokenize: false, stop: vec!["x".into()], ..raw() };
        assert_eq!(SamplingParams::new(no_text), Err(SamplingError::StopWithoutText));
    }

    #[test]
    fn the_logits_rules_follow_their_formulas() {
        let logits = [2.0f32, -1.0, 0.5, 3.0, -2.0, 1.0];
        // Prompt [0, 4], generated [3, 3, 5]: the generated part starts at 2.
        let tokens = [0u32, 4, 3, 3, 5];
        let eog = |t: u32| t == 1;
        let run = |rules: LogitsRules| {
            let mut l = logits;
            rules.apply(&mut l, &tokens, 2, &eog);
            l
        };
        let base = LogitsRules { repetition_penalty: 1.0, ..LogitsRules::default() };
        // OpenAI: logit[j] -= c[j] * frequency + (c[j] > 0) * presence, over generated tokens only.
        let fp = run(LogitsRules { frequency_penalty: 0.5, presence_penalty: 0.25, ..base.clone() });
        assert_eq!(fp, [2.0, -1.0, 0.5, 3.0 - 2.0 * 0.5 - 0.25, -2.0, 1.0 - 0.5 - 0.25]);
        // vLLM / Hugging Face: over prompt and output, positive / p, negative * p, once per token.
        let rp = run(LogitsRules { repetition_penalty: 2.0, ..base.clone() });
        assert_eq!(rp, [1.0, -1.0, 0.5, 1.5, -4.0, 0.5]);
        // logit_bias adds; min_tokens holds back end-of-generation and stop tokens while too few are generated.
        let lb = run(LogitsRules { logit_bias: vec![(2, 5.0), (99, 1.0)], ..base.clone() });
        assert_eq!(lb, [2.0, -1.0, 5.5, 3.0, -2.0, 1.0]);
        let mt = run(LogitsRules { min_tokens: 4, stop_token_ids: vec![5], ..base.clone() });
        assert_eq!(mt, [2.0, f32::NEG_INFINITY, 0.5, 3.0, -2.0, f32::NEG_INFINITY]);
        assert_eq!(run(LogitsRules { min_tokens: 3, ..base.clone() }), logits, "three generated already");
        assert!(!base.active());
        // vLLM's allowed_token_ids: every other token impossible (ids past the vocabulary change nothing).
        const NEG: f32 = f32::NEG_INFINITY;
        let allowed = run(LogitsRules { allowed_token_ids: vec![1, 3, 99], ..base.clone() });
        assert_eq!(allowed, [NEG, -1.0, NEG, 3.0, NEG, NEG]);
        // vLLM's bad_words: a word's last token is out where the output ends with the rest (the output is [3, 3, 5]),
        // a one-token word everywhere; the prompt's tokens do not count.
        let bad = |words: Vec<Vec<u32>>| run(LogitsRules { bad_words: words, ..base.clone() });
        assert_eq!(bad(vec![vec![3, 5, 2], vec![4]]), [2.0, -1.0, NEG, 3.0, NEG, 1.0]);
        assert_eq!(bad(vec![vec![5, 3, 2], vec![4, 0]]), logits, "neither ends the output");
        assert_eq!(bad(vec![vec![4, 0, 3, 3, 5, 1]]), logits, "the prompt is not part of it");
        // Sorted and deduplicated when validated, as the one-pass mask reads them.
        let rules = LogitsRules { allowed_token_ids: vec![5, 1, 5], bad_words: vec![vec![], vec![2]], ..base };
        let p = SamplingParams::new(RawSampling { logits: rules, ..RawSampling::default() }).expect("valid");
        assert_eq!((&p.logits().allowed_token_ids[..], &p.logits().bad_words[..]), (&[1, 5][..], &[vec![2]][..]));
    }

    proptest::proptest! {
        /// The one-pass top-k names the same tokens, in the same order, as sorting the whole vocabulary by logit
        /// (largest first, lower id first among equal ones): logits drawn from a few values, so ties are common.
        #[test]
        fn the_most_likely_tokens_are_those_a_full_sort_ranks_first(
            logits in proptest::collection::vec(-3i8..3, 1..200),
            k in 1usize..25,
        ) {
            let logits: Vec<f32> = logits.into_iter().map(|l| f32::from(l) * 0.5).collect();
            let mut sorted: Vec<u32> = (0..logits.len() as u32).collect();
            sorted.sort_by(|a, b| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b)));
            sorted.truncate(k);
            proptest::prop_assert_eq!(super::most_likely(&logits, k), sorted);
        }
    }

    #[test]
    fn logprobs_are_the_log_softmax_of_the_raw_logits() {
        let logits = [2.0f32, -1.0, 0.5, 3.0, -2.0, 3.0];
        // log p(i) = l(i) - ln(sum_j exp(l(j))), written out.
        let z: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum::<f64>().ln();
        let want = |i: usize| (f64::from(logits[i]) - z) as f32;
        let got = TokenLogprobs::of(&logits, 2, 3);
        assert!((got.logprob - want(2)).abs() < 1e-6);
        // Most likely first; the tie between 3 and 5 goes to the lower id.
        let ids: Vec<u32> = got.top.iter().map(|(id, _)| *id).collect();
        assert_eq!(ids, [3, 5, 0]);
        for (id, lp) in &got.top {
            assert!((lp - want(*id as usize)).abs() < 1e-6);
        }
        let total: f64 = (0..logits.len()).map(|i| f64::from(want(i)).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert!(TokenLogprobs::of(&logits, 1, 0).top.is_empty());
        // Ranks count the tokens at least as likely, itself included: ties rank against it.
        let ranks: Vec<u32> = (0..6).map(|t| TokenLogprobs::of(&logits, t, 0).rank).collect();
        assert_eq!(ranks, [3, 5, 4, 2, 6, 2]);
        assert_eq!(TokenLogprobs::of(&logits, 1, 50).top.len(), logits.len());
        // Large logits do not overflow.
        let big = TokenLogprobs::of(&[1000.0, 1000.0], 0, 1);
        assert!((big.logprob + std::f32::consts::LN_2).abs() < 1e-6);
        // Uniform draws: each distinct word's share.
        let u = TokenLogprobs::uniform(&[7, 8, 7, 9], 7, 2);
        assert!((u.logprob - 0.5f32.ln()).abs() < 1e-6);
        assert_eq!(u.top.iter().map(|(id, _)| *id).collect::<Vec<_>>(), [7, 8]);
        assert_eq!((u.rank, TokenLogprobs::uniform(&[7, 8, 7, 9], 8, 0).rank), (1, 3));
        assert_eq!(TokenLogprobs::uniform(&[7, 8], 5, 0).rank, 3, "never drawn: after every word");
    }

    #[test]
    fn bad_rules_are_refused() {
        let with = |logits: LogitsRules| SamplingParams::new(RawSampling { logits, ..RawSampling::default() });
        let base = LogitsRules { repetition_penalty: 1.0, ..LogitsRules::default() };
        assert!(with(LogitsRules { frequency_penalty: 2.5, ..base.clone() }).is_err());
        assert!(with(LogitsRules { presence_penalty: f32::NAN, ..base.clone() }).is_err());
        assert!(with(LogitsRules { repetition_penalty: 0.0, ..base.clone() }).is_err());
        assert!(with(LogitsRules { logit_bias: vec![(1, 101.0)], ..base.clone() }).is_err());
        assert!(with(LogitsRules { frequency_penalty: -2.0, logit_bias: vec![(1, -100.0)], ..base }).is_ok());
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
    }

    /// Rules that rule out every token leave nothing to sample: `None`, never an arbitrary token.
    #[test]
    fn nothing_is_sampled_where_the_rules_leave_no_token() {
        let logits = [1.0, 2.0, 0.5, 3.0];
        let eog = |t: u32| t == 2;
        for temperature in [0.0, 1.0] {
            let rules = |logits: LogitsRules| {
                let raw = RawSampling { temperature, seed: Some(1), logits, ..RawSampling::default() };
                Sampler::new(SamplingParams::new(raw).expect("valid"), 0)
            };
            // Only the end-of-generation token allowed, and min_tokens forbids it.
            let off = LogitsRules { repetition_penalty: 1.0, ..LogitsRules::default() };
            let mut s = rules(LogitsRules { allowed_token_ids: vec![2], min_tokens: 1, ..off.clone() });
            assert_eq!(s.sample_in(&logits, &[7], 1, &eog), None, "temperature {temperature}");
            // The same rules once min_tokens is met; and a grammar's mask that leaves nothing.
            assert_eq!(s.sample_in(&logits, &[7, 9], 1, &eog), Some(2));
            let masked = [f32::NEG_INFINITY; 4];
            assert_eq!(rules(off).sample_in(&masked, &[7], 1, &eog), None);
        }
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

    #[test]
    fn min_p_keeps_the_tokens_near_enough_the_most_likely_after_temperature() {
        // Probabilities relative to the first token: 1, 0.5, 0.2, 0.05.
        let logits: Vec<f32> = [1.0f32, 0.5, 0.2, 0.05].iter().map(|r| r.ln()).collect();
        let seen = |temperature: f32, min_p: f32| {
            let raw = RawSampling { temperature, min_p, seed: Some(3), ..RawSampling::default() };
            let mut s = Sampler::new(SamplingParams::new(raw).expect("valid"), 0);
            let mut seen: Vec<u32> = (0..2_000).map(|_| s.sample(&logits)).collect();
            seen.sort_unstable();
            seen.dedup();
            seen
        };
        assert_eq!(seen(1.0, 0.0), [0, 1, 2, 3]);
        assert_eq!(seen(1.0, 0.3), [0, 1]);
        assert_eq!(seen(1.0, 0.19), [0, 1, 2]);
        // At temperature 2 the relative weights are their square roots: 1, 0.71, 0.45, 0.22.
        assert_eq!(seen(2.0, 0.3), [0, 1, 2]);
        assert_eq!(seen(1.0, 1.0), [0]);
        for bad in [-0.1, 1.5, f32::NAN] {
            let raw = RawSampling { min_p: bad, ..RawSampling::default() };
            assert!(matches!(SamplingParams::new(raw), Err(SamplingError::MinP(_))), "{bad}");
        }
    }
}
