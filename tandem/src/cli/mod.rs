//! Command-line parsing and dispatch.

mod bench;
mod bench_import;
mod bench_leases;
mod bench_router;
mod bench_tokenize;
mod certs;
mod chart;
mod generate;
mod parity;
mod probe;
mod serve;
mod sim;
mod sim_charts;
mod tune;
mod up;
mod workload;

use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Tandem: disaggregated LLM serving with KV-aware routing.
#[derive(Debug, Parser)]
#[command(name = "tandem", version, about)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start a local cluster (router, prefill and decode workers) on the embedded model until Ctrl-C.
    Up(Box<up::Args>),
    /// Run the router in front of running workers until SIGINT or SIGTERM.
    Router(Box<router::cli::Args>),
    /// Manage the embedded default model.
    Model {
        #[command(subcommand)]
        command: ModelCommand,
    },
    /// Generate text from a prompt, streamed to stdout.
    Generate(generate::Args),
    /// Measure performance.
    Bench {
        #[command(subcommand)]
        command: BenchCommand,
    },
    /// Run a worker (prefill, decode or both) until SIGINT or SIGTERM.
    Worker(Box<worker::cli::Args>),
    /// Replay a trace through a simulated cluster in virtual time, once per routing policy (seconds, not hours).
    Sim(Box<sim::Args>),
    /// Search the router's settings (and the prefill/decode split) in the simulator on the start of a trace,
    /// report the best on the rest against the defaults and round robin, and write or apply its TOML table.
    Tune(Box<tune::Args>),
    /// Exit 0 when an HTTP GET of URL answers 2xx (container health checks and probes).
    Probe(probe::Args),
    /// Certificates for mutual TLS between components.
    Certs {
        #[command(subcommand)]
        command: CertsCommand,
    },
}

#[derive(Debug, Subcommand)]
enum CertsCommand {
    /// Write a development CA and a certificate per component (for a local or test cluster, not production).
    Init(certs::Args),
}

#[derive(Debug, Subcommand)]
enum ModelCommand {
    /// Download and verify the embedded model (SmolLM2-135M-Instruct, Q4_1) into $TANDEM_HOME.
    Fetch,
    /// Print the default model's path (fetching it when missing).
    Path,
    /// Write the model's tokenizer as a Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json),
    /// for tools that load one (aiperf, vLLM's benchmarks).
    Tokenizer {
        /// Directory to write (made if missing).
        dir: PathBuf,
        /// A GGUF model file; the embedded model when absent.
        #[arg(long, value_name = "PATH")]
        model: Option<PathBuf>,
    },
    /// Write a Hugging Face tokenizer directory (tokenizer.json, and tokenizer_config.json for the special tokens
    /// and the chat template) as a vocabulary-only GGUF: what a router fronting vLLM or SGLang servers of that
    /// model reads its tokenizer and template from (`--model`). Byte-level BPE vocabularies whose pre-tokenizer
    /// Tandem implements (GPT-2's, Llama 3's, Qwen 2's and 3.5's, DeepSeek V3's, Mistral's Tekken, Kimi K2's,
    /// Seed-Coder's); others are refused by name. A directory with Mistral's tekken.json is read from that (the file
    /// mistral_common and vLLM's `--tokenizer-mode mistral` encode with), whether or not a tokenizer.json converted
    /// from it is beside it; Kimi K2's from its tiktoken.model, with the tokenizer_config.json that names its
    /// tokenizer (tokenization_kimi) and special tokens.
    Vocab {
        /// The tokenizer directory (a model's Hugging Face directory will do).
        dir: PathBuf,
        /// File to write.
        #[arg(long, value_name = "PATH")]
        out: PathBuf,
        /// A Jinja chat template file to use instead of the directory's (its chat_template.jinja, else
        /// tokenizer_config.json's), for a directory without one, as DeepSeek V4's.
        #[arg(long, value_name = "FILE")]
        chat_template: Option<PathBuf>,
    },
    /// Write a GGUF model as a Hugging Face model directory (config.json, model.safetensors in f16, tokenizer
    /// files), for transformers and PyTorch to run the same weights (the GPU check's PyTorch baseline).
    Export {
        /// Directory to write (made if missing).
        #[arg(long, value_name = "DIR")]
        safetensors: PathBuf,
        /// A GGUF model file; the embedded model when absent.
        #[arg(long, value_name = "PATH")]
        model: Option<PathBuf>,
    },
    /// Compare a backend's logits with the CPU engine's reference mode on fixed steps (whole and chunked
    /// prefills, batched decodes, a mixed batch): `--write FILE` computes the reference here (CPU), `--check FILE`
    /// recomputes on `--device` and prints each step's largest absolute and relative logit error and whether the
    /// top token agrees; it fails when an error passes `--max-rel` or a top token differs.
    Parity {
        /// A GGUF model file (a synthetic one on a machine without the real model).
        #[arg(long, value_name = "PATH")]
        model: PathBuf,
        /// Write the CPU reference logits to this file.
        #[arg(long, value_name = "FILE", conflicts_with = "check")]
        write: Option<PathBuf>,
        /// Compare with the reference logits in this file.
        #[arg(long, value_name = "FILE")]
        check: Option<PathBuf>,
        /// Where the compared logits are computed.
        #[arg(long, default_value = "cpu", value_name = "cpu|cuda[:N]")]
        device: engine::backend::Device,
        /// Largest logit error allowed, relative to the step's largest reference logit.
        #[arg(long, default_value_t = 0.02)]
        max_rel: f32,
    },
    /// Write a synthetic model: the embedded model's shapes, tensor types and tokenizer layout with
    /// deterministic pseudo-random weights, the same bytes on every machine for a seed. For checking kernels
    /// where the real model cannot travel (the GPU check script makes its own); its outputs mean nothing.
    Synth {
        /// The weights' seed.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// File to write.
        #[arg(long, value_name = "PATH", default_value = "synth.gguf")]
        out: PathBuf,
    },
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Prefill and decode throughput of the CPU engine.
    Engine(bench::Args),
    /// KV block transfer throughput on one host: QUIC (mutual TLS) and shared memory against plain TCP.
    Transfer(bench::TransferArgs),
    /// Replay a trace or a synthetic workload against an OpenAI-compatible server, measured from the client.
    Serve(Box<serve::Args>),
    /// What the router adds to the time to the first token: a zero-time mock worker, directly and through a router.
    Router(bench_router::Args),
    /// Whether a prefill's latency grows with the KV leases its worker holds: one CPU prefill worker, leases piling up.
    Leases(bench_leases::Args),
    /// How long the embedded tokenizer takes to encode a text, on one thread and on several at once.
    Tokenize(bench_tokenize::Args),
}

/// Options shared by the commands that run the model.
#[derive(Debug, clap::Args)]
struct ModelArgs {
    /// A GGUF model file; the embedded SmolLM2 model when absent (fetched when missing).
    #[arg(long, value_name = "PATH")]
    model: Option<PathBuf>,
    /// Compute threads (default: all cores).
    #[arg(long)]
    threads: Option<NonZeroUsize>,
    /// How matmuls over quantized weights compute: `reference` (f32 activations, what the golden tests check) or
    /// `fast` (8-bit activations and integer dot products, as llama.cpp; slightly less exact).
    #[arg(long, default_value = "reference", value_name = "fast|reference")]
    precision: engine::forward::Precision,
    /// Where the model computes: `cpu`, or `cuda[:N]` (the CUDA backend, in a build with `--features cuda`;
    /// checked against the CPU engine on an H100, not yet fast: docs/cuda.md).
    #[arg(long, default_value = "cpu", value_name = "cpu|cuda[:N]")]
    device: engine::backend::Device,
}

impl ModelArgs {
    fn path(&self) -> Result<PathBuf, String> {
        model_or_default(self.model.clone())
    }
}

fn fetch_default() -> Result<PathBuf, String> {
    engine::fetch::ensure_default_model(&crate::progress::Bar::new()).map_err(|e| e.to_string())
}

/// `model` when given, else the embedded model (fetched when missing).
fn model_or_default(model: Option<PathBuf>) -> Result<PathBuf, String> {
    model.map_or_else(fetch_default, Ok)
}

/// Runs a parsed command line.
pub fn run(cli: Cli) -> Result<ExitCode, String> {
    match cli.command {
        Command::Model { command: ModelCommand::Fetch } => {
            let path = fetch_default()?;
            println!("{}", path.display());
            Ok(ExitCode::SUCCESS)
        }
        Command::Model { command: ModelCommand::Tokenizer { dir, model } } => {
            let path = model_or_default(model)?;
            let file = engine::gguf::GgufFile::open(&path).map_err(|e| format!("{}: {e}", display(&path)))?;
            let (tokenizer, config) =
                engine::tokenizer::export::hugging_face_files(&file).map_err(|e| e.to_string())?;
            std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", display(&dir)))?;
            for (name, value) in [("tokenizer.json", tokenizer), ("tokenizer_config.json", config)] {
                let out = dir.join(name);
                std::fs::write(&out, value.to_string()).map_err(|e| format!("{}: {e}", display(&out)))?;
            }
            println!("{}", dir.display());
            Ok(ExitCode::SUCCESS)
        }
        Command::Model { command: ModelCommand::Vocab { dir, out, chat_template } } => {
            let read = |name: &str| -> Result<Option<serde_json::Value>, String> {
                let path = dir.join(name);
                match std::fs::read_to_string(&path) {
                    Ok(text) => serde_json::from_str(&text).map(Some).map_err(|e| format!("{}: {e}", display(&path))),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                    Err(e) => Err(format!("{}: {e}", display(&path))),
                }
            };
            let mut config = read("tokenizer_config.json")?;
            // The template file transformers writes beside the others, and reads before tokenizer_config.json's.
            let beside = dir.join("chat_template.jinja");
            if let Some(path) = chat_template.as_ref().or(Some(&beside).filter(|p| p.exists())) {
                let template = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", display(path)))?;
                config.get_or_insert_with(|| serde_json::json!({}))["chat_template"] = template.into();
            }
            // Kimi K2's tiktoken file: its ranks in text, its tokenizer named by tokenizer_config.json.
            let tiktoken = dir.join("tiktoken.model");
            let tiktoken = match std::fs::read_to_string(&tiktoken) {
                Ok(text) => Some(text),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => return Err(format!("{}: {e}", display(&tiktoken))),
            };
            let gguf = match (read("tekken.json")?, read("tokenizer.json")?, tiktoken) {
                (Some(tekken), ..) => engine::tokenizer::tekken::vocabulary_gguf(&tekken, config.as_ref()),
                (None, Some(tokenizer), _) => engine::tokenizer::import::vocabulary_gguf(&tokenizer, config.as_ref()),
                (None, None, Some(model)) => {
                    let config = config.as_ref().ok_or_else(|| {
                        format!("{}: a tiktoken.model without the tokenizer_config.json that names it", display(&dir))
                    })?;
                    engine::tokenizer::tiktoken::vocabulary_gguf(&model, config)
                }
                (None, None, None) => {
                    return Err(format!("{}: no tokenizer.json, tekken.json or tiktoken.model", display(&dir)));
                }
            }
            .map_err(|e| format!("{}: {e}", display(&dir)))?;
            gguf.write(&out).map_err(|e| format!("{}: {e}", display(&out)))?;
            // What was written is what the router will read.
            let file = engine::gguf::GgufFile::open(&out).map_err(|e| format!("{}: {e}", display(&out)))?;
            let text = engine::text::TextModel::from_gguf(&file).map_err(|e| format!("{}: {e}", display(&out)))?;
            println!("{} ({} tokens)", out.display(), text.tokenizer().vocab_size());
            Ok(ExitCode::SUCCESS)
        }
        Command::Model { command: ModelCommand::Export { safetensors, model } } => {
            let path = model_or_default(model)?;
            let file = engine::gguf::GgufFile::open(&path).map_err(|e| format!("{}: {e}", display(&path)))?;
            engine::hf::export(&file, &safetensors).map_err(|e| e.to_string())?;
            println!("{}", safetensors.display());
            Ok(ExitCode::SUCCESS)
        }
        Command::Model { command: ModelCommand::Parity { model, write, check, device, max_rel } } => {
            parity::run(&model, write.as_deref(), check.as_deref(), device, max_rel)
        }
        Command::Model { command: ModelCommand::Synth { seed, out } } => {
            let shape = engine::synth::SynthShape::SMOLLM2_135M;
            engine::synth::write(&out, &shape, seed).map_err(|e| e.to_string())?;
            let file = engine::gguf::GgufFile::open(&out).map_err(|e| e.to_string())?;
            println!("{} {}", out.display(), file.fingerprint());
            Ok(ExitCode::SUCCESS)
        }
        Command::Model { command: ModelCommand::Path } => {
            println!("{}", fetch_default()?.display());
            Ok(ExitCode::SUCCESS)
        }
        Command::Generate(args) => generate::run(args),
        Command::Bench { command: BenchCommand::Engine(args) } => bench::run(args),
        Command::Bench { command: BenchCommand::Transfer(args) } => bench::run_transfer(args),
        Command::Bench { command: BenchCommand::Serve(args) } => serve::run(*args),
        Command::Bench { command: BenchCommand::Router(args) } => bench_router::run(args),
        Command::Bench { command: BenchCommand::Leases(args) } => bench_leases::run(args),
        Command::Bench { command: BenchCommand::Tokenize(args) } => bench_tokenize::run(args),
        Command::Probe(args) => probe::run(args),
        Command::Certs { command: CertsCommand::Init(args) } => certs::run(args),
        Command::Up(args) => up::run(*args),
        Command::Sim(args) => sim::run(*args),
        Command::Tune(args) => tune::run(*args),
        Command::Router(args) => Ok(router::cli::run(*args)),
        Command::Worker(args) => Ok(worker::cli::run(*args, None)),
    }
}

fn display(p: &Path) -> String {
    p.display().to_string()
}
