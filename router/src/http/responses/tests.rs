use serde_json::{Value, json};

use super::stream::Events;
use super::*;

fn chat_of(v: Value) -> Result<(Value, Asked), String> {
    to_chat(v.to_string().as_bytes()).map_err(|e| {
        let body = e.body();
        format!("{} [{}]", body["error"]["message"], body["error"]["param"])
    })
}

#[test]
fn input_items_become_the_conversation() {
    let (chat, asked) = chat_of(json!({"model": "m", "input": "Hi", "instructions": "Be brief.",
                                       "max_output_tokens": 9, "temperature": 0}))
    .expect("valid");
    assert_eq!(
        chat["messages"],
        json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    );
    assert_eq!((&chat["max_completion_tokens"], &chat["temperature"]), (&json!(9), &json!(0)));
    assert_eq!((asked.instructions, asked.tool_choice, asked.tools), (json!("Be brief."), json!("auto"), json!([])));
    let items = json!([
        {"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "in Oslo?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Look it up."}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{\"city\":\"Oslo\"}"},
        {"type": "function_call", "call_id": "c2", "name": "now", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "rain"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Rain at noon."}]},
    ]);
    let (chat, _) = chat_of(json!({"model": "m", "input": items, "stream": true})).expect("valid");
    assert_eq!(
        chat["messages"],
        json!([
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": null, "reasoning_content": "Look it up.", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Oslo\"}"}},
                {"id": "c2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "rain"},
            {"role": "tool", "tool_call_id": "c2", "content": "noon"},
            {"role": "assistant", "content": "Rain at noon."},
        ])
    );
    assert_eq!(chat["stream_options"], json!({"include_usage": true}), "the last event carries the usage");
}

#[test]
fn tools_choices_and_formats_are_chats() {
    let tool = json!({"type": "function", "name": "now", "description": "the time", "parameters": {"type": "object"}});
    let (chat, asked) = chat_of(json!({"model": "m", "input": "?", "tools": [tool],
        "tool_choice": {"type": "function", "name": "now"}, "parallel_tool_calls": false,
        "text": {"format": {"type": "json_schema", "name": "t", "schema": {"type": "object"}, "strict": true}}}))
    .expect("valid");
    assert_eq!(
        chat["tools"],
        json!([{"type": "function", "function": {"name": "now", "description": "the time", "parameters": {"type": "object"}}}])
    );
    assert_eq!(chat["tool_choice"], json!({"type": "function", "function": {"name": "now"}}));
    assert_eq!(
        chat["response_format"],
        json!({"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "object"}, "strict": true}})
    );
    assert_eq!((asked.parallel_tool_calls, &asked.tools), (false, &json!([tool])), "echoed as sent");
    let (chat, _) = chat_of(json!({"model": "m", "input": "?", "text": {"format": {"type": "text"}}})).expect("valid");
    assert!(chat.get("response_format").is_none());
}

#[test]
fn what_is_not_served_is_refused_by_name() {
    for (body, param) in [
        (json!({"model": "m", "input": "?", "store": "yes"}), "store"),
        (json!({"model": "m", "input": "?", "previous_response_id": 7}), "previous_response_id"),
        (json!({"model": "m", "input": "?", "conversation": "conv_1"}), "conversation"),
        (json!({"model": "m", "input": "?", "background": true}), "background"),
        (json!({"model": "m", "input": "?", "include": ["reasoning.encrypted_content"]}), "include"),
        (json!({"model": "m", "input": "?", "reasoning": {"summary": "auto"}}), "reasoning"),
        (json!({"model": "m", "input": "?", "reasoning": "high"}), "reasoning"),
        (json!({"model": "m", "input": "?", "tools": [{"type": "web_search"}]}), "tools"),
        (
            json!({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
            "input",
        ),
        (json!({"model": "m", "input": [{"type": "file_search_call"}]}), "input"),
        (json!({"model": "m", "input": "?", "made_up": 1}), "made_up"),
        (json!({"model": "m"}), "input"),
        (json!({"model": "m", "input": "?", "text": {"format": {"type": "yaml"}}}), "text"),
    ] {
        let e = chat_of(body.clone()).expect_err("refused");
        assert!(e.ends_with(&format!("[\"{param}\"]")), "{body}: {e}");
    }
    let ok = json!({"model": "m", "input": "?", "store": false, "include": [], "truncation": "disabled",
                    "metadata": {"k": "v"}, "reasoning": {}, "background": false, "top_logprobs": 0});
    assert!(chat_of(ok).is_ok());
    assert_eq!(
        (param_of("max_tokens"), param_of("messages"), param_of("seed"), param_of("reasoning_effort")),
        ("max_output_tokens", "input", "seed", "reasoning.effort")
    );
    // The effort is the chat's reasoning_effort (for a chat template that reads it), echoed in the response.
    let (chat, asked) =
        chat_of(json!({"model": "m", "input": "?", "reasoning": {"effort": "high", "summary": null}})).expect("valid");
    assert_eq!(
        (&chat["reasoning_effort"], &asked.reasoning),
        (&json!("high"), &json!({"effort": "high", "summary": null}))
    );
}

/// A response goes on a stored one's conversation (after the new instructions, which are not inherited), and what
/// it keeps of itself is its own turns and its answer as the assistant's turn.
#[test]
fn a_response_goes_on_a_stored_conversation() {
    let (mut chat, asked) = chat_of(json!({"model": "m", "input": "And Rome?", "instructions": "Be brief.",
                                           "previous_response_id": "resp_1"}))
    .expect("valid");
    assert_eq!((asked.previous.as_deref(), asked.store), (Some("resp_1"), true));
    let prior =
        [json!({"role": "user", "content": "Weather in Oslo?"}), json!({"role": "assistant", "content": "Rain."})];
    continue_from(&mut chat, &asked, &prior);
    assert_eq!(
        chat["messages"],
        json!([{"role": "system", "content": "Be brief."}, prior[0], prior[1], {"role": "user", "content": "And Rome?"}])
    );
    assert_eq!(
        conversation_of(&chat, &asked),
        vec![prior[0].clone(), prior[1].clone(), json!({"role": "user", "content": "And Rome?"})]
    );
    let output = from_chat(&whole_chat("tool_calls"), &asked)["output"].as_array().expect("items").clone();
    assert_eq!(
        assistant_turn(&output),
        json!({"role": "assistant", "content": "Let me see.", "reasoning_content": "Hmm.",
               "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]})
    );
    let (_, plain) = chat_of(json!({"model": "m", "input": "?", "store": false})).expect("valid");
    assert!(!plain.store && plain.previous.is_none());
    let r = from_chat(&whole_chat("stop"), &asked);
    assert_eq!((&r["store"], &r["previous_response_id"]), (&json!(true), &json!("resp_1")));
}

/// A chat answer with thinking, text and a call, whole.
fn whole_chat(finish: &str) -> Value {
    json!({"id": "chatcmpl-00ab", "object": "chat.completion", "created": 7, "model": "m",
           "choices": [{"index": 0, "finish_reason": finish, "message": {"role": "assistant",
               "reasoning_content": "Hmm.", "content": "Let me see.",
               "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]}}],
           "usage": {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11,
                     "prompt_tokens_details": {"cached_tokens": 2}, "completion_tokens_details": {"reasoning_tokens": 3}}})
}

#[test]
fn a_chat_answer_is_the_responses_output() {
    let asked = chat_of(json!({"model": "m", "input": "?"})).expect("valid").1;
    let r = from_chat(&whole_chat("tool_calls"), &asked);
    assert_eq!(
        (&r["id"], &r["object"], &r["status"], &r["created_at"]),
        (&json!("resp_00ab"), &json!("response"), &json!("completed"), &json!(7))
    );
    assert_eq!(
        r["output"],
        json!([
            {"type": "reasoning", "id": "rs_00ab", "summary": [], "content": [{"type": "reasoning_text", "text": "Hmm."}]},
            {"type": "message", "id": "msg_00ab", "status": "completed", "role": "assistant",
             "content": [{"type": "output_text", "text": "Let me see.", "annotations": []}]},
            {"type": "function_call", "id": "fc_00ab00", "call_id": "call_1", "name": "now", "arguments": "{}", "status": "completed"},
        ])
    );
    assert_eq!(
        r["usage"],
        json!({"input_tokens": 5, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 6,
               "output_tokens_details": {"reasoning_tokens": 3}, "total_tokens": 11})
    );
    let cut = from_chat(&whole_chat("length"), &asked);
    assert_eq!(
        (&cut["status"], &cut["incomplete_details"]),
        (&json!("incomplete"), &json!({"reason": "max_output_tokens"}))
    );
}

/// The same answer streamed: its events open, fill and close each item in order, and the last one's response is the
/// whole answer's.
#[test]
fn a_streamed_answer_ends_with_the_whole_response() {
    let asked = chat_of(json!({"model": "m", "input": "?"})).expect("valid").1;
    let chunk = |delta: Value, finish: Value| {
        json!({"id": "chatcmpl-00ab", "object": "chat.completion.chunk", "created": 7, "model": "m",
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    };
    let chunks = [
        chunk(json!({"role": "assistant", "reasoning_content": "Hm"}), Value::Null),
        chunk(json!({"reasoning_content": "m."}), Value::Null),
        chunk(json!({"content": "Let me"}), Value::Null),
        chunk(json!({"content": " see."}), Value::Null),
        chunk(
            json!({"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{"}}]}),
            Value::Null,
        ),
        chunk(json!({"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}), Value::Null),
        chunk(json!({}), json!("tool_calls")),
        json!({"id": "chatcmpl-00ab", "object": "chat.completion.chunk", "created": 7, "model": "m", "choices": [],
               "usage": whole_chat("tool_calls")["usage"]}),
    ];
    let mut events = Events::new(asked.clone());
    let mut all: Vec<Value> = chunks.iter().flat_map(|c| events.chunk(c)).collect();
    all.extend(events.end());
    let kinds: Vec<&str> = all.iter().map(|e| e["type"].as_str().expect("type")).collect();
    assert_eq!(
        kinds,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.reasoning_text.delta",
            "response.reasoning_text.delta",
            "response.reasoning_text.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    let numbers: Vec<u64> = all.iter().map(|e| e["sequence_number"].as_u64().expect("number")).collect();
    assert_eq!(numbers, (0..all.len() as u64).collect::<Vec<_>>());
    let last = &all.last().expect("events")["response"];
    assert_eq!(last, &from_chat(&whole_chat("tool_calls"), &asked), "the whole answer's response");
    assert_eq!(all[0]["response"]["status"], "in_progress");
    // An error chunk is the error event.
    let mut events = Events::new(asked);
    let e = events.chunk(&json!({"error": {"message": "gone", "code": "upstream", "param": null}}));
    assert_eq!((&e[0]["type"], &e[0]["message"]), (&json!("error"), &json!("gone")));
}

/// JSON trees of a few levels, their keys mostly the names this API reads.
fn wild_json() -> impl proptest::strategy::Strategy<Value = Value> {
    use proptest::prelude::*;
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        "[a-z_ {}]{0,8}".prop_map(Value::from),
        Just(json!("function")),
        Just(json!("message")),
        Just(json!("user")),
    ];
    leaf.prop_recursive(3, 32, 4, |inner| {
        let key = prop_oneof![
            Just("type".to_string()),
            Just("role".to_string()),
            Just("content".to_string()),
            Just("text".to_string()),
            Just("name".to_string()),
            Just("call_id".to_string()),
            Just("arguments".to_string()),
            Just("output".to_string()),
            Just("format".to_string()),
            Just("schema".to_string()),
            "[a-z]{1,6}",
        ];
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            proptest::collection::btree_map(key, inner, 0..4).prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]
    /// Whatever a client sends, and whatever chunks come back, the conversions answer with a value or an error,
    /// never a panic; a request they take is one the chat checks take or refuse, never one that panics them.
    #[test]
    fn wild_requests_and_answers_never_panic(
        field in proptest::sample::select(vec!["input", "tools", "tool_choice", "text", "instructions", "store",
                                               "reasoning", "include", "stream_options", "metadata"]),
        value in wild_json(),
        input in wild_json(),
        answer in wild_json(),
    ) {
        let body = json!({"model": "m", "input": input, field: value});
        let asked = match to_chat(body.to_string().as_bytes()) {
            Ok((chat, asked)) => {
                let _ = crate::http::openai::check_chat(chat.to_string().as_bytes(), Default::default());
                asked
            }
            Err(_) => Asked::default(),
        };
        let _ = from_chat(&answer, &asked);
        let mut events = Events::new(asked);
        let _ = events.chunk(&answer);
        let _ = events.chunk(&json!({"id": "chatcmpl-1", "choices": [{"delta": answer}]}));
        let _ = events.end();
    }
}

/// `include: ["message.output_text.logprobs"]` asks chat for log-probabilities and puts those of the text's own
/// tokens (not the thinking's) on its `output_text`, whole and streamed alike.
#[test]
fn the_texts_log_probabilities_come_when_included() {
    let (chat, asked) = chat_of(json!({"model": "m", "input": "?", "include": ["message.output_text.logprobs"],
                                       "top_logprobs": 2}))
    .expect("valid");
    assert_eq!((&chat["logprobs"], &chat["top_logprobs"], asked.logprobs), (&json!(true), &json!(2), true));
    let e = chat_of(json!({"model": "m", "input": "?", "top_logprobs": 2})).expect_err("refused");
    assert!(e.contains("include"), "{e}");
    let entry = |t: &str| json!({"token": t, "logprob": -0.5, "bytes": t.as_bytes(), "top_logprobs": []});
    let tokens = ["Hm", "m.</think>", "\n\nYes", ".", ""];
    let answer = json!({"id": "chatcmpl-00ab", "created": 1, "model": "m", "usage": {},
        "choices": [{"index": 0, "finish_reason": "stop", "logprobs": {"content": tokens.map(entry)},
                     "message": {"role": "assistant", "reasoning_content": "Hmm.", "content": "\n\nYes."}}]});
    let r = from_chat(&answer, &asked);
    let kept: Vec<&str> = r["output"][1]["content"][0]["logprobs"]
        .as_array()
        .expect("logprobs")
        .iter()
        .map(|e| e["token"].as_str().expect("token"))
        .collect();
    assert_eq!(kept, ["\n\nYes", "."], "the text's tokens only");
    // Streamed: the same, on the text's part at its end.
    let mut events = Events::new(asked);
    let mut all = Vec::new();
    for (t, d) in tokens.iter().zip([
        json!({"reasoning_content": "Hm"}),
        json!({"reasoning_content": "m."}),
        json!({"content": "\n\nYes"}),
        json!({"content": "."}),
        json!({}),
    ]) {
        let c = json!({"id": "chatcmpl-00ab", "created": 1, "model": "m",
                       "choices": [{"index": 0, "delta": d, "logprobs": {"content": [entry(t)]}, "finish_reason": null}]});
        all.extend(events.chunk(&c));
    }
    all.extend(events.end());
    let last = &all.last().expect("events")["response"];
    assert_eq!(last["output"][1]["content"][0]["logprobs"], r["output"][1]["content"][0]["logprobs"]);
}
