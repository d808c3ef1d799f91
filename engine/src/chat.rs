//! Chat templates: the model's own Jinja text, rendered with minijinja the way transformers renders it
//! (`trim_blocks` and `lstrip_blocks` on, `raise_exception` available).

use minijinja::{Environment, ErrorKind};
use serde::Serialize;

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
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage { role: role.into(), content: content.into(), name: None, tool_calls: None, tool_call_id: None }
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
        env.add_template_owned(NAME, source.to_owned()).map_err(|e| TemplateError(e.to_string()))?;
        Ok(ChatTemplate { env, bos: bos.to_owned(), eos: eos.to_owned() })
    }

    /// The prompt text for `messages`, ending with the assistant's generation prompt when asked.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, TemplateError> {
        self.render_with(messages, &[], add_generation_prompt)
    }

    /// [`render`](Self::render) with the tools the model may call (OpenAI's `tools` entries), which the template
    /// sees as `tools`, as transformers passes them (none when there are none).
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        tools: &[serde_json::Value],
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        let tmpl = self.env.get_template(NAME).map_err(|e| TemplateError(e.to_string()))?;
        let ctx = minijinja::context! {
            messages => messages,
            tools => (!tools.is_empty()).then_some(tools),
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos,
            eos_token => &self.eos,
        };
        tmpl.render(ctx).map_err(|e| TemplateError(e.to_string()))
    }

    /// The prompt text for `messages`, ending as `ending` says. To continue the last message, the conversation is
    /// rendered without a generation prompt and cut right after that message's text (trimmed of surrounding
    /// whitespace), its last occurrence, as transformers does; a template that does not keep the text as it is
    /// cannot be continued. `tools`: the tools the model may call ([`render_with`](Self::render_with)).
    pub fn render_ending(
        &self,
        messages: &[ChatMessage],
        tools: &[serde_json::Value],
        ending: Ending,
    ) -> Result<String, TemplateError> {
        let mut text = self.render_with(messages, tools, ending == Ending::NewTurn)?;
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

#[cfg(test)]
mod tests {
    use super::*;

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
        let out = t.render_with(&chat, &[weather], false).expect("renders");
        assert_eq!(out, "tools: weather | user: rain?; assistant: [weather Oslo]; tool: wet(c1); ");
        assert_eq!(t.render(&chat[..1], false).expect("renders"), "user: rain?; ", "no tools: none");
    }

    #[test]
    fn a_conversation_ends_as_asked() {
        let src = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>\n{% endfor %}\
                   {% if add_generation_prompt %}<assistant>{% endif %}";
        let t = ChatTemplate::new(src, "", "").expect("compiles");
        let chat = [ChatMessage::new("user", "hi"), ChatMessage::new("assistant", " Once upon a time \n")];
        let render = |ending| t.render_ending(&chat, &[], ending).map_err(|e| e.to_string());
        assert_eq!(
            render(Ending::NewTurn).as_deref(),
            Ok("<user>hi</s>\n<assistant> Once upon a time \n</s>\n<assistant>")
        );
        assert_eq!(render(Ending::AsIs).as_deref(), Ok("<user>hi</s>\n<assistant> Once upon a time \n</s>\n"));
        assert_eq!(render(Ending::ContinueLast).as_deref(), Ok("<user>hi</s>\n<assistant> Once upon a time"));
        let blank = [ChatMessage::new("user", "hi"), ChatMessage::new("assistant", " ")];
        assert!(t.render_ending(&blank, &[], Ending::ContinueLast).is_err(), "no text to continue");
        let upper =
            ChatTemplate::new("{% for m in messages %}{{ m.content | upper }}{% endfor %}", "", "").expect("compiles");
        let err = upper.render_ending(&chat[..1], &[], Ending::ContinueLast).expect_err("the text is changed");
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
