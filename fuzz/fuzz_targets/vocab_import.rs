//! `tandem model vocab DIR`: a `tokenizer.json`, a `tekken.json` or Kimi K2's `tiktoken.model` from a model's
//! directory (with its `tokenizer_config.json`) is written as a vocabulary GGUF or refused with an error, never a panic; and a
//! vocabulary it writes is one the router's tokenizer reads and encodes with.
#![no_main]

use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fuzz_target!(|data: &[u8]| {
    // The file, then (after a NUL) its tokenizer_config.json.
    let (file, config) = match data.iter().position(|&b| b == 0) {
        Some(at) => (&data[..at], Some(&data[at + 1..])),
        None => (data, None),
    };
    let config = config.and_then(|c| serde_json::from_slice::<Value>(c).ok());
    let written = match serde_json::from_slice::<Value>(file) {
        Ok(file) => vec![
            engine::tokenizer::import::vocabulary_gguf(&file, config.as_ref()),
            engine::tokenizer::tekken::vocabulary_gguf(&file, config.as_ref()),
        ],
        // Not JSON: a tiktoken.model, read with its config.
        Err(_) => match &config {
            Some(config) => {
                vec![engine::tokenizer::tiktoken::vocabulary_gguf(&String::from_utf8_lossy(file), config)]
            }
            None => return,
        },
    };
    for written in written {
        let Ok(written) = written else { continue };
        let path = std::env::temp_dir().join(format!("tandem-fuzz-vocab-{}.gguf", std::process::id()));
        std::fs::write(&path, written.to_bytes()).expect("a temporary file");
        let gguf = engine::gguf::GgufFile::open(&path).expect("a GGUF it wrote opens");
        if let Ok(tokenizer) = engine::tokenizer::Tokenizer::from_gguf(&gguf) {
            let ids = tokenizer.encode("Hello, wörld! 123 <think>\n\n  x");
            let _ = tokenizer.decode(&ids);
        }
    }
});
