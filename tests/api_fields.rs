//! No request field is silently ignored. The field lists come from the installed `openai` package's own request
//! types (`openai.types.chat.completion_create_params`, `openai.types.completion_create_params`): each field is
//! sent with a value that asks for something, through a real router and worker, and either does what OpenAI
//! specifies (checked here), is one that changes nothing by nature (accepted), or gets 400 naming it. A field the
//! package gains that this test has no value for fails the test, so a new field is decided on, not ignored.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::Command;

use kv_transfer::tls::DevCa;
use serde_json::{Value, json};
use tandem_tests::*;
use worker::Role;

const MODEL: &str = "smollm2-135m-instruct";

/// The fields of a request type of the installed `openai` package (its TypedDict and the bases it extends).
fn openai_fields(module: &str) -> Vec<String> {
    let script = format!(
        "import json, importlib\n\
         base = importlib.import_module('{module}').CompletionCreateParamsBase\n\
         names = []\n\
         for cls in reversed(base.__mro__):\n    \
             names += [k for k in getattr(cls, '__annotations__', {{}}) if k not in names]\n\
         print(json.dumps(names))"
    );
    let out = Command::new("python3").args(["-c", &script]).output().expect("python3 runs");
    assert!(
        out.status.success(),
        "the openai package (scripts/e2e/requirements.txt): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("a JSON list")
}

/// A value asking for something, for every field that is refused or accepted without effect (`true`: accepted).
fn asks(chat: bool) -> BTreeMap<&'static str, (Value, bool)> {
    let mut m = BTreeMap::from([("user", (json!("someone"), true))]);
    if chat {
        m.extend([
            ("metadata", (json!({"k": "v"}), true)),
            ("store", (json!(true), true)),
            ("parallel_tool_calls", (json!(true), true)),
            ("safety_identifier", (json!("hashed-user"), true)),
            ("prompt_cache_key", (json!("session-1"), true)),
            ("prompt_cache_retention", (json!("24h"), true)),
            ("prompt_cache_options", (json!({"mode": "explicit", "ttl": "30m"}), true)),
            ("functions", (json!([{"name": "f", "parameters": {}}]), false)),
            ("function_call", (json!("auto"), false)),
            ("modalities", (json!(["text", "audio"]), false)),
            ("audio", (json!({"voice": "alloy", "format": "wav"}), false)),
            ("prediction", (json!({"type": "content", "content": "x"}), false)),
            // Refused by name: SmolLM2's template does not read it (a template that does gets it).
            ("reasoning_effort", (json!("low"), false)),
            ("verbosity", (json!("low"), false)),
            ("web_search_options", (json!({}), false)),
            ("moderation", (json!({"model": "omni-moderation-latest"}), false)),
            ("service_tier", (json!("flex"), false)),
        ]);
    } else {
        m.extend([("best_of", (json!(2), false)), ("suffix", (json!(" and so on"), false))]);
    }
    m
}

/// Fields implemented: each is checked for its effect below.
const IMPLEMENTED: &[&str] = &[
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream_options",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "n",
    "echo",
    "response_format",
    "tools",
    "tool_choice",
];

struct Api {
    addr: SocketAddr,
    chat: bool,
}

impl Api {
    fn path(&self) -> &'static str {
        if self.chat { "/v1/chat/completions" } else { "/v1/completions" }
    }

    fn base(&self) -> Value {
        let text = "Write one sentence about the sea.";
        if self.chat {
            json!({"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 12})
        } else {
            json!({"model": MODEL, "prompt": text, "max_tokens": 12})
        }
    }

    async fn send(&self, extra: Value) -> Reply {
        let mut body = self.base();
        for (k, v) in extra.as_object().expect("an object") {
            body[k] = v.clone();
        }
        http(self.addr, "POST", self.path(), &body.to_string(), &[]).await
    }

    /// The answer's text, usage and finish reason.
    async fn answer(&self, extra: Value) -> (String, u64, String) {
        let r = self.send(extra.clone()).await;
        assert_eq!(r.status, 200, "{extra}: {}", r.body);
        let v = r.json();
        let choice = &v["choices"][0];
        let text = if self.chat { &choice["message"]["content"] } else { &choice["text"] };
        let tokens = v["usage"]["completion_tokens"].as_u64().expect("usage");
        (text.as_str().unwrap_or_default().to_string(), tokens, choice["finish_reason"].as_str().unwrap_or("").into())
    }

    /// What each implemented field does, as OpenAI specifies it.
    async fn check_implemented(&self, field: &str) {
        match field {
            "messages" => assert_eq!(self.send(json!({})).await.status, 200),
            "prompt" => {
                // Text, token ids and a batch of one list of token ids are the same prompt.
                let text = self.base()["prompt"].as_str().expect("text").to_string();
                let ids = engine::text::TextModel::open(&model()).expect("model").tokenizer().encode(&text);
                let greedy = self.answer(json!({"temperature": 0})).await.0;
                assert_eq!(self.answer(json!({"temperature": 0, "prompt": ids})).await.0, greedy);
                assert_eq!(self.answer(json!({"temperature": 0, "prompt": [ids]})).await.0, greedy);
                for bad in [json!([1, 999_999]), json!([]), json!(["a", ""]), json!(vec!["a"; 33])] {
                    let r = self.send(json!({"prompt": bad})).await;
                    assert_eq!((r.status, r.json()["error"]["param"].clone()), (400, json!("prompt")), "{bad}");
                }
                // A batch: one choice per prompt, in order, each the prompt's own answer; usage over all.
                let other = "The sea at night";
                let alone = self.send(json!({"temperature": 0, "prompt": other})).await.json();
                let batch = self.send(json!({"temperature": 0, "prompt": [text, other]})).await.json();
                let texts: Vec<&str> = batch["choices"]
                    .as_array()
                    .expect("choices")
                    .iter()
                    .map(|c| c["text"].as_str().expect("text"))
                    .collect();
                assert_eq!(texts, [greedy.as_str(), alone["choices"][0]["text"].as_str().expect("text")], "{batch}");
                assert_eq!(batch["choices"][1]["index"], 1);
                let single = self.send(json!({"temperature": 0})).await.json();
                let sum = |k: &str| single["usage"][k].as_u64().expect("u") + alone["usage"][k].as_u64().expect("u");
                assert_eq!(batch["usage"]["prompt_tokens"].as_u64(), Some(sum("prompt_tokens")), "{batch}");
                assert_eq!(batch["usage"]["completion_tokens"].as_u64(), Some(sum("completion_tokens")), "{batch}");
                // Batch and n together: prompt-major, as OpenAI numbers them.
                let both = self.send(json!({"temperature": 0, "prompt": [text, other], "n": 2})).await.json();
                let texts: Vec<&str> = both["choices"]
                    .as_array()
                    .expect("choices")
                    .iter()
                    .map(|c| c["text"].as_str().expect("text"))
                    .collect();
                assert_eq!(texts.len(), 4, "{both}");
                assert_eq!((texts[0], texts[1]), (greedy.as_str(), greedy.as_str()), "{both}");
                assert_eq!(texts[2], alone["choices"][0]["text"].as_str().expect("text"), "{both}");
            }
            "echo" => {
                let text = self.base()["prompt"].as_str().expect("text").to_string();
                let greedy = self.answer(json!({"temperature": 0})).await.0;
                assert_eq!(self.answer(json!({"temperature": 0, "echo": true})).await.0, format!("{text}{greedy}"));
                // Streamed: the prompt comes first.
                let events = self.send(json!({"temperature": 0, "echo": true, "stream": true})).await.events();
                let streamed: String = events
                    .iter()
                    .filter_map(|e| serde_json::from_str::<Value>(e).ok())
                    .filter_map(|c| c["choices"][0]["text"].as_str().map(str::to_string))
                    .collect();
                assert_eq!(streamed, format!("{text}{greedy}"));
                // With log-probabilities, the prompt's tokens come first, the first of them without one.
                let r = self.send(json!({"temperature": 0, "echo": true, "logprobs": 1, "max_tokens": 2})).await;
                assert_eq!(r.status, 200, "{}", r.body);
                let lp = r.json()["choices"][0]["logprobs"].clone();
                let tokens = lp["tokens"].as_array().expect("tokens");
                assert!(tokens.len() > 2, "{lp}");
                assert_eq!((&lp["token_logprobs"][0], &lp["top_logprobs"][0]), (&Value::Null, &Value::Null), "{lp}");
                assert!(lp["token_logprobs"].as_array().expect("lps")[1..].iter().all(Value::is_f64), "{lp}");
            }
            "n" => {
                // Sampled: each choice its own seed (the request's plus its number), so the first is the n = 1
                // answer and the others differ; the prompt counts once in usage, the completions all.
                let hot = json!({"temperature": 1.5, "seed": 11, "max_tokens": 12, "ignore_eos": true});
                let mut three = hot.clone();
                three["n"] = json!(3);
                let r = self.send(three.clone()).await;
                assert_eq!(r.status, 200, "{}", r.body);
                let v = r.json();
                let choice = |c: &Value| {
                    let t = if self.chat { &c["message"]["content"] } else { &c["text"] };
                    t.as_str().expect("text").to_string()
                };
                let texts: Vec<String> = v["choices"].as_array().expect("choices").iter().map(choice).collect();
                let indices: Vec<u64> =
                    v["choices"].as_array().expect("c").iter().map(|c| c["index"].as_u64().expect("i")).collect();
                assert_eq!(indices, [0, 1, 2]);
                let (one, tokens, _) = self.answer(hot.clone()).await;
                assert_eq!(texts[0], one, "choice 0 has the request's seed");
                assert!(texts[1] != texts[0] || texts[2] != texts[0], "the other seeds sample other tokens: {texts:?}");
                assert_eq!(v["usage"]["completion_tokens"].as_u64(), Some(3 * tokens), "{v}");
                let single = self.send(hot.clone()).await.json();
                assert_eq!(v["usage"]["prompt_tokens"], single["usage"]["prompt_tokens"], "the prompt counts once");
                // The same request again: the same three answers.
                let again: Vec<String> = self.send(three.clone()).await.json()["choices"]
                    .as_array()
                    .expect("c")
                    .iter()
                    .map(choice)
                    .collect();
                assert_eq!(again, texts);
                // Streamed: the same choices, their chunks interleaved and told apart by index.
                three["stream"] = json!(true);
                let mut streamed = vec![String::new(); 3];
                for e in self.send(three).await.events() {
                    let Ok(c) = serde_json::from_str::<Value>(&e) else { continue };
                    let Some(c0) = c["choices"].as_array().and_then(|a| a.first()) else { continue };
                    let i = c0["index"].as_u64().expect("index") as usize;
                    let t = if self.chat { &c0["delta"]["content"] } else { &c0["text"] };
                    streamed[i].push_str(t.as_str().unwrap_or(""));
                }
                assert_eq!(streamed, texts);
                for bad in [json!(0), json!(9)] {
                    let r = self.send(json!({"n": bad})).await;
                    assert_eq!((r.status, r.json()["error"]["param"].clone()), (400, json!("n")), "{bad}");
                }
            }
            "model" => {
                let r = self.send(json!({"model": "no-such-model"})).await;
                assert_eq!((r.status, r.json()["error"]["param"].clone()), (404, json!("model")), "{}", r.body);
            }
            "max_tokens" | "max_completion_tokens" => {
                let (_, n, reason) = self.answer(json!({field: 3, "ignore_eos": true})).await;
                assert_eq!((n, reason.as_str()), (3, "length"), "{field}");
            }
            "temperature" => {
                let a = self.answer(json!({"temperature": 0, "seed": 1})).await.0;
                let b = self.answer(json!({"temperature": 0, "seed": 2})).await.0;
                assert_eq!(a, b, "temperature 0 is greedy whatever the seed");
            }
            "top_p" => {
                let greedy = self.answer(json!({"temperature": 0})).await.0;
                let a = self.answer(json!({"temperature": 1, "top_p": 1e-6, "seed": 1})).await.0;
                assert_eq!(a, greedy, "a tiny top_p keeps only the most likely token");
            }
            "seed" => {
                let hot = |seed| json!({"temperature": 1.5, "seed": seed, "max_tokens": 16, "ignore_eos": true});
                let first = self.answer(hot(7)).await.0;
                assert_eq!(self.answer(hot(7)).await.0, first, "the same seed samples the same tokens");
                let mut others = Vec::new();
                for seed in [8, 9, 10] {
                    others.push(self.answer(hot(seed)).await.0);
                }
                assert!(others.iter().any(|o| *o != first), "other seeds sample other tokens: {first:?} {others:?}");
            }
            "stop" => {
                let (greedy, _, _) = self.answer(json!({"temperature": 0, "ignore_eos": true})).await;
                let word = greedy.split_whitespace().nth(1).expect("two words").to_string();
                let (cut, _, reason) = self.answer(json!({"temperature": 0, "stop": [word.clone()]})).await;
                assert!(!cut.contains(&word) && greedy.starts_with(&cut), "{greedy:?} stopped at {word:?}: {cut:?}");
                assert_eq!(reason, "stop");
            }
            "stream_options" => {
                let r = self.send(json!({"stream": true, "stream_options": {"include_usage": true}})).await;
                let events = r.events();
                let usage: Value = serde_json::from_str(&events[events.len() - 2]).expect("the usage chunk");
                assert!(usage["usage"]["completion_tokens"].as_u64().is_some(), "{usage}");
                // vLLM's continuous_usage_stats: every chunk of the choice carries its usage so far, counting up to
                // the usage after the last.
                let options = json!({"include_usage": true, "continuous_usage_stats": true});
                let r = self.send(json!({"stream": true, "stream_options": options, "ignore_eos": true})).await;
                let events = r.events();
                let chunks: Vec<Value> =
                    events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).expect("a chunk")).collect();
                let (last, each) = chunks.split_last().expect("chunks");
                let counted: Vec<u64> = each
                    .iter()
                    .map(|c| c["usage"]["completion_tokens"].as_u64().unwrap_or_else(|| panic!("usage in {c}")))
                    .collect();
                assert!(counted.windows(2).all(|w| w[0] <= w[1]), "{counted:?}");
                assert_eq!(counted.last(), last["usage"]["completion_tokens"].as_u64().as_ref(), "{last}");
                assert_eq!(last["usage"]["completion_tokens"], 12, "{last}");
                assert!(each.iter().all(|c| c["usage"]["prompt_tokens"] == last["usage"]["prompt_tokens"]));
            }
            "frequency_penalty" | "presence_penalty" => {
                // Greedy, long enough to repeat itself: a strong penalty changes what is picked (the formulas are
                // checked exactly in engine::sampling and across workers below).
                let long = json!({"temperature": 0, "max_tokens": 32, "ignore_eos": true});
                let plain = self.answer(long.clone()).await.0;
                let mut with = long;
                with[field] = json!(2.0);
                assert_ne!(self.answer(with).await.0, plain, "{field} changes the output");
            }
            "logit_bias" => {
                let id = engine::text::TextModel::open(&model()).expect("model").tokenizer().encode(" sea")[0];
                let (text, _, _) =
                    self.answer(json!({"temperature": 0, "max_tokens": 3, "ignore_eos": true, "logit_bias": {id.to_string(): 100}})).await;
                assert_eq!(text.trim(), "sea sea sea", "a bias of 100 makes the token certain");
            }
            "logprobs" if self.chat => {
                let ask = json!({"temperature": 0, "logprobs": true, "top_logprobs": 2});
                let r = self.send(ask.clone()).await;
                assert_eq!(r.status, 200, "{}", r.body);
                let v = r.json();
                let content = v["choices"][0]["logprobs"]["content"].as_array().expect("logprobs.content").clone();
                assert_eq!(content.len() as u64, v["usage"]["completion_tokens"].as_u64().expect("usage"));
                for e in &content {
                    let top = e["top_logprobs"].as_array().expect("alternatives");
                    assert_eq!(top.len(), 2, "{e}");
                    // Greedy picks the most likely token; log-probabilities are at most 0, most likely first.
                    assert_eq!((&e["token"], &e["logprob"]), (&top[0]["token"], &top[0]["logprob"]), "{e}");
                    let (a, b) = (top[0]["logprob"].as_f64().expect("lp"), top[1]["logprob"].as_f64().expect("lp"));
                    assert!(a <= 0.0 && b <= a, "{e}");
                    assert!(e["bytes"].as_array().is_some(), "{e}");
                }
                // Streamed: the same entries, spread over the chunks.
                let mut streamed = Vec::new();
                for ev in self
                    .send(json!({"stream": true, "temperature": 0, "logprobs": true, "top_logprobs": 2}))
                    .await
                    .events()
                {
                    let Ok(chunk) = serde_json::from_str::<Value>(&ev) else { continue };
                    if let Some(c) = chunk["choices"][0]["logprobs"]["content"].as_array() {
                        streamed.extend(c.iter().cloned());
                    }
                }
                assert_eq!(streamed, content);
                for bad in [json!("yes"), json!(1)] {
                    let r = self.send(json!({"logprobs": bad})).await;
                    assert_eq!((r.status, r.json()["error"]["param"].clone()), (400, json!("logprobs")), "{bad}");
                }
                let off = self.answer(json!({"logprobs": false})).await;
                assert!(!off.0.is_empty());
            }
            "logprobs" => {
                let ask = json!({"prompt": "The quick brown fox jumps over", "temperature": 0, "logprobs": 3, "max_tokens": 6});
                let r = self.send(ask).await;
                assert_eq!(r.status, 200, "{}", r.body);
                let v = r.json();
                let lp = &v["choices"][0]["logprobs"];
                let tokens = lp["tokens"].as_array().expect("tokens");
                assert_eq!(tokens.len(), 6, "{lp}");
                let joined: String = tokens.iter().map(|t| t.as_str().expect("token")).collect();
                assert_eq!(joined, v["choices"][0]["text"].as_str().expect("text"), "the tokens spell the text");
                let offsets: Vec<u64> =
                    lp["text_offset"].as_array().expect("offsets").iter().map(|o| o.as_u64().expect("o")).collect();
                assert!(offsets[0] == 0 && offsets.windows(2).all(|w| w[0] <= w[1]), "{lp}");
                for (i, top) in lp["top_logprobs"].as_array().expect("top").iter().enumerate() {
                    let top = top.as_object().expect("a map");
                    assert!(!top.is_empty() && top.len() <= 3, "{lp}");
                    let best = top.values().map(|l| l.as_f64().expect("lp")).fold(f64::MIN, f64::max);
                    assert_eq!(lp["token_logprobs"][i].as_f64(), Some(best), "greedy takes the most likely");
                }
                for bad in [json!(21), json!(true), json!(-1)] {
                    let r = self.send(json!({"logprobs": bad})).await;
                    assert_eq!((r.status, r.json()["error"]["param"].clone()), (400, json!("logprobs")), "{bad}");
                }
            }
            "top_logprobs" => {
                for ask in [
                    json!({"top_logprobs": 2}),
                    json!({"logprobs": false, "top_logprobs": 2}),
                    json!({"logprobs": true, "top_logprobs": 21}),
                ] {
                    let r = self.send(ask.clone()).await;
                    assert_eq!((r.status, r.json()["error"]["param"].clone()), (400, json!("top_logprobs")), "{ask}");
                }
                let r = self.send(json!({"logprobs": true, "top_logprobs": 0})).await;
                assert_eq!(r.status, 200, "{}", r.body);
                let content = r.json()["choices"][0]["logprobs"]["content"].clone();
                assert!(
                    content.as_array().is_some_and(|c| c.iter().all(|e| e["top_logprobs"] == json!([]))),
                    "{content}"
                );
            }
            "response_format" => {
                // Sampled at temperature 1, the answers still follow the constraint.
                let schema = json!({"type": "object", "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
                    "required": ["city", "rank"], "additionalProperties": false});
                let format =
                    json!({"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": true}});
                let hot = |extra: Value| {
                    let mut b = json!({"temperature": 1.0, "seed": 4, "n": 4, "max_tokens": 64});
                    for (k, v) in extra.as_object().expect("object") {
                        b[k] = v.clone();
                    }
                    b
                };
                let texts = |v: &Value| -> Vec<String> {
                    v["choices"]
                        .as_array()
                        .expect("choices")
                        .iter()
                        .map(|c| c["message"]["content"].as_str().expect("text").to_string())
                        .collect()
                };
                let r = self.send(hot(json!({"response_format": format}))).await;
                assert_eq!(r.status, 200, "{}", r.body);
                for t in texts(&r.json()) {
                    let v: Value = serde_json::from_str(&t).unwrap_or_else(|e| panic!("{e}: {t:?}"));
                    let o = v.as_object().expect("an object");
                    assert_eq!(o.len(), 2, "{t}");
                    assert!(o["city"].as_str().is_some_and(|c| c.chars().count() <= 12), "{t}");
                    assert!(o["rank"].as_u64().is_some_and(|r| (1..=9).contains(&r)), "{t}");
                }
                let r = self.send(hot(json!({"response_format": {"type": "json_object"}, "max_tokens": 200}))).await;
                assert_eq!(r.status, 200, "{}", r.body);
                for (t, c) in texts(&r.json()).iter().zip(r.json()["choices"].as_array().expect("c")) {
                    if c["finish_reason"] == "stop" {
                        assert!(serde_json::from_str::<Value>(t).is_ok_and(|v| v.is_object()), "{t:?}");
                    }
                }
                // vLLM's fields: a choice and a regular expression.
                let r = self.send(hot(json!({"guided_choice": ["north", "south", "east (or west)"]}))).await;
                for t in texts(&r.json()) {
                    assert!(["north", "south", "east (or west)"].contains(&t.as_str()), "{t:?}");
                }
                let r = self.send(hot(json!({"guided_regex": "[0-9]{3}-[a-z]{2}"}))).await;
                let re = regex::Regex::new("^[0-9]{3}-[a-z]{2}$").expect("regex");
                for t in texts(&r.json()) {
                    assert!(re.is_match(&t), "{t:?}");
                }
                // A Lark grammar (a sum of small numbers, the `+` nesting), in both of vLLM's forms.
                let lark = "start: sum\nsum: NUM | NUM \" + \" sum\nNUM: /[1-9]/";
                let sum = regex::Regex::new(r"^[1-9]( \+ [1-9])*$").expect("regex");
                // The same in GBNF, as llama.cpp and vLLM's xgrammar backend take it.
                let gbnf = "root ::= num (\" + \" num)*\nnum ::= [1-9]";
                for form in [
                    json!({"guided_grammar": lark}),
                    json!({"structured_outputs": {"grammar": lark}}),
                    json!({"guided_grammar": gbnf}),
                ] {
                    let r = self.send(hot(form.clone())).await;
                    assert_eq!(r.status, 200, "{form}: {}", r.body);
                    for (t, c) in texts(&r.json()).iter().zip(r.json()["choices"].as_array().expect("c")) {
                        let whole = c["finish_reason"] == "stop";
                        let in_grammar = t.chars().all(|ch| "123456789 +".contains(ch)) && (!whole || sum.is_match(t));
                        assert!(in_grammar, "{form}: {t:?}");
                    }
                }
                for (bad, param) in [
                    (
                        json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
                        "response_format",
                    ),
                    (json!({"response_format": {"type": "yaml"}}), "response_format"),
                    (json!({"guided_regex": "("}), "guided_regex"),
                    (json!({"response_format": {"type": "json_object"}, "guided_regex": "a"}), "guided_regex"),
                    (json!({"guided_choice": []}), "guided_choice"),
                    (json!({"guided_grammar": "root ::= b"}), "guided_grammar"),
                    (json!({"guided_grammar": "start: ("}), "guided_grammar"),
                ] {
                    let r = self.send(bad.clone()).await;
                    assert_eq!(
                        (r.status, r.json()["error"]["param"].clone()),
                        (400, json!(param)),
                        "{bad}: {}",
                        r.body
                    );
                }
            }
            "tools" => {
                // A named function's call: its arguments follow its parameters (the whole of it in
                // `tool_calls_are_forced_by_their_schemas_across_prefill_and_decode`).
                // Bounded integers and a fixed seed: an unbounded integer sampled at temperature 1 can run past the
                // token budget (it did, once in several runs, before the bounds), and then the arguments are cut.
                let n = json!({"type": "integer", "minimum": 0, "maximum": 999});
                let tools = json!([{"type": "function", "function": {"name": "add", "parameters": {"type": "object",
                    "properties": {"a": n, "b": n}, "required": ["a", "b"], "additionalProperties": false}}}]);
                let choice = json!({"type": "function", "function": {"name": "add"}});
                let r = self.send(json!({"tools": tools, "tool_choice": choice, "max_tokens": 40, "seed": 7})).await;
                assert_eq!(r.status, 200, "{}", r.body);
                let call = &r.json()["choices"][0]["message"]["tool_calls"][0]["function"];
                let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap_or("")).expect("JSON");
                assert!(call["name"] == "add" && args["a"].is_i64() && args["b"].is_i64(), "{}", r.body);
            }
            "tool_choice" => {
                // `none`: text, though tools are given; `auto` needs a parser of the model's calls: refused.
                let tools = json!([{"type": "function", "function": {"name": "f"}}]);
                // (Sampled: the answer may end before max_tokens, as it did once in CI.)
                let (text, _, finish) = self.answer(json!({"tools": tools, "tool_choice": "none"})).await;
                assert!(!text.is_empty() && ["length", "stop"].contains(&finish.as_str()), "{text:?} {finish}");
                let r = self.send(json!({"tools": tools, "tool_choice": "auto"})).await;
                assert_eq!((r.status, r.json()["error"]["param"].clone()), (400, json!("tool_choice")), "{}", r.body);
            }
            other => panic!("no check for implemented field {other}"),
        }
    }
}

async fn every_field(chat: bool) {
    let module =
        if chat { "openai.types.chat.completion_create_params" } else { "openai.types.completion_create_params" };
    let fields = openai_fields(module);
    assert!(fields.len() > 10, "{fields:?}");
    let ca = DevCa::generate().expect("ca");
    let (workers, router) = cluster(&ca, &[Role::Both]).await;
    let api = Api { addr: router.addr, chat };
    let asks = asks(chat);
    for field in &fields {
        if IMPLEMENTED.contains(&field.as_str()) {
            api.check_implemented(field).await;
            continue;
        }
        let Some((value, accepted)) = asks.get(field.as_str()) else {
            panic!(
                "the openai package has a field this test does not know: {field} (decide its rule in router/src/http/fields.rs)"
            );
        };
        let r = api.send(json!({field.as_str(): value})).await;
        if *accepted {
            assert_eq!(r.status, 200, "{field} = {value}: {}", r.body);
        } else {
            let e = r.json();
            assert_eq!((r.status, &e["error"]["param"]), (400, &json!(field)), "{field} = {value}: {}", r.body);
        }
    }
    // A field no schema has is refused as well.
    let r = api.send(json!({"temprature": 0.5})).await;
    assert_eq!((r.status, r.json()["error"]["param"].clone()), (400, json!("temprature")));
    stop(router, workers).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_chat_completion_field_works_or_is_refused_by_name() {
    every_field(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_completion_field_works_or_is_refused_by_name() {
    every_field(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_layer_errors_are_openai_json() {
    let ca = DevCa::generate().expect("ca");
    let (workers, router) = cluster(&ca, &[Role::Both]).await;
    let big = json!({"model": MODEL, "prompt": "x".repeat(3 << 20)}).to_string();
    for (method, path, body, status) in [
        ("POST", "/v1/completions", big.as_str(), 413),
        ("GET", "/v1/chat/completions", "", 405),
        ("POST", "/v1/no-such-endpoint", "{}", 404),
        ("POST", "/v1/completions", "[1, 2]", 400),
    ] {
        let r = http(router.addr, method, path, body, &[]).await;
        assert_eq!(r.status, status, "{method} {path}: {}", r.body);
        let e = r.json();
        assert!(e["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{method} {path}: {}", r.body);
        assert!(e["error"]["type"].is_string(), "{}", r.body);
    }
    stop(router, workers).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_and_detokenize_as_vllm_serves_them() {
    let ca = DevCa::generate().expect("ca");
    let (workers, router) = cluster(&ca, &[Role::Both]).await;
    let text = "The sea is wide and deep.";
    let want = engine::text::TextModel::open(&model()).expect("model").tokenizer().encode(text);
    let r = http(router.addr, "POST", "/tokenize", &json!({"model": MODEL, "prompt": text}).to_string(), &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!((v["tokens"].clone(), v["count"].as_u64()), (json!(want), Some(want.len() as u64)));
    assert!(v["max_model_len"].as_u64().is_some_and(|n| n > 1000));
    let r = http(router.addr, "POST", "/detokenize", &json!({"model": MODEL, "tokens": want}).to_string(), &[]).await;
    assert_eq!((r.status, r.json()["prompt"].clone()), (200, json!(text)), "{}", r.body);
    // Messages go through the chat template: as many tokens as the chat request's prompt.
    let messages = json!([{"role": "user", "content": text}]);
    let counted = http(router.addr, "POST", "/tokenize", &json!({"messages": messages}).to_string(), &[]).await.json();
    let chat = json!({"model": MODEL, "messages": messages, "max_tokens": 1}).to_string();
    let used = http(router.addr, "POST", "/v1/chat/completions", &chat, &[]).await.json();
    assert_eq!(counted["count"], used["usage"]["prompt_tokens"], "{counted} {used}");
    // vLLM's other fields: each token's vocabulary text; the special tokens added (none by this model's tokenizer).
    let body = json!({"prompt": text, "return_token_strs": true, "add_special_tokens": false});
    let v = http(router.addr, "POST", "/tokenize", &body.to_string(), &[]).await.json();
    let strs: Vec<String> = serde_json::from_value(v["token_strs"].clone()).expect("token_strs");
    assert_eq!((v["tokens"].clone(), strs.len()), (json!(want), want.len()), "{v}");
    assert_eq!(strs.concat().replace('\u{120}', " "), text, "GPT-2's alphabet: Ġ is a space");
    let body = json!({"messages": messages, "add_generation_prompt": true, "add_special_tokens": null});
    let v = http(router.addr, "POST", "/tokenize", &body.to_string(), &[]).await.json();
    assert_eq!((v["count"].clone(), v.get("token_strs")), (counted["count"].clone(), None), "{v}");
    // Without the generation prompt (`<|im_start|>assistant\n`: four tokens), and continuing the last message.
    let body = json!({"messages": messages, "add_generation_prompt": false});
    let v = http(router.addr, "POST", "/tokenize", &body.to_string(), &[]).await.json();
    assert_eq!(v["count"].as_u64().map(|n| n + 4), counted["count"].as_u64(), "{v}");
    let reply = json!([{"role": "user", "content": text}, {"role": "assistant", "content": "It is"}]);
    let body = json!({"messages": reply, "add_generation_prompt": false, "continue_final_message": true});
    let v = http(router.addr, "POST", "/tokenize", &body.to_string(), &[]).await.json();
    let ids: Vec<u32> = serde_json::from_value(v["tokens"].clone()).expect("tokens");
    let tail = engine::text::TextModel::open(&model()).expect("model").tokenizer().decode(&ids[ids.len() - 6..]);
    assert!(tail.ends_with("assistant\nIt is"), "ends inside the assistant's message: {tail:?}");
    // Tools reach the template as a chat request's do: as many tokens as its prompt (none more on this model's
    // template, which shows no tools).
    let tools = json!([{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]);
    let v =
        http(router.addr, "POST", "/tokenize", &json!({"messages": messages, "tools": tools}).to_string(), &[]).await;
    assert_eq!(v.status, 200, "{}", v.body);
    let chat = json!({"model": MODEL, "messages": messages, "max_tokens": 1, "tools": tools, "tool_choice": "none"});
    let used = http(router.addr, "POST", "/v1/chat/completions", &chat.to_string(), &[]).await.json();
    assert_eq!(v.json()["count"], used["usage"]["prompt_tokens"], "{used}");
    for (path, body, param) in [
        ("/detokenize", json!({"tokens": [999_999]}), "tokens"),
        ("/tokenize", json!({"prompt": 5}), "prompt"),
        ("/tokenize", json!({"model": "other", "prompt": "x"}), "model"),
        ("/tokenize", json!({"prompt": "x", "return_tokens_strs": true}), "return_tokens_strs"),
        ("/tokenize", json!({"messages": messages, "continue_final_message": true}), "continue_final_message"),
        ("/tokenize", json!({"prompt": "x", "return_token_strs": "yes"}), "return_token_strs"),
        ("/tokenize", json!({"messages": messages, "tools": [{"type": "web"}]}), "tools"),
        ("/detokenize", json!({"tokens": [1], "skip_special_tokens": true}), "skip_special_tokens"),
    ] {
        let r = http(router.addr, "POST", path, &body.to_string(), &[]).await;
        assert!(r.status == 400 || r.status == 404, "{path} {body}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], json!(param), "{path} {body}");
    }
    stop(router, workers).await;
}

/// vLLM's fields for the text of the answer and the end of the conversation, through a router and a worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllms_text_and_template_fields_through_the_router() {
    let ca = DevCa::generate().expect("ca");
    let (workers, router) = cluster(&ca, &[Role::Both]).await;
    let api = Api { addr: router.addr, chat: true };
    // `truncate_prompt_tokens`: the prompt's last k tokens, answered as that much of it given as token ids; the
    // echoed prompt is what is left of it; -1 keeps as much as the context holds (all of a short prompt).
    let completions = Api { addr: router.addr, chat: false };
    let text = "The quick brown fox jumps over the lazy dog near the river bank.";
    let ids = engine::text::TextModel::open(&model()).expect("model").tokenizer().encode(text);
    let last = ids[ids.len() - 5..].to_vec();
    let cut = json!({"prompt": text, "temperature": 0, "max_tokens": 8, "truncate_prompt_tokens": 5, "echo": true});
    let r = completions.send(cut).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["usage"]["prompt_tokens"], 5, "{v}");
    let by_ids =
        completions.send(json!({"prompt": last, "temperature": 0, "max_tokens": 8, "echo": true})).await.json();
    assert_eq!(v["choices"][0]["text"], by_ids["choices"][0]["text"], "{v} / {by_ids}");
    let all = completions.send(json!({"prompt": text, "max_tokens": 1, "truncate_prompt_tokens": -1})).await.json();
    assert_eq!(all["usage"]["prompt_tokens"], ids.len(), "{all}");
    for bad in [json!(0), json!(-2), json!(1_000_000)] {
        let r = completions.send(json!({"truncate_prompt_tokens": bad})).await;
        assert_eq!((r.status, r.json()["error"]["param"].clone()), (400, json!("truncate_prompt_tokens")), "{bad}");
    }
    // `chat_template_kwargs`: each must be an argument the template reads; SmolLM2's reads none, so any is refused
    // by name (on /tokenize too), and none at all is the plain conversation.
    let r = api.send(json!({"chat_template_kwargs": {"enable_thinking": false}})).await;
    assert_eq!((r.status, r.json()["error"]["param"].clone()), (400, json!("chat_template_kwargs")), "{}", r.body);
    assert!(r.body.contains("reads no `enable_thinking`") && r.body.contains("arguments: none"), "{}", r.body);
    let plain = api.send(json!({"temperature": 0})).await.json();
    let empty = api.send(json!({"temperature": 0, "chat_template_kwargs": {}})).await.json();
    assert_eq!(plain["choices"][0]["message"], empty["choices"][0]["message"], "{empty}");
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"messages": []}});
    let r = http(router.addr, "POST", "/tokenize", &body.to_string(), &[]).await;
    assert_eq!((r.status, r.json()["error"]["param"].clone()), (400, json!("chat_template_kwargs")), "{}", r.body);
    // vLLM's `documents` go to a template that reads them (engine/tests/llamacpp_templates.rs renders those);
    // SmolLM2's does not, so they are refused by name rather than dropped.
    let r = api.send(json!({"documents": [{"title": "Tides", "text": "The sea rises twice a day."}]})).await;
    assert_eq!((r.status, r.json()["error"]["param"].clone()), (400, json!("documents")), "{}", r.body);
    // Rules that leave no token possible, on a worker that computes the whole request (the generate path; the
    // penalties test sees it at a prefill worker): a 400 that says so.
    let tokenizer = engine::text::TextModel::open(&model()).expect("model");
    let ends: Vec<u32> = (0..16).filter(|&t| tokenizer.tokenizer().is_end_of_generation(t)).collect();
    let r = api.send(json!({"allowed_token_ids": ends, "min_tokens": 1})).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("no token is possible"), "{}", r.body);
    // `return_tokens_as_token_ids`: log-probabilities name tokens by id, on both endpoints.
    let named = completions
        .send(json!({"prompt": last, "temperature": 0, "max_tokens": 3, "logprobs": 1, "return_tokens_as_token_ids": true}))
        .await
        .json();
    let tokens = named["choices"][0]["logprobs"]["tokens"].as_array().expect("tokens").clone();
    assert!(
        !tokens.is_empty() && tokens.iter().all(|t| t.as_str().is_some_and(|t| t.starts_with("token_id:"))),
        "{named}"
    );
    let r = api
        .send(json!({"temperature": 0, "max_tokens": 3, "logprobs": true, "top_logprobs": 1,
                            "return_tokens_as_token_ids": true}))
        .await
        .json();
    let entry = &r["choices"][0]["logprobs"]["content"][0];
    let id: u32 =
        entry["token"].as_str().and_then(|t| t.strip_prefix("token_id:")).and_then(|t| t.parse().ok()).expect("an id");
    let bytes: Vec<u8> =
        entry["bytes"].as_array().expect("bytes").iter().filter_map(|b| b.as_u64()).map(|b| b as u8).collect();
    let vocab = engine::text::TextModel::open(&model()).expect("model");
    assert_eq!(bytes, vocab.tokenizer().token_bytes(id), "{r}");
    // Past the end of its answer (`ignore_eos`), the model writes the next turns' markers: control tokens, left
    // out of the text unless `skip_special_tokens` is false, as vLLM and llama.cpp's server do.
    let past_the_end = json!({"temperature": 0, "max_tokens": 40, "ignore_eos": true,
        "messages": [{"role": "user", "content": "Say only: yes"}]});
    let (plain, n, _) = api.answer(past_the_end.clone()).await;
    let mut keep = past_the_end.clone();
    keep["skip_special_tokens"] = json!(false);
    let (kept, kept_n, _) = api.answer(keep).await;
    assert!(kept.contains("<|im_start|>") && !plain.contains("<|im_"), "{kept:?} / {plain:?}");
    assert_eq!(kept.replace("<|im_start|>", "").replace("<|im_end|>", ""), plain);
    assert_eq!(n, kept_n, "the same tokens, only their text differs");
    // `include_stop_str_in_output`: the stop string ends the text instead of being cut off.
    let greedy = json!({"temperature": 0, "max_tokens": 24, "ignore_eos": true});
    let (whole, _, _) = api.answer(greedy.clone()).await;
    let word = whole.split_whitespace().nth(2).expect("a few words").to_string();
    let cut = whole.find(&word).expect("the word");
    let mut stopped = greedy.clone();
    stopped["stop"] = json!([word]);
    assert_eq!(api.answer(stopped.clone()).await.0, whole[..cut]);
    stopped["include_stop_str_in_output"] = json!(true);
    for stream in [false, true] {
        stopped["stream"] = json!(stream);
        let r = api.send(stopped.clone()).await;
        let text = if stream {
            r.events()
                .iter()
                .filter_map(|e| serde_json::from_str::<Value>(e).ok())
                .filter_map(|c| c["choices"][0]["delta"]["content"].as_str().map(str::to_string))
                .collect::<String>()
        } else {
            r.json()["choices"][0]["message"]["content"].as_str().expect("text").to_string()
        };
        assert_eq!(text, whole[..cut + word.len()], "streamed: {stream}");
    }
    // The conversation's end: the prompt the worker computed is the one the template makes for it.
    let text_model = engine::text::TextModel::open(&model()).expect("model");
    let chat = vec![
        engine::chat::ChatMessage::new("user", "Name a colour."),
        engine::chat::ChatMessage::new("assistant", "My favourite colour is"),
    ];
    for (fields, ending) in [
        (json!({}), engine::chat::Ending::NewTurn),
        (json!({"add_generation_prompt": false}), engine::chat::Ending::AsIs),
        (json!({"add_generation_prompt": false, "continue_final_message": true}), engine::chat::Ending::ContinueLast),
    ] {
        let mut body = json!({"temperature": 0, "max_tokens": 4, "messages": chat});
        for (k, v) in fields.as_object().expect("fields") {
            body[k] = v.clone();
        }
        let r = api.send(body).await;
        assert_eq!(r.status, 200, "{fields}: {}", r.body);
        let prompt =
            text_model.render_chat_ending(&chat, engine::chat::ChatExtras::default(), ending).expect("renders");
        let want = text_model.tokenizer().encode(&prompt).len() as u64;
        assert_eq!(r.json()["usage"]["prompt_tokens"].as_u64(), Some(want), "{fields}");
    }
    // vLLM's top_k of -1 (or 0) is no limit: the same sample as none.
    let sampled = json!({"temperature": 1.0, "seed": 5, "max_tokens": 12, "ignore_eos": true});
    let (free, _, _) = api.answer(sampled.clone()).await;
    for k in [-1, 0] {
        let mut with = sampled.clone();
        with["top_k"] = json!(k);
        assert_eq!(api.answer(with).await.0, free, "top_k {k}");
    }
    // `min_p` 1 keeps only the most likely token: a hot sample is the greedy answer; 0 is off.
    let greedy = api.answer(json!({"temperature": 0, "max_tokens": 12, "ignore_eos": true})).await.0;
    let mut hot = json!({"temperature": 1.8, "seed": 7, "max_tokens": 12, "ignore_eos": true});
    let free = api.answer(hot.clone()).await.0;
    assert_ne!(free, greedy, "a hot sample strays from the greedy answer");
    hot["min_p"] = json!(0);
    assert_eq!(api.answer(hot.clone()).await.0, free);
    hot["min_p"] = json!(1);
    assert_eq!(api.answer(hot.clone()).await.0, greedy);
    hot["min_p"] = json!(1.5);
    let r = api.send(hot).await;
    assert_eq!((r.status, r.json()["error"]["param"].clone()), (400, json!("min_p")), "{}", r.body);
    // vLLM's newer structured outputs: a choice is one of its strings.
    let (colour, _, _) = api.answer(json!({"structured_outputs": {"choice": ["red", "blue"]}})).await;
    assert!(colour == "red" || colour == "blue", "{colour:?}");
    // Options for a stream, without one: refused, as OpenAI does.
    let r = api.send(json!({"stream_options": {"include_usage": true}})).await;
    assert_eq!((r.status, r.json()["error"]["param"].clone()), (400, json!("stream_options")), "{}", r.body);
    stop(router, workers).await;
}

/// The engine's own answer for `messages` with these sampling rules, in one process.
fn engine_reply(messages: &[engine::chat::ChatMessage], max_tokens: u32, rules: LogitsRules) -> (String, Vec<u32>) {
    use engine::generate::{Engine, EngineConfig, Request};
    use engine::sampling::{RawSampling, SamplingParams};
    let mut e = Engine::open(&model(), EngineConfig::default()).expect("engine");
    let prompt = e.tokenizer().encode(&e.render_chat(messages).expect("template"));
    let raw = RawSampling { temperature: 0.0, max_tokens, logits: rules, ..RawSampling::default() };
    let req = Request::new(prompt, SamplingParams::new(raw).expect("valid"));
    let c = e.run(&[req], &std::sync::atomic::AtomicBool::new(false), |_| {}).expect("runs").remove(0);
    (c.text, c.token_ids)
}

use engine::sampling::LogitsRules;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn penalties_bias_min_tokens_and_stop_ids_across_prefill_and_decode_match_one_engine() {
    let ca = DevCa::generate().expect("ca");
    // A prefill and a decode worker: the first token is sampled on one, the rest on the other.
    let (workers, router) = cluster(&ca, &[Role::Prefill, Role::Decode]).await;
    let system = "You describe places. Answer in two plain sentences about what one sees there. ".repeat(3);
    let question = "Describe the sea at dawn.";
    let messages =
        [engine::chat::ChatMessage::new("system", &system), engine::chat::ChatMessage::new("user", question)];
    let ask = |extra: Value| {
        let mut b = json!({"model": MODEL, "max_tokens": 40, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]});
        for (k, v) in extra.as_object().expect("object") {
            b[k] = v.clone();
        }
        b.to_string()
    };
    let off = LogitsRules { repetition_penalty: 1.0, ..LogitsRules::default() };
    let (plain, plain_ids) = engine_reply(&messages, 40, off.clone());
    let vocab = engine::text::TextModel::open(&model()).expect("model");
    let sea = vocab.tokenizer().encode(" sea")[0];
    let allowed: Vec<u32> = plain_ids.iter().copied().filter(|&t| t != plain_ids[2]).collect();
    let banned = plain.split_whitespace().nth(3).expect("a few words").trim_matches(|c: char| !c.is_alphanumeric());
    let cases = [
        (
            json!({"frequency_penalty": 2.0, "presence_penalty": 1.0}),
            LogitsRules { frequency_penalty: 2.0, presence_penalty: 1.0, ..off.clone() },
        ),
        (json!({"repetition_penalty": 1.3}), LogitsRules { repetition_penalty: 1.3, ..off.clone() }),
        (json!({"logit_bias": {sea.to_string(): 6}}), LogitsRules { logit_bias: vec![(sea, 6.0)], ..off.clone() }),
        (
            json!({"min_tokens": 40, "frequency_penalty": 0.3}),
            LogitsRules { min_tokens: 40, frequency_penalty: 0.3, ..off.clone() },
        ),
        // vLLM's token rules: the plain answer's own tokens but its third; a word of the plain answer banned (as the
        // router tokenizes it: alone and after a space).
        (json!({"allowed_token_ids": allowed}), LogitsRules { allowed_token_ids: allowed.clone(), ..off.clone() }),
        (
            json!({"bad_words": [banned]}),
            LogitsRules {
                bad_words: router::http::completions::bad_word_tokens(vocab.tokenizer(), banned),
                ..off.clone()
            },
        ),
    ];
    for (fields, rules) in cases {
        let (want, _) = engine_reply(&messages, 40, rules);
        assert_ne!(want, plain, "{fields} changes the engine's output");
        let r = http(router.addr, "POST", "/v1/chat/completions", &ask(fields.clone()), &[]).await;
        assert_eq!(r.status, 200, "{fields}: {}", r.body);
        assert_eq!(r.json()["choices"][0]["message"]["content"], json!(want), "{fields}: P + D = one engine");
        if fields.get("bad_words").is_some() {
            let words = || want.split(|c: char| !c.is_alphanumeric());
            assert!(words().all(|w| w != banned), "{banned:?} is out: {want}");
        }
    }
    // A stop token id ends the answer before it, whatever ignore_eos says.
    let stop_id = plain_ids[4];
    let r = http(
        router.addr,
        "POST",
        "/v1/chat/completions",
        &ask(json!({"stop_token_ids": [stop_id], "ignore_eos": true})),
        &[],
    )
    .await
    .json();
    assert_eq!(r["choices"][0]["finish_reason"], "stop", "{r}");
    let (cut, _) = engine_reply(&messages, 4, off);
    assert_eq!(r["choices"][0]["message"]["content"], json!(cut), "{r}");
    // Ids outside the vocabulary and values out of range are refused by name.
    for (fields, param) in [
        (json!({"logit_bias": {"999999": 1}}), "logit_bias"),
        (json!({"logit_bias": {"5": 101}}), "logit_bias"),
        (json!({"frequency_penalty": 2.5}), "frequency_penalty"),
        (json!({"repetition_penalty": 0}), "repetition_penalty"),
        (json!({"min_tokens": 41}), "min_tokens"),
        (json!({"stop_token_ids": [999999]}), "stop_token_ids"),
        (json!({"allowed_token_ids": [999999]}), "allowed_token_ids"),
        (json!({"allowed_token_ids": []}), "allowed_token_ids"),
        (json!({"bad_words": [" "]}), "bad_words"),
    ] {
        let r = http(router.addr, "POST", "/v1/chat/completions", &ask(fields.clone()), &[]).await;
        assert_eq!((r.status, r.json()["error"]["param"].clone()), (400, json!(param)), "{fields}: {}", r.body);
    }
    // Rules that leave no token possible (only end-of-generation tokens allowed, which min_tokens rules out) are a
    // 400 that says so, not an arbitrary token.
    let ends: Vec<u32> = (0..16).filter(|&t| vocab.tokenizer().is_end_of_generation(t)).collect();
    assert!(!ends.is_empty());
    let r = http(
        router.addr,
        "POST",
        "/v1/chat/completions",
        &ask(json!({"allowed_token_ids": ends, "min_tokens": 2})),
        &[],
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.json()["error"]["message"].as_str().is_some_and(|m| m.contains("no token is possible")), "{}", r.body);
    stop(router, workers).await;
}

/// A streamed answer's chunks (all but `[DONE]`), parsed.
fn json_chunks(r: &Reply) -> Vec<Value> {
    r.events().iter().filter(|d| *d != "[DONE]").map(|d| serde_json::from_str(d).expect("json")).collect()
}

/// `base` with `extra`'s fields set, as a request body.
fn merged(mut base: Value, extra: &Value) -> String {
    for (k, v) in extra.as_object().expect("object") {
        base[k] = v.clone();
    }
    base.to_string()
}

/// `tool_choice: auto` with the router's `tool_call_parser` (Hermes' format): the model's own calls are parsed out
/// of its text, whole and streamed (each call once it is written), across a prefill and a decode worker; text
/// without calls is the content. The served model writes no calls by itself, so a regular expression (allowed beside
/// `auto`) makes it write two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_models_own_tool_calls_are_parsed_with_auto() {
    let ca = DevCa::generate().expect("ca");
    let hermes = |r: router::run::RouterConfig| router::run::RouterConfig {
        tool_call_parser: Some(router::http::tools::ToolParser::Hermes),
        ..r
    };
    let (workers, router) = cluster_with(&ca, &[Role::Prefill, Role::Decode], |w| w, hermes).await;
    let r = http(router.addr, "PUT", "/admin/router-config", r#"{"disaggregation":"always"}"#, &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let now = json!({"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}});
    let ask = |extra: Value| {
        let base = json!({"model": MODEL, "max_tokens": 80, "temperature": 0, "tools": [now],
                          "messages": [{"role": "user", "content": "What time is it?"}]});
        merged(base, &extra)
    };
    let post = |body: String| {
        let addr = router.addr;
        async move { http(addr, "POST", "/v1/chat/completions", &body, &[]).await }
    };
    // No tool_choice means auto: the model answers in words, which are the content.
    let r = post(ask(json!({}))).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert!(v["choices"][0]["message"]["content"].as_str().is_some_and(|t| !t.is_empty()), "{v}");
    assert!(v["choices"][0]["message"].get("tool_calls").is_none(), "{v}");
    assert_ne!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
    // Words, then two calls in the model's format.
    let call =
        |zone: &str| format!(r#"<tool_call>\{{"name": "now", "arguments": \{{"zone": "{zone}"\}}\}}</tool_call>"#);
    let regex = format!(r#"Checking\. {}\n{}"#, call("UTC"), call("CET"));
    let written = json!({"tool_choice": "auto", "structured_outputs": {"regex": regex}});
    let r = post(ask(written.clone())).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let choice = &v["choices"][0];
    assert_eq!((&choice["message"]["content"], &choice["finish_reason"]), (&json!("Checking. "), &json!("tool_calls")));
    let calls = choice["message"]["tool_calls"].as_array().expect("calls");
    assert_eq!(calls.len(), 2, "{v}");
    assert_eq!((&calls[0]["function"]["name"], &calls[0]["type"]), (&json!("now"), &json!("function")), "{v}");
    assert_eq!(calls[0]["function"]["arguments"], json!(r#"{"zone":"UTC"}"#), "{v}");
    assert_eq!(calls[1]["function"]["arguments"], json!(r#"{"zone":"CET"}"#), "{v}");
    assert!(calls[0]["id"].as_str().is_some_and(|id| id.starts_with("call_")), "{v}");
    // Streamed: the words as content as they come, never the calls' text; each call whole once written: the
    // usage in every chunk shows the first went out before the second was written.
    let mut streamed = written;
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true, "continuous_usage_stats": true});
    let r = post(ask(streamed)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let chunks = json_chunks(&r);
    let deltas: Vec<&Value> = chunks.iter().filter_map(|c| c["choices"].get(0)).map(|c| &c["delta"]).collect();
    let content: String = deltas.iter().filter_map(|d| d["content"].as_str()).collect();
    assert_eq!(content, "Checking. ", "as the whole answer's: {chunks:?}");
    let pieces: Vec<(&Value, &Value)> = chunks
        .iter()
        .filter_map(|c| Some((&c["choices"].get(0)?["delta"].get("tool_calls")?[0], &c["usage"]["completion_tokens"])))
        .collect();
    assert_eq!(pieces.len(), 2, "{chunks:?}");
    for (k, (piece, _)) in pieces.iter().enumerate() {
        assert_eq!(piece["index"], k, "{chunks:?}");
        assert_eq!(
            (&piece["function"]["name"], &piece["function"]["arguments"]),
            (&json!("now"), &calls[k]["function"]["arguments"])
        );
        assert!(piece["id"].as_str().is_some_and(|id| id.starts_with("call_")), "{chunks:?}");
    }
    let written_by = |k: usize| pieces[k].1.as_u64().expect("usage in every chunk");
    assert!(written_by(0) < written_by(1), "the first call out before the second was written: {chunks:?}");
    let finish = chunks.iter().rev().find_map(|c| c["choices"].get(0)).expect("a choice")["finish_reason"].clone();
    assert_eq!(finish, "tool_calls");
    stop(router, workers).await;
}

/// The same with Mistral's format (`--tool-call-parser mistral`): the words before the marker are the content, the
/// v11 call after it a call, whose id is the 9 letters and digits Mistral's templates take back, as a follow-up turn
/// sends it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mistral_tool_calls_are_parsed_with_ids_its_templates_take() {
    let ca = DevCa::generate().expect("ca");
    let mistral = |r: router::run::RouterConfig| router::run::RouterConfig {
        tool_call_parser: Some(router::http::tools::ToolParser::Mistral),
        ..r
    };
    let (workers, router) = cluster_with(&ca, &[Role::Both], |w| w, mistral).await;
    let now = json!({"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}});
    let question = json!({"role": "user", "content": "What time is it?"});
    let call = r#"Checking\. \[TOOL_CALLS\]now\{"zone": "UTC"\}"#;
    let body = |stream: bool| {
        json!({"model": MODEL, "max_tokens": 40, "temperature": 0, "tools": [now], "stream": stream,
               "messages": [question], "structured_outputs": {"regex": call}})
        .to_string()
    };
    let short =
        |id: &Value| id.as_str().is_some_and(|id| id.len() == 9 && id.chars().all(|c| c.is_ascii_alphanumeric()));
    let r = http(router.addr, "POST", "/v1/chat/completions", &body(false), &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let message = &v["choices"][0]["message"];
    assert_eq!((&message["content"], &v["choices"][0]["finish_reason"]), (&json!("Checking. "), &json!("tool_calls")));
    let calls = message["tool_calls"].as_array().expect("calls");
    assert_eq!(calls.len(), 1, "{v}");
    assert_eq!(
        (&calls[0]["function"]["name"], &calls[0]["function"]["arguments"]),
        (&json!("now"), &json!(r#"{"zone":"UTC"}"#))
    );
    assert!(short(&calls[0]["id"]), "{v}");
    // Streamed: the words as they come, the call whole at the end with an id of the same kind.
    let r = http(router.addr, "POST", "/v1/chat/completions", &body(true), &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let chunks = json_chunks(&r);
    let deltas: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]["delta"]).collect();
    assert_eq!(deltas.iter().filter_map(|d| d["content"].as_str()).collect::<String>(), "Checking. ", "{chunks:?}");
    let pieces: Vec<&Value> = deltas.iter().filter_map(|d| d.get("tool_calls")).map(|c| &c[0]).collect();
    assert_eq!(pieces.len(), 1, "{chunks:?}");
    assert!(short(&pieces[0]["id"]) && pieces[0]["function"]["name"] == "now", "{chunks:?}");
    // The call and the tool's answer go back by that id.
    let follow = json!({"model": MODEL, "max_tokens": 8, "temperature": 0, "tools": [now], "tool_choice": "none",
        "messages": [question, message, {"role": "tool", "tool_call_id": calls[0]["id"], "content": "12:00"}]});
    let r = http(router.addr, "POST", "/v1/chat/completions", &follow.to_string(), &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    stop(router, workers).await;
}

/// A reasoning model's thinking (`--reasoning-parser deepseek_r1`) comes apart from its answer, whole and streamed;
/// a grammar holds only after it, and tool calls (`hermes`) are read from the answer after it; `include_reasoning:
/// false` leaves it out, and a turn that carries it goes back to the template. The served model does not think by
/// itself: shown two turns that think in `<think>` … `</think>` first, it writes its answer the same way, and
/// without them its whole answer is thinking, as DeepSeek R1's, whose template opens the block in the prompt, would
/// be.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thinking_comes_apart_from_the_answer_and_its_calls() {
    let ca = DevCa::generate().expect("ca");
    let parsers = |r: router::run::RouterConfig| router::run::RouterConfig {
        tool_call_parser: Some(router::http::tools::ToolParser::Hermes),
        reasoning_parser: Some(router::http::reasoning::ReasoningParser::DeepSeekR1),
        ..r
    };
    let (workers, router) = cluster_with(&ca, &[Role::Both], |w| w, parsers).await;
    let question = json!({"role": "user", "content": "Is the sky blue?"});
    let shown = json!([
        {"role": "system", "content": "Think first inside <think> and </think>, then answer."},
        {"role": "user", "content": "Is fire hot?"},
        {"role": "assistant", "content": "<think>\nFire burns.\n</think>\n\nYes."},
        {"role": "user", "content": "Is ice cold?"},
        {"role": "assistant", "content": "<think>\nIce is frozen.\n</think>\n\nYes."},
        question,
    ]);
    let ask = |extra: Value| {
        let base = json!({"model": MODEL, "max_tokens": 60, "temperature": 0, "messages": shown});
        merged(base, &extra)
    };
    let post = |body: String| {
        let addr = router.addr;
        async move { http(addr, "POST", "/v1/chat/completions", &body, &[]).await }
    };
    let r = post(ask(json!({}))).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let message = &v["choices"][0]["message"];
    let (thought, answer) = (message["reasoning_content"].clone(), message["content"].clone());
    assert_eq!(message["reasoning"], thought);
    let thinks = thought.as_str().is_some_and(|t| !t.trim().is_empty() && !t.contains("think>"));
    assert!(thinks && answer.as_str().is_some_and(|a| !a.trim().is_empty()), "{v}");
    // The tokens spent thinking: some, not all.
    let usage = v["usage"].clone();
    let spent = usage["completion_tokens_details"]["reasoning_tokens"].as_u64().unwrap_or(0);
    assert!(spent > 2 && spent < usage["completion_tokens"].as_u64().unwrap_or(0), "{usage}");
    // Streamed: the thinking in its own deltas, then the answer.
    let r = post(ask(json!({"stream": true, "stream_options": {"include_usage": true}}))).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let chunks = json_chunks(&r);
    let streamed = chunks.last().map(|c| &c["usage"]["completion_tokens_details"]);
    assert_eq!(streamed, Some(&usage["completion_tokens_details"]), "the same count streamed: {chunks:?}");
    let deltas: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]["delta"]).collect();
    let part = |key: &str| json!(deltas.iter().filter_map(|d| d[key].as_str()).collect::<String>());
    assert_eq!((part("reasoning_content"), part("content")), (thought.clone(), answer.clone()), "{chunks:?}");
    assert!(deltas.iter().all(|d| d["reasoning"] == d["reasoning_content"]), "{chunks:?}");
    // Left out when asked.
    let v = post(ask(json!({"include_reasoning": false}))).await.json();
    assert!(v["choices"][0]["message"].get("reasoning_content").is_none(), "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], answer, "{v}");
    // A grammar holds the answer after the thinking, which stays the model's own.
    let v = post(ask(json!({"response_format": {"type": "json_object"}}))).await.json();
    let message = &v["choices"][0]["message"];
    assert_eq!(message["reasoning_content"], thought, "{v}");
    let content = message["content"].as_str().unwrap_or_else(|| panic!("{v}"));
    let object: Value = serde_json::from_str(content.trim_start()).unwrap_or_else(|e| panic!("{e}: {v}"));
    assert!(object.is_object(), "{v}");
    // Thinking, then a call in the answer after it.
    let now = json!({"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}});
    let v = post(ask(json!({"tools": [now], "tool_choice": "required"}))).await.json();
    let choice = &v["choices"][0];
    assert_eq!(choice["message"]["reasoning_content"], thought, "{v}");
    assert_eq!(choice["message"]["tool_calls"][0]["function"]["name"], "now", "{v}");
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    // Without the turns shown, the model never closes the block: all of its answer is thinking, and no content.
    let alone = json!({"model": MODEL, "max_tokens": 40, "temperature": 0, "messages": [question]});
    let v = post(alone.to_string()).await.json();
    let message = &v["choices"][0]["message"];
    assert!(
        message["reasoning_content"].as_str().is_some_and(|t| !t.is_empty()) && message["content"].is_null(),
        "{v}"
    );
    // The turn goes back with its thinking.
    let follow = json!({"model": MODEL, "max_tokens": 4, "messages": [question,
        {"role": "assistant", "content": "Yes.", "reasoning_content": "Hmm."}, {"role": "user", "content": "Why?"}]});
    assert_eq!(post(follow.to_string()).await.status, 200);
    stop(router, workers).await;
}

/// OpenAI's Responses API answers what the chat endpoint answers for the same conversation, whole and as its
/// events (each named by its type, numbered in order, the last one carrying the whole response); a forced call is a
/// `function_call` item; a refusal names this API's field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_responses_api_answers_as_chat_does() {
    let (workers, router) = disaggregated().await;
    let post = |path: &'static str, body: Value| {
        let addr = router.addr;
        async move { http(addr, "POST", path, &body.to_string(), &[]).await }
    };
    let chat = post(
        "/v1/chat/completions",
        json!({"model": MODEL, "max_tokens": 12, "temperature": 0,
        "messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a river."}]}),
    )
    .await
    .json();
    let want = chat["choices"][0]["message"]["content"].as_str().expect("text").to_string();
    let status = if chat["choices"][0]["finish_reason"] == "length" { "incomplete" } else { "completed" };
    let ask = json!({"model": MODEL, "max_output_tokens": 12, "temperature": 0, "instructions": "Answer briefly.",
                     "input": [{"role": "user", "content": [{"type": "input_text", "text": "Name a river."}]}]});
    let r = post("/v1/responses", ask.clone()).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!((&v["object"], &v["status"]), (&json!("response"), &json!(status)), "{v}");
    assert_eq!(v["output"][0]["content"][0]["text"], json!(want), "{v}");
    assert_eq!(v["usage"]["output_tokens"], chat["usage"]["completion_tokens"], "{v}");
    assert!(v["id"].as_str().is_some_and(|id| id.starts_with("resp_")), "{v}");
    // Streamed.
    let mut streamed = ask.clone();
    streamed["stream"] = json!(true);
    let r = post("/v1/responses", streamed).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let names: Vec<&str> = r.body.lines().filter_map(|l| l.strip_prefix("event: ")).collect();
    let events: Vec<Value> = r.events().iter().map(|d| serde_json::from_str(d).expect("json")).collect();
    assert_eq!(names, events.iter().map(|e| e["type"].as_str().expect("type")).collect::<Vec<_>>());
    assert_eq!((names[0], names[names.len() - 1]), ("response.created", format!("response.{status}").as_str()));
    let text: String = events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .filter_map(|e| e["delta"].as_str())
        .collect();
    assert_eq!(text, want);
    let numbers: Vec<u64> = events.iter().filter_map(|e| e["sequence_number"].as_u64()).collect();
    assert_eq!(numbers, (0..events.len() as u64).collect::<Vec<_>>());
    let last = &events[events.len() - 1]["response"];
    // The same items as the whole answer's (but for their ids: another request's).
    let unnamed = |output: &Value| -> Vec<Value> {
        let mut items = output.as_array().expect("items").clone();
        for item in &mut items {
            item.as_object_mut().expect("an item").remove("id");
        }
        items
    };
    assert_eq!((unnamed(&last["output"]), &last["usage"]), (unnamed(&v["output"]), &v["usage"]), "the whole answer's");
    // Kept: read back by its id, and gone on again by a response naming it (without its instructions, which are not
    // inherited), as the chat endpoint answers the whole conversation.
    let id = v["id"].as_str().expect("id").to_string();
    let got = http(router.addr, "GET", &format!("/v1/responses/{id}"), "", &[]).await;
    assert_eq!((got.status, got.json()), (200, v.clone()));
    let follow = json!({"model": MODEL, "max_output_tokens": 8, "temperature": 0, "previous_response_id": id,
                        "input": "And a mountain?"});
    let next = post("/v1/responses", follow.clone()).await.json();
    let conversation = json!([{"role": "user", "content": "Name a river."}, {"role": "assistant", "content": want},
                              {"role": "user", "content": "And a mountain?"}]);
    let chat_next = post(
        "/v1/chat/completions",
        json!({"model": MODEL, "max_tokens": 8, "temperature": 0,
                                                        "messages": conversation}),
    )
    .await
    .json();
    assert_eq!(next["output"][0]["content"][0]["text"], chat_next["choices"][0]["message"]["content"], "{next}");
    assert_eq!(next["previous_response_id"], json!(id));
    // Deleted: gone for reading and for going on.
    let gone = http(router.addr, "DELETE", &format!("/v1/responses/{id}"), "", &[]).await;
    assert_eq!((gone.status, &gone.json()["deleted"]), (200, &json!(true)));
    assert_eq!(http(router.addr, "GET", &format!("/v1/responses/{id}"), "", &[]).await.status, 404);
    let r = post("/v1/responses", follow).await;
    assert_eq!((r.status, r.json()["error"]["param"].clone()), (404, json!("previous_response_id")), "{}", r.body);
    // Not kept when asked not to.
    let mut unkept = ask.clone();
    unkept["store"] = json!(false);
    let v = post("/v1/responses", unkept).await.json();
    let id = v["id"].as_str().expect("id");
    assert_eq!(http(router.addr, "GET", &format!("/v1/responses/{id}"), "", &[]).await.status, 404);
    // The text's log-probabilities, when included: one entry per token of the text, with its alternatives.
    let mut included = ask.clone();
    included["include"] = json!(["message.output_text.logprobs"]);
    included["top_logprobs"] = json!(2);
    let v = post("/v1/responses", included).await.json();
    let entries = v["output"][0]["content"][0]["logprobs"].as_array().expect("logprobs").clone();
    let spelled: String = entries.iter().filter_map(|e| e["token"].as_str()).collect();
    assert_eq!(spelled, want, "{v}");
    assert!(entries.iter().all(|e| e["top_logprobs"].as_array().is_some_and(|t| t.len() == 2)), "{v}");
    // A forced call.
    let now = json!({"type": "function", "name": "now", "parameters": {"type": "object",
                     "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": false}});
    let forced = json!({"model": MODEL, "input": "What time is it?", "tools": [now],
                        "tool_choice": {"type": "function", "name": "now"}, "max_output_tokens": 20});
    let v = post("/v1/responses", forced).await.json();
    let call = &v["output"][0];
    assert_eq!((&call["type"], &call["name"]), (&json!("function_call"), &json!("now")), "{v}");
    let args: Value = serde_json::from_str(call["arguments"].as_str().expect("arguments")).expect("JSON");
    assert!(["UTC", "CET"].contains(&args["zone"].as_str().unwrap_or("")), "{v}");
    // Refusals name this API's fields.
    for (body, param) in [
        (json!({"model": MODEL, "input": "?", "max_output_tokens": 0}), "max_output_tokens"),
        (json!({"model": MODEL, "input": "?", "conversation": "conv_1"}), "conversation"),
        (json!({"model": MODEL, "input": "?", "seed": 1}), "seed"),
    ] {
        let r = post("/v1/responses", body.clone()).await;
        assert_eq!((r.status, r.json()["error"]["param"].clone()), (400, json!(param)), "{body}: {}", r.body);
    }
    // Its requests are counted under its own route, answered or refused (two chat requests were sent above).
    let metrics = http(router.addr, "GET", "/metrics", "", &[]).await.body;
    let count = |route: &str, status: &str| {
        let line = format!("tandem_router_requests_total{{route=\"{route}\",status=\"{status}\"}} ");
        metrics.lines().find_map(|l| l.strip_prefix(line.as_str())).and_then(|v| v.trim().parse::<u64>().ok())
    };
    assert_eq!(count("/v1/chat/completions", "200"), Some(2), "{metrics}");
    assert!(count("/v1/responses", "200").is_some_and(|n| n >= 3), "{metrics}");
    assert!(count("/v1/responses", "400").is_some_and(|n| n >= 3), "{metrics}");
    stop(router, workers).await;
}

/// A router that keeps no responses (`responses_store_mb = 0`) says so to a request that asks for it, and answers
/// one that leaves `store` to its default without keeping it (the response says `store: false`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_that_keeps_no_responses_says_so() {
    let ca = DevCa::generate().expect("ca");
    let none = |r: router::run::RouterConfig| router::run::RouterConfig { responses_store_mb: 0, ..r };
    let (workers, router) = cluster_with(&ca, &[Role::Both], |w| w, none).await;
    let ask = |store: Option<bool>| {
        let mut b = json!({"model": MODEL, "input": "Hi", "max_output_tokens": 2});
        if let Some(s) = store {
            b["store"] = json!(s);
        }
        b.to_string()
    };
    let r = http(router.addr, "POST", "/v1/responses", &ask(Some(true)), &[]).await;
    assert_eq!((r.status, r.json()["error"]["param"].clone()), (400, json!("store")), "{}", r.body);
    for store in [None, Some(false)] {
        let v = http(router.addr, "POST", "/v1/responses", &ask(store), &[]).await.json();
        assert_eq!(v["store"], json!(false), "{v}");
        let id = v["id"].as_str().expect("id");
        assert_eq!(http(router.addr, "GET", &format!("/v1/responses/{id}"), "", &[]).await.status, 404);
    }
    stop(router, workers).await;
}

/// A prefill and a decode worker behind a router that always disaggregates: the first token is sampled on one,
/// the rest on the other.
async fn disaggregated() -> (Vec<worker::RunningWorker>, router::run::RunningRouter) {
    let ca = DevCa::generate().expect("ca");
    let (workers, router) = cluster(&ca, &[Role::Prefill, Role::Decode]).await;
    let r = http(router.addr, "PUT", "/admin/router-config", r#"{"disaggregation":"always"}"#, &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    (workers, router)
}

/// The engine's own greedy answer to one user message under a JSON schema, in one process.
fn engine_under_schema(question: &str, schema: &Value, max_tokens: u32) -> String {
    use engine::generate::{Engine, EngineConfig, Request};
    use engine::grammar::Grammar;
    use engine::sampling::{RawSampling, SamplingParams};
    let mut e = Engine::open(&model(), EngineConfig::default()).expect("engine");
    let prompt =
        e.tokenizer().encode(&e.render_chat(&[engine::chat::ChatMessage::new("user", question)]).expect("template"));
    let raw = RawSampling {
        temperature: 0.0,
        max_tokens,
        grammar: Some(Grammar::JsonSchema(schema.to_string())),
        ..RawSampling::default()
    };
    let req = Request::new(prompt, SamplingParams::new(raw).expect("valid"));
    e.run(&[req], &std::sync::atomic::AtomicBool::new(false), |_| {}).expect("runs").remove(0).text
}

/// Structured outputs across a prefill and a decode worker: the decode worker rebuilds the grammar's state from the
/// first token and answers as one engine does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_outputs_across_prefill_and_decode_match_one_engine() {
    let (workers, router) = disaggregated().await;
    let schema = json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "colours": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 2}},
        "required": ["name", "colours"], "additionalProperties": false});
    let question = "Name a painter and the colours they liked, as JSON.";
    let want = engine_under_schema(question, &schema, 80);
    let body = json!({"model": MODEL, "max_tokens": 80, "temperature": 0, "messages": [{"role": "user", "content": question}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "painter", "schema": schema}}});
    let r = http(router.addr, "POST", "/v1/chat/completions", &body.to_string(), &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["choices"][0]["message"]["content"], json!(want), "P + D = one engine");
    let v: Value = serde_json::from_str(&want).expect("json");
    assert!(v["colours"].as_array().is_some_and(|c| c.len() <= 2), "{want}");
    stop(router, workers).await;
}

/// The prompt's log-probabilities across a prefill and a decode worker (the prefill worker computes them and its
/// answer carries them): OpenAI's `echo` with `logprobs` (whole, streamed, and with `max_tokens` 0: the prompt
/// alone) and vLLM's `prompt_logprobs` (completions and chat) say what one engine says of the same prompt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_log_probabilities_across_prefill_and_decode_match_one_engine() {
    use engine::generate::{Engine, EngineConfig, Request};
    use engine::sampling::{RawSampling, SamplingParams};
    let ca = DevCa::generate().expect("ca");
    let (workers, router) = cluster(&ca, &[Role::Prefill, Role::Decode]).await;
    let mut e = Engine::open(&model(), EngineConfig::default()).expect("engine");
    // Three blocks and more: the decode worker pulls whole blocks of the prompt.
    let story = "The lighthouse keeper climbed the stairs every evening to light the lamp. Ships passed in the night, \
                 their crews grateful for the beam that swept the rocks, and the keeper wrote each one in his book.";
    let ids = e.tokenizer().encode(story);
    assert!(ids.len() >= 40, "{}", ids.len());
    let raw = RawSampling { max_tokens: 3, prompt_logprobs: Some(2), ..RawSampling::default() };
    let req = Request::new(ids.clone(), SamplingParams::new(raw).expect("valid"));
    let want = e.run(&[req], &std::sync::atomic::AtomicBool::new(false), |_| {}).expect("runs").remove(0);
    assert_eq!(want.prompt_logprobs.len(), ids.len() - 1);
    let tok = e.tokenizer();
    let text = |id: u32| String::from_utf8_lossy(tok.token_bytes(id)).into_owned();
    let post = |path: &'static str, body: Value| {
        let mut b = json!({"model": MODEL, "temperature": 0});
        for (k, v) in body.as_object().expect("object") {
            b[k] = v.clone();
        }
        async move { http(router.addr, "POST", path, &b.to_string(), &[]).await }
    };
    // The echoed prompt's tokens lead the output's, the first without a log-probability.
    let check_echoed = |lp: &Value, generated: usize| {
        let tokens = lp["tokens"].as_array().expect("tokens");
        assert_eq!(tokens.len(), ids.len() + generated, "{lp}");
        assert_eq!(
            (&lp["token_logprobs"][0], &lp["top_logprobs"][0], &lp["text_offset"][0]),
            (&Value::Null, &Value::Null, &json!(0))
        );
        for (i, w) in want.prompt_logprobs.iter().enumerate() {
            assert_eq!(tokens[i + 1], json!(text(ids[i + 1])), "{lp}");
            assert_eq!(lp["token_logprobs"][i + 1].as_f64().map(|l| l as f32), Some(w.logprob), "position {}", i + 1);
            let top = lp["top_logprobs"][i + 1].as_object().expect("alternatives");
            let named: Vec<(String, f32)> = w.top.iter().map(|&(id, l)| (text(id), l)).collect();
            for (name, l) in &named {
                assert_eq!(top.get(name).and_then(Value::as_f64).map(|v| v as f32), Some(*l), "position {}", i + 1);
            }
        }
    };
    let first = json!({"model": MODEL, "prompt": ids, "echo": true, "logprobs": 2, "max_tokens": 3, "temperature": 0});
    let explained = http(router.addr, "POST", "/debug/route", &first.to_string(), &[]).await.json();
    assert_eq!(explained["disaggregate"], true, "a cold prompt goes to the prefill worker: {explained}");
    let r = post("/v1/completions", first.clone()).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(workers[1].pulled_blocks() > 0, "the decode worker pulled the prompt the prefill worker scored");
    let v = r.json();
    check_echoed(&v["choices"][0]["logprobs"], 3);
    assert_eq!(v["choices"][0]["text"], json!(format!("{}{}", tok.decode(&ids), want.text)), "{v}");
    // The prompt is cached now, but a scored prompt is computed whole wherever it goes: routing credits no cache.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await; // let the workers' events reach the index
    let held = |body: Value| async move {
        let v = http(router.addr, "POST", "/debug/route", &body.to_string(), &[]).await.json();
        let candidates = v["decode"]["candidates"].as_array().unwrap_or_else(|| panic!("{v}")).clone();
        candidates.iter().map(|c| c["device_blocks"].as_u64().expect("blocks")).sum::<u64>()
    };
    let plain = json!({"model": MODEL, "prompt": ids, "max_tokens": 3});
    assert!(held(plain).await > 0, "the index knows where the prompt is");
    assert_eq!(held(first.clone()).await, 0);
    // `max_tokens` 0: the prompt alone, scored, and no completion.
    let r = post("/v1/completions", json!({"prompt": ids, "echo": true, "logprobs": 2, "max_tokens": 0})).await;
    let v = r.json();
    check_echoed(&v["choices"][0]["logprobs"], 0);
    assert_eq!(v["choices"][0]["text"], json!(tok.decode(&ids)), "{v}");
    assert_eq!((&v["choices"][0]["finish_reason"], &v["usage"]["completion_tokens"]), (&json!("length"), &json!(0)));
    // Streamed: the first chunk is the prompt with its log-probabilities, the output's follow.
    let r =
        post("/v1/completions", json!({"prompt": ids, "echo": true, "logprobs": 2, "max_tokens": 3, "stream": true}))
            .await;
    let chunks: Vec<Value> = r.events().iter().filter_map(|e| serde_json::from_str(e).ok()).collect();
    assert_eq!(chunks[0]["choices"][0]["text"], json!(tok.decode(&ids)), "{chunks:?}");
    let mut all = json!({"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []});
    for c in &chunks {
        for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
            if let Some(items) = c["choices"][0]["logprobs"][key].as_array() {
                all[key].as_array_mut().expect("list").extend(items.iter().cloned());
            }
        }
    }
    check_echoed(&all, 3);
    // vLLM's `prompt_logprobs`: for each token but the first, its own entry (with its rank) and the alternatives.
    let r = post("/v1/completions", json!({"prompt": ids, "prompt_logprobs": 1, "max_tokens": 2})).await;
    let v = r.json();
    let scored = v["choices"][0]["prompt_logprobs"].as_array().unwrap_or_else(|| panic!("{v}"));
    assert_eq!((scored.len(), &scored[0]), (ids.len(), &Value::Null));
    for (i, w) in want.prompt_logprobs.iter().enumerate() {
        let position = scored[i + 1].as_object().expect("a map");
        let own = &position[&ids[i + 1].to_string()];
        assert_eq!(own["logprob"].as_f64().map(|l| l as f32), Some(w.logprob), "position {}", i + 1);
        assert_eq!((&own["rank"], &own["decoded_token"]), (&json!(w.rank), &json!(text(ids[i + 1]))));
        let (best, l) = w.top[0];
        assert_eq!(position[&best.to_string()]["rank"], json!(1));
        assert_eq!(position[&best.to_string()]["logprob"].as_f64().map(|v| v as f32), Some(l));
        assert!(position.len() <= 2, "the token and one alternative: {position:?}");
    }
    // Chat: one list beside the choices, over the rendered conversation's tokens.
    let messages = json!([{"role": "user", "content": "Name a colour."}]);
    let r = post("/v1/chat/completions", json!({"messages": messages, "prompt_logprobs": 0, "max_tokens": 2})).await;
    let v = r.json();
    let chat = v["prompt_logprobs"].as_array().unwrap_or_else(|| panic!("{v}"));
    assert_eq!(chat.len() as u64, v["usage"]["prompt_tokens"].as_u64().expect("usage"), "{v}");
    assert!(chat[1..].iter().all(|p| p.as_object().is_some_and(|m| m.len() == 1)), "{v}");
    stop(router, workers).await;
}

/// OpenAI's tools, forced as vLLM forces them for a model without a tool-call parser, across a prefill and a
/// decode worker: a named function's call is what one engine writes under the function's parameter schema, whole
/// and streamed; `required` calls are an array of calls (`finish_reason: tool_calls`), or the text when cut short;
/// an earlier turn's calls and a tool's answer go to the template; `auto` is refused by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_calls_are_forced_by_their_schemas_across_prefill_and_decode() {
    let (workers, router) = disaggregated().await;
    let params = json!({"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": false});
    let weather = json!({"type": "function", "function": {"name": "weather", "description": "Today's weather in a city",
                         "parameters": params}});
    let time = json!({"type": "function", "function": {"name": "local_time", "parameters": {"type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"], "additionalProperties": false}}});
    let question = "What is the weather in Paris?";
    let ask = |extra: Value| {
        let base = json!({"model": MODEL, "max_tokens": 60, "temperature": 0, "tools": [weather, time],
                          "messages": [{"role": "user", "content": question}]});
        merged(base, &extra)
    };
    let post = |body: String| {
        let addr = router.addr;
        async move { http(addr, "POST", "/v1/chat/completions", &body, &[]).await }
    };

    // A named function: its arguments are what one engine writes under its parameters (the served model's
    // template shows no tools, so the prompt is the conversation's).
    let want = engine_under_schema(question, &params, 60);
    let named = json!({"tool_choice": {"type": "function", "function": {"name": "weather"}}});
    let r = post(ask(named.clone())).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let choice = &v["choices"][0];
    assert_eq!((&choice["message"]["content"], &choice["finish_reason"]), (&Value::Null, &json!("stop")), "{v}");
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!((&call["type"], &call["function"]["name"]), (&json!("function"), &json!("weather")), "{v}");
    assert!(call["id"].as_str().is_some_and(|id| id.starts_with("call_")), "{v}");
    assert_eq!(call["function"]["arguments"], json!(want), "P + D = one engine");
    let args: Value = serde_json::from_str(&want).expect("the arguments are JSON");
    assert!(
        args["city"].is_string() && ["celsius", "fahrenheit"].contains(&args["unit"].as_str().unwrap_or("")),
        "{want}"
    );

    // Streamed: the first piece names the call, the pieces' arguments add up to the whole answer's.
    let mut streamed = named.clone();
    streamed["stream"] = json!(true);
    let r = post(ask(streamed)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let chunks = json_chunks(&r);
    let deltas: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]["delta"]).collect();
    assert_eq!(deltas[0]["role"], "assistant", "{chunks:?}");
    let pieces: Vec<&Value> = deltas.iter().filter_map(|d| d.get("tool_calls")).map(|c| &c[0]).collect();
    assert_eq!((&pieces[0]["function"]["name"], &pieces[0]["type"]), (&json!("weather"), &json!("function")));
    assert!(pieces[0]["id"].is_string() && pieces[1..].iter().all(|p| p.get("id").is_none()), "{pieces:?}");
    let joined: String = pieces.iter().map(|p| p["function"]["arguments"].as_str().expect("text")).collect();
    assert_eq!(joined, want);
    assert!(deltas.iter().all(|d| d.get("content").is_none()), "no content beside the call: {deltas:?}");
    assert_eq!(chunks.last().expect("chunks")["choices"][0]["finish_reason"], "stop");

    // Required: an array of calls of the tools, whole and streamed alike.
    let r = post(ask(json!({"tool_choice": "required"}))).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
    let calls = v["choices"][0]["message"]["tool_calls"].as_array().expect("calls").clone();
    assert!(!calls.is_empty(), "{v}");
    for c in &calls {
        assert!(["weather", "local_time"].contains(&c["function"]["name"].as_str().unwrap_or("")), "{v}");
        let args: Value = serde_json::from_str(c["function"]["arguments"].as_str().expect("text")).expect("JSON");
        assert!(args["city"].is_string(), "{v}");
    }
    let r = post(ask(json!({"tool_choice": "required", "stream": true}))).await;
    let chunks = json_chunks(&r);
    let got: Vec<Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"].get("tool_calls"))
        .map(|c| json!([c[0]["function"]["name"], c[0]["function"]["arguments"]]))
        .collect();
    let whole: Vec<Value> = calls.iter().map(|c| json!([c["function"]["name"], c["function"]["arguments"]])).collect();
    assert_eq!(got, whole, "{chunks:?}");
    assert_eq!(chunks.last().expect("chunks")["choices"][0]["finish_reason"], "tool_calls");
    // Each call goes out once its item is whole, before the array closes: the usage in every chunk shows it.
    let usage = json!({"include_usage": true, "continuous_usage_stats": true});
    let r = post(ask(json!({"tool_choice": "required", "stream": true, "stream_options": usage}))).await;
    let chunks = json_chunks(&r);
    let tokens = |c: &Value| c["usage"]["completion_tokens"].as_u64().expect("usage in every chunk");
    let first_call = chunks.iter().find(|c| c["choices"][0]["delta"].get("tool_calls").is_some()).expect("a call");
    let total = tokens(chunks.last().expect("chunks"));
    let written_by = tokens(first_call);
    assert!(written_by < total, "the first call out before the array closed: {chunks:?}");
    // Cut short after it: the whole items before the cut are the calls, and the answer says it was cut.
    let r = post(ask(json!({"tool_choice": "required", "max_tokens": written_by}))).await;
    let v = r.json();
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    assert_eq!(v["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"], calls[0]["function"]["arguments"]);
    // Cut short before any item is whole: the text comes back as it is.
    let r = post(ask(json!({"tool_choice": "required", "max_tokens": 3}))).await;
    let v = r.json();
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    assert!(v["choices"][0]["message"].get("tool_calls").is_none(), "{v}");
    assert!(v["choices"][0]["message"]["content"].as_str().is_some_and(|t| t.starts_with('[')), "{v}");

    // A conversation that called a tool and got its answer goes on; without tool_choice, tools mean `auto`: refused
    // by a router with no tool_call_parser.
    let turn = json!({"messages": [{"role": "user", "content": question},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 degrees."}], "tool_choice": "none"});
    let r = post(ask(turn)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.json()["choices"][0]["message"]["content"].is_string(), "{}", r.body);
    for refused in [
        json!({}),
        json!({"tool_choice": "auto"}),
        json!({"tool_choice": {"type": "function", "function": {"name": "rain"}}}),
    ] {
        let r = post(ask(refused.clone())).await;
        assert_eq!(
            (r.status, r.json()["error"]["param"].clone()),
            (400, json!("tool_choice")),
            "{refused}: {}",
            r.body
        );
    }
    stop(router, workers).await;
}
