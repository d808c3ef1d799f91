//! Structured outputs on the real model: sampled at temperature 1, every output under a nested JSON schema parses
//! and validates; a regular expression and "any JSON object" hold too; a sequence continued elsewhere (the prompt
//! ending in tokens generated earlier) goes on under the same grammar state.

mod common;

use std::sync::atomic::AtomicBool;

use engine::chat::ChatMessage;
use engine::generate::{EngineConfig, Request};
use engine::grammar::Grammar;
use engine::sampling::{LogitsRules, RawSampling, SamplingParams};
use serde_json::Value;

const SCHEMA: &str = r#"{
  "type": "object",
  "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "address": {
      "type": "object",
      "properties": {
        "city": {"type": "string", "maxLength": 16},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}
      },
      "required": ["city", "zip"],
      "additionalProperties": false
    },
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    "active": {"type": "boolean"}
  },
  "required": ["name", "age", "address", "tags", "active"],
  "additionalProperties": false
}"#;

/// The schema above, checked by hand.
fn valid(v: &Value) -> Result<(), String> {
    let o = v.as_object().ok_or("not an object")?;
    let keys: Vec<&str> = o.keys().map(String::as_str).collect();
    let mut sorted = keys.clone();
    sorted.sort_unstable();
    if sorted != ["active", "address", "age", "name", "tags"] {
        return Err(format!("properties {keys:?}"));
    }
    let name = o["name"].as_str().ok_or("name is not a string")?;
    if name.is_empty() || name.chars().count() > 16 {
        return Err(format!("name {name:?}"));
    }
    let age = o["age"].as_u64().ok_or("age is not a non-negative integer")?;
    if age > 120 {
        return Err(format!("age {age}"));
    }
    let a = o["address"].as_object().ok_or("address is not an object")?;
    if a.len() != 2 || a.get("city").and_then(Value::as_str).is_none_or(|c| c.chars().count() > 16) {
        return Err(format!("address {a:?}"));
    }
    let zip = a.get("zip").and_then(Value::as_str).ok_or("zip")?;
    if zip.len() != 5 || !zip.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("zip {zip:?}"));
    }
    let tags = o["tags"].as_array().ok_or("tags is not an array")?;
    if tags.len() > 3 || !tags.iter().all(|t| matches!(t.as_str(), Some("red" | "green" | "blue"))) {
        return Err(format!("tags {tags:?}"));
    }
    o["active"].as_bool().ok_or("active is not a boolean")?;
    Ok(())
}

fn request(prompt: &[u32], grammar: Grammar, temperature: f32, seed: u64, max_tokens: u32) -> Request {
    let raw =
        RawSampling { temperature, seed: Some(seed), max_tokens, grammar: Some(grammar), ..RawSampling::default() };
    Request {
        prompt: prompt.to_vec(),
        sampling: SamplingParams::new(raw).expect("valid"),
        namespace: None,
        deadline: None,
        priority: 0,
    }
}

#[test]
fn a_hundred_samples_at_temperature_one_all_validate_against_a_nested_schema() {
    let mut e = common::engine(EngineConfig::default());
    let ask = "Describe a person as JSON with name, age, address, tags and whether they are active.";
    let text = e.render_chat(&[ChatMessage::new("user", ask)]).expect("template");
    let prompt = e.tokenizer().encode(&text);
    let requests: Vec<Request> =
        (0..100).map(|seed| request(&prompt, Grammar::JsonSchema(SCHEMA.into()), 1.0, seed, 256)).collect();
    let done = e.run(&requests, &AtomicBool::new(false), |_| {}).expect("runs");
    let mut distinct = std::collections::BTreeSet::new();
    for (i, c) in done.iter().enumerate() {
        let v: Value = serde_json::from_str(&c.text).unwrap_or_else(|err| panic!("sample {i}: {err}: {:?}", c.text));
        valid(&v).unwrap_or_else(|err| panic!("sample {i}: {err}: {}", c.text));
        assert_eq!(c.finish_reason.as_str(), "stop", "sample {i} ended where the grammar did: {}", c.text);
        distinct.insert(c.text.clone());
    }
    assert!(distinct.len() > 50, "temperature 1 samples vary: {} distinct", distinct.len());
}

#[test]
fn regular_expressions_and_any_json_object_hold_and_bad_grammars_are_refused() {
    let mut e = common::engine(EngineConfig::default());
    let text = e.render_chat(&[ChatMessage::new("user", "Pick a colour.")]).expect("template");
    let prompt = e.tokenizer().encode(&text);
    let rx = "(red|green|blue)( and (red|green|blue))?";
    let re = regex::Regex::new(&format!("^{rx}$")).expect("regex");
    let runs: Vec<Request> = (0..8).map(|seed| request(&prompt, Grammar::Regex(rx.into()), 1.0, seed, 32)).collect();
    for c in e.run(&runs, &AtomicBool::new(false), |_| {}).expect("runs") {
        assert!(re.is_match(&c.text), "{:?}", c.text);
    }
    let any: Vec<Request> = (0..8).map(|seed| request(&prompt, Grammar::JsonObject, 1.0, seed, 200)).collect();
    for c in e.run(&any, &AtomicBool::new(false), |_| {}).expect("runs") {
        if c.finish_reason.as_str() == "stop" {
            let v: Value = serde_json::from_str(&c.text).unwrap_or_else(|err| panic!("{err}: {:?}", c.text));
            assert!(v.is_object(), "{}", c.text);
        } else {
            assert!(c.text.starts_with('{'), "cut by max_tokens, still an object's start: {:?}", c.text);
        }
    }
    for bad in [Grammar::JsonSchema("{not json".into()), Grammar::Regex("(".into())] {
        let err = e.run(&[request(&prompt, bad.clone(), 0.0, 1, 8)], &AtomicBool::new(false), |_| {});
        assert!(err.is_err(), "{bad:?} is refused");
    }
}

/// A Lark grammar (llguidance's dialect) holds at temperature 1, recursion included: balanced brackets, which no
/// regular expression can say (12 seeded samples of up to 40 tokens: 7 ended by the grammar where this was written);
/// a grammar that does not compile is refused.
#[test]
fn lark_grammars_hold_recursion_included() {
    let mut e = common::engine(EngineConfig::default());
    let text = e.render_chat(&[ChatMessage::new("user", "Write some brackets.")]).expect("template");
    let prompt = e.tokenizer().encode(&text);
    let lark = "start: group+\ngroup: \"(\" group* \")\" | \"[\" group* \"]\"";
    let runs: Vec<Request> = (0..12).map(|seed| request(&prompt, Grammar::Lark(lark.into()), 1.0, seed, 40)).collect();
    let balanced = |s: &str| {
        let mut open = Vec::new();
        for c in s.chars() {
            match c {
                '(' | '[' => open.push(c),
                ')' if open.pop() == Some('(') => {}
                ']' if open.pop() == Some('[') => {}
                _ => return false,
            }
        }
        open.is_empty()
    };
    let mut finished = 0;
    for c in e.run(&runs, &AtomicBool::new(false), |_| {}).expect("runs") {
        assert!(c.text.chars().all(|ch| "()[]".contains(ch)) && !c.text.is_empty(), "{:?}", c.text);
        if c.finish_reason.as_str() == "stop" {
            assert!(balanced(&c.text), "{:?}", c.text);
            finished += 1;
        }
    }
    assert!(finished > 0, "some answers end by the grammar");
    let bad = Grammar::Lark("start: (".into());
    assert!(e.run(&[request(&prompt, bad, 0.0, 1, 8)], &AtomicBool::new(false), |_| {}).is_err());
}

/// A prefill worker samples the first token and a decode worker continues from the prompt plus that token: the
/// continued sequence rebuilds its grammar state from the tokens generated so far and ends as one engine does.
#[test]
fn a_continued_sequence_keeps_its_grammar_state() {
    let mut e = common::engine(EngineConfig::default());
    let text = e.render_chat(&[ChatMessage::new("user", "Describe a person.")]).expect("template");
    let prompt = e.tokenizer().encode(&text);
    let whole =
        e.run(&[request(&prompt, Grammar::JsonSchema(SCHEMA.into()), 0.0, 1, 256)], &AtomicBool::new(false), |_| {});
    let whole = whole.expect("runs").remove(0);
    valid(&serde_json::from_str(&whole.text).expect("json")).expect("valid");
    let split = 3;
    let continued_prompt = [prompt.clone(), whole.token_ids[..split].to_vec()].concat();
    let raw = RawSampling {
        temperature: 0.0,
        max_tokens: 256,
        grammar: Some(Grammar::JsonSchema(SCHEMA.into())),
        logits: LogitsRules { prior_generated: split as u32, repetition_penalty: 1.0, ..LogitsRules::default() },
        ..RawSampling::default()
    };
    let req = Request::new(continued_prompt, SamplingParams::new(raw).expect("valid"));
    let rest = e.run(&[req], &AtomicBool::new(false), |_| {}).expect("runs").remove(0);
    assert_eq!([&whole.token_ids[..split], &rest.token_ids[..]].concat(), whole.token_ids);
}

/// A reasoning model's thinking comes before what the grammar holds (`Thinking`): with the thinking open (the
/// prompt opened it), any text goes until `</think>` and the grammar holds after it; with it optional, the output may
/// open with a thinking block or answer at once. The thinking here is tokens generated earlier (a continued
/// sequence), since this model does not think by itself; the grammar's answer is then sampled at temperature 1.
#[test]
fn a_grammar_holds_after_the_thinking() {
    use engine::grammar::Thinking;
    let mut e = common::engine(EngineConfig::default());
    let text = e.render_chat(&[ChatMessage::new("user", "Describe a person as JSON.")]).expect("template");
    let prompt = e.tokenizer().encode(&text);
    let after = |e: &engine::generate::Engine, thought: &str, thinking, seed| {
        let thought = e.tokenizer().encode_ordinary(thought);
        let raw = RawSampling {
            temperature: 1.0,
            seed: Some(seed),
            max_tokens: 256,
            grammar: Some(Grammar::JsonSchema(SCHEMA.into())),
            thinking,
            logits: LogitsRules {
                prior_generated: thought.len() as u32,
                repetition_penalty: 1.0,
                ..LogitsRules::default()
            },
            ..RawSampling::default()
        };
        Request::new([prompt.clone(), thought].concat(), SamplingParams::new(raw).expect("valid"))
    };
    // Thinking that is not JSON (a brace, a quote) and is closed: the answer after it validates.
    let open = "A person: {name, \"age\"} and more.</think>";
    let opened = "<think>Hmm, a person.</think>";
    let runs: Vec<Request> = (0..4)
        .map(|seed| after(&e, open, Thinking::Open, seed))
        .chain((0..4).map(|seed| after(&e, opened, Thinking::Optional, seed)))
        .chain((0..4).map(|seed| after(&e, "", Thinking::Optional, seed)))
        // Gemma 4's channel, its markers text in this vocabulary.
        .chain((0..2).map(|seed| after(&e, "<|channel>thought\nA {person}.<channel|>", Thinking::Channel, seed)))
        .collect();
    let mut answered = 0;
    for (i, c) in e.run(&runs, &AtomicBool::new(false), |_| {}).expect("runs").iter().enumerate() {
        // Where the thinking was optional and nothing came before, the model may open a block of its own: the
        // answer is what follows it, and an unclosed one ran out of tokens.
        let answer = match c.text.strip_prefix("<think>") {
            Some(t) if i >= 8 => match t.split_once("</think>") {
                Some((_, answer)) => answer,
                None => {
                    assert_eq!(c.finish_reason.as_str(), "length", "run {i}: {:?}", c.text);
                    continue;
                }
            },
            _ => &c.text,
        };
        answered += 1;
        let v: Value =
            serde_json::from_str(answer.trim_start()).unwrap_or_else(|err| panic!("run {i}: {err}: {:?}", c.text));
        valid(&v).unwrap_or_else(|err| panic!("run {i}: {err}: {}", c.text));
        assert_eq!(c.finish_reason.as_str(), "stop", "run {i} ended where the grammar did: {}", c.text);
    }
    assert!(answered > 8, "some optional-thinking runs answered at once: {answered} answers");
    // Without the thinking before it, the grammar refuses that text; with it optional, text that does not open the
    // block is the grammar's from its first token.
    for (thought, thinking) in
        [(open, Thinking::None), ("Hmm.</think>", Thinking::Optional), ("A {person}.<channel|>", Thinking::Channel)]
    {
        let r = e.run(&[after(&e, thought, thinking, 1)], &AtomicBool::new(false), |_| {});
        assert!(r.is_err(), "{thought:?} under {thinking:?}");
    }
    // While it is open, the thinking is the model's own: greedy, its first tokens are the ones it writes without a
    // grammar.
    let free = e.run(&[common::greedy(prompt.clone(), 8)], &AtomicBool::new(false), |_| {}).expect("runs").remove(0);
    let raw = RawSampling {
        max_tokens: 8,
        grammar: Some(Grammar::JsonSchema(SCHEMA.into())),
        thinking: Thinking::Open,
        ..RawSampling::default()
    };
    let req = Request::new(prompt.clone(), SamplingParams::new(raw).expect("valid"));
    let thinking = e.run(&[req], &AtomicBool::new(false), |_| {}).expect("runs").remove(0);
    assert_eq!(thinking.token_ids, free.token_ids, "{:?} against {:?}", thinking.text, free.text);
}
