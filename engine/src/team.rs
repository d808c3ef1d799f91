//! The engine's compute threads: a fixed team that a forward step hands its parallel loops to.
//!
//! A decode step of the embedded model runs about 150 parallel loops (a layer's matmuls and its attention) of a few
//! tens of microseconds each. A general-purpose pool parks a thread that finds no work within microseconds, and
//! waking it goes through the kernel: on a VM that is tens of microseconds per loop, a large share of a small
//! matmul. This team's helpers wait for the next loop by spinning for a while (a loop then starts and ends in well
//! under a microsecond), then by yielding, and only then sleep, so that between steps they cost nothing.
//!
//! A loop's parts are taken from a shared counter by every thread, the caller included, so a thread slowed by the
//! VM takes fewer parts. What a part computes does not depend on which thread takes it.

#![allow(unsafe_code)]

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a helper spins for the next loop before it starts yielding its core.
const SPIN: Duration = Duration::from_micros(50);

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
    /// Bumped for every loop (and once more to stop): a helper runs the job published with each new value.
    generation: AtomicU64,
    /// The current loop, on its caller's stack; valid from the bump of `generation` until every helper has counted
    /// itself in its `done`.
    job: AtomicPtr<Job<'static>>,
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
    /// Helpers done with this job: once a helper has counted itself it no longer touches it.
    done: AtomicUsize,
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
        let job =
            Job { task: &task, parts, next: AtomicUsize::new(0), done: AtomicUsize::new(0), panic: Mutex::new(None) };
        let running = self.running.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let shared = &*self.shared;
        // SAFETY: only the lifetime is erased. The job outlives every helper's use of it: this function returns
        // (or unwinds) only after every helper has counted itself in `done` below.
        let ptr: *mut Job<'static> = (&raw const job).cast_mut().cast();
        shared.job.store(ptr, Ordering::Relaxed);
        shared.generation.fetch_add(1, Ordering::SeqCst);
        if shared.sleepers.load(Ordering::SeqCst) > 0 {
            let _lock = shared.lock.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            shared.wake.notify_all();
        }
        IN_PART.set(true);
        let mine = job.work();
        IN_PART.set(false);
        let helpers = self.helpers.len();
        let started = Instant::now();
        let mut spins = 0u32;
        while job.done.load(Ordering::Acquire) < helpers {
            pause(&mut spins, started, Duration::MAX);
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

/// A helper's life: wait for the next loop, take its parts, count itself done; until the team is dropped.
fn helper(shared: &Shared) {
    IN_PART.set(true);
    let mut seen = 0;
    loop {
        seen = wait_for_next(shared, seen);
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        // SAFETY: the caller published this job before bumping the generation we saw (SeqCst), and keeps it alive
        // until we count ourselves in `done`, our last use of it.
        let job = unsafe { &*shared.job.load(Ordering::Relaxed) };
        if let Err(payload) = job.work() {
            let mut first = job.panic.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            first.get_or_insert(payload);
        }
        job.done.fetch_add(1, Ordering::Release);
    }
}

/// Waits until the generation moves past `seen`, and returns the new one: spinning, then yielding, then asleep.
fn wait_for_next(shared: &Shared, seen: u64) -> u64 {
    let started = Instant::now();
    let mut spins = 0u32;
    loop {
        let now = shared.generation.load(Ordering::SeqCst);
        if now != seen {
            return now;
        }
        if !pause(&mut spins, started, YIELD) {
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

/// One round of waiting that began at `started`: a spin-loop hint for the first [`SPIN`], then a yield of the core;
/// false once `limit` has passed (the clock is read every 64 rounds).
fn pause(spins: &mut u32, started: Instant, limit: Duration) -> bool {
    *spins = spins.wrapping_add(1);
    if !spins.is_multiple_of(64) {
        std::hint::spin_loop();
        return true;
    }
    let waited = started.elapsed();
    if waited < SPIN {
        std::hint::spin_loop();
    } else if waited < limit {
        std::thread::yield_now();
    } else {
        return false;
    }
    true
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
