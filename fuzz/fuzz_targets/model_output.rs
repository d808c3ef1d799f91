//! A model's answer, as a worker or an external engine streams it back to the router: every reasoning parser (or
//! none) and every tool-call parser after it read any text without a panic, and the same text cut into any pieces
//! and streamed gives what the whole answer gives (the thinking, the content and the calls a streaming client sees
//! are a non-streaming client's), the tool-call parser reading the content pieces the thinking's split leaves, as
//! the router's stream does.
#![no_main]

use libfuzzer_sys::fuzz_target;
use router::http::reasoning::{ReasoningParser, ReasoningStream, Split};
use router::http::tools::{AutoStream, Choosing, Function, ToolParser};
use serde_json::json;

/// Every tool-call parser and reasoning parser, by name.
const TOOL_PARSERS: [&str; 15] = [
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
    "granite",
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

    // The thinking, when the router has a reasoning parser: the content pieces it leaves, streamed, add up to the
    // whole answer's content, and the thinking to its thinking.
    let (content, pieces) = match REASONING_PARSERS.get(*reasoning as usize % (REASONING_PARSERS.len() + 1)) {
        None => (text.to_string(), pieces(&text, *seed)),
        Some(name) => {
            let parser: ReasoningParser = name.parse().unwrap();
            let whole = parser.split(&text);
            let mut stream = ReasoningStream::new(parser);
            let (mut thought, mut content, mut left) = (String::new(), String::new(), Vec::new());
            let mut add = |s: Split| {
                thought.push_str(&s.reasoning.unwrap_or_default());
                content.push_str(&s.content);
                left.push(s.content);
            };
            for piece in pieces(&text, *seed) {
                add(stream.push(&piece));
            }
            add(stream.end(""));
            assert_eq!(content, whole.content, "{parser:?} streamed content");
            match whole.reasoning {
                Some(r) => assert_eq!(thought, r, "{parser:?} streamed thinking"),
                None => assert!(thought.trim().is_empty(), "{parser:?} streamed thinking {thought:?}"),
            }
            (whole.content, left)
        }
    };

    // The calls, read from that content as the router reads them: whole, and from the pieces as they come.
    let functions = vec![
        Function {
            name: "now".into(),
            params: json!({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}),
        },
        Function { name: "get_weather".into(), params: json!({"properties": {"city": {"type": ["string", "null"]}}}) },
    ];
    let parser: ToolParser = TOOL_PARSERS[*tool as usize % TOOL_PARSERS.len()].parse().unwrap();
    let choosing = Choosing { parser, functions, parallel: parallel & 1 == 1 };
    let made = choosing.parse(&content);
    let mut stream = AutoStream::new(choosing);
    let (mut sent, mut calls) = (String::new(), Vec::new());
    for piece in &pieces {
        let out = stream.push(piece);
        assert_eq!(out.first, calls.len());
        sent.push_str(&out.content);
        calls.extend(out.calls);
    }
    let last = stream.end("");
    sent.push_str(&last.content);
    calls.extend(last.calls);
    match made {
        Some(made) => {
            assert_eq!(calls, made.calls, "{parser:?} streamed calls");
            match made.content {
                Some(c) => assert_eq!(sent, c, "{parser:?} streamed content"),
                None => assert!(sent.trim().is_empty(), "{parser:?} streamed content {sent:?}"),
            }
        }
        None => {
            assert_eq!(sent, content, "{parser:?} streamed content");
            assert!(calls.is_empty(), "{parser:?} streamed calls {calls:?}");
        }
    }
});
