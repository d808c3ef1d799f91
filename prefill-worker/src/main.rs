//! `prefill-worker`: a Tandem worker in the prefill role (see `worker::cli` for its settings).

use clap::Parser;

/// As `tandem`'s: tokio frees across threads, which glibc's allocator serializes on arena locks.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "prefill-worker", version, about = "A Tandem worker in the prefill role")]
struct Cli {
    #[command(flatten)]
    args: worker::cli::Args,
}

fn main() -> std::process::ExitCode {
    worker::cli::run(Cli::parse().args, Some(worker::Role::Prefill))
}
