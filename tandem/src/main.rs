//! `tandem`: one command for the common jobs. For now: fetch the model, generate text, measure the engine.

#![forbid(unsafe_code)]

mod cli;
mod hugepages;
mod progress;

use std::process::ExitCode;

use clap::Parser;

/// mimalloc instead of glibc's allocator. Tokio moves tasks between threads, so memory is often freed on another
/// thread than the one that took it; glibc then locks the taking thread's arena, and at 64 streams through the
/// router (`tandem bench router`) a sixth of the process's time went to those locks' futex waits and wake-ups.
/// mimalloc frees across threads without a lock.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    hugepages::allow_advised();
    let args = cli::Cli::parse();
    match cli::run(args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
