//! A model's answer, as a worker or an external engine streams it back to the router: every tool-call parser and
//! every reasoning parser reads any text without a panic, and the same text cut into any pieces and streamed gives
//! what the whole answer gives (the content, the thinking and the calls a streaming client sees are a
//! non-streaming client's).
#![no_main]

use libfuzzer_sys::fuzz_target;
use router::http::reasoning::{ReasoningParser, ReasoningStream, Split};
use router::http::tools::{AutoStream, Choosing, Function, ToolParser};
use serde_json::json;

/// Every tool-call parser and reasoning parser, by name.
const TOOL_PARSERS: [&str; 14] = [
    "hermes",
    "llama3_json",
    "mistral",
    "pythonic",
    "qwen3_coder",
    "gemma4",
    "deepseek_v3",
    "deepseek_v31",
    "deepseek_v32",
    "glm45",
    "minimax_m2",
    "openai",
    "seed_oss",
    "kimi_k2",
];
const REASONING_PARSERS: [&str; 6] = ["deepseek_r1", "qwen3", "gemma4", "openai_gptoss", "seed_oss", "kimi_k2"];

/// The text cut into pieces of 1 to 8 characters, the sizes drawn from `seed`.
fn pieces(text: &str, seed: u8) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let mut state = u32::from(seed) | 1;
    let mut out = Vec::new();
    let mut at = 0;
    while at < chars.len() {
        state = state.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        let size = 1 + (state >> 16) as usize % 8;
        let end = (at + size).min(chars.len());
        out.push(chars[at..end].iter().collect());
        at = end;
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let [tool, reasoning, seed, parallel, rest @ ..] = data else { return };
    let text = String::from_utf8_lossy(rest);
    let cut = pieces(&text, *seed);

    // The thinking.
    let parser: ReasoningParser = REASONING_PARSERS[*reasoning as usize % REASONING_PARSERS.len()].parse().unwrap();
    let whole = parser.split(&text);
    let mut stream = ReasoningStream::new(parser);
    let (mut thought, mut content) = (String::new(), String::new());
    let mut add = |s: Split| {
        thought.push_str(&s.reasoning.unwrap_or_default());
        content.push_str(&s.content);
    };
    for piece in &cut {
        add(stream.push(piece));
    }
    add(stream.end(""));
    assert_eq!(content, whole.content, "{parser:?} streamed content");
    match whole.reasoning {
        Some(r) => assert_eq!(thought, r, "{parser:?} streamed thinking"),
        None => assert!(thought.trim().is_empty(), "{parser:?} streamed thinking {thought:?}"),
    }

    // The calls.
    let functions = vec![
        Function {
            name: "now".into(),
            params: json!({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}),
        },
        Function { name: "get_weather".into(), params: json!({"properties": {"city": {"type": ["string", "null"]}}}) },
    ];
    let parser: ToolParser = TOOL_PARSERS[*tool as usize % TOOL_PARSERS.len()].parse().unwrap();
    let choosing = Choosing { parser, functions, parallel: parallel & 1 == 1 };
    let made = choosing.parse(&text);
    let mut stream = AutoStream::new(choosing);
    let (mut content, mut calls) = (String::new(), Vec::new());
    for piece in &cut {
        let sent = stream.push(piece);
        assert_eq!(sent.first, calls.len());
        content.push_str(&sent.content);
        calls.extend(sent.calls);
    }
    let last = stream.end("");
    content.push_str(&last.content);
    calls.extend(last.calls);
    match made {
        Some(made) => {
            assert_eq!(calls, made.calls, "{parser:?} streamed calls");
            match made.content {
                Some(c) => assert_eq!(content, c, "{parser:?} streamed content"),
                None => assert!(content.trim().is_empty(), "{parser:?} streamed content {content:?}"),
            }
        }
        None => {
            assert_eq!(content, *text, "{parser:?} streamed content");
            assert!(calls.is_empty(), "{parser:?} streamed calls {calls:?}");
        }
    }
});
