//! The distributions a workload needs, over the scheduler's reproducible random source (SplitMix64).

pub use router::scheduler::rng::Rng;

/// Uniform in (0, 1]: safe to take the logarithm of.
fn open_unit(rng: &mut Rng) -> f64 {
    1.0 - rng.unit()
}

/// Standard normal (Box–Muller).
pub fn normal(rng: &mut Rng) -> f64 {
    (-2.0 * open_unit(rng).ln()).sqrt() * (std::f64::consts::TAU * rng.unit()).cos()
}

/// Gamma with shape `k` and scale 1 (Marsaglia and Tsang; boosted for k < 1).
pub fn gamma(rng: &mut Rng, k: f64) -> f64 {
    if k < 1.0 {
        return gamma(rng, k + 1.0) * open_unit(rng).powf(1.0 / k);
    }
    let d = k - 1.0 / 3.0;
    let c = 1.0 / (9.0 * d).sqrt();
    loop {
        let x = normal(rng);
        let v = (1.0 + c * x).powi(3);
        if v > 0.0 && open_unit(rng).ln() < 0.5 * x * x + d - d * v + d * v.ln() {
            return d * v;
        }
    }
}

/// Draws from a Zipf distribution over `0..n` with exponent `s` (rank 0 most popular), by inverting its table.
#[derive(Clone, Debug)]
pub struct Zipf {
    cumulative: Vec<f64>,
}

impl Zipf {
    pub fn new(n: usize, s: f64) -> Zipf {
        let mut sum = 0.0;
        let cumulative = (1..=n.max(1))
            .map(|k| {
                sum += 1.0 / (k as f64).powf(s);
                sum
            })
            .collect();
        Zipf { cumulative }
    }

    pub fn sample(&self, rng: &mut Rng) -> usize {
        let total = self.cumulative.last().copied().unwrap_or(1.0);
        let u = open_unit(rng) * total;
        self.cumulative.partition_point(|&c| c < u).min(self.cumulative.len() - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gamma_has_its_mean_and_variance() {
        let mut r = Rng::new(3);
        for k in [0.5, 1.0, 4.0] {
            let xs: Vec<f64> = (0..200_000).map(|_| gamma(&mut r, k)).collect();
            let mean = xs.iter().sum::<f64>() / xs.len() as f64;
            let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / xs.len() as f64;
            assert!((mean - k).abs() < 0.02 * k.max(1.0), "k {k}: mean {mean}");
            assert!((var - k).abs() < 0.05 * k.max(1.0), "k {k}: variance {var}");
        }
    }

    #[test]
    fn zipf_favours_low_ranks() {
        let z = Zipf::new(10, 1.0);
        let mut r = Rng::new(1);
        let mut counts = [0usize; 10];
        for _ in 0..100_000 {
            counts[z.sample(&mut r)] += 1;
        }
        // P(0) = 1 / H(10) ≈ 0.341, P(9) ≈ 0.034.
        assert!((counts[0] as f64 / 1e5 - 0.341).abs() < 0.01, "{counts:?}");
        assert!((counts[9] as f64 / 1e5 - 0.0341).abs() < 0.005, "{counts:?}");
    }
}
