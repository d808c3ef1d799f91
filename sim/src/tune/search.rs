//! Successive halving: every candidate on a short window of the training part, the best third on a window three
//! times longer, and so on until the survivors run on the whole training part; each evaluation averaged over
//! the seeds, evaluations run in parallel. The evaluation itself is the caller's (a simulation), so this is
//! testable on any function.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

/// One evaluation of one candidate.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Evaluation {
    pub round: usize,
    pub candidate: usize,
    /// Requests of the training part simulated.
    pub window: usize,
    pub seed: u64,
    /// The objective as a loss (lower is better); infinite when the run failed as a whole.
    pub loss: f64,
}

/// What a search did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Search {
    /// The candidate that won the last round.
    pub best: usize,
    /// Candidates alive in each round, best first (by their mean loss in that round).
    pub rounds: Vec<Vec<(usize, f64)>>,
    pub evaluations: Vec<Evaluation>,
}

/// Windows of a training part of `train` requests for `rounds` rounds, each `eta` times the last, ending at
/// `train` (none shorter than `min_window`).
pub fn windows(train: usize, rounds: usize, eta: usize, min_window: usize) -> Vec<usize> {
    let eta = eta.max(2);
    let mut out: Vec<usize> =
        (0..rounds.max(1)).rev().map(|k| (train / eta.pow(k as u32)).max(min_window.min(train)).max(1)).collect();
    out.dedup();
    out
}

/// Runs the rounds over candidates `0..n`, keeping the best `1/eta` (at least one) after each, and candidate 0
/// (the current settings) in every round, so the winner is never worse than it on the whole training part.
pub fn successive_halving<E>(
    n: usize,
    windows: &[usize],
    eta: usize,
    seeds: &[u64],
    jobs: usize,
    eval: E,
) -> Result<Search, String>
where
    E: Fn(usize, usize, u64) -> Result<f64, String> + Sync,
{
    let mut alive: Vec<usize> = (0..n).collect();
    let mut search = Search::default();
    for (round, &window) in windows.iter().enumerate() {
        let tasks: Vec<(usize, u64)> = alive.iter().flat_map(|&c| seeds.iter().map(move |&s| (c, s))).collect();
        let losses = par_map(&tasks, jobs, |&(c, s)| eval(c, window, s))?;
        let mut ranked: Vec<(usize, f64)> = alive
            .iter()
            .map(|&c| {
                let mine: Vec<f64> = tasks.iter().zip(&losses).filter(|((k, _), _)| *k == c).map(|(_, l)| *l).collect();
                (c, mean(&mine))
            })
            .collect();
        // NaN and infinity (failed runs) sort last; equal losses keep the candidates' order.
        ranked.sort_by(|a, b| sortable(a.1).total_cmp(&sortable(b.1)));
        for (&(candidate, seed), &loss) in tasks.iter().zip(&losses) {
            search.evaluations.push(Evaluation { round, candidate, window, seed, loss });
        }
        let keep = if round + 1 == windows.len() { 1 } else { ranked.len().div_ceil(eta.max(2)) };
        alive = ranked.iter().take(keep.max(1)).map(|(c, _)| *c).collect();
        if round + 1 < windows.len() && n > 0 && !alive.contains(&0) {
            alive.push(0);
        }
        search.rounds.push(ranked);
    }
    search.best = alive.first().copied().unwrap_or(0);
    Ok(search)
}

fn sortable(x: f64) -> f64 {
    if x.is_nan() { f64::INFINITY } else { x }
}

pub fn mean(v: &[f64]) -> f64 {
    if v.is_empty() { f64::NAN } else { v.iter().sum::<f64>() / v.len() as f64 }
}

/// Sample standard deviation (0 for fewer than two values).
pub fn std_dev(v: &[f64]) -> f64 {
    if v.len() < 2 {
        return 0.0;
    }
    let m = mean(v);
    (v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (v.len() - 1) as f64).sqrt()
}

/// `f` over `items` on `jobs` threads, results in the items' order; the first error stops the rest.
pub fn par_map<T, R, F>(items: &[T], jobs: usize, f: F) -> Result<Vec<R>, String>
where
    T: Sync,
    R: Send,
    F: Fn(&T) -> Result<R, String> + Sync,
{
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Result<R, String>>>> = Mutex::new((0..items.len()).map(|_| None).collect());
    let failed = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        for _ in 0..jobs.clamp(1, items.len().max(1)) {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= items.len() || failed.load(Ordering::Relaxed) {
                        return;
                    }
                    let r = f(&items[i]);
                    failed.fetch_or(r.is_err(), Ordering::Relaxed);
                    if let Ok(mut slots) = results.lock() {
                        slots[i] = Some(r);
                    }
                }
            });
        }
    });
    let slots = results.into_inner().map_err(|_| "an evaluation thread panicked".to_string())?;
    slots.into_iter().map(|r| r.unwrap_or_else(|| Err("an evaluation was not run".into()))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_grow_by_eta_up_to_the_training_part() {
        assert_eq!(windows(900, 3, 3, 1), vec![100, 300, 900]);
        assert_eq!(windows(900, 3, 3, 200), vec![200, 300, 900]);
        assert_eq!(windows(10, 4, 3, 5), vec![5, 10]);
    }

    #[test]
    fn halving_keeps_the_best_third_and_finds_the_minimum() {
        // Candidate c's loss is |c - 17| (plus noise that shrinks with the window), the same for every seed.
        let eval = |c: usize, window: usize, seed: u64| -> Result<f64, String> {
            let noise = ((c as u64 * 31 + seed) % 7) as f64 / window as f64;
            Ok((c as f64 - 17.0).abs() + noise)
        };
        let s = successive_halving(27, &[10, 30, 90], 3, &[0, 1], 2, eval).expect("runs");
        assert_eq!(s.best, 17);
        // Candidate 0 (the current settings) rides along in every round.
        assert_eq!(s.rounds.iter().map(Vec::len).collect::<Vec<_>>(), vec![27, 10, 5]);
        assert!(s.rounds.iter().all(|r| r.iter().any(|(c, _)| *c == 0)));
        assert_eq!(s.evaluations.len(), (27 + 10 + 5) * 2);
        assert!(s.rounds[1].iter().all(|(c, _)| *c == 0 || (*c as i64 - 17).abs() <= 4), "{:?}", s.rounds[1]);
    }

    #[test]
    fn failed_runs_rank_last_and_errors_stop_the_search() {
        let s = successive_halving(3, &[5], 3, &[0], 2, |c, _, _| Ok(if c == 0 { f64::NAN } else { c as f64 }))
            .expect("runs");
        assert_eq!(s.best, 1);
        let e = successive_halving(3, &[5], 3, &[0], 2, |c, _, _| if c == 2 { Err("boom".into()) } else { Ok(0.0) });
        assert_eq!(e.expect_err("the error stops it"), "boom");
    }

    #[test]
    fn par_map_keeps_the_order() {
        let items: Vec<u64> = (0..100).collect();
        let out = par_map(&items, 4, |x| Ok::<_, String>(x * 2)).expect("runs");
        assert_eq!(out, items.iter().map(|x| x * 2).collect::<Vec<_>>());
    }
}
