//! Fitting a [`TimingProfile`] to measured step times: least squares of the relative error (each step weighted by
//! 1/its time, so a 10 ms decode step counts as much as a 5 s prefill) over the profile's linear terms (the
//! utilisation polynomial, a GPU-style term, is left out), with each coefficient's standard error, and the
//! relative error of the fitted profile on shapes it was not fitted on.

use super::{StepShape, TimingProfile};

/// Terms fitted, in order (the names in the printed report).
pub const TERMS: [&str; N] = [
    "prefill.base_ms",
    "prefill.per_token_ms",
    "prefill.per_token_sq_ms",
    "prefill.per_context_ktoken_ms",
    "decode.base_ms",
    "decode.per_seq_ms",
    "decode.per_seq_sq_ms",
    "decode.per_kv_ktoken_ms",
    "mixed_ms",
];

/// Terms fitted.
const N: usize = 9;

/// What kind of step a shape is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    Prefill,
    Decode,
    Mixed,
}

/// One measured step (what `--fit-profile` saves next to the profile, so it can be re-fitted without measuring).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Sample {
    pub prefill_tokens: usize,
    /// Σ new tokens × cached tokens before them, over the step's prompt chunks.
    pub prefill_context_pairs: u64,
    pub decode_seqs: usize,
    pub decode_kv_tokens: usize,
    pub ms: f64,
}

impl Sample {
    /// A step of `shape` that took `ms`.
    pub fn of(shape: &StepShape, ms: f64) -> Sample {
        Sample {
            prefill_tokens: shape.prefill_tokens,
            prefill_context_pairs: shape.prefill_context_pairs,
            decode_seqs: shape.decode_seqs,
            decode_kv_tokens: shape.decode_kv_tokens,
            ms,
        }
    }

    /// Prompt chunks only, decode rows only (an empty step counts as decode), or both.
    pub fn kind(&self) -> Kind {
        match (self.prefill_tokens > 0, self.decode_seqs > 0) {
            (true, false) => Kind::Prefill,
            (false, _) => Kind::Decode,
            (true, true) => Kind::Mixed,
        }
    }

    /// The timing model's view of the step.
    pub fn shape(&self) -> StepShape {
        StepShape {
            prefill_tokens: self.prefill_tokens,
            prefill_context_pairs: self.prefill_context_pairs,
            decode_seqs: self.decode_seqs,
            decode_kv_tokens: self.decode_kv_tokens,
            ..StepShape::default()
        }
    }
}

/// The terms' multipliers for one shape (what each coefficient is multiplied by).
pub fn features(s: &StepShape) -> [f64; N] {
    let (p, d) = (s.prefill_tokens > 0, s.decode_seqs > 0);
    let (t, b) = (s.prefill_tokens as f64, s.decode_seqs as f64);
    [
        f64::from(u8::from(p)),
        t,
        t * t,
        s.prefill_context_pairs as f64 / 1000.0,
        f64::from(u8::from(d)),
        b,
        b * b,
        s.decode_kv_tokens as f64 / 1000.0,
        f64::from(u8::from(p && d)),
    ]
}

/// A fit: coefficients and their standard errors, in [`TERMS`] order.
#[derive(Clone, Debug, PartialEq)]
pub struct Fit {
    pub coefficients: [f64; N],
    pub std_errors: [f64; N],
}

impl Fit {
    /// `base` with the fitted terms in place.
    pub fn apply(&self, base: &TimingProfile) -> TimingProfile {
        let c = self.coefficients;
        let mut p = base.clone();
        (p.prefill.base_ms, p.prefill.per_token_ms, p.prefill.per_token_sq_ms, p.prefill.per_context_ktoken_ms) =
            (c[0], c[1], c[2], c[3]);
        (p.decode.base_ms, p.decode.per_seq_ms, p.decode.per_seq_sq_ms, p.decode.per_kv_ktoken_ms) =
            (c[4], c[5], c[6], c[7]);
        p.mixed_ms = c[8];
        p.decode.utilization_ms.clear();
        p.decode.min_ms = 0.0;
        p
    }
}

/// Least squares of `samples`' relative errors; `None` with fewer samples than terms.
pub fn fit(samples: &[Sample]) -> Option<Fit> {
    if samples.len() < N {
        return None;
    }
    // Columns are scaled to unit size first (T² and T differ by orders of magnitude).
    let rows: Vec<[f64; N]> = samples.iter().map(|s| features(&s.shape())).collect();
    let mut scale = [0f64; N];
    for r in &rows {
        for j in 0..N {
            scale[j] = scale[j].max(r[j].abs());
        }
    }
    let scale = scale.map(|s| if s > 0.0 { s } else { 1.0 });
    let mut xtx = [[0f64; N]; N];
    let mut xty = [0f64; N];
    let weight = |s: &Sample| 1.0 / s.ms.max(1e-6);
    for (r, s) in rows.iter().zip(samples) {
        let w = weight(s);
        let x: [f64; N] = std::array::from_fn(|j| r[j] / scale[j] * w);
        for i in 0..N {
            xty[i] += x[i] * s.ms * w;
            for j in 0..N {
                xtx[i][j] += x[i] * x[j];
            }
        }
    }
    // A whisper of ridge keeps a term no sample exercises from making the system singular.
    let ridge = 1e-12 * (0..N).map(|i| xtx[i][i]).sum::<f64>() / N as f64;
    for (i, row) in xtx.iter_mut().enumerate() {
        row[i] += ridge.max(f64::MIN_POSITIVE);
    }
    let inverse = invert(xtx)?;
    let beta: [f64; N] = std::array::from_fn(|i| (0..N).map(|j| inverse[i][j] * xty[j]).sum());
    let residual: f64 = rows
        .iter()
        .zip(samples)
        .map(|(r, s)| {
            let predicted: f64 = (0..N).map(|j| r[j] / scale[j] * beta[j]).sum();
            ((s.ms - predicted) * weight(s)).powi(2)
        })
        .sum();
    let sigma2 = residual / (samples.len().saturating_sub(N).max(1)) as f64;
    Some(Fit {
        coefficients: std::array::from_fn(|i| beta[i] / scale[i]),
        std_errors: std::array::from_fn(|i| (sigma2 * inverse[i][i]).max(0.0).sqrt() / scale[i]),
    })
}

/// Gauss–Jordan inversion with partial pivoting.
fn invert<const N: usize>(mut a: [[f64; N]; N]) -> Option<[[f64; N]; N]> {
    let mut inv: [[f64; N]; N] = std::array::from_fn(|i| std::array::from_fn(|j| f64::from(u8::from(i == j))));
    for col in 0..N {
        let pivot = (col..N).max_by(|&x, &y| a[x][col].abs().total_cmp(&a[y][col].abs()))?;
        if a[pivot][col].abs() < 1e-300 {
            return None;
        }
        a.swap(col, pivot);
        inv.swap(col, pivot);
        let p = a[col][col];
        for j in 0..N {
            a[col][j] /= p;
            inv[col][j] /= p;
        }
        for row in 0..N {
            if row != col {
                let f = a[row][col];
                for j in 0..N {
                    a[row][j] -= f * a[col][j];
                    inv[row][j] -= f * inv[col][j];
                }
            }
        }
    }
    Some(inv)
}

/// |predicted − measured| / measured for each sample under `profile`.
pub fn relative_errors(profile: &TimingProfile, samples: &[Sample]) -> Vec<f64> {
    samples.iter().map(|s| (profile.step_ms(&s.shape()) - s.ms).abs() / s.ms.max(1e-9)).collect()
}

/// The `q` quantile (nearest rank) of `values`.
pub fn quantile(values: &[f64], q: f64) -> f64 {
    let mut v: Vec<f64> = values.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return 0.0;
    }
    v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(t: usize, c: usize, b: usize, k: usize, truth: &TimingProfile) -> Sample {
        let shape = StepShape {
            prefill_tokens: t,
            prefill_context_pairs: (t * c) as u64,
            decode_seqs: b,
            decode_kv_tokens: k,
            ..StepShape::default()
        };
        Sample::of(&shape, truth.step_ms(&shape))
    }

    #[test]
    fn a_profile_is_recovered_from_its_own_times() {
        let text = "mixed_ms = -2\n[prefill]\nbase_ms = 3\nper_token_ms = 0.5\nper_token_sq_ms = 1e-4\n\
                    per_context_ktoken_ms = 0.02\n\
                    [decode]\nbase_ms = 9\nper_seq_ms = 1.5\nper_seq_sq_ms = -0.01\nper_kv_ktoken_ms = 0.7\n";
        let truth = TimingProfile::parse("truth", text).expect("parses");
        let mut samples = Vec::new();
        for t in [16, 64, 256, 1024] {
            for c in [0, 512, 2048] {
                samples.push(sample(t, c, 0, 0, &truth));
            }
        }
        for b in [1, 4, 8, 16] {
            for ctx in [128, 1024] {
                samples.push(sample(0, 0, b, b * ctx, &truth));
                samples.push(sample(128, 0, b, b * ctx, &truth));
            }
        }
        let f = fit(&samples).expect("fits");
        let got = f.apply(&TimingProfile::default());
        for (name, (a, b)) in
            TERMS.iter().zip(f.coefficients.iter().zip([3.0, 0.5, 1e-4, 0.02, 9.0, 1.5, -0.01, 0.7, -2.0]))
        {
            assert!((a - b).abs() < 1e-6 * b.abs().max(1.0), "{name}: {a} vs {b}");
        }
        assert!(quantile(&relative_errors(&got, &samples), 1.0) < 1e-6);
        assert!(f.std_errors.iter().all(|e| *e < 1e-6), "{:?}", f.std_errors);
    }

    #[test]
    fn quantiles_are_nearest_rank() {
        let v = [5.0, 1.0, 4.0, 2.0, 3.0];
        assert_eq!((quantile(&v, 0.5), quantile(&v, 0.9), quantile(&v, 1.0)), (3.0, 5.0, 5.0));
    }
}
