//! `tandem generate`: one prompt, streamed to stdout.

use std::io::Write;
use std::num::NonZeroUsize;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use engine::chat::ChatMessage;
use engine::generate::{Completion, Engine, EngineConfig, Event, Request};
use engine::sampling::{RawSampling, SamplingParams};
use serde::Serialize;

use super::{ModelArgs, display};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Treat PROMPT as a user message and apply the model's chat template.
    #[arg(long)]
    chat: bool,
    /// System message for --chat (the template's default when absent).
    #[arg(long, requires = "chat")]
    system: Option<String>,
    #[arg(long, default_value_t = 256)]
    max_tokens: u32,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temperature: f32,
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    top_p: f32,
    /// Sample among the k most likely tokens; 0 is no limit, as in the API.
    #[arg(long)]
    top_k: Option<u32>,
    /// Leave out tokens less likely than this fraction of the most likely one (after temperature); 0 is off.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    min_p: f32,
    #[arg(long)]
    seed: Option<u64>,
    /// Stop when this text appears (repeatable).
    #[arg(long = "stop")]
    stop: Vec<String>,
    /// Tokens of the prompt computed per step (chunked prefill).
    #[arg(long)]
    prefill_chunk: Option<NonZeroUsize>,
    /// Report each token's log-probability and this many most likely alternatives (0-20; in --json's output).
    #[arg(long, requires = "json")]
    logprobs: Option<u32>,
    /// Report each prompt token's log-probability (from the second on) and this many most likely alternatives
    /// (0-20; in --json's output, as `prompt_logprobs`): the prompt is scored, as vLLM's `prompt_logprobs` does.
    #[arg(long, requires = "json")]
    prompt_logprobs: Option<u32>,
    /// Print one JSON object at the end instead of streaming text.
    #[arg(long)]
    json: bool,
    prompt: String,
}

#[derive(Serialize)]
struct JsonOut<'a> {
    prompt_ids: &'a [u32],
    token_ids: &'a [u32],
    text: &'a str,
    finish_reason: &'static str,
    ttft_ms: f64,
    decode_tokens_per_s: Option<f64>,
    /// Per token: its log-probability and the alternatives as `[id, logprob]`, most likely first.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    logprobs: Vec<JsonLogprobs>,
    /// Per prompt token from the second on, the same.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    prompt_logprobs: Vec<JsonLogprobs>,
}

#[derive(Serialize)]
struct JsonLogprobs {
    logprob: f32,
    /// 1 for the most likely token (ties counted against it).
    rank: u32,
    top: Vec<(u32, f32)>,
}

impl From<&engine::sampling::TokenLogprobs> for JsonLogprobs {
    fn from(l: &engine::sampling::TokenLogprobs) -> JsonLogprobs {
        JsonLogprobs { logprob: l.logprob, rank: l.rank, top: l.top.clone() }
    }
}

pub fn run(args: Args) -> Result<ExitCode, String> {
    let sampling = SamplingParams::new(RawSampling {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k.filter(|&k| k > 0),
        min_p: args.min_p,
        seed: args.seed,
        max_tokens: args.max_tokens,
        stop: args.stop.clone(),
        ignore_eos: false,
        detokenize: true,
        logprobs: args.logprobs,
        prompt_logprobs: args.prompt_logprobs,
        ..RawSampling::default()
    })
    .map_err(|e| e.to_string())?;
    let path = args.model.path()?;
    let config = EngineConfig {
        backend: args.model.device.into(),
        threads: args.model.threads,
        precision: args.model.precision,
        prefill_chunk: args.prefill_chunk,
        ..EngineConfig::default()
    };
    let engine = Engine::open(&path, config).map_err(|e| e.to_string())?;
    let text = if args.chat {
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(ChatMessage::new("system", system.clone()));
        }
        messages.push(ChatMessage::new("user", args.prompt.clone()));
        engine.render_chat(&messages).map_err(|e| e.to_string())?
    } else {
        args.prompt.clone()
    };
    let prompt = engine.tokenizer().encode_prompt(&text, args.chat, None);
    let request = Request::new(prompt, sampling);
    let cancel = Arc::new(AtomicBool::new(false));
    let completion = run_cancellable(engine, request, Arc::clone(&cancel), !args.json)
        .map_err(|e| format!("{e} (model {})", display(&path)))?;
    if args.json {
        print_json(&completion).map_err(|e| e.to_string())?;
    } else {
        println!();
    }
    Ok(if cancel.load(Ordering::Relaxed) { ExitCode::from(130) } else { ExitCode::SUCCESS })
}

/// Runs generation on its own thread while this one waits for Ctrl-C, which stops it after the current step.
fn run_cancellable(
    mut engine: Engine,
    request: Request,
    cancel: Arc<AtomicBool>,
    stream: bool,
) -> Result<Completion, String> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_io().build().map_err(|e| e.to_string())?;
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    let flag = Arc::clone(&cancel);
    let worker = std::thread::spawn(move || {
        let mut stdout = std::io::stdout();
        let result = engine.run(std::slice::from_ref(&request), &flag, |Event::Token { text, .. }| {
            if stream && !text.is_empty() {
                // A closed stdout (say, `| head`) only ends the output, not the run.
                let _ = stdout.write_all(text.as_bytes());
                let _ = stdout.flush();
            }
        });
        let _ = done_tx.send(());
        result
    });
    runtime.block_on(async {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => cancel.store(true, Ordering::Relaxed),
            _ = done_rx => {}
        }
    });
    let result = worker.join().map_err(|_| "the generation thread panicked".to_string())?;
    let mut completions = result.map_err(|e| e.to_string())?;
    completions.pop().ok_or_else(|| "no completion".to_string())
}

fn print_json(c: &Completion) -> serde_json::Result<()> {
    let decoded = c.token_ids.len().saturating_sub(1);
    let secs = c.decode_time.as_secs_f64();
    let out = JsonOut {
        prompt_ids: &c.prompt_ids,
        token_ids: &c.token_ids,
        text: &c.text,
        finish_reason: c.finish_reason.as_str(),
        ttft_ms: c.time_to_first_token.as_secs_f64() * 1000.0,
        decode_tokens_per_s: (decoded > 0 && secs > 0.0).then(|| decoded as f64 / secs),
        logprobs: c.logprobs.iter().map(JsonLogprobs::from).collect(),
        prompt_logprobs: c.prompt_logprobs.iter().map(JsonLogprobs::from).collect(),
    };
    println!("{}", serde_json::to_string(&out)?);
    Ok(())
}
