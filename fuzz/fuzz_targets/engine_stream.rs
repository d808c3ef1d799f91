//! What an external engine sends back (vLLM, SGLang, llama-server): a response stream of server-sent events cut
//! anywhere, each event's chunk read by each engine's reader, and its metrics and settings as the router polls them.
//! Any bytes give chunks or errors, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use router::external::sse::SseParser;
use router::external::{EngineKind, Rank, llama_server, metrics, sglang, vllm};

fuzz_target!(|data: &[u8]| {
    let [cut, asked, rest @ ..] = data else { return };
    let alternatives = (asked & 1 == 1).then_some(u32::from(asked >> 1) % 21);
    let (mut vllm, mut sglang) = (vllm::Parser::new(alternatives), sglang::Parser::new(alternatives));
    let mut sse = SseParser::default();
    for piece in rest.chunks(usize::from(*cut).max(1)) {
        for event in sse.push(piece) {
            let _ = vllm.push(&event);
            let _ = sglang.push(&event);
            let _ = llama_server::parse(&event, alternatives);
        }
    }

    let text = String::from_utf8_lossy(rest);
    let rank = Rank { rank: u32::from(*cut % 4), of: u32::from(*asked % 5) };
    for kind in [EngineKind::Vllm, EngineKind::Sglang, EngineKind::LlamaServer] {
        let _ = metrics::parse(kind, &text, None);
        let _ = metrics::parse(kind, &text, Some(rank));
    }
    let _ = vllm::capacity_tokens(&text, Some(rank.rank));
    if let Ok(value) = serde_json::from_slice::<serde_json::Value>(rest) {
        let _ = sglang::capacity_tokens(&value, asked & 1 == 1);
        let _ = llama_server::capacity_tokens(&value);
    }
});
