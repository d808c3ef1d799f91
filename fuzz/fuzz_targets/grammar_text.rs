//! A client's grammar in llama.cpp's GBNF (`guided_grammar`, `structured_outputs.grammar`): any text is told GBNF
//! or not and, as GBNF, written as Lark or refused with an error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let _ = engine::gbnf::is_gbnf(&text);
    let _ = engine::gbnf::to_lark(&text);
});
