//! Choosing among scored candidates: argmin with ties broken by rendezvous hashing or at random, or sampling by
//! temperature.

use super::rng::Rng;
use super::view::WorkerId;

/// Ties: costs this close are equal (floating-point noise must not break a tie by position).
const TIE_EPSILON: f64 = 1e-9;

/// How [`choose`] breaks a tie at temperature 0.
#[derive(Clone, Copy, Debug)]
pub enum Tie<'a> {
    /// Uniformly at random.
    Random,
    /// The tied candidate whose id ranks first by rendezvous hash with `key` (`ids[i]` is candidate `i`'s id).
    Hashed { key: u64, ids: &'a [WorkerId] },
}

/// The position of the chosen cost (lower is better); `costs` must not be empty.
///
/// `temperature == 0`: the minimum, ties broken as `tie` says. `temperature > 0`: each candidate with
/// probability ∝ `exp(-(c - min) / ((max - min) * T))`, uniform when all costs are equal.
pub fn choose(costs: &[f64], temperature: f64, tie: Tie, rng: &mut Rng) -> usize {
    let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
    let max = costs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if temperature <= 0.0 {
        let ties = (0..costs.len()).filter(|&i| costs[i] - min <= TIE_EPSILON);
        return match tie {
            Tie::Random => {
                let ties: Vec<usize> = ties.collect();
                ties[rng.below(ties.len())]
            }
            Tie::Hashed { key, ids } => ties
                .max_by_key(|&i| rendezvous(key, u64::from(ids[i].0).wrapping_mul(0xD6E8_FEB8_6659_FD93)))
                .unwrap_or(0),
        };
    }
    if max - min <= TIE_EPSILON {
        return rng.below(costs.len());
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

/// Consistent hashing with bounded load: candidates ranked by rendezvous hash of `key` with their names; the
/// first whose requests in flight stay within `ceil(factor × (total + 1) / n)` with this one added wins.
pub fn prefix_hash(key: u64, names: &[&str], requests: &[u64], factor: f64) -> usize {
    let total: u64 = requests.iter().sum();
    let cap = (factor * (total + 1) as f64 / names.len().max(1) as f64).ceil() as u64;
    let mut ranked: Vec<(u64, usize)> = names.iter().enumerate().map(|(i, n)| (rendezvous(key, fnv1a(n)), i)).collect();
    ranked.sort_unstable_by(|a, b| b.cmp(a));
    ranked
        .iter()
        .map(|&(_, i)| i)
        .find(|&i| requests[i] < cap)
        .unwrap_or_else(|| (0..requests.len()).min_by_key(|&i| requests[i]).unwrap_or(0))
}

/// SGLang's gateway rule. `matched`: the share of the prompt each candidate holds; `requests`: requests in flight.
/// Imbalanced load (max − min > `abs` and max > `rel` × min): the shortest queue. Otherwise the best match when it
/// is at least `threshold`, else the shortest queue. Ties are broken at random.
pub fn sglang_threshold(matched: &[f64], requests: &[u64], threshold: f64, abs: f64, rel: f64, rng: &mut Rng) -> usize {
    let loads: Vec<f64> = requests.iter().map(|&r| r as f64).collect();
    let max = loads.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let min = loads.iter().copied().fold(f64::INFINITY, f64::min);
    let shortest = |rng: &mut Rng| choose(&loads, 0.0, Tie::Random, rng);
    if max - min > abs && max > rel * min {
        return shortest(rng);
    }
    let best = matched.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if best >= threshold && best > 0.0 {
        let negated: Vec<f64> = matched.iter().map(|m| -m).collect();
        return choose(&negated, 0.0, Tie::Random, rng);
    }
    shortest(rng)
}

/// Rendezvous hashing: the rank (higher first) of the worker named by `worker` (a hash of its name or id) for a
/// request keyed `key`, a SplitMix64 mix of the two, so each key orders the workers independently and uniformly.
fn rendezvous(key: u64, worker: u64) -> u64 {
    Rng::new(key ^ worker).next_u64()
}

/// FNV-1a: a stable hash of a worker's name (the same in every router process).
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xCBF2_9CE4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01B3))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn histogram(costs: &[f64], t: f64, n: usize) -> Vec<usize> {
        let mut rng = Rng::new(7);
        let mut h = vec![0; costs.len()];
        for _ in 0..n {
            h[choose(costs, t, Tie::Random, &mut rng)] += 1;
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
    fn a_prefix_keeps_its_home_until_the_home_is_overloaded() {
        let names = ["a", "b", "c", "d"];
        let home = prefix_hash(42, &names, &[0, 0, 0, 0], 1.25);
        assert_eq!(prefix_hash(42, &names, &[1, 1, 1, 1], 1.25), home, "even load keeps the home");
        // Different prefixes spread over the workers.
        let homes: std::collections::HashSet<usize> =
            (0..64).map(|k| prefix_hash(k, &names, &[0, 0, 0, 0], 1.25)).collect();
        assert_eq!(homes.len(), 4);
        // The home has 5 of 8 in flight: the cap is ceil(1.25 × 9 / 4) = 3, so the next in rank takes it.
        let mut loads = [1, 1, 1, 1];
        loads[home] = 5;
        let next = prefix_hash(42, &names, &loads, 1.25);
        assert_ne!(next, home);
        assert_eq!(prefix_hash(42, &names, &loads, 1.25), next, "and the same one every time");
    }

    #[test]
    fn sglang_prefers_the_cache_unless_the_load_is_imbalanced() {
        let mut rng = Rng::new(5);
        // Balanced: the best match (above the threshold) wins even though it is busier.
        assert_eq!(sglang_threshold(&[0.1, 0.8, 0.0], &[3, 5, 2], 0.3, 64.0, 1.5, &mut rng), 1);
        // Matches under the threshold: the shortest queue.
        assert_eq!(sglang_threshold(&[0.1, 0.2, 0.0], &[3, 5, 2], 0.3, 64.0, 1.5, &mut rng), 2);
        // Imbalanced past both thresholds: the shortest queue whatever the cache says.
        assert_eq!(sglang_threshold(&[0.1, 0.9, 0.0], &[3, 100, 2], 0.3, 64.0, 1.5, &mut rng), 2);
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
