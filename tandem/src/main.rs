//! `tandem`: one command for the common jobs. For now: fetch the model, generate text, measure the engine.

#![forbid(unsafe_code)]

mod cli;
mod progress;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let args = cli::Cli::parse();
    match cli::run(args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
