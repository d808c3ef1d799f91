//! The chat template renderer against transformers' own way of rendering, on real models' templates: every
//! template in llama.cpp's `models/templates/` (which comes with llama.cpp's source, fetched by
//! `scripts/llama-cpp.sh` from PyPI) renders a handful of conversations (a system turn, several turns, tools offered,
//! a call and its result, no generation prompt) here and through Jinja2 as transformers' `apply_chat_template` sets
//! it up (`scripts/templates/render_hf.py`); each must give the same text, or both must refuse. Three kinds of
//! difference are allowed: [`LENIENT`] templates render here where transformers' Python fails with a type error,
//! [`KNOWN`] ones differ in their text on purpose, and a template that changes a list in place (Kimi K2's queue of
//! call ids), which transformers' immutable sandbox refuses, renders here as Jinja2's sandbox that allows it renders
//! it (as llama.cpp's renderer does).

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use engine::chat::{ChatExtras, ChatMessage, ChatTemplate};
use serde_json::{Value, json};

mod common;

/// Templates whose text differs from transformers' on purpose, and why.
const KNOWN: &[(&str, &str)] = &[(
    "meetkai-functionary-medium-v3.1.jinja",
    "Jinja2 HTML-escapes text added to a `|safe` string (Markup's `+`), so transformers writes `&#39;` for a quote \
     in a tool's description; here it stays as written",
)];

/// Templates that render here where transformers' Python fails with a type error: the `tool_use` variants iterate
/// `tools`, which transformers passes as None when there are none (minijinja iterates None as nothing), and
/// llama.cpp's own DeepSeek R1 template hands `tojson` a generator (Jinja2's `map`), which Python cannot serialize.
const LENIENT: &[&str] = &[
    "CohereForAI-c4ai-command-r-plus-tool_use.jinja",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
    "llama-cpp-deepseek-r1.jinja",
];

/// One conversation to render.
struct Case {
    what: &'static str,
    messages: Vec<ChatMessage>,
    tools: Vec<Value>,
    add_generation_prompt: bool,
    /// Template arguments (`chat_template_kwargs`), given to the templates that read them all.
    arguments: serde_json::Map<String, Value>,
}

fn cases() -> Vec<Case> {
    let m = ChatMessage::new;
    let weather = json!({"type": "function", "function": {"name": "get_weather",
        "description": "Today's weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"},
                                                        "unit": {"type": "string", "enum": ["c", "f"]}},
                       "required": ["city"]}}});
    let call = ChatMessage {
        tool_calls: Some(json!([{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}])),
        ..m("assistant", "")
    };
    let answer = ChatMessage { tool_call_id: Some("call_1".into()), ..m("tool", "{\"temperature\": 21}") };
    let two_calls = ChatMessage {
        tool_calls: Some(json!([
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}])),
        ..m("assistant", "")
    };
    let second = ChatMessage { tool_call_id: Some("call_2".into()), ..m("tool", "{\"temperature\": 4}") };
    let thought = ChatMessage { reasoning_content: Some("Two and two.".into()), ..m("assistant", "4.") };
    let off: serde_json::Map<String, Value> = [("enable_thinking".to_string(), json!(false))].into_iter().collect();
    vec![
        Case {
            what: "one user turn",
            messages: vec![m("user", "Hello!")],
            tools: vec![],
            add_generation_prompt: true,
            arguments: Default::default(),
        },
        Case {
            what: "a system turn",
            messages: vec![m("system", "Be brief."), m("user", "Hi there.")],
            tools: vec![],
            add_generation_prompt: true,
            arguments: Default::default(),
        },
        Case {
            what: "several turns",
            messages: vec![m("user", "Count to 2."), m("assistant", "1, 2."), m("user", "Now to 3.")],
            tools: vec![],
            add_generation_prompt: true,
            arguments: Default::default(),
        },
        Case {
            what: "no generation prompt",
            messages: vec![m("user", "Name a colour."), m("assistant", "Blue.")],
            tools: vec![],
            add_generation_prompt: false,
            arguments: Default::default(),
        },
        Case {
            what: "tools offered",
            messages: vec![m("user", "Weather in Paris?")],
            tools: vec![weather.clone()],
            add_generation_prompt: true,
            arguments: Default::default(),
        },
        Case {
            what: "a call and its result",
            messages: vec![m("user", "Weather in Paris?"), call, answer.clone()],
            tools: vec![weather.clone()],
            add_generation_prompt: true,
            arguments: Default::default(),
        },
        Case {
            what: "two calls and their results",
            messages: vec![m("user", "Weather in Paris and Oslo?"), two_calls, answer, second],
            tools: vec![weather.clone()],
            add_generation_prompt: true,
            arguments: Default::default(),
        },
        Case {
            what: "an earlier turn's thinking, text beyond ASCII",
            messages: vec![m("user", "2+2? Grüße 👋"), thought, m("user", "And 3+3?")],
            tools: vec![],
            add_generation_prompt: true,
            arguments: Default::default(),
        },
        Case {
            what: "thinking turned off",
            messages: vec![m("user", "Hello!")],
            tools: vec![],
            add_generation_prompt: true,
            arguments: off,
        },
        Case {
            what: "a reasoning effort (OpenAI's reasoning_effort, which the router gives a template that reads it)",
            messages: vec![m("user", "2+2?")],
            tools: vec![],
            add_generation_prompt: true,
            arguments: serde_json::Map::from_iter([("reasoning_effort".to_string(), json!("high"))]),
        },
        Case {
            // With a tool: Cohere's templates read documents beside tools, which they iterate (None in Python).
            what: "documents for retrieval (vLLM's documents, which the router gives a template that reads them)",
            messages: vec![m("user", "When does the tide come in?")],
            tools: vec![weather],
            add_generation_prompt: true,
            arguments: serde_json::Map::from_iter([(
                "documents".to_string(),
                json!([{"title": "Tides", "text": "The sea rises twice a day."}, {"title": "Moon", "text": "Its pull."}]),
            )]),
        },
    ]
}

#[test]
fn real_templates_render_as_transformers_renders_them() {
    let dir = common::llama_cpp_models().join("templates");
    let files = common::files(&dir, "jinja");
    assert!(files.len() >= 60, "{} templates in {}", files.len(), dir.display());
    let (bos, eos) = ("<s>", "</s>");
    let cases = cases();
    let mut inputs = Vec::new();
    let mut ours = Vec::new();
    for file in &files {
        let source = std::fs::read_to_string(file).expect("a template");
        let template = ChatTemplate::new(&source, bos, eos);
        for case in &cases {
            let reads = |t: &ChatTemplate| case.arguments.keys().all(|k| t.arguments().contains(k));
            if !case.arguments.is_empty() && !template.as_ref().is_ok_and(reads) {
                continue;
            }
            inputs.push(json!({"template": source, "bos_token": bos, "eos_token": eos, "messages": case.messages,
                               "tools": case.tools, "add_generation_prompt": case.add_generation_prompt,
                               "arguments": case.arguments}));
            let arguments = (!case.arguments.is_empty()).then_some(&case.arguments);
            let extras = ChatExtras { tools: &case.tools, arguments };
            let rendered = match &template {
                Ok(t) => t.render_with(&case.messages, extras, case.add_generation_prompt).map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            ours.push((file.file_name().expect("a name").to_string_lossy().into_owned(), case.what, rendered));
        }
    }
    let reference = reference(&inputs);
    assert_eq!(reference.len(), ours.len());
    // gpt-oss's, DeepSeek V4's (two), Hunyuan 3's, Cohere's MoE and Solar Open's read reasoning_effort.
    let effort: Vec<&str> =
        ours.iter().filter(|(_, what, _)| what.starts_with("a reasoning effort")).map(|(n, ..)| n.as_str()).collect();
    assert!(effort.len() >= 6, "templates reading reasoning_effort: {effort:?}");
    // Command R7B's, Cohere's MoE and Granite 3.3's, 4.0's and 4.1's read documents.
    let documents: Vec<&str> =
        ours.iter().filter(|(_, what, _)| what.starts_with("documents")).map(|(n, ..)| n.as_str()).collect();
    assert!(documents.len() >= 5, "templates reading documents: {documents:?}");
    let mut differ = Vec::new();
    let (mut rendered, mut lenient, mut in_place) = (0, 0, 0);
    for ((name, what, ours), theirs) in ours.iter().zip(&reference) {
        let python_type_error = LENIENT.contains(&name.as_str())
            && theirs.get("error").and_then(Value::as_str).is_some_and(|e| e.starts_with("TypeError"));
        match (ours, theirs.get("text").and_then(Value::as_str)) {
            (Ok(a), Some(b)) if a == b => rendered += 1,
            (Ok(_), Some(_)) if KNOWN.iter().any(|(known, _)| known == name) => {}
            (Ok(_), None) if python_type_error => lenient += 1,
            (Ok(a), None) if theirs.get("in_place").and_then(Value::as_str) == Some(a) => in_place += 1,
            (Err(_), None) => {}
            (Ok(a), Some(b)) => {
                differ.push(format!("{name}, {what}: rendered differently:\n--- here\n{a}\n--- transformers\n{b}"))
            }
            (Ok(_), None) => differ.push(format!("{name}, {what}: rendered here, refused by transformers: {theirs}")),
            (Err(e), Some(_)) => differ.push(format!("{name}, {what}: refused here ({e}), rendered by transformers")),
        }
    }
    assert!(differ.is_empty(), "{} of {} renders differ:\n{}", differ.len(), ours.len(), differ.join("\n\n"));
    assert!(rendered > ours.len() * 9 / 10, "{rendered} of {} rendered", ours.len());
    assert!(lenient > 0, "the lenient templates are still named for a reason");
    assert!(in_place >= 4, "Kimi K2's templates rendered with their calls: {in_place}");
}

/// transformers' renders of `inputs`, by `scripts/templates/render_hf.py`.
fn reference(inputs: &[Value]) -> Vec<Value> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/templates/render_hf.py");
    let mut child = Command::new("python3")
        .arg(script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 runs (with Jinja2: scripts/e2e/requirements.txt)");
    let input = serde_json::to_vec(inputs).expect("JSON");
    child.stdin.take().expect("stdin").write_all(&input).expect("writes the cases");
    let out = child.wait_with_output().expect("the renders");
    assert!(out.status.success(), "render_hf.py failed");
    serde_json::from_slice(&out.stdout).expect("a JSON list")
}
