//! Chat templates: the model's own Jinja text, rendered with minijinja the way transformers renders it
//! (`trim_blocks` and `lstrip_blocks` on, `raise_exception` available).

use minijinja::{Environment, ErrorKind};
use serde::Serialize;

/// One chat message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage { role: role.into(), content: content.into() }
    }
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
        let tmpl = self.env.get_template(NAME).map_err(|e| TemplateError(e.to_string()))?;
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos,
            eos_token => &self.eos,
        };
        tmpl.render(ctx).map_err(|e| TemplateError(e.to_string()))
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
    fn blocks_are_trimmed_like_transformers() {
        let src = "{% for m in messages %}\n  {{ m.role }}:{{ m.content }}\n{% endfor %}";
        let t = ChatTemplate::new(src, "", "").expect("compiles");
        let out = t.render(&[ChatMessage::new("user", "hi")], false).expect("renders");
        assert_eq!(out, "  user:hi\n");
    }
}
