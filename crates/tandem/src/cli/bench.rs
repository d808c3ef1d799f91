//! `tandem bench engine`: prefill and decode throughput.

use std::num::NonZeroUsize;
use std::process::ExitCode;

use engine::bench::{self, BenchSpec};
use engine::model::Model;

use super::{ModelArgs, display};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    /// Prompt length of each sequence in the decode measurement.
    #[arg(long, default_value_t = 128)]
    decode_prompt_tokens: usize,
    /// Tokens each sequence generates in the decode measurement.
    #[arg(long, default_value_t = 128)]
    decode_tokens: usize,
    /// Batch sizes for the decode measurement.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    batches: Vec<NonZeroUsize>,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<ExitCode, String> {
    let path = args.model.path()?;
    let model = Model::open(&path).map_err(|e| e.to_string())?;
    let threads = args.model.threads.map_or(0, NonZeroUsize::get);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().map_err(|e| e.to_string())?;
    let spec = BenchSpec {
        prompt_tokens: args.prompt_tokens,
        decode_prompt_tokens: args.decode_prompt_tokens,
        decode_tokens: args.decode_tokens,
        batches: args.batches.iter().map(|b| b.get()).collect(),
    };
    let report = pool.install(|| bench::run(&model, &spec)).map_err(|e| format!("{e} (model {})", display(&path)))?;
    if args.json {
        println!("{}", serde_json::to_string(&report).map_err(|e| e.to_string())?);
    } else {
        println!("threads            {}", report.threads);
        println!("prefill pp{:<6}    {:8.1} tokens/s", report.prefill_tokens, report.prefill_tokens_per_s);
        for d in &report.decode {
            println!("decode batch {:<3}   {:8.1} tokens/s", d.batch, d.tokens_per_s);
        }
    }
    Ok(ExitCode::SUCCESS)
}
