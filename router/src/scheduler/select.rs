//! Choosing among scored candidates: argmin with uniform random ties, or sampling by temperature.

use super::rng::Rng;
use super::view::WorkerId;

/// Ties: costs this close are equal (floating-point noise must not break a tie by position).
const TIE_EPSILON: f64 = 1e-9;

/// The position of the chosen cost (lower is better); `costs` must not be empty.
///
/// `temperature == 0`: the minimum, ties broken uniformly at random. `temperature > 0`: each candidate with
/// probability ∝ `exp(-(c - min) / ((max - min) * T))`, uniform when all costs are equal.
pub fn choose(costs: &[f64], temperature: f64, rng: &mut Rng) -> usize {
    let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
    let max = costs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if temperature <= 0.0 || max - min <= TIE_EPSILON {
        let ties: Vec<usize> = (0..costs.len()).filter(|&i| costs[i] - min <= TIE_EPSILON).collect();
        return ties[rng.below(ties.len())];
    }
    let weights: Vec<f64> = costs.iter().map(|c| (-(c - min) / ((max - min) * temperature)).exp()).collect();
    let mut target = rng.unit() * weights.iter().sum::<f64>();
    for (i, w) in weights.iter().enumerate() {
        if target < *w {
            return i;
        }
        target -= w;
    }
    costs.len() - 1
}

/// Round robin's place: the worker it chose last, per pool. A true rotation over whichever workers are eligible
/// now: the next one after the last chosen, in id order, wrapping around.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Rotation {
    last: Option<WorkerId>,
}

impl Rotation {
    /// The position in `ids` of the worker after the last chosen one (the first when none was), and remembers it.
    pub fn next(&mut self, ids: &[WorkerId]) -> usize {
        let after = |id: &WorkerId| self.last.is_none_or(|l| *id > l);
        let at = ids
            .iter()
            .enumerate()
            .filter(|(_, id)| after(id))
            .min_by_key(|(_, id)| **id)
            .or_else(|| ids.iter().enumerate().min_by_key(|(_, id)| **id))
            .map_or(0, |(i, _)| i);
        self.last = ids.get(at).copied();
        at
    }
}

/// The less loaded of two distinct random positions (one when there is only one).
pub fn power_of_two(loads: &[f64], rng: &mut Rng) -> usize {
    if loads.len() < 2 {
        return 0;
    }
    let a = rng.below(loads.len());
    let b = (a + 1 + rng.below(loads.len() - 1)) % loads.len();
    if loads[b] < loads[a] { b } else { a }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn histogram(costs: &[f64], t: f64, n: usize) -> Vec<usize> {
        let mut rng = Rng::new(7);
        let mut h = vec![0; costs.len()];
        for _ in 0..n {
            h[choose(costs, t, &mut rng)] += 1;
        }
        h
    }

    #[test]
    fn argmin_without_temperature() {
        assert_eq!(histogram(&[3.0, 1.0, 2.0], 0.0, 100), vec![0, 100, 0]);
    }

    #[test]
    fn ties_are_broken_uniformly_not_by_position() {
        let h = histogram(&[1.0, 5.0, 1.0, 1.0 + 1e-12], 0.0, 30_000);
        assert_eq!(h[1], 0);
        for i in [0, 2, 3] {
            assert!((9_000..11_000).contains(&h[i]), "{h:?}");
        }
    }

    #[test]
    fn temperature_follows_the_stated_distribution() {
        // Costs 0, 1, 2 at T = 1: weights e^0, e^-0.5, e^-1.
        let h = histogram(&[0.0, 1.0, 2.0], 1.0, 60_000);
        let z = 1.0 + (-0.5f64).exp() + (-1.0f64).exp();
        for (i, w) in [1.0, (-0.5f64).exp(), (-1.0f64).exp()].iter().enumerate() {
            let want = 60_000.0 * w / z;
            assert!((h[i] as f64 - want).abs() < want * 0.05, "{h:?} vs {want} at {i}");
        }
        // Equal costs: uniform.
        let h = histogram(&[2.0, 2.0], 0.5, 20_000);
        assert!((9_000..11_000).contains(&h[0]), "{h:?}");
    }

    #[test]
    fn round_robin_rotates_over_whoever_is_eligible_now() {
        let ids = |v: &[u32]| v.iter().map(|&i| WorkerId(i)).collect::<Vec<_>>();
        let mut r = Rotation::default();
        let picks: Vec<u32> = (0..4).map(|_| ids(&[5, 2, 9])[r.next(&ids(&[5, 2, 9]))].0).collect();
        assert_eq!(picks, [2, 5, 9, 2]);
        // Worker 5 is busy this time: the rotation goes on from 2 to the next eligible one, 9.
        assert_eq!(ids(&[2, 9])[r.next(&ids(&[2, 9]))].0, 9);
        // A newcomer takes its turn in id order.
        assert_eq!(ids(&[2, 5, 7, 9])[r.next(&ids(&[2, 5, 7, 9]))].0, 2);
        assert_eq!(ids(&[2, 5, 7, 9])[r.next(&ids(&[2, 5, 7, 9]))].0, 5);
        assert_eq!(ids(&[2, 5, 7, 9])[r.next(&ids(&[2, 5, 7, 9]))].0, 7);
    }

    #[test]
    fn power_of_two_never_picks_the_most_loaded_of_three() {
        let mut rng = Rng::new(1);
        for _ in 0..1000 {
            assert_ne!(power_of_two(&[1.0, 9.0, 2.0], &mut rng), 1);
        }
        assert_eq!(power_of_two(&[4.0], &mut rng), 0);
    }
}
