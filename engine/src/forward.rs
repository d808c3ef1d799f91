//! The forward pass on CPU over the paged KV cache.
//!
//! A batch is a list of sequence chunks, each with its own positions and block table. Token-wise work (norms,
//! projections, MLP) runs on all chunks' tokens stacked together; attention runs per sequence and head, and
//! always reads K and V back from the cache in their storage dtype, so a token's result does not depend on what
//! shares its batch or how its prompt was chunked.

use crate::columns;
use crate::kernels::{
    TILE_COLS, TILE_ROWS, dequantize_row, dot, dot_quantized, dot_tile, f16_to_f32, scaled_dots, scaled_dots_f16,
    weighted_rows, weighted_rows_f16,
};
use crate::kv::{BlockId, KvPart, KvStore};
use crate::model::{Matrix, Model};
use crate::q8::{self, Q8Rows};
use crate::sampling::TokenLogprobs;
use crate::team::Team;

/// How matmuls over quantized weights compute.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// f32 activations against dequantized weights: what the golden tests hold to [`LOGIT_TOLERANCE`].
    #[default]
    Reference,
    /// Matmuls over Q4_1/Q8_0 weights quantize the activations to 8 bits per 32-value block and dot them with the
    /// weights in integers ([`crate::q8`], as llama.cpp computes quantized matmuls): up to four activation rows
    /// (decode) with AVX2 or AVX-512 VNNI; more (prompts, large batches) in VNNI's 4 × 4 tiles where the CPU has
    /// AVX-512 VNNI, in AVX2 tiles of one weight row by four activation rows where it has AVX2 alone, and as in
    /// the reference without either. Faster in docs/performance.md's runs, within a measured tolerance of the reference
    /// (`tests/precision.rs`); a sequence's logits depend on how many share its step, as in llama.cpp and vLLM:
    /// the batch-invariance guarantees are the reference precision's.
    Fast,
}

impl std::str::FromStr for Precision {
    type Err = String;

    fn from_str(s: &str) -> Result<Precision, String> {
        match s {
            "reference" => Ok(Precision::Reference),
            "fast" => Ok(Precision::Fast),
            other => Err(format!("unknown precision {other:?}: expected `fast` or `reference`")),
        }
    }
}

/// One sequence's share of a forward step.
#[derive(Clone, Copy, Debug)]
pub struct SeqChunk<'a> {
    /// The new tokens, at positions `start..start + tokens.len()`.
    pub tokens: &'a [u32],
    /// Number of this sequence's tokens already in the cache.
    pub start: usize,
    /// The sequence's block table; it must cover every position up to the chunk's last.
    pub blocks: &'a [BlockId],
    /// Whether to return logits for the chunk's last token.
    pub logits: bool,
    /// Whether its caller takes only the largest of those logits (the lowest index among equal ones: a greedy
    /// sampler with no rule over the logits, no grammar and no log-probabilities): a backend may answer with that
    /// token ([`crate::backend::Next::Token`]) instead of the whole vocabulary's logits, so that a GPU does not
    /// copy them out.
    pub greedy: bool,
    /// Prompt log-probabilities to report from this chunk's rows (`None`: none).
    pub scored: Option<Scored<'a>>,
}

/// What a chunk's rows score: row `i` (the token at `start + i`) predicts `targets[i]`, the prompt token after it,
/// for as many rows as there are targets (a prompt's last token predicts no prompt token: its logits are the next
/// token's, [`SeqChunk::logits`]). Each scored row is reported as a [`TokenLogprobs`] of its target, with `top`
/// alternatives.
#[derive(Clone, Copy, Debug)]
pub struct Scored<'a> {
    pub targets: &'a [u32],
    pub top: usize,
}

/// Why a forward step was refused (before any compute).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ForwardError {
    #[error("token id {0} is outside the vocabulary")]
    TokenOutOfRange(u32),
    #[error("position {0} is beyond the model's context of {1} tokens")]
    PastContext(usize, usize),
    #[error("the block table holds {have} blocks, {need} are needed")]
    BlockTableShort { have: usize, need: usize },
    #[error("block {0} is outside the KV store")]
    BlockOutOfRange(u32),
    #[error("a chunk of {rows} tokens cannot score {targets} prompt tokens")]
    Targets { targets: usize, rows: usize },
    /// The backend computes no prompt log-probabilities (it is named).
    #[error("the {0} backend does not compute prompt log-probabilities")]
    NoPromptScores(&'static str),
    /// The device computing the step failed (a GPU backend's driver or library error).
    #[error("{0}")]
    Device(String),
}

/// The first of `tokens` that is not an id of a `vocab`-token vocabulary. The common answer, none, takes one pass
/// that vectorizes (the largest id); only a list holding a bad id is searched for the first.
pub fn first_out_of_vocab(tokens: &[u32], vocab: usize) -> Option<u32> {
    let largest = tokens.iter().copied().max()?;
    if (largest as usize) < vocab {
        return None;
    }
    tokens.iter().copied().find(|&t| t as usize >= vocab)
}

/// What a step checks of one chunk before any compute, whatever computes it: token ids in the vocabulary,
/// positions within the context, a block table covering them, blocks inside the store.
pub fn check_chunk(kv: &KvStore, s: &SeqChunk<'_>, vocab: usize, context: usize) -> Result<(), ForwardError> {
    if let Some(t) = first_out_of_vocab(s.tokens, vocab) {
        return Err(ForwardError::TokenOutOfRange(t));
    }
    if let Some(scored) = &s.scored {
        if scored.targets.len() > s.tokens.len() {
            return Err(ForwardError::Targets { targets: scored.targets.len(), rows: s.tokens.len() });
        }
        if let Some(t) = first_out_of_vocab(scored.targets, vocab) {
            return Err(ForwardError::TokenOutOfRange(t));
        }
    }
    check_placement(kv, s, context)
}

/// [`check_chunk`] but for the token ids: where the chunk goes (positions within the context, a block table
/// covering them, blocks inside the store), for a chunk whose ids are known to be in the vocabulary.
pub fn check_placement(kv: &KvStore, s: &SeqChunk<'_>, context: usize) -> Result<(), ForwardError> {
    let bt = kv.layout().block_tokens;
    let end = s.start + s.tokens.len();
    if end > context {
        return Err(ForwardError::PastContext(end - 1, context));
    }
    let need = end.div_ceil(bt);
    if s.blocks.len() < need {
        return Err(ForwardError::BlockTableShort { have: s.blocks.len(), need });
    }
    // The blocks this chunk writes; those before it were checked when their own chunk ran (or came from the pool,
    // whose slots are the store's), so a decode step checks one block per sequence, not its whole table.
    let first = (s.start / bt).min(need);
    if let Some(b) = s.blocks[first..need].iter().find(|b| b.0 as usize >= kv.capacity()) {
        return Err(ForwardError::BlockOutOfRange(b.0));
    }
    Ok(())
}

/// How far this engine's logits may be from the float64 reference (`scripts/reference/golden.py`): f32
/// activations over dequantized weights and an f16 KV cache. Measured worst case on the golden prompts: see
/// `tests/golden.rs`. Greedy tokens are comparable wherever the reference's top-1 margin exceeds twice this.
pub const LOGIT_TOLERANCE: f32 = 0.05;

/// Up to this many activation rows, matmuls dequantize weights in registers instead of through a buffer.
const FUSED_MAX_ROWS: usize = 2;

/// Up to this many activation rows, the fast precision computes in 8 bits ([`crate::q8`]) on every CPU with a
/// kernel for it; more where [`q8::tiles_any_rows`] (AVX2 without VNNI) or VNNI's tiles take them.
const FAST_MAX_ROWS: usize = q8::PAIRED_MAX_ROWS;

/// Activation rows in 8 bits taken together against a part's weight rows (about 20 KiB at the model's width of
/// 576, kept in L1 while the part's rows pass over them).
const Q8_TOKEN_BLOCK: usize = 32;

/// Rows of weights dequantized together (72 KiB of f32 at the model's width of 576: they stay in L2), so each
/// activation row is read from memory once per group rather than once per row.
const ROW_GROUP: usize = 32;

/// Activation rows taken together against a group's weight rows: 18 KiB at width 576, kept in L1 while every
/// row of the group passes over them.
const TOKEN_BLOCK: usize = 8;

/// Prompt rows whose logits are computed at once for their log-probabilities: 6 MiB of logits.
const SCORED_ROWS: usize = 32;

impl Model {
    /// Runs one step on `team`'s threads: writes the chunks' K and V into `kv` and returns the last-token logits of
    /// every chunk that asked for them, in batch order. The results do not depend on the team's size.
    pub fn forward(
        &self,
        team: &Team,
        kv: &mut KvStore,
        batch: &[SeqChunk<'_>],
    ) -> Result<Vec<Vec<f32>>, ForwardError> {
        self.forward_scored(team, kv, batch, &mut Vec::new())
    }

    /// [`forward`](Self::forward), also appending to `scores` the log-probabilities of the rows the chunks score
    /// ([`SeqChunk::scored`]), in batch order and row order within a chunk.
    pub fn forward_scored(
        &self,
        team: &Team,
        kv: &mut KvStore,
        batch: &[SeqChunk<'_>],
        scores: &mut Vec<TokenLogprobs>,
    ) -> Result<Vec<Vec<f32>>, ForwardError> {
        self.check(kv, batch)?;
        let c = &self.config;
        let n: usize = batch.iter().map(|s| s.tokens.len()).sum();
        let (d, kvd) = (c.n_embd, c.kv_dim());
        let mut x = vec![0f32; n * d];
        for (row, &tok) in x.chunks_exact_mut(d).zip(batch.iter().flat_map(|s| s.tokens)) {
            dequantize_row(self.token_embd.ty, self.token_embd.row(tok as usize), row);
        }
        let positions: Vec<usize> = batch.iter().flat_map(|s| s.start..s.start + s.tokens.len()).collect();
        let (mut h, mut q, mut k, mut v) =
            (vec![0f32; n * d], vec![0f32; n * d], vec![0f32; n * kvd], vec![0f32; n * kvd]);
        let (mut attn, mut tmp) = (vec![0f32; n * d], vec![0f32; n * d]);
        let (mut gate, mut up) = (vec![0f32; n * c.n_ff], vec![0f32; n * c.n_ff]);
        let mut scratch = Scratch { team, precision: self.precision, q8: Q8Rows::default() };
        let scratch = &mut scratch;
        for (l, layer) in self.layers.iter().enumerate() {
            rms_norm(&x, &layer.attn_norm, c.rms_eps, &mut h);
            matmuls(&mut [(&layer.wq, &mut q), (&layer.wk, &mut k), (&layer.wv, &mut v)], &h, n, scratch);
            self.rope(&mut q, &positions, c.n_heads);
            self.rope(&mut k, &positions, c.n_kv_heads);
            write_kv(kv, batch, l, &k, &v, c.n_kv_heads, c.head_dim);
            self.attention(team, kv, batch, l, &q, &mut attn);
            matmul(&layer.wo, &attn, n, &mut tmp, scratch);
            add(&mut x, &tmp);
            rms_norm(&x, &layer.ffn_norm, c.rms_eps, &mut h);
            matmuls(&mut [(&layer.w_gate, &mut gate), (&layer.w_up, &mut up)], &h, n, scratch);
            for (g, u) in gate.iter_mut().zip(&up) {
                *g = *g / (1.0 + (-*g).exp()) * u;
            }
            matmul(&layer.w_down, &gate, n, &mut tmp, scratch);
            add(&mut x, &tmp);
        }
        self.score_rows(&x, batch, scores, scratch);
        // Logits only for the last token of the chunks that asked.
        let mut last = Vec::new();
        let mut end = 0;
        for s in batch {
            end += s.tokens.len();
            if s.logits {
                last.extend_from_slice(&x[(end - 1) * d..end * d]);
            }
        }
        let m = last.len() / d;
        let mut normed = vec![0f32; m * d];
        rms_norm(&last, &self.output_norm, c.rms_eps, &mut normed);
        let mut logits = vec![0f32; m * c.n_vocab];
        matmul(&self.output, &normed, m, &mut logits, scratch);
        Ok(logits.chunks_exact(c.n_vocab).map(<[f32]>::to_vec).collect())
    }

    /// The scored rows' log-probabilities from the last layer's output `x`, their logits computed
    /// [`SCORED_ROWS`] rows at a time (a 2,048-token prompt's whole logits would take 400 MB).
    fn score_rows(
        &self,
        x: &[f32],
        batch: &[SeqChunk<'_>],
        scores: &mut Vec<TokenLogprobs>,
        scratch: &mut Scratch<'_>,
    ) {
        let c = &self.config;
        let d = c.n_embd;
        // (row of `x`, target, alternatives) for every scored row.
        let mut rows = Vec::new();
        let mut first = 0;
        for s in batch {
            if let Some(scored) = &s.scored {
                rows.extend(scored.targets.iter().enumerate().map(|(i, &t)| (first + i, t, scored.top)));
            }
            first += s.tokens.len();
        }
        let mut picked = vec![0f32; SCORED_ROWS.min(rows.len()) * d];
        let mut normed = vec![0f32; picked.len()];
        let mut logits = vec![0f32; SCORED_ROWS.min(rows.len()) * c.n_vocab];
        for group in rows.chunks(SCORED_ROWS) {
            let m = group.len();
            for (to, &(row, _, _)) in picked.chunks_exact_mut(d).zip(group) {
                to.copy_from_slice(&x[row * d..(row + 1) * d]);
            }
            rms_norm(&picked[..m * d], &self.output_norm, c.rms_eps, &mut normed[..m * d]);
            matmul(&self.output, &normed[..m * d], m, &mut logits[..m * c.n_vocab], scratch);
            // Each row's log-softmax over the vocabulary, on the team's threads (a pass of `exp` per row).
            let logits = &logits;
            scores.extend(scratch.team.map(m, |i| {
                let (_, target, top) = group[i];
                TokenLogprobs::of(&logits[i * c.n_vocab..(i + 1) * c.n_vocab], target, top)
            }));
        }
    }

    fn check(&self, kv: &KvStore, batch: &[SeqChunk<'_>]) -> Result<(), ForwardError> {
        batch.iter().try_for_each(|s| self.check_chunk(kv, s))
    }

    /// What [`forward`](Self::forward) checks of one chunk before any compute (see [`check_chunk`]).
    pub fn check_chunk(&self, kv: &KvStore, s: &SeqChunk<'_>) -> Result<(), ForwardError> {
        check_chunk(kv, s, self.config.n_vocab, self.config.context_len)
    }

    /// Rotates adjacent pairs `(2i, 2i+1)` of every head (GGML's normal rope for `llama`, whose Q/K weights are
    /// stored permuted for it).
    fn rope(&self, x: &mut [f32], positions: &[usize], heads: usize) {
        let hd = self.config.head_dim;
        let pairs = hd / 2;
        for (row, &pos) in x.chunks_exact_mut(heads * hd).zip(positions) {
            let table = &self.rope[pos * pairs..(pos + 1) * pairs];
            for head in row.chunks_exact_mut(hd) {
                for (pair, &[cos, sin]) in head.chunks_exact_mut(2).zip(table) {
                    let (a, b) = (pair[0], pair[1]);
                    pair[0] = a * cos - b * sin;
                    pair[1] = a * sin + b * cos;
                }
            }
        }
    }

    /// Causal attention of every chunk token over its sequence's cached K/V; `out` is `n × n_embd`.
    fn attention(&self, team: &Team, kv: &KvStore, batch: &[SeqChunk<'_>], layer: usize, q: &[f32], out: &mut [f32]) {
        let c = &self.config;
        let (hd, d) = (c.head_dim, c.n_embd);
        let group = c.n_heads / c.n_kv_heads;
        let mut offsets = Vec::with_capacity(batch.len());
        let mut off = 0;
        for s in batch {
            offsets.push(off);
            off += s.tokens.len();
        }
        // Decode chunks: a task per KV head and sequence, or per query head where that would leave the team too few
        // tasks to share evenly (a single sequence's three KV heads on two threads).
        let per_task = if batch.len() * c.n_kv_heads < 4 * team.threads() { 1 } else { group };
        let mut tasks = Vec::new();
        for (seq, chunk) in batch.iter().enumerate() {
            let n = chunk.tokens.len();
            if n == 0 {
                continue;
            }
            if n <= DIRECT_MAX_TOKENS {
                tasks.extend((0..c.n_heads).step_by(per_task).map(|h| AttentionTask {
                    seq,
                    heads: h..h + per_task,
                    tokens: 0..n,
                }));
                continue;
            }
            // The last query tokens see the most keys: their tasks come first, and the short ones fill in at the end.
            for t0 in (0..n).step_by(ATTENTION_TOKENS).rev() {
                let tokens = t0..(t0 + ATTENTION_TOKENS).min(n);
                tasks.extend((0..c.n_kv_heads).map(|g| AttentionTask {
                    seq,
                    heads: g * group..(g + 1) * group,
                    tokens: tokens.clone(),
                }));
            }
        }
        let results = team.map(tasks.len(), |i| {
            let task = &tasks[i];
            let base = offsets[task.seq];
            attend(kv, &batch[task.seq], layer, task, group, |h, t| &q[(base + t) * d + h * hd..][..hd])
        });
        for (task, res) in tasks.iter().zip(results) {
            for (h, per_head) in task.heads.clone().zip(res.chunks_exact(task.tokens.len() * hd)) {
                for (t, o) in task.tokens.clone().zip(per_head.chunks_exact(hd)) {
                    out[(offsets[task.seq] + t) * d + h * hd..][..hd].copy_from_slice(o);
                }
            }
        }
    }
}

/// Chunks of up to this many tokens (decode) read K and V where the cache stores them, in f16; longer ones (prompts)
/// convert their K and V to f32 once per task for the query heads that share them (grouped-query attention), in
/// tasks of up to [`ATTENTION_TOKENS`] query tokens. Every score and every sum is the same either way, bit for bit.
const DIRECT_MAX_TOKENS: usize = 4;

/// Query tokens of a prompt in one attention task.
const ATTENTION_TOKENS: usize = 64;

/// Some query heads of one KV head, for some of a chunk's tokens.
struct AttentionTask {
    seq: usize,
    heads: std::ops::Range<usize>,
    tokens: std::ops::Range<usize>,
}

/// A task's outputs, `heads × tokens × head_dim`: each of its query heads for each of its tokens, over the
/// sequence's cached K and V up to that token. `query(h, t)` is head `h`'s query for chunk token `t`.
fn attend<'q>(
    kv: &KvStore,
    chunk: &SeqChunk<'_>,
    layer: usize,
    task: &AttentionTask,
    group: usize,
    query: impl Fn(usize, usize) -> &'q [f32],
) -> Vec<f32> {
    let layout = kv.layout();
    let (hd, bt) = (layout.head_dim, layout.block_tokens);
    let kv_head = task.heads.start / group;
    let len = chunk.start + task.tokens.end;
    let blocks = &chunk.blocks[..len.div_ceil(bt)];
    let scale = 1.0 / (hd as f32).sqrt();
    let mut scores = vec![0f32; len];
    let mut out = vec![0f32; task.heads.len() * task.tokens.len() * hd];
    let mut outs = out.chunks_exact_mut(hd);
    let queries = task.heads.clone().flat_map(|h| task.tokens.clone().map(move |t| (h, t)));
    if task.tokens.len() <= DIRECT_MAX_TOKENS {
        let head = |b: BlockId, part| kv.head(b, layer, part, kv_head);
        for ((h, t), o) in queries.zip(&mut outs) {
            let visible = chunk.start + t + 1;
            // Block `i` holds positions `i * bt..`; the last one visible may be partly written.
            let parts = blocks.iter().enumerate().map(|(i, &b)| (b, i * bt)).take_while(|&(_, first)| first < visible);
            for (b, first) in parts.clone() {
                let rows = bt.min(visible - first);
                scaled_dots_f16(query(h, t), &head(b, KvPart::K)[..rows * hd], hd, scale, &mut scores[first..][..rows]);
            }
            let sum = softmax_weights(&mut scores[..visible]);
            for (b, first) in parts {
                let rows = bt.min(visible - first);
                weighted_rows_f16(o, &scores[first..][..rows], sum, &head(b, KvPart::V)[..rows * hd]);
            }
        }
        return out;
    }
    let mut keys = vec![0f32; blocks.len() * bt * hd];
    let mut values = vec![0f32; blocks.len() * bt * hd];
    for (i, &b) in blocks.iter().enumerate() {
        f16_to_f32(kv.head(b, layer, KvPart::K, kv_head), &mut keys[i * bt * hd..(i + 1) * bt * hd]);
        f16_to_f32(kv.head(b, layer, KvPart::V, kv_head), &mut values[i * bt * hd..(i + 1) * bt * hd]);
    }
    for ((h, t), o) in queries.zip(&mut outs) {
        let visible = chunk.start + t + 1;
        scaled_dots(query(h, t), &keys[..visible * hd], hd, scale, &mut scores[..visible]);
        let sum = softmax_weights(&mut scores[..visible]);
        weighted_rows(o, &scores[..visible], sum, &values[..visible * hd]);
    }
    out
}

/// Attention's weights from its scores, in place: `exp(score - max)`, unnormalized; returns their sum.
fn softmax_weights(scores: &mut [f32]) -> f32 {
    let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
    let mut sum = 0f32;
    for s in scores {
        *s = (*s - max).exp();
        sum += *s;
    }
    sum
}

/// Stores every chunk token's K and V (all KV heads) at its position.
fn write_kv(kv: &mut KvStore, batch: &[SeqChunk<'_>], layer: usize, k: &[f32], v: &[f32], heads: usize, hd: usize) {
    let bt = kv.layout().block_tokens;
    let mut row = 0;
    for s in batch {
        for pos in s.start..s.start + s.tokens.len() {
            let (block, slot) = (s.blocks[pos / bt], pos % bt);
            for h in 0..heads {
                let at = row * heads * hd + h * hd;
                kv.write(block, layer, KvPart::K, h, slot, &k[at..at + hd]);
                kv.write(block, layer, KvPart::V, h, slot, &v[at..at + hd]);
            }
            row += 1;
        }
    }
}

/// RMSNorm of every row of `x` (sum of squares accumulated in f64, as llama.cpp does).
fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ss: f64 = xr.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        let scale = (1.0 / (ss / d as f64 + f64::from(eps)).sqrt()) as f32;
        for ((o, &v), &w) in or.iter_mut().zip(xr).zip(weight) {
            *o = v * scale * w;
        }
    }
}

fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// A forward pass's threads, the precision its matmuls compute in, and buffers reused across them.
struct Scratch<'t> {
    team: &'t Team,
    precision: Precision,
    /// The activation rows in 8 bits ([`Precision::Fast`]).
    q8: Q8Rows,
}

/// `out[t][r] = w[r] · x[t]` for `n` activation rows. Parallel over weight rows, each task writing its rows'
/// values in place ([`columns`]); every element is one [`dot`] of a dequantized row and an activation row, whatever
/// `n` is (in [`Precision::Fast`], one integer dot of the weight row and the quantized activation row).
fn matmul(w: &Matrix, x: &[f32], n: usize, out: &mut [f32], scratch: &mut Scratch<'_>) {
    matmuls(&mut [(w, out)], x, n, scratch);
}

/// [`matmul`] of every `(w, out)` pair over the same `x`, in one parallel region (and, in the fast precision, one
/// quantization of `x`) where they compute the same way; each element as [`matmul`] computes it.
fn matmuls(jobs: &mut [(&Matrix, &mut [f32])], x: &[f32], n: usize, scratch: &mut Scratch<'_>) {
    if n == 0 || jobs.is_empty() {
        return;
    }
    let cols = jobs[0].0.cols;
    let kernel = Kernel::of(jobs[0].0, n, scratch.precision);
    if jobs.iter().any(|(w, _)| w.cols != cols || Kernel::of(w, n, scratch.precision) != kernel) {
        for (w, out) in jobs.iter_mut() {
            matmuls(&mut [(*w, &mut **out)], x, n, scratch);
        }
        return;
    }
    let team = scratch.team;
    let tasks = team.threads() * 4;
    let ws: Vec<&Matrix> = jobs.iter().map(|(w, _)| *w).collect();
    let mut outs: Vec<columns::Output<'_>> = jobs
        .iter_mut()
        .map(|(w, out)| columns::Output {
            out,
            rows: w.rows,
            per_task: w.rows.div_ceil(tasks).next_multiple_of(ROW_GROUP).max(ROW_GROUP),
        })
        .collect();
    let xq = &mut scratch.q8;
    match kernel {
        #[cfg(target_arch = "x86_64")]
        Kernel::Vnni => {
            xq.quantize(&x[..n * cols], cols);
            let xq = &*xq;
            columns::par_rows_each(team, &mut outs, n, |i, part| {
                q8::vnni::matmul_rows(ws[i].ty, |r| ws[i].row(r), part, xq, n)
            });
        }
        Kernel::Q8 => {
            xq.quantize(&x[..n * cols], cols);
            // The activation rows' views, made once rather than per weight row.
            let xs: Vec<q8::Q8Row<'_>> = (0..n).map(|t| xq.row(t)).collect();
            columns::par_rows_each(team, &mut outs, n, |i, part| {
                let w = ws[i];
                // Activation rows in blocks that stay in L1 while every weight row of the part passes over them.
                for (b, block) in xs.chunks(Q8_TOKEN_BLOCK).enumerate() {
                    for r in 0..part.len() {
                        let t0 = b * Q8_TOKEN_BLOCK;
                        q8::dot_rows(w.ty, w.row(part.first() + r), block, |t, v| part.set(r, t0 + t, v));
                    }
                }
            });
        }
        Kernel::F32 => columns::par_rows_each(team, &mut outs, n, |i, part| f32_part(ws[i], x, n, part)),
    }
}

/// How a matmul computes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kernel {
    /// [`Precision::Fast`] over AVX-512 VNNI's tiles (more than [`FAST_MAX_ROWS`] rows).
    #[cfg(target_arch = "x86_64")]
    Vnni,
    /// [`Precision::Fast`] through [`q8::dot_rows`].
    Q8,
    /// f32 activations against dequantized weights (the reference precision, and types without an integer dot).
    F32,
}

impl Kernel {
    fn of(w: &Matrix, n: usize, precision: Precision) -> Kernel {
        let cols = w.cols;
        if precision != Precision::Fast {
            return Kernel::F32;
        }
        #[cfg(target_arch = "x86_64")]
        if n > FAST_MAX_ROWS && q8::vnni::supported(w.ty, cols) && q8::vnni::available() {
            return Kernel::Vnni;
        }
        if q8::supported(w.ty, cols) && (n <= FAST_MAX_ROWS || q8::tiles_any_rows()) {
            return Kernel::Q8;
        }
        Kernel::F32
    }
}

/// One part of an f32 matmul ([`Kernel::F32`]).
fn f32_part(w: &Matrix, x: &[f32], n: usize, part: &columns::Part<'_>) {
    let cols = w.cols;
    let (r0, nr) = (part.first(), part.len());
    // Few activation rows: dequantize in registers (bit-identical to the buffered path below).
    if n <= FUSED_MAX_ROWS && dot_quantized(w.ty, w.row(r0), &x[..cols]).is_some() {
        for r in 0..nr {
            let row = w.row(r0 + r);
            for (t, xt) in x.chunks_exact(cols).take(n).enumerate() {
                part.set(r, t, dot_quantized(w.ty, row, xt).unwrap_or_default());
            }
        }
        return;
    }
    let mut wbuf = vec![0f32; ROW_GROUP * cols];
    for g0 in (0..nr).step_by(ROW_GROUP) {
        let gn = ROW_GROUP.min(nr - g0);
        for k in 0..gn {
            dequantize_row(w.ty, w.row(r0 + g0 + k), &mut wbuf[k * cols..(k + 1) * cols]);
        }
        let w = |k: usize| &wbuf[k * cols..(k + 1) * cols];
        let xt = |t: usize| &x[t * cols..(t + 1) * cols];
        for t0 in (0..n).step_by(TOKEN_BLOCK) {
            let tn = TOKEN_BLOCK.min(n - t0);
            // Tiles of rows × activation rows where they fit, single dots for the rest: either way every element
            // is the same `dot`, bit for bit.
            let (tiled_rows, tiled_end) = (gn / TILE_ROWS * TILE_ROWS, t0 + tn / TILE_COLS * TILE_COLS);
            for k in (0..tiled_rows).step_by(TILE_ROWS) {
                for t in (t0..tiled_end).step_by(TILE_COLS) {
                    let tile = dot_tile([w(k), w(k + 1)], [xt(t), xt(t + 1), xt(t + 2), xt(t + 3)]);
                    for (r, row) in tile.iter().enumerate() {
                        for (c, &v) in row.iter().enumerate() {
                            part.set(g0 + k + r, t + c, v);
                        }
                    }
                }
            }
            for k in 0..gn {
                for t in t0..t0 + tn {
                    if k >= tiled_rows || t >= tiled_end {
                        part.set(g0 + k, t, dot(w(k), xt(t)));
                    }
                }
            }
        }
    }
}
