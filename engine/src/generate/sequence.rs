//! One sequence's state in the scheduler: its tokens, how far its KV is computed, its device blocks, its sampler
//! and text, and when it finished.

use std::time::Instant;

use kv_cache::{BlockHashes, BlockSize, CacheNamespace};

use super::{Completion, Event, FinishReason, TextStream};
use crate::forward::{Scored, SeqChunk};
use crate::kv::BlockId;
use crate::sampling::{Sampler, TokenLogprobs};
use crate::tokenizer::Tokenizer;

#[derive(Debug)]
pub(super) struct Seq {
    /// Prompt plus generated tokens.
    pub tokens: Vec<u32>,
    /// Mixed into the first block's hash (tenant isolation).
    pub namespace: Option<CacheNamespace>,
    /// Hashes of the leading full blocks hashed so far (each block is hashed once: see [`Seq::hashes`]).
    pub hashes: BlockHashes,
    pub prompt_len: usize,
    /// Leading tokens whose K/V is in `blocks`.
    pub computed: usize,
    /// Device slots; block `i` holds tokens `[i * block, (i + 1) * block)`.
    pub blocks: Vec<BlockId>,
    /// Leading blocks that are registered in the pool (computed here or taken from the cache).
    pub registered: usize,
    /// Whether the sequence holds blocks and takes part in steps.
    pub running: bool,
    /// When it was last admitted (larger = newer); preemption takes the newest of the lowest priority first.
    pub admitted_at: u64,
    /// Lower runs first ([`super::Request::priority`]).
    pub priority: i32,
    /// Times admitted (more than once after preemption).
    pub admissions: u32,
    /// Prompt tokens taken from cache at the first admission.
    pub cached_tokens: usize,
    pub sampler: Sampler,
    pub text: TextStream,
    pub out: String,
    pub max_new: usize,
    /// Keep the blocks when the sequence finishes (their KV is exported before they are released).
    pub keep_blocks: bool,
    /// Device blocks of the prompt held for the sequence until it is admitted (blocks pulled from another worker):
    /// nothing can evict them while it waits.
    pub pinned: Vec<BlockId>,
    /// Prompt tokens found cached when the sequence arrived: an estimate of what it will not compute.
    pub cached_hint: usize,
    /// Why the engine ended this sequence alone (it then also has a `finish`).
    pub failure: Option<Failure>,
    /// When nobody waits for the answer any more.
    pub deadline: Option<Instant>,
    pub ignore_eos: bool,
    /// Whether the output's text is made (otherwise only its token ids).
    pub detokenize: bool,
    pub finish: Option<FinishReason>,
    pub first_token: Option<Instant>,
    pub last_token: Option<Instant>,
    /// Each generated token's log-probabilities, when the request asked for them.
    pub logprobs: Vec<TokenLogprobs>,
    /// The prompt's log-probabilities computed so far (entry `i` for token `i + 1`), when the request asked.
    pub prompt_logprobs: Vec<TokenLogprobs>,
    /// The grammar the output must match, with what it has taken so far.
    pub grammar: Option<crate::grammar::Constrained>,
}

/// Why the engine ended one sequence on its own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Failure {
    /// Something went wrong with this sequence (what).
    Error(String),
    /// What the request asks cannot be done (what): another engine would refuse it too.
    Refused(String),
    /// Its deadline passed.
    Expired,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Error(why) | Failure::Refused(why) => f.write_str(why),
            Failure::Expired => f.write_str("the request's deadline passed"),
        }
    }
}

impl Seq {
    /// Its share of the next forward step: the `n` tokens after the computed ones.
    pub fn chunk(&self, n: usize) -> SeqChunk<'_> {
        let end = self.computed + n;
        // Rows whose next token is a prompt token score it, when the prompt's log-probabilities were asked for.
        let scored = self.sampler.params().prompt_logprobs().map(|top| {
            let targets = &self.tokens[(self.computed + 1).min(self.prompt_len)..(end + 1).min(self.prompt_len)];
            Scored { targets, top: top as usize }
        });
        SeqChunk {
            tokens: &self.tokens[self.computed..end],
            start: self.computed,
            blocks: &self.blocks,
            logits: end == self.tokens.len(),
            greedy: self.grammar.is_none() && self.sampler.takes_the_top(),
            scored: scored.filter(|s| !s.targets.is_empty()),
        }
    }

    /// How many leading blocks admission may take from the cache: all but the one holding the last token (its
    /// logits are needed), and none past the prompt's log-probabilities computed so far (a cached token has no
    /// logits to score the next one with).
    pub fn reusable_blocks(&self, block_tokens: usize) -> usize {
        let reusable = (self.tokens.len() - 1) / block_tokens;
        match self.sampler.params().prompt_logprobs() {
            Some(_) if self.prompt_logprobs.len() + 1 < self.prompt_len => {
                reusable.min(self.prompt_logprobs.len() / block_tokens)
            }
            _ => reusable,
        }
    }

    /// Takes from a step's scores (in batch order) those of its chunk of `n` tokens, before the chunk is counted
    /// as computed: as many as [`Seq::chunk`] gave it targets, kept for the rows not scored before (a sequence
    /// preempted and recomputed scores some rows again).
    pub fn take_scores(&mut self, n: usize, scores: &mut impl Iterator<Item = TokenLogprobs>) {
        let share = self.chunk(n).scored.map_or(0, |c| c.targets.len());
        for (row, lp) in (self.computed..).zip(scores.take(share)) {
            if row == self.prompt_logprobs.len() {
                self.prompt_logprobs.push(lp);
            }
        }
    }

    /// Hashes of at least the first `blocks` full blocks (slice them): computed once per block over the
    /// sequence's life, since its tokens only grow.
    pub fn hashes(&mut self, blocks: usize, block_size: BlockSize) -> &BlockHashes {
        let end = (blocks * block_size.tokens()).min(self.tokens.len());
        self.hashes.extend(&self.tokens[..end], block_size, self.namespace.as_ref());
        &self.hashes
    }

    /// Tokens still to compute before the next token can be sampled.
    pub fn remaining(&self) -> usize {
        self.tokens.len() - self.computed
    }

    pub fn active(&self) -> bool {
        self.finish.is_none()
    }

    /// Prompt tokens still to compute before the first token, for load reports: what is not cached of a sequence
    /// that has not started, what is left of one in prefill, nothing once it decodes.
    pub fn pending_prefill(&self) -> usize {
        match self.remaining() {
            0 | 1 => 0,
            n if !self.running && self.admissions == 0 => n.saturating_sub(self.cached_hint).max(1),
            n => n,
        }
    }

    /// Device blocks its prompt will hold that it does not hold yet: the whole prompt of one waiting to be
    /// admitted (less blocks pinned for it), the rest of one in prefill, nothing once it decodes (a decoding
    /// sequence's growth is not reserved ahead). With the blocks it holds, this is what a router counts for a
    /// request it sent, so a load report covering the request keeps counting its blocks.
    pub fn blocks_to_come(&self, block_tokens: usize) -> usize {
        if self.running && self.remaining() <= 1 {
            return 0;
        }
        self.tokens.len().div_ceil(block_tokens.max(1)).saturating_sub(self.blocks.len() + self.pinned.len())
    }

    /// The finished sequence as a caller sees it; `start` is when its request arrived. Consumes the sequence: its
    /// tokens become the prompt's ids without a copy (a long prompt's were copied once per request before).
    pub fn into_completion(self, start: Instant) -> Completion {
        let first = self.first_token.unwrap_or(start);
        let mut prompt_ids = self.tokens;
        let token_ids = prompt_ids.split_off(self.prompt_len);
        Completion {
            prompt_ids,
            token_ids,
            text: self.out,
            finish_reason: self.finish.unwrap_or(FinishReason::Cancelled),
            cached_tokens: self.cached_tokens,
            time_to_first_token: first.saturating_duration_since(start),
            decode_time: self.last_token.unwrap_or(first).saturating_duration_since(first),
            logprobs: self.logprobs,
            prompt_logprobs: self.prompt_logprobs,
        }
    }

    /// Appends a token sampled from the pass that ended at `now` (with its log-probabilities, when they were
    /// asked for), decides whether the sequence is done, and reports the text it makes.
    pub fn accept(
        &mut self,
        index: usize,
        token: u32,
        logprobs: Option<TokenLogprobs>,
        now: Instant,
        tokenizer: &Tokenizer,
        on_event: &mut impl FnMut(Event<'_>),
    ) {
        self.first_token.get_or_insert(now);
        self.last_token = Some(now);
        self.tokens.push(token);
        let generated = self.tokens.len() - self.prompt_len;
        // A stop token id ends the sequence even with `ignore_eos`, as in vLLM; neither is part of the text.
        let stop_token = self.sampler.params().logits().stop_token_ids.contains(&token);
        // Under a grammar, end-of-generation is only possible where the grammar is complete: it ends the output
        // even with `ignore_eos`.
        let eog = tokenizer.is_end_of_generation(token) && (!self.ignore_eos || self.grammar.is_some());
        let end_of_generation = stop_token || eog;
        let (mut text, stop_string) = if end_of_generation || !self.detokenize {
            (String::new(), false)
        } else {
            self.text.push(tokenizer, token)
        };
        if end_of_generation || stop_string {
            self.finish = Some(FinishReason::Stop);
        } else if generated >= self.max_new {
            self.finish = Some(FinishReason::Length);
        }
        if self.finish.is_some() && self.detokenize {
            // Text held back as a possible stop-string start is released, unless a stop string ended the sequence.
            text.push_str(&self.text.finish(stop_string));
        }
        self.out.push_str(&text);
        let has_logprobs = logprobs.is_some();
        self.logprobs.extend(logprobs);
        let logprobs = if has_logprobs { self.logprobs.last() } else { None };
        let prompt_logprobs = if generated == 1 { &self.prompt_logprobs[..] } else { &[] };
        on_event(Event::Token { seq: index, token, text: &text, logprobs, prompt_logprobs });
    }
}

/// Queues `seq` with its `tag` (kept index for index) behind every sequence of the same or a higher priority
/// (a lower value): the queue stays in priority order, first come first served within one. Returns its index.
pub(super) fn enqueue<T>(seqs: &mut Vec<Seq>, tags: &mut Vec<T>, seq: Seq, tag: T) -> usize {
    let at = seqs.partition_point(|s| s.priority <= seq.priority);
    seqs.insert(at, seq);
    tags.insert(at, tag);
    at
}

/// Removes the finished sequences from `seqs` together with their entries in `tags` (kept index for index), and
/// returns them. The others keep their order, priority first and then arrival ([`super::Stepper`] queues them so):
/// sequences are admitted and their decodes and prompt chunks planned in it.
pub(super) fn take_finished<T>(seqs: &mut Vec<Seq>, tags: &mut Vec<T>) -> Vec<(Seq, T)> {
    // Most steps finish nobody: nothing moves before the first finished sequence (a sequence is large, and
    // swapping each with itself copied every one of them at every step).
    let Some(first) = seqs.iter().position(|s| !s.active()) else { return Vec::new() };
    let mut kept = first;
    for i in first + 1..seqs.len() {
        if seqs[i].active() {
            seqs.swap(kept, i);
            tags.swap(kept, i);
            kept += 1;
        }
    }
    seqs.drain(kept..).zip(tags.drain(kept..)).collect()
}
