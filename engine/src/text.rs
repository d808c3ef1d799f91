//! The text side of a model, without its weights: tokenizer, chat template and the file's fingerprint. The engine
//! uses it, and so does the router, which tokenizes prompts to hash their blocks but never runs the model.

use std::path::Path;

use crate::chat::{ChatExtras, ChatMessage, ChatTemplate, Ending, TemplateError};
use crate::gguf::{GgufError, GgufFile};
use crate::tokenizer::{Tokenizer, TokenizerError};

/// Why a model file's text side could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    #[error(transparent)]
    Model(#[from] GgufError),
    #[error("{0}")]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Template(#[from] TemplateError),
    /// A request's template arguments name one the template does not read (or one every render sets).
    #[error("{0}")]
    TemplateArgument(TemplateError),
    #[error("the model file has no chat template")]
    NoChatTemplate,
}

/// Tokenizer, chat template and identity of one model file.
#[derive(Debug)]
pub struct TextModel {
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    /// The file's bytes, mapped, for the fingerprint: hashed the first time it is asked for (reading the whole
    /// file was half the time of opening it, and a simulator never asks).
    mapping: std::sync::Arc<memmap2::Mmap>,
    fingerprint: std::sync::OnceLock<String>,
    context_len: Option<usize>,
}

impl TextModel {
    /// Reads the text side of the GGUF file at `path` (the weights stay unread).
    pub fn open(path: &Path) -> Result<TextModel, TextError> {
        TextModel::from_gguf(&GgufFile::open(path)?)
    }

    pub fn from_gguf(file: &GgufFile) -> Result<TextModel, TextError> {
        let tokenizer = Tokenizer::from_gguf(file)?;
        let template = match file.metadata().get("tokenizer.chat_template").and_then(|v| v.as_str()) {
            None => None,
            Some(src) => {
                let text = |id: Option<u32>| id.and_then(|i| tokenizer.token_text(i)).unwrap_or("").to_string();
                let (bos, eos) = (text(tokenizer.special().bos), text(tokenizer.special().eos));
                Some(ChatTemplate::new(src, &bos, &eos)?)
            }
        };
        let meta = file.metadata();
        let arch = meta.get("general.architecture").and_then(|v| v.as_str()).unwrap_or("llama");
        let context_len = meta.get(&format!("{arch}.context_length")).and_then(|v| v.as_u64()).map(|n| n as usize);
        Ok(TextModel { tokenizer, template, mapping: file.mapping(), fingerprint: Default::default(), context_len })
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The model file's content fingerprint: KV is exchanged only between holders of equal ones.
    pub fn fingerprint(&self) -> &str {
        self.fingerprint.get_or_init(|| crate::gguf::fingerprint(&self.mapping))
    }

    /// The context length the model was trained for, when the file states it.
    pub fn context_len(&self) -> Option<usize> {
        self.context_len
    }

    /// The prompt text for a conversation, with the assistant's generation prompt.
    /// Whether the chat template reads `argument` (one of a request's `chat_template_kwargs`).
    pub fn template_reads(&self, argument: &str) -> bool {
        self.template.as_ref().is_some_and(|t| t.arguments().contains(argument))
    }

    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, TextError> {
        self.render_chat_ending(messages, ChatExtras::default(), Ending::NewTurn)
    }

    /// The prompt text for a conversation with a request's [`ChatExtras`] (the tools the model may call, the
    /// template's arguments), ending as `ending` says. Arguments the template does not read are refused by name
    /// ([`TextError::TemplateArgument`]).
    pub fn render_chat_ending(
        &self,
        messages: &[ChatMessage],
        extras: ChatExtras<'_>,
        ending: Ending,
    ) -> Result<String, TextError> {
        let t = self.template.as_ref().ok_or(TextError::NoChatTemplate)?;
        if let Some(arguments) = extras.arguments {
            t.check_arguments(arguments).map_err(TextError::TemplateArgument)?;
        }
        Ok(t.render_ending(messages, extras, ending)?)
    }
}
