//! Chat templates: the model's own Jinja text, rendered with minijinja the way transformers renders it
//! (`trim_blocks` and `lstrip_blocks` on, `raise_exception` available).

use std::collections::BTreeSet;

use minijinja::{Environment, ErrorKind};
use serde::Serialize;

mod pylist;
mod python;

/// One chat message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// The participant's name (OpenAI's `name`), handed to the template as transformers hands it: a template that
    /// reads `message.name` shows it, and one without it is undefined there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant turn's calls of tools, as OpenAI's messages carry them but with each call's `arguments` as a
    /// JSON value rather than its text (as transformers documents them and vLLM hands them over): a template with
    /// tool support shows them, one without leaves them out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// A tool turn's answer to this call id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// An assistant turn's thinking, as a reasoning model's answer carried it apart: a template that shows past
    /// thinking (Qwen3's) reads `message.reasoning_content`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            name: None,
            tool_calls: None,
            tool_call_id: None,
            reasoning_content: None,
        }
    }

    /// The same message from the participant `name`.
    pub fn named(self, name: Option<String>) -> ChatMessage {
        ChatMessage { name, ..self }
    }
}

/// How a rendered conversation ends: where the model's text goes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Ending {
    /// With the assistant's generation prompt: the model writes a new turn.
    #[default]
    NewTurn,
    /// As the template ends the last message (vLLM's `add_generation_prompt: false`).
    AsIs,
    /// Inside the last message, right after its text: the model goes on writing it (transformers' and vLLM's
    /// `continue_final_message`).
    ContinueLast,
}

/// What a request adds to its conversation's rendering besides the messages: the tools the model may call (OpenAI's
/// `tools` entries, which the template sees as `tools`, as transformers passes them; none when there are none), and
/// arguments of the template's own (vLLM's `chat_template_kwargs`: `enable_thinking`, `date_string`...).
#[derive(Clone, Copy, Debug, Default)]
pub struct ChatExtras<'a> {
    pub tools: &'a [serde_json::Value],
    pub arguments: Option<&'a serde_json::Map<String, serde_json::Value>>,
}

/// What every render passes the template itself: no request's template arguments may name them.
const PASSED: [&str; 5] = ["messages", "tools", "add_generation_prompt", "bos_token", "eos_token"];

/// Why a template could not be compiled or rendered.
#[derive(Debug, thiserror::Error)]
#[error("chat template: {0}")]
pub struct TemplateError(String);

/// A compiled chat template.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
    /// The variables the template reads that nothing passes it but a request's arguments.
    arguments: BTreeSet<String>,
}

const NAME: &str = "chat";

impl ChatTemplate {
    /// Compiles `source`; `bos` and `eos` are the texts templates see as `bos_token` and `eos_token`.
    pub fn new(source: &str, bos: &str, eos: &str) -> Result<ChatTemplate, TemplateError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        // What transformers gives templates beyond Jinja: Python's methods on strings, lists and dicts, and the
        // date (Llama 3.2's and 3.3's templates write today's into the system turn).
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("namespace", pylist::namespace);
        env.add_filter("tojson", |v: minijinja::Value, args: minijinja::value::Kwargs| {
            let options = python::JsonOptions {
                indent: args.get("indent")?,
                ascii: args.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
                separators: match args.get::<Option<Vec<String>>>("separators")? {
                    None => None,
                    Some(pair) => match <[String; 2]>::try_from(pair) {
                        Ok([item, key]) => Some((item, key)),
                        Err(_) => {
                            let why = "tojson's separators are two strings: between items, and after a key";
                            return Err(minijinja::Error::new(ErrorKind::InvalidOperation, why));
                        }
                    },
                },
                sort_keys: args.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
            };
            args.assert_all_used()?;
            let bad = |e: serde_json::Error| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string());
            let mut out = String::new();
            python::json(&serde_json::to_value(&v).map_err(bad)?, &options, 0, &mut out);
            Ok::<_, minijinja::Error>(minijinja::Value::from_safe_string(out))
        });
        // What a template prints, or makes a string of, is Python's text of it: a list or dict as its `repr`, True,
        // False, None.
        env.set_formatter(|out, state, value| match python_text(value)? {
            Some(text) => {
                out.write_str(&text).map_err(|e| minijinja::Error::new(ErrorKind::WriteFailure, e.to_string()))
            }
            None => minijinja::escape_formatter(out, state, value),
        });
        env.add_filter("string", |value: minijinja::Value| {
            Ok::<_, minijinja::Error>(match python_text(&value)? {
                Some(text) => minijinja::Value::from(text),
                None if value.as_str().is_some() => value,
                None => minijinja::Value::from(value.to_string()),
            })
        });
        // Python's None is not iterable (minijinja iterates it as empty): Qwen3-Coder's template asks
        // `tools is iterable` of the `tools` transformers passes as None when there are none.
        env.add_test("iterable", |v: minijinja::Value| !v.is_none() && v.try_iter().is_ok());
        env.add_function("strftime_now", |format: String| -> Result<String, minijinja::Error> {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            crate::datetime::strftime(now.as_secs(), &format)
                .map_err(|why| minijinja::Error::new(ErrorKind::InvalidOperation, why))
        });
        env.add_template_owned(NAME, without_generation_tags(source)).map_err(|e| TemplateError(e.to_string()))?;
        let mut read = env.get_template(NAME).map_err(|e| TemplateError(e.to_string()))?.undeclared_variables(false);
        read.extend(self_defaulted(source));
        let arguments = read
            .into_iter()
            .filter(|v| !PASSED.contains(&v.as_str()) && env.globals().all(|(global, _)| global != v))
            .collect();
        Ok(ChatTemplate { env, bos: bos.to_owned(), eos: eos.to_owned(), arguments })
    }

    /// The names of the arguments the template reads (variables it uses that no render passes it otherwise).
    pub fn arguments(&self) -> &BTreeSet<String> {
        &self.arguments
    }

    /// Whether `arguments` (a request's `chat_template_kwargs`) are all ones the template reads: `Err` names the
    /// first that is not, or that names what every render passes.
    pub fn check_arguments(&self, arguments: &serde_json::Map<String, serde_json::Value>) -> Result<(), TemplateError> {
        match arguments.keys().find(|k| PASSED.contains(&k.as_str()) || !self.arguments.contains(*k)) {
            Some(k) if PASSED.contains(&k.as_str()) => {
                Err(TemplateError(format!("`{k}` is not a template argument: the request itself sets it")))
            }
            Some(k) => {
                let known = self.arguments.iter().map(|a| format!("`{a}`")).collect::<Vec<_>>().join(", ");
                let known = if known.is_empty() { "none".to_string() } else { known };
                Err(TemplateError(format!("the template reads no `{k}` (its arguments: {known})")))
            }
            None => Ok(()),
        }
    }

    /// The prompt text for `messages`, ending with the assistant's generation prompt when asked.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, TemplateError> {
        self.render_with(messages, ChatExtras::default(), add_generation_prompt)
    }

    /// [`render`](Self::render) with a request's [`ChatExtras`] (arguments checked by
    /// [`check_arguments`](Self::check_arguments) first: here they cannot override what every render passes).
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        extras: ChatExtras<'_>,
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        let tmpl = self.env.get_template(NAME).map_err(|e| TemplateError(e.to_string()))?;
        let tools = extras.tools;
        let ctx = minijinja::context! {
            messages => messages,
            tools => (!tools.is_empty()).then_some(tools),
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos,
            eos_token => &self.eos,
            ..minijinja::Value::from_serialize(extras.arguments)
        };
        tmpl.render(ctx).map_err(|e| TemplateError(e.to_string()))
    }

    /// The prompt text for `messages`, ending as `ending` says. To continue the last message, the conversation is
    /// rendered without a generation prompt and cut right after that message's text (trimmed of surrounding
    /// whitespace), its last occurrence, as transformers does; a template that does not keep the text as it is
    /// cannot be continued. `extras`: as [`render_with`](Self::render_with) takes them.
    pub fn render_ending(
        &self,
        messages: &[ChatMessage],
        extras: ChatExtras<'_>,
        ending: Ending,
    ) -> Result<String, TemplateError> {
        let mut text = self.render_with(messages, extras, ending == Ending::NewTurn)?;
        if ending == Ending::ContinueLast {
            let last = messages.last().map(|m| m.content.trim()).unwrap_or_default();
            if last.is_empty() {
                return Err(TemplateError("continuing the final message needs one with text".into()));
            }
            let Some(at) = text.rfind(last) else {
                return Err(TemplateError(
                    "the template changes the final message's text, so it cannot be continued".into(),
                ));
            };
            text.truncate(at + last.len());
        }
        Ok(text)
    }
}

/// Python's text of `value` where it differs from minijinja's (a list, dict, boolean or None); `None` otherwise.
fn python_text(value: &minijinja::Value) -> Result<Option<String>, minijinja::Error> {
    use minijinja::value::ValueKind;
    if !matches!(value.kind(), ValueKind::Map | ValueKind::Seq | ValueKind::Bool | ValueKind::None) {
        return Ok(None);
    }
    let bad = |e: serde_json::Error| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string());
    let mut text = String::new();
    python::repr(&serde_json::to_value(value).map_err(bad)?, &mut text);
    Ok(Some(text))
}

/// Variables whose first `{% set %}` gives them a value computed from themselves (`{% set effort = effort if effort
/// is defined else "high" %}`, Solar Open's and Nemotron 3's way of defaulting an argument): read before they are
/// set, so arguments, which minijinja's `undeclared_variables` does not count (it sees them set in the template).
/// A later set of a variable set before (`{% set text = text + part %}` in a loop) reads the template's own.
fn self_defaulted(source: &str) -> Vec<String> {
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut names = Vec::new();
    let mut set_before = std::collections::HashSet::new();
    for block in source.split("{%").skip(1) {
        let Some((body, _)) = block.split_once("%}") else { continue };
        let body = body.trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        let Some(rest) = body.strip_prefix("set").filter(|r| r.starts_with(char::is_whitespace)) else { continue };
        let rest = rest.trim_start();
        let name_end = rest.find(|c: char| !word(c)).unwrap_or(rest.len());
        let (name, after) = rest.split_at(name_end);
        let Some(expr) = after.trim_start().strip_prefix('=').filter(|e| !e.starts_with('=')) else { continue };
        if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) || !set_before.insert(name) {
            continue;
        }
        // The expression's words outside its string literals.
        let mut code = String::with_capacity(expr.len());
        let mut quote = None;
        for c in expr.chars() {
            match quote {
                Some(q) if c == q => quote = None,
                Some(_) => {}
                None if c == '"' || c == '\'' => quote = Some(c),
                None => code.push(c),
            }
        }
        if code.split(|c: char| !word(c)).any(|w| w == name) && !names.iter().any(|n| n == name) {
            names.push(name.to_string());
        }
    }
    names
}

/// `source` with transformers' `{% generation %}` … `{% endgeneration %}` (which marks the assistant's text for
/// training masks and renders its body as it is) written as a block that always renders, whitespace control kept.
fn without_generation_tags(source: &str) -> String {
    static OPEN: std::sync::OnceLock<regex::Regex> = std::sync::OnceLock::new();
    static CLOSE: std::sync::OnceLock<regex::Regex> = std::sync::OnceLock::new();
    let open = OPEN.get_or_init(|| regex::Regex::new(r"\{%(-?)\s*generation\s*(-?)%\}").expect("a valid regex"));
    let close = CLOSE.get_or_init(|| regex::Regex::new(r"\{%(-?)\s*endgeneration\s*(-?)%\}").expect("a valid regex"));
    let opened = open.replace_all(source, "{%${1} if true ${2}%}");
    close.replace_all(&opened, "{%${1} endif ${2}%}").into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_argument_the_template_defaults_itself_is_an_argument() {
        let src = r#"{%- set effort = effort if effort is defined else "high" %}{% set shown = 'shown' %}
            {%- set role = 'role' ~ "effort" %}{% set n = namespace(x=1) %}{% set n.x = n.x + 1 %}
            {%- set shown = shown ~ '' %}
            {%- set think = think | default(true) -%}{{ effort }}{{ shown }}{{ role }}{{ think }}"#;
        let t = ChatTemplate::new(src, "", "").expect("compiles");
        let named: Vec<&str> = t.arguments().iter().map(String::as_str).collect();
        assert_eq!(named, ["effort", "think"]);
        let args = serde_json::Map::from_iter([("effort".to_string(), serde_json::json!("low"))]);
        let extras = ChatExtras { tools: &[], arguments: Some(&args) };
        assert_eq!(t.render_with(&[], extras, false).expect("renders"), "lowshownroleeffortTrue");
    }

    /// A list kept in a namespace changes in place, as Python's does (Kimi K2's templates queue call ids so), and
    /// prints, measures and serializes as any list.
    #[test]
    fn a_namespaces_list_changes_in_place() {
        let src = "{% set ns = namespace(q=[], n=0) %}{% set _ = ns.q.append('a') %}{% set _ = ns.q.extend(['b', 'c']) %}\
                   {{ ns.q.pop(0) }}{{ ns.q.pop() }}{{ ns.q | length }}{{ ns.q }}{{ ns.q | tojson }}\
                   {% set _ = ns.q.insert(-9, 'z') %}{% for x in ns.q %}{{ x }}{% endfor %}{{ ns.q[-1] }}{{ ns.n }}";
        let t = ChatTemplate::new(src, "", "").expect("compiles");
        assert_eq!(t.render(&[], false).expect("renders"), "ac1['b'][\"b\"]zbb0");
        let empty = ChatTemplate::new("{% set ns = namespace(q=[]) %}{{ ns.q.pop(0) }}", "", "").expect("compiles");
        assert!(empty.render(&[], false).is_err(), "pop from an empty list");
    }

    #[test]
    fn raise_exception_becomes_an_error() {
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}", "", "").expect("compiles");
        let err = t.render(&[], true).expect_err("raises");
        assert!(err.to_string().contains("no system role"));
    }

    #[test]
    fn a_name_reaches_the_template_and_an_absent_one_is_undefined() {
        let src = "{% for m in messages %}{{ m.role }}{% if m.name is defined %}({{ m.name }}){% endif %}: \
                   {{ m.content }}\n{% endfor %}";
        let t = ChatTemplate::new(src, "", "").expect("compiles");
        let chat = [ChatMessage::new("user", "hi").named(Some("ann".into())), ChatMessage::new("user", "yo")];
        assert_eq!(t.render(&chat, false).expect("renders"), "user(ann): hi\nuser: yo\n");
    }

    /// What Hugging Face templates use beyond Jinja renders as transformers renders it: `tojson` (Qwen 2.5's and
    /// Llama 3.1's tools), Python's string and dict methods (Qwen 3's `split`, `strip`, `startswith`, `items`) and
    /// `strftime_now` (Llama 3.2's date); none is taken for a template argument.
    #[test]
    fn hugging_face_template_extras_render() {
        let src = "{% for t in tools %}{{ t | tojson }}\n{% endfor %}\
                   {% for m in messages %}{% set parts = m.content.split('</think>') %}\
                   {{ parts[-1].strip() }}|{{ m.content.startswith('<think>') }}|\
                   {% for k, v in {'a': 1}.items() %}{{ k }}={{ v }}{% endfor %}{% endfor %}|\
                   {{ strftime_now('%Y') | length }}";
        let t = ChatTemplate::new(src, "", "").expect("compiles");
        assert!(t.arguments().is_empty(), "{:?}", t.arguments());
        let tool = serde_json::json!({"type": "function", "function": {"name": "now"}});
        let chat = [ChatMessage::new("assistant", "<think>hm</think>  Yes. ")];
        let out = t.render_with(&chat, ChatExtras { tools: &[tool], arguments: None }, false).expect("renders");
        // A boolean prints as Python prints it, and keys keep the order they came in.
        assert_eq!(out, "{\"type\": \"function\", \"function\": {\"name\": \"now\"}}\nYes.|True|a=1|4");
        // With an indent, as Python indents.
        let t = ChatTemplate::new("{{ tools[0] | tojson(indent=2) }}", "", "").expect("compiles");
        let tool = serde_json::json!({"a": [1, "é"], "b": {}});
        let out = t.render_with(&[], ChatExtras { tools: &[tool], arguments: None }, false).expect("renders");
        assert_eq!(out, "{\n  \"a\": [\n    1,\n    \"é\"\n  ],\n  \"b\": {}\n}");
    }

    /// Qwen3's templates show an earlier turn's thinking from `message.reasoning_content`.
    #[test]
    fn an_assistant_turns_thinking_reaches_the_template() {
        let src = "{% for m in messages %}{{ m.role }}:{% if m.reasoning_content is defined %}\
                   <think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }};{% endfor %}";
        let t = ChatTemplate::new(src, "", "").expect("compiles");
        let chat = [
            ChatMessage::new("user", "2+2?"),
            ChatMessage { reasoning_content: Some("Four.".into()), ..ChatMessage::new("assistant", "4") },
        ];
        assert_eq!(t.render(&chat, false).expect("renders"), "user:2+2?;assistant:<think>Four.</think>4;");
    }

    #[test]
    fn tools_and_tool_calls_reach_the_template() {
        let src = "{% if tools %}tools: {% for t in tools %}{{ t.function.name }} {% endfor %}| {% endif %}\
                   {% for m in messages %}{{ m.role }}: {{ m.content }}\
                   {% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments.city }}]{% endfor %}\
                   {% if m.tool_call_id is defined %}({{ m.tool_call_id }}){% endif %}; {% endfor %}";
        let t = ChatTemplate::new(src, "", "").expect("compiles");
        let weather = serde_json::json!({"type": "function", "function": {"name": "weather", "parameters": {}}});
        let call = serde_json::json!([{"id": "c1", "type": "function",
                                       "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]);
        let chat = [
            ChatMessage::new("user", "rain?"),
            ChatMessage { tool_calls: Some(call), ..ChatMessage::new("assistant", "") },
            ChatMessage { tool_call_id: Some("c1".into()), ..ChatMessage::new("tool", "wet") },
        ];
        let out = t.render_with(&chat, ChatExtras { tools: &[weather], arguments: None }, false).expect("renders");
        assert_eq!(out, "tools: weather | user: rain?; assistant: [weather Oslo]; tool: wet(c1); ");
        assert_eq!(t.render(&chat[..1], false).expect("renders"), "user: rain?; ", "no tools: none");
    }

    #[test]
    fn the_templates_own_arguments_are_found_passed_and_checked() {
        let src = "{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}\
                   {% set n = namespace(k=0) %}{% for m in messages %}{{ m.content }}{% endfor %}\
                   {{ date_string | default('today') }}{% if add_generation_prompt %}>{% endif %}\
                   {{ raise_exception('x') if messages | length > 9 else '' }}";
        let t = ChatTemplate::new(src, "", "").expect("compiles");
        let names: Vec<&str> = t.arguments().iter().map(String::as_str).collect();
        assert_eq!(names, ["date_string", "enable_thinking"], "not messages, globals, functions or loop variables");
        let chat = [ChatMessage::new("user", "hi ")];
        let args = serde_json::json!({"enable_thinking": false, "date_string": "7 Dec"});
        let args = args.as_object().expect("object");
        t.check_arguments(args).expect("both read");
        let out = t.render_with(&chat, ChatExtras { tools: &[], arguments: Some(args) }, true).expect("renders");
        assert_eq!(out, "/no_think hi 7 Dec>");
        assert_eq!(t.render(&chat, true).expect("renders"), "hi today>", "none given: the template's defaults");
        for (bad, says) in [(r#"{"thinking": true}"#, "reads no `thinking`"), (r#"{"messages": []}"#, "sets it")] {
            let bad: serde_json::Map<String, serde_json::Value> = serde_json::from_str(bad).expect("json");
            let e = t.check_arguments(&bad).expect_err("refused").to_string();
            assert!(e.contains(says), "{e}");
        }
    }

    #[test]
    fn a_conversation_ends_as_asked() {
        let src = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>\n{% endfor %}\
                   {% if add_generation_prompt %}<assistant>{% endif %}";
        let t = ChatTemplate::new(src, "", "").expect("compiles");
        let chat = [ChatMessage::new("user", "hi"), ChatMessage::new("assistant", " Once upon a time \n")];
        let render = |ending| t.render_ending(&chat, ChatExtras::default(), ending).map_err(|e| e.to_string());
        assert_eq!(
            render(Ending::NewTurn).as_deref(),
            Ok("<user>hi</s>\n<assistant> Once upon a time \n</s>\n<assistant>")
        );
        assert_eq!(render(Ending::AsIs).as_deref(), Ok("<user>hi</s>\n<assistant> Once upon a time \n</s>\n"));
        assert_eq!(render(Ending::ContinueLast).as_deref(), Ok("<user>hi</s>\n<assistant> Once upon a time"));
        let blank = [ChatMessage::new("user", "hi"), ChatMessage::new("assistant", " ")];
        assert!(t.render_ending(&blank, ChatExtras::default(), Ending::ContinueLast).is_err(), "no text to continue");
        let upper =
            ChatTemplate::new("{% for m in messages %}{{ m.content | upper }}{% endfor %}", "", "").expect("compiles");
        let err = upper
            .render_ending(&chat[..1], ChatExtras::default(), Ending::ContinueLast)
            .expect_err("the text is changed");
        assert!(err.to_string().contains("cannot be continued"), "{err}");
    }

    #[test]
    fn blocks_are_trimmed_like_transformers() {
        let src = "{% for m in messages %}\n  {{ m.role }}:{{ m.content }}\n{% endfor %}";
        let t = ChatTemplate::new(src, "", "").expect("compiles");
        let out = t.render(&[ChatMessage::new("user", "hi")], false).expect("renders");
        assert_eq!(out, "  user:hi\n");
    }
}
