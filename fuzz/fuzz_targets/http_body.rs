//! The router's checks of an OpenAI request body: any bytes give a checked request or an `ApiError`, never a panic,
//! whichever tool-call and reasoning parsers the router runs with (they decide which fields are allowed).
#![no_main]

use libfuzzer_sys::fuzz_target;
use router::http::openai::OutputParsers;

/// The parsers a router may run with: none, or one of each kind that changes the checks.
const TOOL_CALL: [Option<&str>; 4] = [None, Some("hermes"), Some("mistral"), Some("openai")];
const REASONING: [Option<&str>; 4] = [None, Some("qwen3"), Some("deepseek_v3"), Some("openai_gptoss")];

fuzz_target!(|data: &[u8]| {
    let Some((&which, body)) = data.split_first() else { return };
    let parsers = OutputParsers {
        tool_call: TOOL_CALL[usize::from(which & 3)].map(|n| n.parse().unwrap()),
        reasoning: REASONING[usize::from((which >> 2) & 3)].map(|n| n.parse().unwrap()),
    };
    let _ = router::http::openai::check_chat(body, parsers);
    let _ = router::http::openai::check_completion(body);
});
