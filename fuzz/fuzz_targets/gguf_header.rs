//! The GGUF reader on arbitrary bytes: a layout or a `ParseError`, never a panic and never an allocation the
//! bytes cannot back.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    let _ = engine::gguf::parse_layout(bytes);
});
