//! A backend that computes nothing and takes the time its [`TimingProfile`] gives for each step.
//!
//! Everything else is the real engine, so a mock worker admits, batches, chunks, caches, evicts, offloads,
//! preempts, exports and imports exactly as a real one does. Its KV blocks hold no values; their size is set
//! apart from the modelled model's (`block_bytes`), so that tens of mock workers fit in one machine's memory while
//! their transfers are charged for the modelled size.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::{Backend, Next, Pacing, StepContext, StepShape, TimingProfile};
use crate::forward::{ForwardError, SeqChunk};
use crate::kv::{KvLayout, KvStore};

/// A mock worker's context when none is given: long enough for any real trace (it computes nothing).
pub const DEFAULT_MOCK_CONTEXT: usize = 131_072;
/// Bytes per stand-in KV block when none is given.
pub const DEFAULT_MOCK_BLOCK_BYTES: usize = 1024;

/// How a mock backend behaves.
#[derive(Clone, Debug, PartialEq)]
pub struct MockSettings {
    pub profile: TimingProfile,
    /// Every modelled duration is divided by this.
    pub speedup: f64,
    /// Bytes of one stand-in KV block (a multiple of 4 × block tokens). 0 in virtual time only: the blocks hold
    /// nothing at all (the simulator moves no KV bytes; its transfers are charged at the profile's size).
    pub block_bytes: usize,
    /// Longest sequence accepted.
    pub context_len: usize,
    /// Keep no real time: a step returns at once and its modelled duration is read back by whoever keeps the clock
    /// (the simulator). Off for workers, whose steps sleep.
    pub virtual_time: bool,
    /// Switches that break the stand-in device: every chunk fails as a broken GPU's would, or the step hangs.
    pub fault: DeviceFault,
}

/// Shared switches that break a mock backend's device (a mock worker flips one on SIGUSR1 and back on SIGUSR2), for
/// testing routers against a failed GPU whose process and streams go on. Broken: every sequence the engine would
/// step fails with a device error, so the worker answers every call with an error. Stuck: a step in real time does
/// not end until unstuck (a hung device), so the worker computes nothing while it still answers and reports.
/// Clones share the switches.
#[derive(Clone, Debug, Default)]
pub struct DeviceFault {
    broken: Arc<AtomicBool>,
    stuck: Arc<AtomicBool>,
}

impl DeviceFault {
    pub fn set_broken(&self, broken: bool) {
        self.broken.store(broken, Ordering::Relaxed);
    }

    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Relaxed)
    }

    pub fn set_stuck(&self, stuck: bool) {
        self.stuck.store(stuck, Ordering::Relaxed);
    }

    pub fn is_stuck(&self) -> bool {
        self.stuck.load(Ordering::Relaxed)
    }
}

/// How often a stuck step looks whether it may end.
const STUCK_POLL: Duration = Duration::from_millis(10);

/// Settings compare by value; every switch is alike.
impl PartialEq for DeviceFault {
    fn eq(&self, _: &DeviceFault) -> bool {
        true
    }
}

impl MockSettings {
    /// The `gpu-default` profile at real speed.
    pub fn gpu_default() -> MockSettings {
        MockSettings {
            profile: TimingProfile::load("gpu-default").unwrap_or_default(),
            speedup: 1.0,
            block_bytes: DEFAULT_MOCK_BLOCK_BYTES,
            context_len: DEFAULT_MOCK_CONTEXT,
            virtual_time: false,
            fault: DeviceFault::default(),
        }
    }

    /// Problems with these settings for blocks of `block_tokens` tokens.
    pub fn problems(&self, block_tokens: usize) -> Vec<String> {
        let mut out = Vec::new();
        if !(self.speedup.is_finite() && self.speedup > 0.0) {
            out.push(format!("the mock speed-up must be a positive number, not {}", self.speedup));
        }
        let unit = 4 * block_tokens.max(1);
        if self.block_bytes == 0 && !self.virtual_time {
            out.push("mock block bytes must be positive for a worker (only the simulator keeps none)".into());
        } else if !self.block_bytes.is_multiple_of(unit) {
            out.push(format!(
                "mock block bytes ({}) must be a multiple of {unit} (4 bytes × {block_tokens} tokens)",
                self.block_bytes
            ));
        }
        if self.context_len == 0 {
            out.push("the mock context must be at least one token".into());
        }
        out
    }
}

/// Steps that sleep for their modelled duration.
#[derive(Debug)]
pub struct MockBackend {
    settings: MockSettings,
    vocab: usize,
    /// Tokens the output is drawn from (ordinary words, never an end-of-generation token).
    words: Arc<[u32]>,
    capacity_tokens: usize,
    pacing: Pacing,
    /// The modelled duration of the last step, in seconds (after the speed-up).
    last_step: f64,
}

impl MockBackend {
    /// A mock over a vocabulary of `vocab` tokens drawing output from `words`, with a device tier of
    /// `capacity_tokens` tokens.
    pub fn new(
        settings: MockSettings,
        vocab: usize,
        words: impl Into<Arc<[u32]>>,
        capacity_tokens: usize,
    ) -> MockBackend {
        MockBackend { settings, vocab, words: words.into(), capacity_tokens, pacing: Pacing::default(), last_step: 0.0 }
    }

    /// The timing model's view of a batch.
    pub fn shape(batch: &[SeqChunk<'_>], onboarded: [u64; 2], capacity_tokens: usize) -> StepShape {
        let mut s = StepShape { onboarded, capacity_tokens, ..StepShape::default() };
        for c in batch {
            let n = c.tokens.len();
            s.batch_kv_tokens += c.start + n;
            if n == 1 && c.logits {
                s.decode_seqs += 1;
                s.decode_kv_tokens += c.start + 1;
            } else {
                s.prefill_tokens += n;
                s.prefill_context_pairs += (n * c.start) as u64;
            }
        }
        s
    }
}

impl Backend for MockBackend {
    fn name(&self) -> &'static str {
        "mock"
    }

    fn vocab(&self) -> usize {
        self.vocab
    }

    fn context_len(&self) -> usize {
        self.settings.context_len
    }

    fn kv_layout(&self, block_tokens: usize) -> KvLayout {
        // One layer, one head: the stand-in block is exactly `block_bytes` of f16 K and V.
        let head_dim = self.settings.block_bytes / (4 * block_tokens.max(1));
        KvLayout { layers: 1, kv_heads: 1, head_dim, block_tokens }
    }

    fn threads(&self) -> usize {
        1
    }

    /// Where the chunk goes, but not its token ids: this backend never reads one (and a sequence's ids are in the
    /// vocabulary by construction). Reading every prompt once more from memory, for nothing, was 2% of a
    /// simulation.
    fn check_chunk(&self, kv: &KvStore, chunk: &SeqChunk<'_>) -> Result<(), ForwardError> {
        if self.settings.fault.is_broken() {
            return Err(ForwardError::Device("the mock device is broken (SIGUSR2 mends it)".into()));
        }
        crate::forward::check_placement(kv, chunk, self.settings.context_len)
    }

    fn forward_into(
        &mut self,
        _: &mut KvStore,
        batch: &[SeqChunk<'_>],
        ctx: StepContext,
        next: &mut Vec<Next>,
    ) -> Result<(), ForwardError> {
        let shape = MockBackend::shape(batch, ctx.onboarded, self.capacity_tokens);
        let modelled = self.settings.profile.step_ms(&shape) / 1000.0 / self.settings.speedup;
        self.last_step = modelled;
        if self.settings.virtual_time {
            self.pacing.record(modelled, modelled);
        } else {
            let until = ctx.started + Duration::from_secs_f64(modelled);
            let now = Instant::now();
            if until > now {
                std::thread::sleep(until - now);
            }
            let mut stuck = false;
            while self.settings.fault.is_stuck() {
                stuck = true;
                std::thread::sleep(STUCK_POLL);
            }
            // A hang says nothing about the machine's speed: the step counts as on time.
            let actual = if stuck { modelled } else { ctx.started.elapsed().as_secs_f64() };
            self.pacing.record(modelled, actual);
        }
        next.extend(batch.iter().filter(|c| c.logits).map(|_| Next::Draw(Arc::clone(&self.words))));
        Ok(())
    }

    fn pacing(&self) -> Option<Pacing> {
        Some(self.pacing)
    }

    fn virtual_step_secs(&self) -> Option<f64> {
        self.settings.virtual_time.then_some(self.last_step)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::BlockId;

    #[test]
    fn the_shape_separates_prompt_chunks_from_decode_rows() {
        let blocks = [BlockId(0); 8];
        let prompt = [1u32; 40];
        let batch = [
            SeqChunk { tokens: &prompt, start: 24, blocks: &blocks, logits: true, greedy: false, scored: None },
            SeqChunk { tokens: &prompt[..1], start: 99, blocks: &blocks, logits: true, greedy: false, scored: None },
            SeqChunk { tokens: &prompt[..1], start: 9, blocks: &blocks, logits: true, greedy: false, scored: None },
        ];
        let s = MockBackend::shape(&batch, [3, 1], 1000);
        assert_eq!(s.prefill_tokens, 40);
        assert_eq!(s.prefill_context_pairs, 40 * 24);
        assert_eq!((s.decode_seqs, s.decode_kv_tokens), (2, 110));
        assert_eq!(s.batch_kv_tokens, 64 + 100 + 10);
        assert_eq!(s.onboarded, [3, 1]);
    }

    #[test]
    fn a_step_takes_its_modelled_time_divided_by_the_speedup() {
        let profile = TimingProfile::parse("t", "[prefill]\nbase_ms = 40\n").expect("parses");
        let settings =
            MockSettings { profile, speedup: 2.0, block_bytes: 64, context_len: 100, ..MockSettings::gpu_default() };
        let mut mock = MockBackend::new(settings, 10, vec![5, 6], 100);
        let layout = mock.kv_layout(16);
        assert_eq!(layout.block_bytes(), 64);
        let mut kv = KvStore::new(layout, 4);
        let blocks = [BlockId(0)];
        let batch =
            [SeqChunk { tokens: &[1, 2, 3], start: 0, blocks: &blocks, logits: true, greedy: false, scored: None }];
        let started = Instant::now();
        let next = mock.forward(&mut kv, &batch, StepContext { started, onboarded: [0, 0] }).expect("runs");
        assert!(started.elapsed() >= Duration::from_millis(20));
        assert!(matches!(&next[..], [Next::Draw(w)] if w[..] == [5, 6]));
        let p = mock.pacing().expect("a mock paces");
        assert_eq!((p.steps, p.modelled_nanos), (1, 20_000_000));
    }

    #[test]
    fn a_chunk_is_checked_for_where_it_goes_not_for_its_ids() {
        let settings = MockSettings { block_bytes: 64, context_len: 8, ..MockSettings::gpu_default() };
        let mock = MockBackend::new(settings, 10, vec![5, 6], 100);
        let kv = KvStore::new(mock.kv_layout(4), 2);
        let blocks = [BlockId(0), BlockId(1)];
        let chunk =
            |tokens, start, blocks| SeqChunk { tokens, start, blocks, logits: true, greedy: false, scored: None };
        assert!(mock.check_chunk(&kv, &chunk(&[1, 2, 3], 0, &blocks)).is_ok());
        // Ids it never reads are not looked at (an engine's sequences hold none outside the vocabulary).
        assert!(mock.check_chunk(&kv, &chunk(&[99], 0, &blocks)).is_ok());
        assert!(matches!(mock.check_chunk(&kv, &chunk(&[1, 2], 7, &blocks)), Err(ForwardError::PastContext(8, 8))));
        assert!(matches!(
            mock.check_chunk(&kv, &chunk(&[1; 5], 0, &blocks[..1])),
            Err(ForwardError::BlockTableShort { have: 1, need: 2 })
        ));
        let outside = [BlockId(0), BlockId(7)];
        assert!(matches!(mock.check_chunk(&kv, &chunk(&[1; 5], 0, &outside)), Err(ForwardError::BlockOutOfRange(7))));
    }

    #[test]
    fn bad_settings_are_named() {
        let s = MockSettings { speedup: 0.0, block_bytes: 100, ..MockSettings::gpu_default() };
        let p = s.problems(16);
        assert_eq!(p.len(), 2, "{p:?}");
        let empty = MockSettings { block_bytes: 0, ..MockSettings::gpu_default() };
        assert_eq!(empty.problems(16).len(), 1, "a worker's blocks must hold bytes");
        let simulated = MockSettings { virtual_time: true, ..empty };
        assert!(simulated.problems(16).is_empty(), "the simulator's need not");
        assert_eq!(MockBackend::new(simulated, 10, vec![5], 100).kv_layout(16).block_bytes(), 0);
    }
}
