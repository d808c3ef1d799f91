//! The batch scheduler: continuous batching with chunked prefill under a per-step token budget, prefix reuse
//! through the tiered block pool (device, host, disk), preemption by recompute when device blocks run out (newest
//! sequence first), sampling, stop conditions and cancellation. Compute runs on the engine's own thread pool.

mod handle;
mod kv_io;
mod sequence;
mod step;
mod stepper;
#[cfg(test)]
mod tests;
pub mod text;

use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

pub use handle::{EngineHandle, EngineStats, LoadMark, SeqEvent, SeqStream, StepHold, SubmitError, Tag};
use kv_cache::CacheNamespace;
use kv_cache::events::{EventId, KvEvent, Snapshot, Tier, TooOld};
use kv_cache::pool::{BlockPool, PoolError, TierSizes, TierUsage};
pub use kv_io::{ExportedKv, PulledBlocks};
use sequence::Seq;
pub use stepper::{Output, Stepped, Stepper};
pub use text::TextStream;

use crate::backend::cpu::CpuBackend;
use crate::backend::mock::{MockBackend, MockSettings};
use crate::backend::{Backend, Pacing};
use crate::chat::ChatMessage;
use crate::forward::{ForwardError, Precision};
use crate::gguf::{GgufError, GgufFile};
use crate::kv::{KvLayout, KvStore};
use crate::model::Model;
use crate::sampling::{Sampler, SamplingParams};
use crate::team::Team;
use crate::text::{TextError, TextModel};
use crate::tiers::{DiskTier, TierError, TierStores};
use crate::tokenizer::Tokenizer;

/// Tokens per KV block: vLLM's and Dynamo's default, and what `routing.md` hashes by.
pub const DEFAULT_BLOCK_TOKENS: usize = 16;
/// Tokens computed per step across all sequences: vLLM's CPU default for `max_num_batched_tokens`.
pub const DEFAULT_MAX_BATCHED_TOKENS: usize = 2048;
/// Device KV blocks when nothing else is said: one full 8k context of SmolLM2 plus room for a few short
/// sequences (377 MB for SmolLM2, claimed when the engine starts: see `KvStore::new`).
pub const DEFAULT_KV_BLOCKS: usize = 1024;
/// Sequences running at once: enough to keep a CPU busy; more only adds attention work per step.
pub const DEFAULT_MAX_NUM_SEQS: usize = 64;
/// Events kept for resubscribers: a few seconds of a busy worker's changes.
pub const DEFAULT_REPLAY_EVENTS: usize = 65_536;

/// What computes the engine's steps.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum BackendChoice {
    /// The model's forward pass on CPU.
    #[default]
    Cpu,
    /// No compute: each step takes the time a timing profile gives (see [`crate::backend::mock`]).
    Mock(Box<MockSettings>),
    /// The model's forward pass on CUDA device N (a build with the `cuda` feature; docs/cuda.md).
    Cuda(usize),
}

impl From<crate::backend::Device> for BackendChoice {
    fn from(device: crate::backend::Device) -> BackendChoice {
        match device {
            crate::backend::Device::Cpu => BackendChoice::Cpu,
            crate::backend::Device::Cuda(n) => BackendChoice::Cuda(n),
        }
    }
}

/// How an engine runs.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineConfig {
    pub backend: BackendChoice,
    /// How the CPU backend computes matmuls over quantized weights.
    pub precision: Precision,
    /// Compute threads; `None` means one per available core.
    pub threads: Option<NonZeroUsize>,
    /// Device tier size in blocks.
    pub kv_blocks: usize,
    /// Host tier size in blocks (0: no host tier).
    pub host_blocks: usize,
    /// Disk tier size in blocks (0: no disk tier); needs `disk_dir`.
    pub disk_blocks: usize,
    pub disk_dir: Option<PathBuf>,
    /// Put the device tier's KV store in a new file here (in shared memory, e.g. `/dev/shm`), which other
    /// processes on the host may map to read exported blocks where they lie. When the file cannot be made (no
    /// room, say) the store stays in the process's own memory: [`Engine::device_file`] says which.
    pub device_file: Option<PathBuf>,
    pub block_tokens: usize,
    /// Prompt and decode tokens computed per step over the whole batch.
    pub max_batched_tokens: usize,
    /// Most prompt tokens one sequence computes in one step (chunked prefill); `None`: no limit of its own.
    pub prefill_chunk: Option<NonZeroUsize>,
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    /// Longest sequence (prompt plus output) accepted; `None`: the model's context.
    pub max_model_len: Option<usize>,
    pub replay_events: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            backend: BackendChoice::Cpu,
            precision: Precision::Reference,
            threads: None,
            kv_blocks: DEFAULT_KV_BLOCKS,
            host_blocks: 0,
            disk_blocks: 0,
            disk_dir: None,
            device_file: None,
            block_tokens: DEFAULT_BLOCK_TOKENS,
            max_batched_tokens: DEFAULT_MAX_BATCHED_TOKENS,
            prefill_chunk: None,
            max_num_seqs: DEFAULT_MAX_NUM_SEQS,
            max_model_len: None,
            replay_events: DEFAULT_REPLAY_EVENTS,
        }
    }
}

/// Why the engine could not start or could not run a request.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] GgufError),
    #[error(transparent)]
    Text(#[from] TextError),
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error(transparent)]
    Grammar(#[from] crate::grammar::GrammarError),
    #[error("the prompt has {prompt} tokens; the model's context is {context} tokens")]
    PromptTooLong { prompt: usize, context: usize },
    #[error("out of KV capacity: no device block can be had ({used} of {total} referenced by running sequences)")]
    OutOfKvCapacity { used: usize, total: usize },
    #[error("invalid engine configuration: {0}")]
    Config(String),
    #[error("could not start compute threads: {0}")]
    Threads(String),
    /// The compute device could not be opened (a sentence saying why and what to do).
    #[error("{0}")]
    Device(String),
    #[error(transparent)]
    Forward(#[from] ForwardError),
    #[error(transparent)]
    Tier(TierError),
    #[error("block pool: {0}")]
    Pool(PoolError),
    /// A block pulled from another worker failed its check in the engine's KV: nothing of the import was kept.
    #[error("KV import: {0}")]
    Import(String),
    /// One sequence failed (the others went on).
    #[error("{0}")]
    Sequence(String),
}

/// One request: prompt tokens and how to sample.
#[derive(Clone, Debug)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    /// The tenant's cache namespace: its blocks are hashed apart from everyone else's.
    pub namespace: Option<CacheNamespace>,
    /// Past this instant nobody waits for the answer: the engine drops the sequence at its next step.
    pub deadline: Option<Instant>,
    /// Scheduling order in a [`Stepper`]'s queue, vLLM's meaning: lower runs first, ties by arrival; when device
    /// blocks run out, the running sequence of the highest value (the newest among equals) is preempted first.
    /// [`Engine::run`] takes its requests together, in the order given.
    pub priority: i32,
}

impl Request {
    /// `prompt` under `sampling`, in no namespace, with no deadline, at priority 0.
    pub fn new(prompt: Vec<u32>, sampling: SamplingParams) -> Request {
        Request { prompt, sampling, namespace: None, deadline: None, priority: 0 }
    }

    /// Greedy decoding of up to `max_tokens` after `prompt`, in no namespace.
    pub fn greedy(prompt: Vec<u32>, max_tokens: std::num::NonZeroU32) -> Request {
        Request::new(prompt, SamplingParams::greedy(max_tokens))
    }
}

/// Why a sequence ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token or a stop string.
    Stop,
    /// `max_tokens`, or the model's context, was reached.
    Length,
    /// The caller cancelled.
    Cancelled,
}

impl FinishReason {
    /// The name OpenAI's API uses.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// A finished sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    pub prompt_ids: Vec<u32>,
    /// Generated ids, the end-of-generation token included when one ended the sequence.
    pub token_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    /// Prompt tokens served from cache (any tier) instead of computed.
    pub cached_tokens: usize,
    /// From the start of the run to this sequence's first token.
    pub time_to_first_token: Duration,
    /// From the first token to the last.
    pub decode_time: Duration,
    /// Each generated token's log-probabilities, when the request asked for them (else empty).
    pub logprobs: Vec<crate::sampling::TokenLogprobs>,
    /// The log-probabilities of the prompt's tokens from the second on, when the request asked for them (else
    /// empty).
    pub prompt_logprobs: Vec<crate::sampling::TokenLogprobs>,
}

/// What a run reports as it goes.
#[derive(Debug)]
pub enum Event<'a> {
    /// Sequence `seq` produced `token`; `text` is what is now safe to show; `logprobs` when the request asked;
    /// with its first token, the prompt's log-probabilities when the request asked for them (else empty).
    Token {
        seq: usize,
        token: u32,
        text: &'a str,
        logprobs: Option<&'a crate::sampling::TokenLogprobs>,
        prompt_logprobs: &'a [crate::sampling::TokenLogprobs],
    },
}

/// Counters a worker exports (totals since the engine started).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Tokens run through the model (prompt chunks, recomputation and decode steps).
    pub prefill_tokens: u64,
    /// Prompt tokens taken from cached blocks instead of computed, by the tier they came from.
    pub cached_tokens: [u64; 3],
    pub preemptions: u64,
    /// Blocks copied down to each tier (index 0 unused).
    pub offloads: [u64; 3],
    /// Blocks copied up to the device from each tier (index 0 unused).
    pub onboards: [u64; 3],
    /// Disk blocks that failed their check when read and were recomputed.
    pub corrupt_disk_blocks: u64,
    /// Blocks pulled from other workers and stored here.
    pub imported_blocks: u64,
    /// Imports that found no free device block (the decode worker full of running sequences): the request was
    /// queued without them, to compute its prompt when admitted.
    pub import_fallbacks: u64,
    /// Time spent in steps, admission and block allocation included (with `prefill_tokens`, the engine's measured
    /// speed).
    pub compute_nanos: u64,
}

/// A model with its tokenizer, chat template, tiered KV storage, block pool and thread pool.
#[derive(Debug)]
pub struct Engine {
    backend: Box<dyn Backend>,
    text: Arc<TextModel>,
    /// Structured outputs' grammars, compiled against this model's vocabulary.
    grammars: crate::grammar::Grammars,
    stores: TierStores,
    pool: BlockPool,
    config: EngineConfig,
    counters: Counters,
    tick: u64,
    /// Exported blocks whose pins ended, waiting to be released here ([`Engine::reclaim_pinned`]).
    unpinned: Arc<crate::kv::Unpinned>,
    /// Why the device store is not in the file `EngineConfig::device_file` named, when it is not.
    device_file_refused: Option<String>,
    /// Device slots pins hold (a pool reference each) and how many pins hold each, until reclaimed.
    pins: kv_io::PinCounts,
    /// For a backend in virtual time, the one instant every step reads: its steps take no real time, and whoever
    /// drives it keeps the clock (three clock reads a step were a few percent of a simulation).
    frozen_clock: Option<std::time::Instant>,
    /// The step's plan (sequence, tokens), kept between steps for its memory: a simulated worker steps millions
    /// of times.
    plan: Vec<(usize, usize)>,
    /// The step's outputs from the backend, kept likewise.
    next: Vec<crate::backend::Next>,
    /// The memory of the step's batch, kept likewise (empty between steps: see `step::recycle`).
    chunks: Vec<crate::forward::SeqChunk<'static>>,
}

impl Engine {
    /// Loads the model at `path` and prepares to run it. Configuration errors are reported all at once.
    pub fn open(path: &std::path::Path, config: EngineConfig) -> Result<Engine, EngineError> {
        let file = GgufFile::open(path)?;
        let text = Arc::new(TextModel::from_gguf(&file)?);
        let backend: Box<dyn Backend> = match &config.backend {
            BackendChoice::Cpu => {
                let mut model = Model::load(&file)?;
                model.precision = config.precision;
                check_config(&config, model.config.context_len)?;
                let threads = config.threads.map_or(0, NonZeroUsize::get);
                let team = Team::new(threads, "tandem-compute").map_err(|e| EngineError::Threads(e.to_string()))?;
                Box::new(CpuBackend::new(model, team))
            }
            BackendChoice::Mock(_) => {
                let words = text.tokenizer().plain_words();
                return Engine::open_mock(text, words.into(), config);
            }
            BackendChoice::Cuda(ordinal) => {
                let model = Model::load(&file)?;
                check_config(&config, model.config.context_len)?;
                crate::backend::open_cuda(&model, *ordinal).map_err(EngineError::Device)?
            }
        };
        Engine::with_backend(backend, text, config)
    }

    /// A mock engine over a text model already read, drawing output from `words` (`Tokenizer::plain_words`):
    /// many engines share one model's vocabulary without each reading the file, and one copy of the words (the
    /// simulator's workers: every token drawn reads the table at random, and one copy stays in cache).
    pub fn open_mock(text: Arc<TextModel>, words: Arc<[u32]>, config: EngineConfig) -> Result<Engine, EngineError> {
        let BackendChoice::Mock(mock) = &config.backend else {
            return Err(EngineError::Config("open_mock needs the mock backend".into()));
        };
        let problems = mock.problems(config.block_tokens);
        if !problems.is_empty() {
            return Err(EngineError::Config(problems.join("; ")));
        }
        check_config(&config, mock.context_len)?;
        if words.is_empty() {
            return Err(EngineError::Config("the vocabulary has no plain word tokens for the mock to draw".into()));
        }
        let capacity = config.kv_blocks * config.block_tokens;
        let vocab = text.tokenizer().vocab_size();
        let backend = Box::new(MockBackend::new((**mock).clone(), vocab, words, capacity));
        Engine::with_backend(backend, text, config)
    }

    /// An engine over a backend made elsewhere (a device of the caller's, a test's), with the text model of the
    /// same file: the scheduler, the pool and the tiers are the same code whatever computes the steps.
    pub fn with_backend(
        backend: Box<dyn Backend>,
        text: Arc<TextModel>,
        config: EngineConfig,
    ) -> Result<Engine, EngineError> {
        let layout = backend.kv_layout(config.block_tokens);
        let disk = match (&config.disk_dir, config.disk_blocks) {
            (Some(dir), n) if n > 0 => Some(DiskTier::open(dir).map_err(EngineError::Tier)?),
            _ => None,
        };
        let host = (config.host_blocks > 0).then(|| KvStore::new(layout, config.host_blocks));
        // A store in a shared file when asked and the file can be made; else the process's own memory.
        let shared = config.device_file.as_deref().map(|path| {
            KvStore::in_file(layout, config.kv_blocks, path).map_err(|e| format!("{}: {e}", path.display()))
        });
        let (device, device_file_refused) = match shared {
            Some(Ok(store)) => (store, None),
            Some(Err(why)) => (KvStore::new(layout, config.kv_blocks), Some(why)),
            None => (KvStore::new(layout, config.kv_blocks), None),
        };
        let stores = TierStores::new(device, host, disk);
        let sizes = TierSizes { device: config.kv_blocks, host: config.host_blocks, disk: config.disk_blocks };
        let pool = BlockPool::new(sizes, config.replay_events).map_err(EngineError::Pool)?;
        let grammars = crate::grammar::Grammars::new(Arc::clone(&text));
        let unpinned = Arc::default();
        let pins = kv_io::PinCounts::new(config.kv_blocks);
        let frozen_clock = backend.virtual_step_secs().map(|_| std::time::Instant::now());
        Ok(Engine {
            backend,
            text,
            grammars,
            stores,
            pool,
            config,
            counters: Counters::default(),
            tick: 0,
            unpinned,
            device_file_refused,
            pins,
            frozen_clock,
            plan: Vec::new(),
            next: Vec::new(),
            chunks: Vec::new(),
        })
    }

    /// The time now, as the engine's steps see it (the same instant throughout for a backend in virtual time).
    pub(crate) fn now(&self) -> std::time::Instant {
        self.frozen_clock.unwrap_or_else(std::time::Instant::now)
    }

    /// What computes the steps: `cpu` or `mock`.
    pub fn backend_name(&self) -> &'static str {
        self.backend.name()
    }

    /// Tokens in the vocabulary.
    pub fn vocab(&self) -> usize {
        self.backend.vocab()
    }

    /// How closely a modelled backend keeps to its timing profile; `None` for a computing backend.
    pub fn pacing(&self) -> Option<Pacing> {
        self.backend.pacing()
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        self.text.tokenizer()
    }

    /// Tokenizer, chat template and fingerprint.
    pub fn text(&self) -> &TextModel {
        &self.text
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The model file's content fingerprint: workers exchange KV only when theirs are equal.
    pub fn fingerprint(&self) -> &str {
        self.text.fingerprint()
    }

    /// The file the device tier's KV store lives in, when it lives in one (`EngineConfig::device_file`).
    pub fn device_file(&self) -> Option<&std::path::Path> {
        self.stores.device.file()
    }

    /// Why the device KV store could not be put in the file `EngineConfig::device_file` named (it is in the
    /// process's own memory instead).
    pub fn device_file_refused(&self) -> Option<&str> {
        self.device_file_refused.as_deref()
    }

    /// The KV block shape.
    pub fn kv_layout(&self) -> KvLayout {
        *self.stores.device.layout()
    }

    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// Compute threads in use.
    pub fn threads(&self) -> usize {
        self.backend.threads()
    }

    /// Blocks per state on `tier`.
    pub fn kv_usage(&self, tier: Tier) -> TierUsage {
        self.pool.usage(tier)
    }

    /// Device blocks a new sequence could get: free ones and cached ones (evictable).
    pub fn free_blocks(&self) -> usize {
        let u = self.pool.usage(Tier::Device);
        u.free + u.cached
    }

    /// Every tier's content as of the newest event.
    pub fn kv_snapshot(&self) -> Snapshot {
        self.pool.snapshot()
    }

    /// KV events after `after`, or [`TooOld`] when a snapshot is needed.
    pub fn kv_events_after(&self, after: Option<EventId>) -> Result<Vec<(EventId, KvEvent)>, TooOld> {
        self.pool.events_after(after)
    }

    /// KV events not read yet, moved out: for a sole reader that never resubscribes (the simulator).
    pub fn take_kv_events(&mut self) -> Result<Vec<(EventId, KvEvent)>, TooOld> {
        self.pool.take_events()
    }

    /// Longest sequence accepted.
    pub fn max_model_len(&self) -> usize {
        self.config.max_model_len.unwrap_or(self.backend.context_len())
    }

    /// The prompt text for a conversation, with the assistant's generation prompt.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, EngineError> {
        Ok(self.text.render_chat(messages)?)
    }

    /// Runs `requests` together to completion. `on_event` sees every token as it is made; `cancel` stops every
    /// sequence at the next step. Validation happens before any compute; every block is released on every path.
    pub fn run(
        &mut self,
        requests: &[Request],
        cancel: &AtomicBool,
        mut on_event: impl FnMut(Event<'_>),
    ) -> Result<Vec<Completion>, EngineError> {
        let start = Instant::now();
        let mut seqs: Vec<Seq> =
            requests.iter().enumerate().map(|(i, r)| self.new_seq(r.clone(), i)).collect::<Result<_, _>>()?;
        let result = self.drive(&mut seqs, cancel, &mut on_event);
        for s in &mut seqs {
            let released = self.release_blocks(s);
            if result.is_ok() {
                released?;
            }
        }
        result?;
        Ok(seqs.into_iter().map(|s| s.into_completion(start)).collect())
    }

    /// A sequence for `request`, checked before any compute: an empty prompt or one that leaves no room to
    /// generate within `max_model_len` is refused. The prompt's vector becomes the sequence's tokens.
    fn new_seq(&self, request: Request, index: usize) -> Result<Seq, EngineError> {
        let context = self.max_model_len();
        let r = request;
        if r.prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if r.prompt.len() >= context {
            return Err(EngineError::PromptTooLong { prompt: r.prompt.len(), context });
        }
        let vocab = self.backend.vocab();
        if let Some(t) = crate::forward::first_out_of_vocab(&r.prompt, vocab) {
            return Err(EngineError::Forward(ForwardError::TokenOutOfRange(t)));
        }
        if r.sampling.prompt_logprobs().is_some() && !self.backend.scores_prompts() {
            return Err(EngineError::Forward(ForwardError::NoPromptScores(self.backend.name())));
        }
        let max_new = (r.sampling.max_tokens() as usize).min(context - r.prompt.len());
        // The tokens at the end of the prompt that were generated earlier have been through the grammar already.
        let grammar = match r.sampling.grammar() {
            None => None,
            Some(g) => {
                let prior = (r.sampling.logits().prior_generated as usize).min(r.prompt.len());
                Some(self.grammars.matcher(g, r.sampling.thinking(), &r.prompt[r.prompt.len() - prior..])?)
            }
        };
        let prompt_len = r.prompt.len();
        let (ignore_eos, detokenize) = (r.sampling.ignore_eos(), r.sampling.detokenize());
        let text = TextStream::new(r.sampling.stop().to_vec());
        let sampler = Sampler::new(r.sampling, random_seed(index));
        // Room for the output too (up to a bound), so the first token does not copy the whole prompt; a caller
        // that made the prompt with that room saves copying it at all.
        let mut tokens = r.prompt;
        tokens.reserve(max_new.min(2048));
        Ok(Seq {
            tokens,
            namespace: r.namespace,
            hashes: kv_cache::BlockHashes::default(),
            prompt_len,
            computed: 0,
            blocks: Vec::new(),
            registered: 0,
            running: false,
            admitted_at: 0,
            admissions: 0,
            cached_tokens: 0,
            sampler,
            text,
            out: String::new(),
            max_new,
            ignore_eos,
            detokenize,
            keep_blocks: false,
            deadline: r.deadline,
            priority: r.priority,
            pinned: Vec::new(),
            cached_hint: 0,
            failure: None,
            finish: None,
            first_token: None,
            logprobs: Vec::new(),
            prompt_logprobs: Vec::new(),
            grammar,
            last_token: None,
        })
    }

    /// A sequence for `request` ready to queue: `blocks` (full blocks of its prompt pulled from another worker, by
    /// position) stored and held for it, its KV kept for export when `export`, and how much of it is cached.
    fn prepare(
        &mut self,
        request: Request,
        index: usize,
        export: bool,
        blocks: &dyn PulledBlocks,
    ) -> Result<Seq, EngineError> {
        self.prepare_hashed(request, None, index, export, blocks)
    }

    /// [`prepare`](Self::prepare), given the hashes of the prompt's full blocks in this engine's block size and
    /// the request's namespace (from a [`kv_cache::HashedTokens`], so they are the prompt's own), which the
    /// sequence then keeps instead of hashing its prompt again.
    fn prepare_hashed(
        &mut self,
        request: Request,
        hashes: Option<kv_cache::BlockHashes>,
        index: usize,
        export: bool,
        blocks: &dyn PulledBlocks,
    ) -> Result<Seq, EngineError> {
        self.reclaim_pinned();
        let mut seq = self.new_seq(request, index)?;
        if let Some(hashes) = hashes {
            seq.hashes = hashes;
        }
        if blocks.count() > 0 {
            seq.pinned = match self.import_pinned(&mut seq, blocks) {
                Ok(pinned) => pinned,
                // Every device block is held by running sequences: the request waits and computes what it
                // cannot find cached when admitted, rather than failing for want of room it will get later.
                Err(EngineError::OutOfKvCapacity { .. }) => {
                    self.counters.import_fallbacks += 1;
                    Vec::new()
                }
                Err(e) => return Err(e),
            };
        }
        seq.keep_blocks = export;
        seq.cached_hint = self.cached_prefix_tokens(&mut seq);
        Ok(seq)
    }

    fn drive(
        &mut self,
        seqs: &mut [Seq],
        cancel: &AtomicBool,
        on_event: &mut impl FnMut(Event<'_>),
    ) -> Result<(), EngineError> {
        while seqs.iter().any(Seq::active) {
            if cancel.load(Ordering::Relaxed) {
                for s in seqs.iter_mut().filter(|s| s.active()) {
                    s.finish = Some(FinishReason::Cancelled);
                    self.release_blocks(s)?;
                    s.running = false;
                }
                break;
            }
            if !self.step(seqs, on_event)? {
                return Err(self.out_of_capacity());
            }
            if let Some(why) = seqs.iter().find_map(|s| s.failure.as_ref()) {
                return Err(EngineError::Sequence(why.to_string()));
            }
        }
        Ok(())
    }
}

/// Every configuration problem, reported together.
fn check_config(c: &EngineConfig, context: usize) -> Result<(), EngineError> {
    let mut problems = Vec::new();
    if c.block_tokens == 0 {
        problems.push("block_tokens must be at least 1".to_string());
    }
    if c.max_batched_tokens == 0 {
        problems.push("max_batched_tokens must be at least 1".to_string());
    }
    if c.max_num_seqs == 0 {
        problems.push("max_num_seqs must be at least 1".to_string());
    }
    let max_len = c.max_model_len.unwrap_or(context);
    if max_len == 0 || max_len > context {
        problems.push(format!("max_model_len {max_len} must be between 1 and the model's context ({context})"));
    }
    if c.kv_blocks == 0 {
        problems.push("the device tier needs at least one block (kv_blocks)".to_string());
    } else if c.block_tokens > 0 && c.kv_blocks < max_len.div_ceil(c.block_tokens) {
        problems.push(format!(
            "the device tier ({} blocks) cannot hold one sequence of max_model_len {max_len} tokens ({} blocks)",
            c.kv_blocks,
            max_len.div_ceil(c.block_tokens)
        ));
    }
    if c.disk_blocks > 0 && c.disk_dir.is_none() {
        problems.push("a disk tier (disk_blocks > 0) needs disk_dir".to_string());
    }
    if problems.is_empty() { Ok(()) } else { Err(EngineError::Config(problems.join("; "))) }
}

/// A seed for a request that brought none: different per process and per sequence.
fn random_seed(i: usize) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_usize(i);
    h.finish()
}
