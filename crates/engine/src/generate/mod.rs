//! Driving sequences to completion: chunked prefill under a per-step token budget, batched decode, sampling,
//! stop conditions and cancellation. Compute runs on the engine's own thread pool.
//!
//! This driver runs a fixed batch of requests; the continuous-batching scheduler with prefix reuse and
//! preemption builds on the same [`Model::forward`] step.

mod text;

use std::num::NonZeroUsize;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

pub use text::TextStream;

use crate::chat::{ChatMessage, ChatTemplate, TemplateError};
use crate::forward::{ForwardError, SeqChunk};
use crate::gguf::{GgufError, GgufFile};
use crate::kv::{BlockId, KvLayout, KvStore};
use crate::model::Model;
use crate::sampling::{Sampler, SamplingParams};
use crate::tokenizer::{Tokenizer, TokenizerError};

/// Tokens per KV block: vLLM's and Dynamo's default, and what `routing.md` hashes by.
pub const DEFAULT_BLOCK_TOKENS: usize = 16;
/// Tokens computed per step across all sequences: vLLM's CPU default for `max_num_batched_tokens`.
pub const DEFAULT_MAX_BATCHED_TOKENS: usize = 2048;
/// KV blocks reserved when nothing else is said: one full 8k context of SmolLM2 plus room for a few short
/// sequences (the memory is only committed as blocks are written).
pub const DEFAULT_KV_BLOCKS: usize = 1024;

/// How an engine runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// Compute threads; `None` means one per available core.
    pub threads: Option<NonZeroUsize>,
    pub kv_blocks: usize,
    pub block_tokens: usize,
    /// Prompt and decode tokens computed per step over the whole batch.
    pub max_batched_tokens: usize,
    /// Most prompt tokens one sequence computes in one step (chunked prefill); `None`: no limit of its own.
    pub prefill_chunk: Option<NonZeroUsize>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            threads: None,
            kv_blocks: DEFAULT_KV_BLOCKS,
            block_tokens: DEFAULT_BLOCK_TOKENS,
            max_batched_tokens: DEFAULT_MAX_BATCHED_TOKENS,
            prefill_chunk: None,
        }
    }
}

/// Why the engine could not start or could not run a request.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] GgufError),
    #[error("{0}")]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Template(#[from] TemplateError),
    #[error("the model file has no chat template")]
    NoChatTemplate,
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt has {prompt} tokens; the model's context is {context} tokens")]
    PromptTooLong { prompt: usize, context: usize },
    #[error("out of KV capacity: {need} blocks needed, {free} free of {total}")]
    OutOfKvCapacity { need: usize, free: usize, total: usize },
    #[error("invalid engine configuration: {0}")]
    Config(String),
    #[error("could not start compute threads: {0}")]
    Threads(String),
    #[error(transparent)]
    Forward(#[from] ForwardError),
}

/// One request: prompt tokens and how to sample.
#[derive(Clone, Debug)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
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
    /// From the start of the run to this sequence's first token.
    pub time_to_first_token: Duration,
    /// From the first token to the last.
    pub decode_time: Duration,
}

/// What a run reports as it goes.
#[derive(Debug)]
pub enum Event<'a> {
    /// Sequence `seq` produced `token`; `text` is what is now safe to show.
    Token { seq: usize, token: u32, text: &'a str },
}

/// A model with its tokenizer, chat template, KV store and thread pool.
#[derive(Debug)]
pub struct Engine {
    model: Model,
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    kv: KvStore,
    free: Vec<BlockId>,
    pool: rayon::ThreadPool,
    config: EngineConfig,
}

struct Seq {
    tokens: Vec<u32>,
    prompt_len: usize,
    computed: usize,
    blocks: Vec<BlockId>,
    sampler: Sampler,
    text: TextStream,
    out: String,
    max_new: usize,
    finish: Option<FinishReason>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
}

impl Engine {
    /// Loads the model at `path` and prepares to run it.
    pub fn open(path: &std::path::Path, config: EngineConfig) -> Result<Engine, EngineError> {
        if config.block_tokens == 0 || config.kv_blocks == 0 || config.max_batched_tokens == 0 {
            return Err(EngineError::Config(
                "block_tokens, kv_blocks and max_batched_tokens must be at least 1".into(),
            ));
        }
        let file = GgufFile::open(path)?;
        let model = Model::load(&file)?;
        let tokenizer = Tokenizer::from_gguf(&file)?;
        let template = match file.metadata().get("tokenizer.chat_template").and_then(|v| v.as_str()) {
            None => None,
            Some(src) => {
                let text = |id: Option<u32>| id.and_then(|i| tokenizer.token_text(i)).unwrap_or("").to_string();
                let (bos, eos) = (text(tokenizer.special().bos), text(tokenizer.special().eos));
                Some(ChatTemplate::new(src, &bos, &eos)?)
            }
        };
        let threads = config.threads.map_or(0, NonZeroUsize::get);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("tandem-compute-{i}"))
            .build()
            .map_err(|e| EngineError::Threads(e.to_string()))?;
        let layout = KvLayout::for_model(&model.config, config.block_tokens);
        let kv = KvStore::new(layout, config.kv_blocks);
        let free = (0..config.kv_blocks as u32).rev().map(BlockId).collect();
        Ok(Engine { model, tokenizer, template, kv, free, pool, config })
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Compute threads in use.
    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// Free KV blocks.
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// The prompt text for a conversation, with the assistant's generation prompt.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, EngineError> {
        let t = self.template.as_ref().ok_or(EngineError::NoChatTemplate)?;
        Ok(t.render(messages, true)?)
    }

    /// Runs `requests` together to completion. `on_event` sees every token as it is made; `cancel` stops every
    /// sequence at the next step. Validation happens before any compute; blocks are returned on every path.
    pub fn run(
        &mut self,
        requests: &[Request],
        cancel: &AtomicBool,
        mut on_event: impl FnMut(Event<'_>),
    ) -> Result<Vec<Completion>, EngineError> {
        let context = self.model.config.context_len;
        for r in requests {
            if r.prompt.is_empty() {
                return Err(EngineError::EmptyPrompt);
            }
            if r.prompt.len() >= context {
                return Err(EngineError::PromptTooLong { prompt: r.prompt.len(), context });
            }
        }
        let start = Instant::now();
        let mut seqs: Vec<Seq> = requests
            .iter()
            .enumerate()
            .map(|(i, r)| Seq {
                tokens: r.prompt.clone(),
                prompt_len: r.prompt.len(),
                computed: 0,
                blocks: Vec::new(),
                sampler: Sampler::new(r.sampling.clone(), random_seed(i)),
                text: TextStream::new(r.sampling.stop().to_vec()),
                out: String::new(),
                max_new: (r.sampling.max_tokens() as usize).min(context - r.prompt.len()),
                finish: None,
                first_token: None,
                last_token: None,
            })
            .collect();
        let result = self.drive(&mut seqs, cancel, &mut on_event);
        for s in &mut seqs {
            self.free.append(&mut s.blocks);
        }
        result?;
        Ok(seqs
            .into_iter()
            .map(|s| {
                let first = s.first_token.unwrap_or(start);
                Completion {
                    prompt_ids: s.tokens[..s.prompt_len].to_vec(),
                    token_ids: s.tokens[s.prompt_len..].to_vec(),
                    text: s.out,
                    finish_reason: s.finish.unwrap_or(FinishReason::Cancelled),
                    time_to_first_token: first - start,
                    decode_time: s.last_token.unwrap_or(first) - first,
                }
            })
            .collect())
    }

    fn drive(
        &mut self,
        seqs: &mut [Seq],
        cancel: &AtomicBool,
        on_event: &mut impl FnMut(Event<'_>),
    ) -> Result<(), EngineError> {
        let bt = self.config.block_tokens;
        let chunk_cap = self.config.prefill_chunk.map_or(usize::MAX, NonZeroUsize::get);
        while seqs.iter().any(|s| s.finish.is_none()) {
            if cancel.load(Ordering::Relaxed) {
                for s in seqs.iter_mut().filter(|s| s.finish.is_none()) {
                    s.finish = Some(FinishReason::Cancelled);
                }
                break;
            }
            // Plan the step: decodes first (one token each), then prompt chunks while the budget lasts.
            let mut budget = self.config.max_batched_tokens;
            let mut plan: Vec<(usize, usize)> = Vec::new();
            for (i, s) in seqs.iter().enumerate() {
                if s.finish.is_none() && s.computed >= s.prompt_len && budget > 0 {
                    plan.push((i, 1));
                    budget -= 1;
                }
            }
            for (i, s) in seqs.iter().enumerate() {
                if s.finish.is_none() && s.computed < s.prompt_len && budget > 0 {
                    let n = (s.prompt_len - s.computed).min(chunk_cap).min(budget);
                    plan.push((i, n));
                    budget -= n;
                }
            }
            for &(i, n) in &plan {
                let need = (seqs[i].computed + n).div_ceil(bt).saturating_sub(seqs[i].blocks.len());
                if need > self.free.len() {
                    return Err(EngineError::OutOfKvCapacity {
                        need,
                        free: self.free.len(),
                        total: self.kv.capacity(),
                    });
                }
                let at = self.free.len() - need;
                seqs[i].blocks.extend(self.free.drain(at..).rev());
            }
            let chunks: Vec<SeqChunk<'_>> = plan
                .iter()
                .map(|&(i, n)| {
                    let s = &seqs[i];
                    let end = s.computed + n;
                    SeqChunk {
                        tokens: &s.tokens[s.computed..end],
                        start: s.computed,
                        blocks: &s.blocks,
                        logits: end >= s.prompt_len,
                    }
                })
                .collect();
            let (model, kv) = (&self.model, &mut self.kv);
            let logits = self.pool.install(|| model.forward(kv, &chunks))?;
            let mut logits = logits.into_iter();
            for &(i, n) in &plan {
                let s = &mut seqs[i];
                s.computed += n;
                if s.computed < s.prompt_len {
                    continue;
                }
                let Some(l) = logits.next() else { continue };
                let token = s.sampler.sample(&l);
                self.accept(i, s, token, on_event);
            }
        }
        Ok(())
    }

    /// Appends a sampled token and decides whether the sequence is done.
    fn accept(&self, i: usize, s: &mut Seq, token: u32, on_event: &mut impl FnMut(Event<'_>)) {
        let now = Instant::now();
        s.first_token.get_or_insert(now);
        s.last_token = Some(now);
        s.tokens.push(token);
        let generated = s.tokens.len() - s.prompt_len;
        let end_of_generation = self.tokenizer.is_end_of_generation(token);
        let (mut text, stop_string) =
            if end_of_generation { (String::new(), false) } else { s.text.push(&self.tokenizer, token) };
        if end_of_generation || stop_string {
            s.finish = Some(FinishReason::Stop);
        } else if generated >= s.max_new {
            s.finish = Some(FinishReason::Length);
        }
        if s.finish.is_some() {
            // Text held back as a possible stop-string start is released, unless a stop string ended the sequence.
            text.push_str(&s.text.finish(stop_string));
        }
        s.out.push_str(&text);
        on_event(Event::Token { seq: i, token, text: &text });
    }
}

/// A seed for a request that brought none: different per process and per sequence.
fn random_seed(i: usize) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_usize(i);
    h.finish()
}

/// A cancellation flag shared between a runner and whoever may stop it.
pub fn cancel_flag() -> Arc<AtomicBool> {
    Arc::new(AtomicBool::new(false))
}
