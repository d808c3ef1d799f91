//! A host's cores shared by its workers' steps (`--host-cores`): processor sharing. Each step carries the work its
//! profile gives it, in seconds of a core of its own; while `k` steps run on `c` cores each advances at
//! `min(1, c / k)`. A step's end moves whenever another starts or ends, so every change hands back new end times
//! for the steps under way, each under a fresh number: an end scheduled before the change is stale.

/// The steps under way on one host.
#[derive(Debug)]
pub struct Cores {
    cores: f64,
    /// When the steps' remaining work was last brought up to date.
    since: f64,
    /// Per worker: the work its step under way has left (seconds at full speed), if one is under way.
    left: Vec<Option<f64>>,
    /// Per worker: the number of its current end time.
    turn: Vec<u64>,
}

/// When worker `worker`'s step ends, unless its number `turn` is stale by then.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct End {
    pub worker: usize,
    pub turn: u64,
    pub at: f64,
}

impl Cores {
    pub fn new(cores: usize, workers: usize) -> Cores {
        Cores { cores: cores.max(1) as f64, since: 0.0, left: vec![None; workers], turn: vec![0; workers] }
    }

    /// Worker `w` starts a step of `secs` at `now`: the end times of every step under way.
    pub fn start(&mut self, now: f64, w: usize, secs: f64) -> Vec<End> {
        self.advance(now);
        self.left[w] = Some(secs.max(0.0));
        self.ends(now)
    }

    /// Worker `w`'s step ended at `now` as its end number `turn` said: the new end times of the others. `None`
    /// when `turn` is stale (a later change moved that end).
    pub fn end(&mut self, now: f64, w: usize, turn: u64) -> Option<Vec<End>> {
        if self.turn[w] != turn || self.left[w].is_none() {
            return None;
        }
        self.advance(now);
        self.left[w] = None;
        Some(self.ends(now))
    }

    fn speed(&self) -> f64 {
        let running = self.left.iter().flatten().count() as f64;
        (self.cores / running.max(1.0)).min(1.0)
    }

    /// Charges the work done since the last change.
    fn advance(&mut self, now: f64) {
        let done = (now - self.since) * self.speed();
        for left in self.left.iter_mut().flatten() {
            *left = (*left - done).max(0.0);
        }
        self.since = now;
    }

    fn ends(&mut self, now: f64) -> Vec<End> {
        let speed = self.speed();
        let mut ends = Vec::new();
        for (w, left) in self.left.iter().enumerate() {
            if let Some(left) = left {
                self.turn[w] += 1;
                ends.push(End { worker: w, turn: self.turn[w], at: now + left / speed });
            }
        }
        ends
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_share_the_cores_and_speed_up_when_others_end() {
        let mut c = Cores::new(1, 2);
        assert_eq!(c.start(0.0, 0, 0.110), vec![End { worker: 0, turn: 1, at: 0.110 }]);
        // A second step at 1 ms: both at half speed; 0 has 109 ms left, 1 has 110.
        let ends = c.start(0.001, 1, 0.110);
        assert!((ends[0].at - 0.219).abs() < 1e-12 && (ends[1].at - 0.221).abs() < 1e-12, "{ends:?}");
        assert_eq!(c.end(0.110, 0, 1), None, "the first end time is stale");
        // Worker 0 ends at 219 ms; worker 1 has 1 ms left, alone now.
        let ends = c.end(0.219, 0, ends[0].turn).expect("current");
        assert_eq!(ends.len(), 1);
        assert!((ends[0].at - 0.220).abs() < 1e-12, "{ends:?}");
        // Two cores for two steps: nobody slows down.
        let mut c = Cores::new(2, 2);
        c.start(0.0, 0, 0.1);
        let ends = c.start(0.05, 1, 0.1);
        assert!((ends[0].at - 0.1).abs() < 1e-12 && (ends[1].at - 0.15).abs() < 1e-12, "{ends:?}");
    }
}
