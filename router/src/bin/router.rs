//! The router binary: `router --workers host:port,...` (see `router --help`).

use std::process::ExitCode;

use clap::Parser;

/// As `tandem`'s: tokio frees across threads, which glibc's allocator serializes on arena locks.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "router", about = "Tandem's router: OpenAI-compatible HTTP in front of prefill and decode workers")]
struct Cli {
    #[command(flatten)]
    args: router::cli::Args,
}

fn main() -> ExitCode {
    router::cli::run(Cli::parse().args)
}
