//! gpt-oss's answers, read apart (vLLM's `openai_gptoss` reasoning parser). gpt-oss answers in harmony's messages:
//! `<|channel|>analysis<|message|>` thinking `<|end|>`, then `<|start|>assistant<|channel|>final<|message|>` the
//! answer, or `<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>` a call's
//! arguments (the recipient may also come before the channel, as its template writes it). The first message has no
//! `<|start|>assistant` (the prompt ends with it) and the last no `<|end|>` (`<|return|>` or `<|call|>` ends the
//! answer). The analysis channel is the thinking; the final channel, and commentary to no one (a preamble), the
//! content; a message to a function is handed on in the content as `to=functions.NAME<|message|>arguments`, which
//! the `openai` tool-call parser reads ([`CALL`]). An answer that does not open with a message is all content. Pure:
//! a whole answer's split, and the same split made piece by piece as it streams.

use super::reasoning::Split;

const START: &str = "<|start|>";
const CHANNEL: &str = "<|channel|>";
const MESSAGE: &str = "<|message|>";
const END: &str = "<|end|>";
/// What the first message's header may open with (its `<|start|>assistant` is the prompt's): its channel, or its
/// recipient, which gpt-oss's template writes first.
const OPENINGS: [&str; 3] = [CHANNEL, START, "to="];
/// How a message to a function goes on in the content, its name after it, then [`MESSAGE`] and its arguments.
pub const CALL: &str = "to=functions.";

/// Where a message's text goes.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Part {
    Reasoning,
    /// The content: an answer's, a preamble's, or a call's arguments (after [`CALL`] and the function's name).
    Content,
}

/// The part a message's header (between its start and [`MESSAGE`]) makes its text, by its channel and recipient,
/// and the function it calls, if it does.
fn part(header: &str) -> (Part, Option<&str>) {
    let word = |key: &str| {
        let at = header.find(key)? + key.len();
        let rest = &header[at..];
        Some(&rest[..rest.find([' ', '<']).unwrap_or(rest.len())])
    };
    match (word(CHANNEL), word("to=")) {
        (_, Some(to)) if to.starts_with("functions.") => (Part::Content, Some(&to["functions.".len()..])),
        (Some("analysis"), _) => (Part::Reasoning, None),
        _ => (Part::Content, None),
    }
}

/// Where a streamed answer is.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Phase {
    /// Its start is whitespace or part of a message's start so far.
    Opening,
    /// It is no harmony: all content.
    Plain,
    /// In a message's header.
    Header,
    /// In a message's text.
    Body(Part),
}

/// gpt-oss's answer read apart as it streams: each piece gives the thinking and the content to send now; a header
/// waits until it is whole, and an end that may be a marker's start until the next piece shows what it is.
#[derive(Debug)]
pub struct HarmonyStream {
    text: String,
    /// How much of `text` has been read.
    read: usize,
    phase: Phase,
}

impl Default for HarmonyStream {
    fn default() -> HarmonyStream {
        HarmonyStream { text: String::new(), read: 0, phase: Phase::Opening }
    }
}

impl HarmonyStream {
    /// The thinking and the content to send for the next piece of text `s`.
    pub fn push(&mut self, s: &str) -> Split {
        self.text.push_str(s);
        let (mut reasoning, mut content) = (String::new(), String::new());
        loop {
            let rest = &self.text[self.read..];
            match self.phase {
                Phase::Opening => {
                    let lead = rest.trim_start();
                    if OPENINGS.iter().any(|o| lead.starts_with(o)) {
                        self.read += rest.len() - lead.len();
                        self.phase = Phase::Header;
                    } else if OPENINGS.iter().any(|o| o.starts_with(lead)) {
                        break;
                    } else {
                        self.phase = Phase::Plain;
                    }
                }
                Phase::Plain => {
                    content.push_str(rest);
                    self.read = self.text.len();
                    break;
                }
                Phase::Header => {
                    let Some(at) = rest.find(MESSAGE) else { break };
                    let (kind, name) = part(&rest[..at]);
                    if let Some(name) = name {
                        content.push_str(&format!("{CALL}{name}{MESSAGE}"));
                    }
                    self.read += at + MESSAGE.len();
                    self.phase = Phase::Body(kind);
                }
                Phase::Body(kind) => {
                    let out = if kind == Part::Reasoning { &mut reasoning } else { &mut content };
                    match [END, START].iter().filter_map(|m| rest.find(m).map(|i| (i, *m))).min() {
                        Some((i, marker)) => {
                            out.push_str(&rest[..i]);
                            // A message's end is read; the next one's start is part of its header.
                            self.read += i + if marker == END { END.len() } else { 0 };
                            self.phase = Phase::Header;
                        }
                        None => {
                            // An end that may be the start of the message's end or of the next one waits.
                            let len = rest.len() - super::markers::held(rest, &[END, START]);
                            out.push_str(&rest[..len]);
                            self.read += len;
                            break;
                        }
                    }
                }
            }
        }
        Split { reasoning: (!reasoning.is_empty()).then_some(reasoning), content }
    }

    /// At the end: what is still to send for the last text `rest` and anything held back. A header cut short says
    /// nothing; a start that never became a message is content.
    pub fn end(&mut self, rest: &str) -> Split {
        let mut out = self.push(rest);
        let left = &self.text[self.read..];
        match self.phase {
            Phase::Opening | Phase::Body(Part::Content) => out.content.push_str(left),
            Phase::Body(Part::Reasoning) => out.reasoning.get_or_insert_with(String::new).push_str(left),
            Phase::Plain | Phase::Header => {}
        }
        out.reasoning = out.reasoning.filter(|r| !r.is_empty());
        self.read = self.text.len();
        out
    }
}

/// A whole answer split (its thinking none when only whitespace).
pub fn split(text: &str) -> Split {
    let out = HarmonyStream::default().end(text);
    Split { reasoning: out.reasoning.filter(|r| !r.trim().is_empty()), content: out.content }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whole(text: &str) -> (Option<String>, String) {
        let s = split(text);
        (s.reasoning, s.content)
    }

    fn some(s: &str) -> Option<String> {
        Some(s.to_string())
    }

    #[test]
    fn the_analysis_is_the_thinking_and_the_final_the_content() {
        let text = "<|channel|>analysis<|message|>User greets.<|end|><|start|>assistant<|channel|>final<|message|>Hi!";
        assert_eq!(whole(text), (some("User greets."), "Hi!".to_string()));
        assert_eq!(whole("<|channel|>final<|message|>Hi!"), (None, "Hi!".to_string()), "no thinking");
        assert_eq!(whole("Just text."), (None, "Just text.".to_string()), "no harmony: all content");
        assert_eq!(whole(" <|channel|>analysis<|message|>Cut sh"), (some("Cut sh"), String::new()), "cut short");
        let preamble = "<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|channel|>commentary<|message|>\
                        Checking.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.";
        assert_eq!(whole(preamble), (some("Hmm."), "Checking.Sunny.".to_string()));
        // A header cut short says nothing.
        assert_eq!(whole("<|channel|>final<|message|>Hi<|end|><|start|>assistant<|chan"), (None, "Hi".to_string()));
    }

    /// A message to a function goes on in the content, its recipient before or after its channel.
    #[test]
    fn a_message_to_a_function_is_handed_on_as_a_call() {
        let after = "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary \
                     to=functions.weather <|constrain|>json<|message|>{\"city\": \"Oslo\"}";
        assert_eq!(whole(after), (some("Need weather."), "to=functions.weather<|message|>{\"city\": \"Oslo\"}".into()));
        let before = "<|start|>assistant to=functions.now<|channel|>commentary json<|message|>{}";
        assert_eq!(whole(before), (None, "to=functions.now<|message|>{}".to_string()));
        let first = " to=functions.now<|channel|>commentary json<|message|>{}";
        assert_eq!(whole(first), (None, "to=functions.now<|message|>{}".to_string()), "the first message");
        assert_eq!(whole("tomorrow"), (None, "tomorrow".to_string()));
    }
}
