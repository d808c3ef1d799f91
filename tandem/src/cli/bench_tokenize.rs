//! `tandem bench tokenize`: how long the embedded model's tokenizer takes to encode a text, on one thread and on
//! several at once sharing the tokenizer (as a router's runtime threads do). By default the text is `bench
//! router`'s prompt, so its figures are the tokenizing part of the router's overhead.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// A text file to encode; `bench router`'s prompt of `--prompt-tokens` plain words when absent.
    #[arg(long, value_name = "PATH")]
    file: Option<PathBuf>,
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    /// Threads encoding at once, each level measured in turn.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    threads: Vec<usize>,
    /// Encodings per thread at each level.
    #[arg(long, default_value_t = 20_000)]
    iterations: usize,
}

pub fn run(args: Args) -> Result<ExitCode, String> {
    if args.threads.contains(&0) || args.iterations == 0 || args.prompt_tokens == 0 {
        return Err("--threads, --iterations and --prompt-tokens must be at least 1".into());
    }
    let model = super::fetch_default()?;
    let text_model = engine::text::TextModel::open(&model).map_err(|e| e.to_string())?;
    let tokenizer = text_model.tokenizer();
    let text = match &args.file {
        Some(path) => std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?,
        None => super::bench_router::bench_prompt(tokenizer, args.prompt_tokens).1,
    };
    let tokens = tokenizer.encode(&text).len();
    println!(
        "encoding {} bytes ({tokens} tokens), {} times per thread; microseconds per encoding",
        text.len(),
        args.iterations
    );
    println!("{:>8} {:>10} {:>10}", "threads", "mean", "tokens/s");
    for &threads in &args.threads {
        let started = Instant::now();
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| {
                    for _ in 0..args.iterations {
                        std::hint::black_box(tokenizer.encode(std::hint::black_box(&text)));
                    }
                });
            }
        });
        // Every thread ran the whole time: the wall time per encoding of one thread.
        let us = started.elapsed().as_secs_f64() * 1e6 / args.iterations as f64;
        let rate = (threads * tokens) as f64 / (us / 1e6);
        println!("{threads:>8} {us:>10.2} {rate:>10.0}");
    }
    Ok(ExitCode::SUCCESS)
}
