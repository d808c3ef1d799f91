//! The chat template renderer against transformers' own way of rendering, on real models' templates: every
//! template in llama.cpp's `models/templates/` (which comes with llama.cpp's source, fetched by
//! `scripts/llama-cpp.sh` from PyPI) renders a handful of conversations (a system turn, several turns, tools offered,
//! a call and its result, no generation prompt) here and through Jinja2 as transformers' `apply_chat_template` sets
//! it up (`scripts/templates/render_hf.py`); each must give the same text, or both must refuse. Two kinds of
//! difference are allowed, and named: a template that transformers' Python refuses with a type error (iterating
//! the `tools` it passes as None when there are none, serializing a generator) renders here, leniently; and
//! [`KNOWN`] lists the templates whose text differs on purpose.

use std::io::Write;
use std::path::{Path, PathBuf};
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

/// One conversation to render.
struct Case {
    what: &'static str,
    messages: Vec<ChatMessage>,
    tools: Vec<Value>,
    add_generation_prompt: bool,
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
    vec![
        Case { what: "one user turn", messages: vec![m("user", "Hello!")], tools: vec![], add_generation_prompt: true },
        Case {
            what: "a system turn",
            messages: vec![m("system", "Be brief."), m("user", "Hi there.")],
            tools: vec![],
            add_generation_prompt: true,
        },
        Case {
            what: "several turns",
            messages: vec![m("user", "Count to 2."), m("assistant", "1, 2."), m("user", "Now to 3.")],
            tools: vec![],
            add_generation_prompt: true,
        },
        Case {
            what: "no generation prompt",
            messages: vec![m("user", "Name a colour."), m("assistant", "Blue.")],
            tools: vec![],
            add_generation_prompt: false,
        },
        Case {
            what: "tools offered",
            messages: vec![m("user", "Weather in Paris?")],
            tools: vec![weather.clone()],
            add_generation_prompt: true,
        },
        Case {
            what: "a call and its result",
            messages: vec![m("user", "Weather in Paris?"), call, answer],
            tools: vec![weather],
            add_generation_prompt: true,
        },
    ]
}

#[test]
fn real_templates_render_as_transformers_renders_them() {
    let dir = common::llama_cpp_models().join("templates");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("the templates")
        .map(|e| e.expect("an entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "jinja"))
        .collect();
    files.sort();
    assert!(files.len() >= 60, "{} templates in {}", files.len(), dir.display());
    let (bos, eos) = ("<s>", "</s>");
    let cases = cases();
    let mut inputs = Vec::new();
    let mut ours = Vec::new();
    for file in &files {
        let source = std::fs::read_to_string(file).expect("a template");
        let template = ChatTemplate::new(&source, bos, eos);
        for case in &cases {
            inputs.push(json!({"template": source, "bos_token": bos, "eos_token": eos, "messages": case.messages,
                               "tools": case.tools, "add_generation_prompt": case.add_generation_prompt}));
            let extras = ChatExtras { tools: &case.tools, arguments: None };
            let rendered = match &template {
                Ok(t) => t.render_with(&case.messages, extras, case.add_generation_prompt).map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            ours.push((file.file_name().expect("a name").to_string_lossy().into_owned(), case.what, rendered));
        }
    }
    let reference = reference(&inputs);
    assert_eq!(reference.len(), ours.len());
    let mut differ = Vec::new();
    let (mut rendered, mut lenient) = (0, 0);
    for ((name, what, ours), theirs) in ours.iter().zip(&reference) {
        let python_type_error = theirs.get("error").and_then(Value::as_str).is_some_and(|e| e.starts_with("TypeError"));
        match (ours, theirs.get("text").and_then(Value::as_str)) {
            (Ok(a), Some(b)) if a == b => rendered += 1,
            (Ok(_), Some(_)) if KNOWN.iter().any(|(known, _)| known == name) => {}
            (Ok(_), None) if python_type_error => lenient += 1,
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
    assert!(lenient <= 16, "{lenient} renders where transformers has a type error");
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
