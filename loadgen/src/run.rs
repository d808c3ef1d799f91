//! Drives a workload against a target: prepares prompts ahead of their send time, sends each on schedule (or when
//! a concurrency slot frees up, or after its session's previous turn), collects one record per request, and
//! reads the target's mock-worker step overrun before and after.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::tokenizer::Tokenizer;
use tokio::sync::{Semaphore, mpsc};

use crate::client::{self, Ask, Outcome, Target};
use crate::prompt::PromptBuilder;
use crate::schedule::{Arrivals, Start, plan};
use crate::summary::{Record, RunFacts, Slo, Summary, summarize};
use crate::trace::TraceRequest;

/// Prompts prepared ahead of the dispatcher.
const LOOKAHEAD: usize = 256;

/// Tokens kept free for a chat template's own tokens when prompts are cut to fit the context.
const CHAT_TEMPLATE_ROOM: usize = 64;

/// One run.
#[derive(Clone, Debug)]
pub struct RunConfig {
    pub target: Target,
    pub requests: Vec<TraceRequest>,
    pub arrivals: Arrivals,
    /// Stop sending new requests after this long.
    pub duration: Option<Duration>,
    pub ignore_eos: bool,
    /// Prompts longer than this are cut to it (and counted).
    pub max_isl: Option<usize>,
    /// The server's context: a prompt is also cut so that it and its output fit (with room for a chat
    /// template's tokens on the chat endpoint).
    pub context: Option<usize>,
    pub slo: Slo,
    /// Seeds each request's sampling (request i gets seed + i), so reruns ask for the same outputs.
    pub seed: u64,
    pub progress: bool,
}

/// What the workload needs of the tokenizer: word tokens and decoding.
#[derive(Clone, Debug)]
pub struct Text {
    pub builder: PromptBuilder,
    pub tokenizer: Arc<Tokenizer>,
}

struct Job {
    index: usize,
    prompt: String,
    prompt_len: usize,
    clipped: bool,
}

struct Shared {
    config: RunConfig,
    text: Text,
    start: Instant,
    deadline: Option<Instant>,
    followers: HashMap<usize, (usize, f64)>,
    slots: Option<Arc<Semaphore>>,
    records: mpsc::UnboundedSender<Record>,
}

impl Shared {
    fn job(&self, index: usize) -> Job {
        let r = &self.config.requests[index];
        let template = match self.config.target.endpoint {
            client::Endpoint::Chat => CHAT_TEMPLATE_ROOM,
            client::Endpoint::Completions => 0,
        };
        let fit = self.config.context.map(|c| c.saturating_sub(r.output_length + template).max(1));
        let limit = match (self.config.max_isl, fit) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let p = self.text.builder.prompt(r, index, limit);
        // A literal prompt goes as it was written, unless it had to be cut.
        let prompt = match r.literal.as_ref().filter(|_| !p.clipped) {
            Some(l) => l.text.clone(),
            None => self.text.tokenizer.decode(&p.tokens),
        };
        Job { index, prompt_len: p.tokens.len(), prompt, clipped: p.clipped }
    }

    fn ms(&self, at: Instant) -> f64 {
        at.saturating_duration_since(self.start).as_secs_f64() * 1000.0
    }

    fn past_deadline(&self) -> bool {
        self.deadline.is_some_and(|d| Instant::now() >= d)
    }
}

/// Runs the workload; returns every record (in index order) and the summary.
pub async fn run(config: RunConfig, text: Text) -> Result<(Vec<Record>, Summary), String> {
    let starts = plan(&config.requests, &config.arrivals);
    let followers: HashMap<usize, (usize, f64)> = starts
        .iter()
        .enumerate()
        .filter_map(|(i, s)| match *s {
            Start::After { prev, delay_ms } => Some((prev, (i, delay_ms))),
            _ => None,
        })
        .collect();
    let overrun_before = crate::overrun::read(&config.target).await;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let slots = match config.arrivals {
        Arrivals::Concurrency(c) => Some(Arc::new(Semaphore::new(c.max(1)))),
        _ => None,
    };
    let start = Instant::now();
    let shared = Arc::new(Shared {
        deadline: config.duration.map(|d| start + d),
        config,
        text,
        start,
        followers,
        slots,
        records: tx,
    });
    let total = shared.config.requests.len();
    let bar = progress_bar(shared.config.progress, total);
    // Prompts for the requests that start on their own, built in order ahead of time on a thread of their own.
    let (job_tx, mut job_rx) = mpsc::channel::<Job>(LOOKAHEAD);
    let independent: Vec<(usize, Start)> =
        starts.iter().copied().enumerate().filter(|(_, s)| !matches!(s, Start::After { .. })).collect();
    let builder = Arc::clone(&shared);
    let indices: Vec<usize> = independent.iter().map(|(i, _)| *i).collect();
    std::thread::spawn(move || {
        for i in indices {
            if job_tx.blocking_send(builder.job(i)).is_err() {
                return;
            }
        }
    });
    let dispatcher = {
        let shared = Arc::clone(&shared);
        tokio::spawn(async move {
            for (_, s) in independent {
                let Some(job) = job_rx.recv().await else { return };
                if shared.past_deadline() {
                    return;
                }
                let scheduled = match s {
                    Start::At(ms) => {
                        let due = shared.start + Duration::from_secs_f64(ms / 1000.0);
                        tokio::time::sleep_until(due.into()).await;
                        due
                    }
                    _ => Instant::now(),
                };
                let permit = match &shared.slots {
                    Some(s) => Arc::clone(s).acquire_owned().await.ok(),
                    None => None,
                };
                if shared.past_deadline() {
                    return;
                }
                let scheduled = if permit.is_some() { Instant::now() } else { scheduled };
                tokio::spawn(request(Arc::clone(&shared), job, scheduled, permit));
            }
        })
    };
    let _ = dispatcher.await;
    let (target, slo, closed_loop) =
        (shared.config.target.clone(), shared.config.slo, shared.config.arrivals.closed_loop());
    let gaps = mean_gap(&starts);
    // Every sender of records is a request task holding `shared`: the channel ends when the last one does.
    drop(shared);
    let mut records = Vec::with_capacity(total);
    while let Some(r) = rx.recv().await {
        bar.inc(1);
        records.push(r);
    }
    bar.finish_and_clear();
    records.sort_by_key(|r| r.index);
    let first = records.iter().map(|r| r.sent_ms).fold(f64::INFINITY, f64::min);
    let last = records.iter().map(|r| r.sent_ms + r.request_latency_ms).fold(0.0, f64::max);
    // Before the first load report (a cluster just started) there is nothing to subtract.
    let overrun = crate::overrun::read(&target)
        .await
        .and_then(|after| crate::overrun::p99_between(&overrun_before.unwrap_or_default(), &after));
    let facts = RunFacts {
        duration_s: if records.is_empty() { 0.0 } else { (last - first).max(0.0) / 1000.0 },
        closed_loop,
        step_overrun_p99: overrun,
        mean_arrival_gap_ms: gaps,
    };
    let summary = summarize(&records, slo, &facts);
    Ok((records, summary))
}

/// The mean gap between timed starts, when there are at least two.
fn mean_gap(starts: &[Start]) -> Option<f64> {
    let times: Vec<f64> = starts.iter().filter_map(|s| if let Start::At(t) = s { Some(*t) } else { None }).collect();
    let first = times.iter().copied().reduce(f64::min)?;
    let last = times.iter().copied().reduce(f64::max)?;
    (times.len() > 1).then(|| (last - first) / (times.len() - 1) as f64)
}

/// Sends one request, records it, and starts its session's next turn (after the turn's delay).
fn request(
    shared: Arc<Shared>,
    mut job: Job,
    scheduled: Instant,
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
    Box::pin(async move {
        let r = &shared.config.requests[job.index];
        let ask = Ask {
            prompt: std::mem::take(&mut job.prompt),
            max_tokens: r.output_length,
            ignore_eos: shared.config.ignore_eos,
            seed: shared.config.seed.wrapping_add(job.index as u64),
            priority: r.priority,
        };
        let sent = Instant::now();
        let outcome = client::send(&shared.config.target, &ask).await;
        drop(permit);
        let record = record(&shared, &job, scheduled, sent, outcome);
        let _ = shared.records.send(record);
        if let Some(&(next, delay_ms)) = shared.followers.get(&job.index) {
            let shared = Arc::clone(&shared);
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_secs_f64(delay_ms / 1000.0)).await;
                if shared.past_deadline() {
                    return;
                }
                let permit = match &shared.slots {
                    Some(s) => Arc::clone(s).acquire_owned().await.ok(),
                    None => None,
                };
                let scheduled = Instant::now();
                let builder = Arc::clone(&shared);
                let Ok(job) = tokio::task::spawn_blocking(move || builder.job(next)).await else { return };
                request(shared, job, scheduled, permit).await;
            });
        }
    })
}

fn record(shared: &Shared, job: &Job, scheduled: Instant, sent: Instant, o: Outcome) -> Record {
    let ttft = o.chunk_ms.first().copied();
    let output_tokens = o.completion_tokens.unwrap_or(o.chunk_ms.len() as u64);
    let latency = o.end_ms;
    Record {
        index: job.index,
        scheduled_ms: shared.ms(scheduled),
        sent_ms: shared.ms(sent),
        status: o.status,
        error: o.error.clone(),
        time_to_first_token_ms: ttft,
        request_latency_ms: latency,
        time_per_output_token_ms: ttft
            .filter(|_| output_tokens > 1)
            .map(|t| (latency - t) / (output_tokens - 1) as f64),
        output_tokens,
        prompt_tokens: o.prompt_tokens.unwrap_or(job.prompt_len as u64),
        cached_tokens: o.cached_tokens.unwrap_or(0),
        input_length: shared.config.requests[job.index].input_length,
        clipped: job.clipped,
        finish_reason: o.finish_reason.clone(),
        inter_chunk_ms: o.chunk_ms.windows(2).map(|w| w[1] - w[0]).collect(),
    }
}

fn progress_bar(show: bool, total: usize) -> indicatif::ProgressBar {
    if !show {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(total as u64);
    if let Ok(style) = indicatif::ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} requests") {
        bar.set_style(style);
    }
    bar
}
