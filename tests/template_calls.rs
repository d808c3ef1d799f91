//! Models' own chat templates (llama.cpp's copies, `models/templates`) write an assistant's earlier tool calls as
//! the model writes its calls, so each tool-call parser must read back what its model's template writes: the
//! calls of a conversation rendered by the template, read by the parser vLLM names for that model, are the same
//! calls (names, and arguments as JSON values), for GLM 4.6 and 4.7, MiniMax M2, Qwen3-Coder, DeepSeek V3.1, Hermes
//! 2 Pro, Seed-OSS and Kimi K2 (Instruct and Thinking). And where a template opens the thinking in its generation
//! prompt (GLM 4.7's, Qwen 3.5's), the answer is read as thinking from its start; where it closes it (Seed-OSS's
//! with no thinking budget), as no thinking at all.

use engine::chat::{ChatExtras, ChatMessage, ChatTemplate};
use router::http::reasoning::ReasoningParser;
use router::http::tools::{Function, ToolParser};
use serde_json::{Value, json};
use tandem_tests::llama_cpp_models;

#[test]
fn each_parser_reads_back_the_calls_its_models_template_writes() {
    let params = json!({"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "units": {"type": "array"}}});
    let functions = vec![
        Function { name: "weather".into(), params: params.clone() },
        Function { name: "now".into(), params: json!({"type": "object", "properties": {}}) },
    ];
    let tools: Vec<Value> = functions
        .iter()
        .map(|f| json!({"type": "function", "function": {"name": f.name, "description": "d", "parameters": f.params}}))
        .collect();
    let arguments = [json!({"city": "Oslo, Norway", "days": 3, "units": ["C", "mm"]}), json!({})];
    let calls = json!([
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": arguments[0]}},
        {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": arguments[1]}},
    ]);
    let question = "What is the weather in Oslo?";
    let messages = [
        ChatMessage::new("user", question),
        ChatMessage { tool_calls: Some(calls), ..ChatMessage::new("assistant", "") },
        ChatMessage { tool_call_id: Some("call_1".into()), ..ChatMessage::new("tool", "Rain.") },
        ChatMessage { tool_call_id: Some("call_2".into()), ..ChatMessage::new("tool", "Noon.") },
    ];
    let dir = llama_cpp_models().join("templates");
    for (file, parser) in [
        ("GLM-4.6.jinja", "glm45"),
        ("GLM-4.7-Flash.jinja", "glm47"),
        ("MiniMax-M2.jinja", "minimax_m2"),
        ("Qwen3-Coder.jinja", "qwen3_coder"),
        ("deepseek-ai-DeepSeek-V3.1.jinja", "deepseek_v31"),
        ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja", "hermes"),
        ("ByteDance-Seed-OSS.jinja", "seed_oss"),
        ("moonshotai-Kimi-K2.jinja", "kimi_k2"),
        ("Kimi-K2-Instruct.jinja", "kimi_k2"),
        ("Kimi-K2-Thinking.jinja", "kimi_k2"),
    ] {
        let source = std::fs::read_to_string(dir.join(file)).expect("the template");
        let template = ChatTemplate::new(&source, "<s>", "</s>").expect("the template compiles");
        let extras = ChatExtras { tools: &tools, arguments: None };
        let rendered = template.render_with(&messages, extras, false).expect("the conversation renders");
        // The assistant's turn: after the question (the system part describes the format with placeholders).
        let turn = &rendered[rendered.rfind(question).expect("the question") + question.len()..];
        let parser: ToolParser = parser.parse().expect("a parser");
        let made = parser.parse(turn, &functions).unwrap_or_else(|| panic!("{file}: no calls read from {turn:?}"));
        let read: Vec<(String, Value)> = made
            .calls
            .iter()
            .map(|(name, args)| (name.clone(), serde_json::from_str(args).expect("arguments as JSON")))
            .collect();
        let want = vec![("weather".to_string(), arguments[0].clone()), ("now".to_string(), arguments[1].clone())];
        assert_eq!(read, want, "{file} with {parser:?}, from {turn:?}");
    }
}

/// GLM 4.7's and Qwen 3.5's generation prompts open `<think>` unless `enable_thinking` is false (then they close it),
/// GLM 4.6's and Qwen3's hybrid models' never do: the `glm45` and `qwen3` parsers read the answer as thinking from
/// its start exactly where the rendered prompt opened the block. Seed-OSS and Kimi K2 Thinking think from the
/// start, but for Seed-OSS with `thinking_budget` 0, whose prompt closes the block.
#[test]
fn the_thinking_split_follows_the_rendered_prompt() {
    let dir = llama_cpp_models().join("templates");
    let messages = [ChatMessage::new("user", "Hi")];
    let off: serde_json::Map<String, Value> =
        [("enable_thinking".to_string(), Value::Bool(false))].into_iter().collect();
    let no_budget: serde_json::Map<String, Value> = [("thinking_budget".to_string(), json!(0))].into_iter().collect();
    for (file, parser, arguments, thinks) in [
        ("GLM-4.7-Flash.jinja", "glm45", None, true),
        ("GLM-4.7-Flash.jinja", "glm45", Some(&off), false),
        ("GLM-4.6.jinja", "glm45", None, false),
        ("Qwen3.5-4B.jinja", "qwen3", None, true),
        ("Qwen3.5-4B.jinja", "qwen3", Some(&off), false),
        ("Qwen-Qwen3-0.6B.jinja", "qwen3", None, false),
        ("ByteDance-Seed-OSS.jinja", "seed_oss", None, true),
        ("ByteDance-Seed-OSS.jinja", "seed_oss", Some(&no_budget), false),
        ("Kimi-K2-Thinking.jinja", "kimi_k2", None, true),
    ] {
        let Ok(source) = std::fs::read_to_string(dir.join(file)) else {
            panic!("{file}: not among llama.cpp's templates");
        };
        let template = ChatTemplate::new(&source, "<s>", "</s>").expect("the template compiles");
        let extras = ChatExtras { tools: &[], arguments };
        let prompt = template.render_with(&messages, extras, true).expect("the conversation renders");
        let parser: ReasoningParser = parser.parse().expect("a parser");
        // An answer that writes no marker is thinking only where the prompt left it thinking.
        let opened = parser.after_prompt(&prompt).is_some_and(|p| p.split("Hmm").reasoning.is_some());
        assert_eq!(opened, thinks, "{file} {arguments:?}: {prompt:?}");
    }
}

/// gpt-oss's template writes an earlier call as harmony's message to the function (recipient before the channel):
/// the model's answer as it would write it (after the prompt's `<|start|>assistant`, up to its `<|call|>`), read by
/// the `openai_gptoss` reasoning parser and the `openai` tool-call parser, is the same call.
#[test]
fn gpt_oss_calls_read_back_through_harmony() {
    let source =
        std::fs::read_to_string(llama_cpp_models().join("templates/openai-gpt-oss-120b.jinja")).expect("the template");
    let template = ChatTemplate::new(&source, "<|startoftext|>", "<|return|>").expect("the template compiles");
    let params = json!({"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}});
    let functions = vec![Function { name: "weather".into(), params: params.clone() }];
    let tools =
        vec![json!({"type": "function", "function": {"name": "weather", "description": "d", "parameters": params}})];
    let arguments = json!({"city": "Oslo, Norway", "days": 3});
    let calls = json!([{"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": arguments}}]);
    let messages = [
        ChatMessage::new("user", "Weather in Oslo?"),
        ChatMessage { tool_calls: Some(calls), ..ChatMessage::new("assistant", "") },
        ChatMessage { tool_call_id: Some("call_1".into()), ..ChatMessage::new("tool", "Rain.") },
    ];
    let rendered = template
        .render_with(&messages, ChatExtras { tools: &tools, arguments: None }, false)
        .expect("the conversation renders");
    let turn = &rendered[rendered.rfind("Weather in Oslo?").expect("the question")..];
    let call = &turn[turn.find("<|start|>assistant").expect("the assistant's turn") + "<|start|>assistant".len()..];
    let answer = &call[..call.find("<|call|>").expect("the call's end")];
    let split = "openai_gptoss".parse::<ReasoningParser>().expect("a parser").split(answer);
    let made = "openai".parse::<ToolParser>().expect("a parser").parse(&split.content, &functions);
    let made = made.unwrap_or_else(|| panic!("no call read from {answer:?} (content {:?})", split.content));
    let read: Value = serde_json::from_str(&made.calls[0].1).expect("arguments as JSON");
    assert_eq!((made.calls[0].0.as_str(), read), ("weather", arguments), "{answer:?}");
}

/// The `openai` tool-call parser reads calls as the `openai_gptoss` reasoning parser hands them on: a router given
/// the first without the second does not start, and says why.
#[tokio::test]
async fn the_openai_tool_parser_needs_the_harmony_reader() {
    let ca = kv_transfer::tls::DevCa::generate().expect("ca");
    let openai = Some(ToolParser::OpenAi);
    let alone = router::run::RouterConfig { tool_call_parser: openai, ..tandem_tests::router_config(&ca, vec![]) };
    let e = router::run::RunningRouter::start(alone).await.expect_err("refused");
    assert!(e.to_string().contains("openai_gptoss"), "{e}");
    let both = router::run::RouterConfig {
        tool_call_parser: openai,
        reasoning_parser: Some(ReasoningParser::GptOss),
        ..tandem_tests::router_config(&ca, vec![])
    };
    let router = router::run::RunningRouter::start(both).await.expect("starts");
    router.shutdown(std::time::Duration::from_secs(1)).await;
}
