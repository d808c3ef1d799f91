//! `decode-worker`: a Tandem worker in the decode role (see `worker::cli` for its settings).

use clap::Parser;

#[derive(Parser)]
#[command(name = "decode-worker", version, about = "A Tandem worker in the decode role")]
struct Cli {
    #[command(flatten)]
    args: worker::cli::Args,
}

fn main() -> std::process::ExitCode {
    worker::cli::run(Cli::parse().args, Some(worker::Role::Decode))
}
