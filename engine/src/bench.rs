//! Engine throughput measurements, shared by `tandem bench engine` and anything else that wants the figures.
//!
//! Prefill: one prompt of `prompt_tokens` computed in one step. Decode: `batch` sequences with
//! `decode_prompt_tokens`-token prompts, then `decode_tokens` steps in which every sequence adds one greedy token
//! (end-of-generation ignored, as llama.cpp's benches do), timed from the first decode step to the last.

use std::time::Instant;

use serde::Serialize;

use crate::forward::{ForwardError, SeqChunk};
use crate::kv::{BlockId, KvLayout, KvStore};
use crate::model::Model;
use crate::sampling::argmax;
use crate::team::Team;

/// What to measure.
#[derive(Clone, Debug)]
pub struct BenchSpec {
    pub prompt_tokens: usize,
    pub decode_prompt_tokens: usize,
    pub decode_tokens: usize,
    pub batches: Vec<usize>,
}

impl Default for BenchSpec {
    /// The shapes llama.cpp's `llama-bench -p 512` and `llama-batched-bench -npp 128 -ntg 128 -npl 1,4,16` use.
    fn default() -> Self {
        BenchSpec { prompt_tokens: 512, decode_prompt_tokens: 128, decode_tokens: 128, batches: vec![1, 4, 16] }
    }
}

/// Decode throughput at one batch size.
#[derive(Clone, Debug, Serialize)]
pub struct DecodeFigure {
    pub batch: usize,
    /// Tokens per second over all sequences together.
    pub tokens_per_s: f64,
}

/// The figures of one run.
#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    pub threads: usize,
    pub prefill_tokens: usize,
    pub prefill_tokens_per_s: f64,
    pub decode: Vec<DecodeFigure>,
}

/// Deterministic prompt ids spread over the vocabulary (past the special tokens).
fn prompt(len: usize, salt: usize, vocab: usize) -> Vec<u32> {
    (0..len).map(|i| prompt_token(i, salt, vocab)).collect()
}

/// Token `i` of [`prompt`]`(_, salt, vocab)` (the parity steps use the same ids).
pub(crate) fn prompt_token(i: usize, salt: usize, vocab: usize) -> u32 {
    (100 + (i * 7919 + salt * 104_729) % (vocab - 100)) as u32
}

/// Runs the measurements on `team`'s threads.
pub fn run(model: &Model, team: &Team, spec: &BenchSpec) -> Result<BenchReport, ForwardError> {
    let layout = KvLayout::for_model(&model.config, 16);
    let mut forward = |kv: &mut KvStore, chunks: &[SeqChunk<'_>]| {
        Ok(model.forward(team, kv, chunks)?.iter().map(|l| argmax(l)).collect())
    };
    let (prefill_tokens_per_s, decode) = measure(layout, model.config.n_vocab, spec, Warm::Small, &mut forward)?;
    Ok(BenchReport { threads: team.threads(), prefill_tokens: spec.prompt_tokens, prefill_tokens_per_s, decode })
}

/// The same measurements through any backend (the CUDA one: each step ends with its next tokens on the host, so a
/// step's time is its whole time). The chunks are greedy ([`SeqChunk::greedy`]), as the engine's own are for
/// greedy requests: a backend that can answers with the top token and keeps the logits where they are. Each timed
/// shape runs once untimed first: a GPU backend's first step of a shape grows its buffers, lets cuBLAS choose its
/// kernels, or records the step as a graph.
pub fn run_backend(backend: &mut dyn crate::backend::Backend, spec: &BenchSpec) -> Result<BenchReport, ForwardError> {
    let layout = backend.kv_layout(16);
    let vocab = backend.vocab();
    let threads = backend.threads();
    let mut forward = |kv: &mut KvStore, chunks: &[SeqChunk<'_>]| -> Result<Vec<u32>, ForwardError> {
        let context = crate::backend::StepContext { started: Instant::now(), onboarded: [0, 0] };
        let next = backend.forward(kv, chunks, context)?;
        next.into_iter()
            .map(|n| match n {
                crate::backend::Next::Logits(l) => Ok(argmax(&l)),
                crate::backend::Next::Token(t) => Ok(t),
                crate::backend::Next::Draw(_) => Err(ForwardError::Device("this backend computes no logits".into())),
            })
            .collect()
    };
    let (prefill_tokens_per_s, decode) = measure(layout, vocab, spec, Warm::EachShape, &mut forward)?;
    Ok(BenchReport { threads, prefill_tokens: spec.prompt_tokens, prefill_tokens_per_s, decode })
}

/// One forward step: the top token per chunk that asked for its next token.
type Forward<'a> = dyn FnMut(&mut KvStore, &[SeqChunk<'_>]) -> Result<Vec<u32>, ForwardError> + 'a;

/// What runs untimed before the timed steps.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Warm {
    /// A short prompt, touching the weights and the KV pages once (the CPU engine).
    Small,
    /// Also the timed prompt's whole shape, and the first decode step of each batch.
    EachShape,
}

/// Prefill tokens/s and the decode figures, stepping with `forward`.
fn measure(
    layout: KvLayout,
    vocab: usize,
    spec: &BenchSpec,
    warm_up: Warm,
    forward: &mut Forward<'_>,
) -> Result<(f64, Vec<DecodeFigure>), ForwardError> {
    let max_batch = spec.batches.iter().copied().max().unwrap_or(1);
    let per_seq = (spec.decode_prompt_tokens + spec.decode_tokens).max(spec.prompt_tokens).div_ceil(16) + 1;
    let mut kv = KvStore::new(layout, per_seq * max_batch);
    let tables: Vec<Vec<BlockId>> =
        (0..max_batch).map(|s| (0..per_seq).map(|b| BlockId((s * per_seq + b) as u32)).collect()).collect();

    // Warm-up touches the weights and the KV pages once.
    let warm = prompt(spec.prompt_tokens.min(64), 0, vocab);
    forward(
        &mut kv,
        &[SeqChunk { tokens: &warm, start: 0, blocks: &tables[0], logits: true, greedy: true, scored: None }],
    )?;

    let long = prompt(spec.prompt_tokens, 1, vocab);
    if warm_up == Warm::EachShape {
        forward(
            &mut kv,
            &[SeqChunk { tokens: &long, start: 0, blocks: &tables[0], logits: true, greedy: true, scored: None }],
        )?;
    }
    let t = Instant::now();
    forward(
        &mut kv,
        &[SeqChunk { tokens: &long, start: 0, blocks: &tables[0], logits: true, greedy: true, scored: None }],
    )?;
    let prefill_tokens_per_s = spec.prompt_tokens as f64 / t.elapsed().as_secs_f64();

    let mut decode = Vec::new();
    for &batch in &spec.batches {
        let prompts: Vec<Vec<u32>> = (0..batch).map(|s| prompt(spec.decode_prompt_tokens, s + 2, vocab)).collect();
        let chunks: Vec<SeqChunk<'_>> = prompts
            .iter()
            .zip(&tables)
            .map(|(p, blocks)| SeqChunk { tokens: p, start: 0, blocks, logits: true, greedy: true, scored: None })
            .collect();
        let mut next = forward(&mut kv, &chunks)?;
        // With `Warm::EachShape` the first decode step is not timed.
        let untimed = usize::from(warm_up == Warm::EachShape);
        let mut t = Instant::now();
        for step in 0..untimed + spec.decode_tokens {
            if step == untimed {
                t = Instant::now();
            }
            let tokens: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
            let chunks: Vec<SeqChunk<'_>> = tokens
                .iter()
                .zip(&tables)
                .map(|(tok, blocks)| SeqChunk {
                    tokens: tok,
                    start: spec.decode_prompt_tokens + step,
                    blocks,
                    logits: true,
                    greedy: true,
                    scored: None,
                })
                .collect();
            next = forward(&mut kv, &chunks)?;
        }
        let secs = t.elapsed().as_secs_f64();
        decode.push(DecodeFigure { batch, tokens_per_s: (batch * spec.decode_tokens) as f64 / secs });
    }
    Ok((prefill_tokens_per_s, decode))
}

/// Decode throughput of `sequences` requests run together through the engine's scheduler.
#[derive(Clone, Debug, Serialize)]
pub struct ConcurrencyFigure {
    pub sequences: usize,
    /// Tokens per second over all sequences, from the moment every sequence has its first token to the end.
    pub decode_tokens_per_s: f64,
    /// From the start of the run until every sequence had its first token (all prompts prefilled).
    pub all_first_tokens_ms: f64,
}

/// Runs `sequences` greedy requests (prompt `prompt_tokens`, `decode_tokens` each, end-of-generation ignored)
/// through [`Engine::run`](crate::generate::Engine::run) and times the decode phase.
pub fn concurrency(
    engine: &mut crate::generate::Engine,
    sequences: usize,
    prompt_tokens: usize,
    decode_tokens: usize,
) -> Result<ConcurrencyFigure, crate::generate::EngineError> {
    use crate::generate::{Event, Request};
    use crate::sampling::{RawSampling, SamplingParams};
    let vocab = engine.vocab();
    let raw = RawSampling { max_tokens: decode_tokens as u32, ignore_eos: true, ..RawSampling::default() };
    let sampling = SamplingParams::new(raw).map_err(|e| crate::generate::EngineError::Config(e.to_string()))?;
    let requests: Vec<Request> =
        (0..sequences).map(|s| Request::new(prompt(prompt_tokens, 1000 + s, vocab), sampling.clone())).collect();
    let mut first: Vec<Option<Instant>> = vec![None; sequences];
    let mut stamps: Vec<Instant> = Vec::with_capacity(sequences * decode_tokens);
    let start = Instant::now();
    engine.run(&requests, &std::sync::atomic::AtomicBool::new(false), |Event::Token { seq, .. }| {
        let now = Instant::now();
        first[seq].get_or_insert(now);
        stamps.push(now);
    })?;
    let end = Instant::now();
    let all_first = first.iter().flatten().max().copied().unwrap_or(end);
    // Tokens made once every sequence was decoding.
    let decode = stamps.iter().filter(|&&t| t > all_first).count();
    Ok(ConcurrencyFigure {
        sequences,
        decode_tokens_per_s: decode as f64 / end.duration_since(all_first).as_secs_f64().max(1e-9),
        all_first_tokens_ms: all_first.duration_since(start).as_secs_f64() * 1000.0,
    })
}

/// Shapes for fitting a timing profile: prompt chunks of `prefill_tokens` new tokens after `contexts` cached
/// ones, decode steps of `batches` sequences at `decode_contexts` tokens each, and mixed steps (a prompt chunk
/// with a decode batch).
#[derive(Clone, Debug)]
pub struct ShapeGrid {
    pub prefill_tokens: Vec<usize>,
    pub contexts: Vec<usize>,
    pub batches: Vec<usize>,
    pub decode_contexts: Vec<usize>,
    pub mixed_prefill: Vec<usize>,
    pub mixed_batches: Vec<usize>,
    /// Timed runs per shape; the median is kept.
    pub reps: usize,
}

impl Default for ShapeGrid {
    fn default() -> Self {
        // Sized so that the whole grid runs in a few minutes on two cores (prefill is ~130 tokens/s there).
        ShapeGrid {
            prefill_tokens: vec![16, 48, 96, 192, 384, 768],
            contexts: vec![0, 256, 1024],
            batches: vec![1, 2, 4, 8, 12, 16],
            decode_contexts: vec![64, 320, 960],
            mixed_prefill: vec![32, 96, 256],
            mixed_batches: vec![2, 6, 12],
            reps: 3,
        }
    }
}

/// Times one forward step per shape of `grid` (after untimed steps that fill the cached context), on `team`'s
/// threads.
pub fn measure_steps(
    model: &Model,
    team: &Team,
    grid: &ShapeGrid,
) -> Result<Vec<crate::backend::fit::Sample>, ForwardError> {
    use crate::backend::fit::Sample;
    use crate::backend::mock::MockBackend;
    let vocab = model.config.n_vocab;
    let longest = [&grid.prefill_tokens, &grid.contexts, &grid.decode_contexts, &grid.mixed_prefill]
        .iter()
        .map(|v| v.iter().copied().max().unwrap_or(0))
        .sum::<usize>()
        + grid.reps
        + 16;
    let seqs = grid.batches.iter().chain(&grid.mixed_batches).copied().max().unwrap_or(1) + 1;
    let per_seq = longest.div_ceil(16);
    let mut kv = KvStore::new(KvLayout::for_model(&model.config, 16), per_seq * seqs);
    let tables: Vec<Vec<BlockId>> =
        (0..seqs).map(|s| (0..per_seq).map(|b| BlockId((s * per_seq + b) as u32)).collect()).collect();
    // Fills `len` tokens of context for sequence `s` (untimed, in chunks the size real prefill would use).
    let fill = |kv: &mut KvStore, s: usize, len: usize| -> Result<(), ForwardError> {
        let p = prompt(len, s + 11, vocab);
        for (i, c) in p.chunks(512).enumerate() {
            model.forward(
                team,
                kv,
                &[SeqChunk {
                    tokens: c,
                    start: i * 512,
                    blocks: &tables[s],
                    logits: false,
                    greedy: false,
                    scored: None,
                }],
            )?;
        }
        Ok(())
    };
    let timed = |kv: &mut KvStore, prefill: Option<(usize, usize)>, decode: (usize, usize)| {
        let (b, ctx) = decode;
        let mut times = Vec::new();
        let mut shape = crate::backend::StepShape::default();
        for rep in 0..grid.reps {
            let chunk_tokens = prefill.map(|(t, _)| prompt(t, rep + 3, vocab));
            let singles: Vec<[u32; 1]> = (0..b).map(|i| [(100 + i * 31 + rep) as u32]).collect();
            let mut batch: Vec<SeqChunk<'_>> = Vec::new();
            if let (Some((_, c)), Some(tokens)) = (prefill, &chunk_tokens) {
                batch.push(SeqChunk {
                    tokens,
                    start: c,
                    blocks: &tables[seqs - 1],
                    logits: true,
                    greedy: false,
                    scored: None,
                });
            }
            for (i, one) in singles.iter().enumerate() {
                batch.push(SeqChunk {
                    tokens: one,
                    start: ctx + rep,
                    blocks: &tables[i],
                    logits: true,
                    greedy: false,
                    scored: None,
                });
            }
            shape = MockBackend::shape(&batch, [0, 0], 0);
            let t = Instant::now();
            model.forward(team, kv, &batch)?;
            times.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        times.sort_by(f64::total_cmp);
        Ok::<Sample, ForwardError>(Sample::of(&shape, times[times.len() / 2]))
    };
    let mut out = Vec::new();
    // Warm-up touches the weights and the KV pages once.
    fill(&mut kv, seqs - 1, 64)?;
    for &c in &grid.contexts {
        fill(&mut kv, seqs - 1, c)?;
        for &t in &grid.prefill_tokens {
            out.push(timed(&mut kv, Some((t, c)), (0, 0))?);
        }
    }
    for &ctx in &grid.decode_contexts {
        for s in 0..seqs - 1 {
            fill(&mut kv, s, ctx)?;
        }
        for &b in &grid.batches {
            out.push(timed(&mut kv, None, (b, ctx))?);
        }
        if ctx == grid.decode_contexts[grid.decode_contexts.len() / 2] {
            for &t in &grid.mixed_prefill {
                for &b in &grid.mixed_batches {
                    out.push(timed(&mut kv, Some((t, 0)), (b, ctx))?);
                }
            }
        }
    }
    Ok(out)
}
