//! The engine's compute threads: a fixed team that a forward step hands its parallel loops to.
//!
//! A decode step of the embedded model runs about 150 parallel loops (a layer's matmuls and its attention) of a few
//! tens of microseconds each. This team's helpers wait for the next loop by yielding their core (a loop published
//! is seen within a system call's time), and sleep only after a while without one, so that between steps they cost
//! nothing.
//!
//! A loop's parts are taken from a shared counter by every thread, the caller included, so a thread slowed by the
//! VM takes fewer parts, and a helper that is not running (its core given to another process) takes none: a loop
//! ends when its parts are done, not when every helper has looked at it. What a part computes does not depend on
//! which thread takes it.

#![allow(unsafe_code)]

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a waiting thread spins before it starts yielding its core: short, because a spinning thread keeps its
/// core from any other process's threads (two engines of two threads each on two cores ran batch-1 decode at 40–55
/// tokens/s each with 50 us of spinning and helpers that every loop waited for, 107–110 with rayon's pool).
const SPIN: Duration = Duration::from_micros(2);

/// How long a helper waits for the next loop, spinning then yielding, before it sleeps.
const YIELD: Duration = Duration::from_micros(300);

/// A fixed team of compute threads: the caller of a loop and `threads - 1` helpers.
pub struct Team {
    shared: Arc<Shared>,
    helpers: Vec<JoinHandle<()>>,
    /// One loop at a time: a second caller waits for the first's loop to end.
    running: Mutex<()>,
}

impl std::fmt::Debug for Team {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Team").field("threads", &self.threads()).finish()
    }
}

/// What the caller and the helpers share.
struct Shared {
    /// Bumped for every loop (and once more to stop): a helper that sees a new value joins the job published then,
    /// if it is still there.
    generation: AtomicU64,
    /// The current loop, on its caller's stack, or null once its caller has taken it back.
    job: AtomicPtr<Job<'static>>,
    /// Helpers that may be reading `job`: counted before they read the pointer, uncounted when done with the job.
    /// A caller takes its job back (null) and then waits for this to reach 0, so no helper reads a job whose loop
    /// has returned.
    joined: AtomicUsize,
    /// Helpers asleep on `wake` (or about to be): the caller takes `lock` to wake them only when there are some.
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    stop: AtomicBool,
}

/// One parallel loop: `parts` calls of `task`, each part taken by whichever thread reaches the counter first.
struct Job<'a> {
    task: &'a (dyn Fn(usize) + Sync),
    parts: usize,
    next: AtomicUsize,
    /// The first panic of a part run by a helper, raised again on the caller.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

impl Job<'_> {
    /// Takes and runs parts until none are left; a panic stops the loop's remaining parts.
    fn work(&self) -> Result<(), Box<dyn Any + Send>> {
        catch_unwind(AssertUnwindSafe(|| {
            loop {
                let i = self.next.fetch_add(1, Ordering::Relaxed);
                if i >= self.parts {
                    return;
                }
                (self.task)(i);
            }
        }))
        .inspect_err(|_| self.next.store(self.parts, Ordering::Relaxed))
    }
}

thread_local! {
    /// Set on a team's threads while they run a part: a loop started from inside a part runs inline there.
    static IN_PART: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl Team {
    /// A team of `threads` threads (0: one per core), the caller counted: `threads - 1` helpers are started,
    /// named `{name}-{i}`.
    pub fn new(threads: usize, name: &str) -> std::io::Result<Team> {
        let threads = match threads {
            0 => std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get),
            n => n,
        };
        let shared = Arc::new(Shared {
            generation: AtomicU64::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            joined: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let mut team = Team { shared, helpers: Vec::with_capacity(threads - 1), running: Mutex::new(()) };
        for i in 1..threads {
            let shared = Arc::clone(&team.shared);
            // On an error the team built so far is dropped, which stops the helpers already started.
            team.helpers.push(std::thread::Builder::new().name(format!("{name}-{i}")).spawn(move || helper(&shared))?);
        }
        Ok(team)
    }

    /// A team of the calling thread alone: every loop runs inline.
    pub fn serial() -> Team {
        Team::new(1, "unused").expect("a team of one starts no thread")
    }

    /// How many threads run a loop, the caller counted.
    pub fn threads(&self) -> usize {
        self.helpers.len() + 1
    }

    /// Calls `task(i)` for every `i` in `0..parts`, on the team's threads, and returns when all have returned. A
    /// panic in a part is raised here once the other threads have left the loop.
    pub fn for_each(&self, parts: usize, task: impl Fn(usize) + Sync) {
        if parts <= 1 || self.helpers.is_empty() || IN_PART.get() {
            (0..parts).for_each(task);
            return;
        }
        let job = Job { task: &task, parts, next: AtomicUsize::new(0), panic: Mutex::new(None) };
        let running = self.running.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let shared = &*self.shared;
        // Only the lifetime is erased: no helper reads the job once this function has taken it back below.
        let ptr: *mut Job<'static> = (&raw const job).cast_mut().cast();
        shared.job.store(ptr, Ordering::SeqCst);
        shared.generation.fetch_add(1, Ordering::SeqCst);
        if shared.sleepers.load(Ordering::SeqCst) > 0 {
            let _lock = shared.lock.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            shared.wake.notify_all();
        }
        IN_PART.set(true);
        let mine = job.work();
        IN_PART.set(false);
        // Every part is taken. Take the job back, then wait for the helpers that joined it (those still running a
        // part among them); a helper that looks later finds none. All four accesses are SeqCst: a helper counts
        // itself in `joined` before it reads `job`, the caller nulls `job` before it reads `joined`, so either the
        // helper reads null or the caller sees it counted.
        shared.job.store(std::ptr::null_mut(), Ordering::SeqCst);
        let mut wait = Wait::new();
        while shared.joined.load(Ordering::SeqCst) > 0 {
            wait.round(Duration::MAX);
        }
        drop(running);
        if let Err(payload) = mine {
            resume_unwind(payload);
        }
        if let Some(payload) = job.panic.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner) {
            resume_unwind(payload);
        }
    }

    /// `f(i)` for every `i` in `0..parts`, computed as [`for_each`](Self::for_each) does, in order of `i`.
    pub fn map<T: Send + Sync>(&self, parts: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
        let slots: Vec<OnceLock<T>> = (0..parts).map(|_| OnceLock::new()).collect();
        self.for_each(parts, |i| {
            let _ = slots[i].set(f(i));
        });
        slots.into_iter().map(|s| s.into_inner().expect("every part ran")).collect()
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.generation.fetch_add(1, Ordering::SeqCst);
        {
            let _lock = self.shared.lock.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            self.shared.wake.notify_all();
        }
        for h in self.helpers.drain(..) {
            let _ = h.join();
        }
    }
}

/// A helper's life: wait for the next loop, join it if it is still there and take parts; until the team is dropped.
fn helper(shared: &Shared) {
    IN_PART.set(true);
    let mut seen = 0;
    loop {
        seen = wait_for_next(shared, seen);
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        shared.joined.fetch_add(1, Ordering::SeqCst);
        let ptr = shared.job.load(Ordering::SeqCst);
        // SAFETY: we are counted in `joined` and read a job its caller had not taken back: the caller waits for
        // `joined` to reach 0 before its loop returns, so the job lives until we uncount ourselves below.
        if let Some(job) = unsafe { ptr.as_ref() }
            && let Err(payload) = job.work()
        {
            let mut first = job.panic.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            first.get_or_insert(payload);
        }
        shared.joined.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Waits until the generation moves past `seen`, and returns the new one: spinning, then yielding, then asleep.
fn wait_for_next(shared: &Shared, seen: u64) -> u64 {
    let mut wait = Wait::new();
    loop {
        let now = shared.generation.load(Ordering::SeqCst);
        if now != seen {
            return now;
        }
        if !wait.round(YIELD) {
            break;
        }
    }
    let mut lock = shared.lock.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    shared.sleepers.fetch_add(1, Ordering::SeqCst);
    // Checked again after counting ourselves a sleeper: a caller that bumped the generation before this load sees
    // us in `sleepers` and takes the lock to wake us, which it cannot do before we wait.
    while shared.generation.load(Ordering::SeqCst) == seen {
        lock = shared.wake.wait(lock).unwrap_or_else(std::sync::PoisonError::into_inner);
    }
    shared.sleepers.fetch_sub(1, Ordering::SeqCst);
    shared.generation.load(Ordering::SeqCst)
}

/// A thread waiting for another: spin-loop hints for the first [`SPIN`] (the clock read every 64 rounds), then a
/// yield of its core every round.
struct Wait {
    started: Instant,
    spinning: bool,
    rounds: u32,
}

impl Wait {
    fn new() -> Wait {
        Wait { started: Instant::now(), spinning: true, rounds: 0 }
    }

    /// One round of waiting; false once `limit` has passed since the wait began.
    fn round(&mut self, limit: Duration) -> bool {
        if self.spinning {
            self.rounds = self.rounds.wrapping_add(1);
            if self.rounds.is_multiple_of(64) {
                self.spinning = self.started.elapsed() < SPIN;
            }
            std::hint::spin_loop();
            return true;
        }
        if self.started.elapsed() >= limit {
            return false;
        }
        std::thread::yield_now();
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_part_runs_once_on_every_team_size() {
        for threads in 1..=4 {
            let team = Team::new(threads, "test").expect("team");
            for parts in [0, 1, 2, 3, 17, 1000] {
                let counts: Vec<AtomicUsize> = (0..parts).map(|_| AtomicUsize::new(0)).collect();
                team.for_each(parts, |i| {
                    counts[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1), "{threads} threads, {parts} parts");
            }
            assert_eq!(team.map(5, |i| i * i), vec![0, 1, 4, 9, 16]);
        }
    }

    /// Loops in quick succession: helpers join late, find a loop already taken back, or join the next one; every
    /// part of every loop still runs once, and no loop returns before its parts are done.
    #[test]
    fn many_short_loops_in_a_row_each_run_every_part_once() {
        let team = Team::new(3, "test").expect("team");
        let counts: Vec<AtomicUsize> = (0..5).map(|_| AtomicUsize::new(0)).collect();
        for round in 0..20_000 {
            let parts = 2 + round % 4;
            team.for_each(parts, |i| {
                counts[i].fetch_add(1, Ordering::Relaxed);
            });
            for (i, c) in counts.iter().enumerate().take(parts) {
                assert_eq!(c.swap(0, Ordering::Relaxed), 1, "round {round}, part {i}");
            }
        }
    }

    #[test]
    fn helpers_take_parts_and_a_loop_inside_a_part_runs_inline() {
        let team = Team::new(2, "test").expect("team");
        let main = std::thread::current().id();
        // Parts that wait for each other's start: both threads must take one.
        let started = AtomicUsize::new(0);
        let ids = team.map(2, |_| {
            started.fetch_add(1, Ordering::SeqCst);
            while started.load(Ordering::SeqCst) < 2 {
                std::hint::spin_loop();
            }
            std::thread::current().id()
        });
        assert!(ids.contains(&main) && ids.iter().any(|&id| id != main), "{ids:?}");
        let nested = team.map(2, |i| team.map(3, |j| i * 10 + j));
        assert_eq!(nested, vec![vec![0, 1, 2], vec![10, 11, 12]]);
    }

    #[test]
    fn sleeping_helpers_wake_for_the_next_loop() {
        let team = Team::new(3, "test").expect("team");
        for _ in 0..3 {
            std::thread::sleep(YIELD * 4);
            let sum = AtomicUsize::new(0);
            team.for_each(100, |i| {
                sum.fetch_add(i, Ordering::Relaxed);
            });
            assert_eq!(sum.load(Ordering::Relaxed), 4950);
        }
    }

    #[test]
    fn a_panicking_part_reaches_the_caller_and_the_team_goes_on() {
        let team = Team::new(2, "test").expect("team");
        for bad in [0, 7] {
            let caught = catch_unwind(AssertUnwindSafe(|| {
                team.for_each(8, |i| assert!(i != bad, "part {i} fails"));
            }));
            let payload = caught.expect_err("the panic reaches the caller");
            let message = payload.downcast_ref::<String>().expect("a formatted message");
            assert_eq!(message, &format!("part {bad} fails"));
        }
        assert_eq!(team.map(3, |i| i + 1), vec![1, 2, 3]);
    }
}
