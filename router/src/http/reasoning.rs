//! A reasoning model's thinking, split from its answer as vLLM's `--reasoning-parser` splits it: the text inside
//! `<think>` … `</think>` is the message's reasoning, the text after it the content (which tool calls are then
//! parsed from). Pure: a whole answer's split, and the same split made piece by piece as an answer streams.

/// How the served model marks its thinking (vLLM's `--reasoning-parser` names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(try_from = "String")]
pub enum ReasoningParser {
    /// The answer thinks from its start, whether or not it writes `<think>` itself (DeepSeek R1's template opens
    /// the block in the prompt), until `</think>`; an answer cut short before it is all thinking. For QwQ and
    /// the Qwen3 models that always think (their templates open the block too), and MiniMax M2 (`minimax_m2`).
    DeepSeekR1,
    /// The answer thinks only when it opens with `<think>` (Qwen3's hybrid models; `enable_thinking: false` in
    /// `chat_template_kwargs` turns it off); otherwise it is all content. GLM 4.5's and 4.6's too (`glm45`).
    Qwen3,
    /// As `Qwen3`, in Gemma 4's channel, `<|channel>thought\n` … `<channel|>` (its markers are control tokens, so
    /// the answer keeps their text); the `thought` label is not part of the thinking. Gemma 4 thinks when
    /// `chat_template_kwargs` has `enable_thinking: true`.
    Gemma4,
    /// As `DeepSeekR1` when `chat_template_kwargs` turns thinking on (`thinking` or `enable_thinking` true, which
    /// DeepSeek V3.1's, V3.2's and V4's templates read; their prompt then opens the block), else no thinking at all:
    /// each request's parser is one of those two ([`ReasoningParser::for_request`]).
    DeepSeekV3,
    /// gpt-oss's harmony messages ([`super::harmony`]): the analysis channel is the thinking, the final channel the
    /// content, and a message to a function goes on in the content for the `openai` tool-call parser.
    GptOss,
    /// As `DeepSeekR1`, in `<seed:think>` … `</seed:think>`: ByteDance's Seed-OSS. Its markers may be control tokens,
    /// so the answer keeps their text.
    SeedOss,
    /// As `DeepSeekR1` unless `chat_template_kwargs` turns `thinking` off (then no thinking at all), as vLLM reads
    /// Kimi K2's answers: K2 Thinking's. Its vocabulary's markers are control tokens, so the answer keeps their text.
    KimiK2,
}

/// Each parser's name.
const NAMES: [(&str, ReasoningParser); 9] = [
    ("deepseek_r1", ReasoningParser::DeepSeekR1),
    ("deepseek_v3", ReasoningParser::DeepSeekV3),
    ("qwen3", ReasoningParser::Qwen3),
    ("glm45", ReasoningParser::Qwen3),
    ("minimax_m2", ReasoningParser::DeepSeekR1),
    ("openai_gptoss", ReasoningParser::GptOss),
    ("gemma4", ReasoningParser::Gemma4),
    ("seed_oss", ReasoningParser::SeedOss),
    ("kimi_k2", ReasoningParser::KimiK2),
];

impl std::str::FromStr for ReasoningParser {
    type Err = String;

    fn from_str(s: &str) -> Result<ReasoningParser, String> {
        super::by_name(&NAMES, s, "reasoning parser")
    }
}

impl TryFrom<String> for ReasoningParser {
    type Error = String;

    fn try_from(s: String) -> Result<ReasoningParser, String> {
        s.parse()
    }
}

/// A chat request's thinking: split by `parser`, and in the response unless `shown` is false (vLLM's
/// `include_reasoning`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Thinking {
    pub parser: ReasoningParser,
    pub shown: bool,
}

/// Gemma 4's label at the start of its thinking channel.
const GEMMA4_LABEL: &str = "thought\n";

/// An answer split: its thinking (none when it has none, or only whitespace) and its content.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Split {
    pub reasoning: Option<String>,
    pub content: String,
}

impl ReasoningParser {
    /// The parser of a request whose template arguments are `arguments`: `DeepSeekV3`'s is DeepSeek R1's when they
    /// turn thinking on, none otherwise; `KimiK2`'s is DeepSeek R1's unless they turn it off; every other parser is
    /// its own.
    pub fn for_request(
        self,
        arguments: Option<&serde_json::Map<String, serde_json::Value>>,
    ) -> Option<ReasoningParser> {
        let set = |key: &str, to: bool| arguments.and_then(|a| a.get(key)) == Some(&serde_json::Value::Bool(to));
        match self {
            ReasoningParser::DeepSeekV3 => {
                (set("thinking", true) || set("enable_thinking", true)).then_some(ReasoningParser::DeepSeekR1)
            }
            ReasoningParser::KimiK2 => (!set("thinking", false)).then_some(ReasoningParser::DeepSeekR1),
            parser => Some(parser),
        }
    }

    /// The parser for an answer to `prompt` (a conversation as its template rendered it), `None` when the answer
    /// cannot think: one that thinks only when the answer opens the block (`qwen3`, `glm45`) thinks from the
    /// answer's start when the prompt opened it, as vLLM finds the opening in the prompt (Qwen 3.5, Qwen3's
    /// thinking-only models (2507) and GLM 4.7 write `<think>` at the end of their generation prompt); one that
    /// thinks from the start does not think at all when the prompt closed the block (Seed-OSS's template does with
    /// `thinking_budget: 0`), where vLLM's would take the whole answer for thinking.
    pub fn after_prompt(self, prompt: &str) -> Option<ReasoningParser> {
        let (start, end) = self.markers();
        let prompt = prompt.trim_end();
        match self {
            ReasoningParser::Qwen3 if prompt.ends_with(start) => Some(ReasoningParser::DeepSeekR1),
            parser if parser.thinks_from_the_start() && prompt.ends_with(end) => None,
            parser => Some(parser),
        }
    }

    /// Where the answer's thinking comes before what a grammar holds, as the worker applies it: the grammar holds
    /// after the thinking, as vLLM's does with a reasoning parser.
    pub fn before_grammar(self) -> engine::grammar::Thinking {
        match self {
            ReasoningParser::DeepSeekR1
            | ReasoningParser::DeepSeekV3
            | ReasoningParser::SeedOss
            | ReasoningParser::KimiK2 => engine::grammar::Thinking::Open,
            ReasoningParser::Qwen3 => engine::grammar::Thinking::Optional,
            ReasoningParser::Gemma4 => engine::grammar::Thinking::Channel,
            // Not reached: a grammar beside harmony's answers is refused (`openai::check_chat`).
            ReasoningParser::GptOss => engine::grammar::Thinking::None,
        }
    }

    /// The markers around the thinking.
    fn markers(self) -> (&'static str, &'static str) {
        match self {
            ReasoningParser::DeepSeekR1
            | ReasoningParser::DeepSeekV3
            | ReasoningParser::Qwen3
            | ReasoningParser::KimiK2 => ("<think>", "</think>"),
            ReasoningParser::SeedOss => ("<seed:think>", "</seed:think>"),
            ReasoningParser::Gemma4 => ("<|channel>", "<channel|>"),
            ReasoningParser::GptOss => ("<|channel|>analysis<|message|>", "<|end|>"),
        }
    }

    /// Whether an answer that does not open with the start marker thinks anyway (the prompt opened it).
    fn thinks_from_the_start(self) -> bool {
        matches!(
            self,
            ReasoningParser::DeepSeekR1
                | ReasoningParser::DeepSeekV3
                | ReasoningParser::SeedOss
                | ReasoningParser::KimiK2
        )
    }

    /// Whether the router reads `chat_template_kwargs`' `enable_thinking: false` itself (Qwen3's templates then
    /// close the block in the prompt, so a grammar holds from the first token).
    pub fn reads_thinking_switch(self) -> bool {
        self == ReasoningParser::Qwen3
    }

    /// Whether the answer must keep its control tokens' text for the thinking to be found.
    pub fn needs_control_text(self) -> bool {
        matches!(
            self,
            ReasoningParser::Gemma4 | ReasoningParser::GptOss | ReasoningParser::SeedOss | ReasoningParser::KimiK2
        )
    }

    /// Splits a whole answer.
    pub fn split(self, text: &str) -> Split {
        if self == ReasoningParser::GptOss {
            return super::harmony::split(text);
        }
        let (start, end) = self.markers();
        let opened = text.trim_start().strip_prefix(start);
        if !self.thinks_from_the_start() && opened.is_none() {
            return Split { reasoning: None, content: text.to_string() };
        }
        let thought = opened.unwrap_or(text);
        let thought = match self {
            ReasoningParser::Gemma4 => thought.strip_prefix(GEMMA4_LABEL).unwrap_or(thought),
            _ => thought,
        };
        let (reasoning, content) = match thought.find(end) {
            Some(at) => (&thought[..at], &thought[at + end.len()..]),
            None => (thought, ""),
        };
        Split { reasoning: (!reasoning.trim().is_empty()).then(|| reasoning.to_string()), content: content.to_string() }
    }
}

/// Where a streamed answer is.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Phase {
    /// Its start is whitespace or part of `<think>` so far: whether it thinks is not known yet.
    Opening,
    /// Just inside the thinking, where Gemma 4's label may still come.
    Labelled,
    Thinking,
    Answering,
}

/// The split of an answer as it streams: each piece of text gives the thinking and the content to send now; an
/// end that may be the start of a marker is held back until the next piece shows what it is.
#[derive(Debug)]
pub struct ReasoningStream {
    parser: ReasoningParser,
    /// gpt-oss's messages, read by their own reader.
    harmony: Option<super::harmony::HarmonyStream>,
    text: String,
    /// How much of `text` has been sent (or swallowed, for the markers).
    sent: usize,
    phase: Phase,
}

impl ReasoningStream {
    pub fn new(parser: ReasoningParser) -> ReasoningStream {
        let harmony = (parser == ReasoningParser::GptOss).then(super::harmony::HarmonyStream::default);
        ReasoningStream { parser, harmony, text: String::new(), sent: 0, phase: Phase::Opening }
    }

    /// The thinking and the content to send for the next piece of text `s`.
    pub fn push(&mut self, s: &str) -> Split {
        if let Some(harmony) = &mut self.harmony {
            return harmony.push(s);
        }
        self.text.push_str(s);
        let mut out = Split::default();
        let (start, end) = self.parser.markers();
        if self.phase == Phase::Opening {
            let lead = self.text.trim_start();
            if lead.starts_with(start) {
                self.sent = self.text.len() - lead.len() + start.len();
                self.phase = Phase::Labelled;
            } else if !start.starts_with(lead) {
                self.phase = if self.parser.thinks_from_the_start() { Phase::Labelled } else { Phase::Answering };
            }
        }
        if self.phase == Phase::Labelled {
            let rest = &self.text[self.sent..];
            let gemma = self.parser == ReasoningParser::Gemma4;
            if gemma && rest.starts_with(GEMMA4_LABEL) {
                self.sent += GEMMA4_LABEL.len();
                self.phase = Phase::Thinking;
            } else if !gemma || !GEMMA4_LABEL.starts_with(rest) {
                // Held while what came is the start of the label.
                self.phase = Phase::Thinking;
            }
        }
        if self.phase == Phase::Thinking {
            match self.text[self.sent..].find(end) {
                Some(at) => {
                    out.reasoning = Some(self.text[self.sent..self.sent + at].to_string());
                    self.sent += at + end.len();
                    self.phase = Phase::Answering;
                }
                None => {
                    let held = super::markers::held(&self.text, &[end]);
                    let to = (self.text.len() - held).max(self.sent);
                    out.reasoning = Some(self.text[self.sent..to].to_string());
                    self.sent = to;
                }
            }
        }
        if self.phase == Phase::Answering {
            out.content.push_str(&self.text[self.sent..]);
            self.sent = self.text.len();
        }
        out.reasoning = out.reasoning.filter(|r| !r.is_empty());
        out
    }

    /// At the end: what is still to send for the last text `rest` and anything held back.
    pub fn end(&mut self, rest: &str) -> Split {
        if let Some(harmony) = &mut self.harmony {
            return harmony.end(rest);
        }
        let mut out = self.push(rest);
        let held = &self.text[self.sent..];
        if !held.is_empty() {
            // A start that never became `<think>`, or an end that never became `</think>`.
            match self.phase {
                Phase::Opening if !self.parser.thinks_from_the_start() => out.content.push_str(held),
                Phase::Answering => out.content.push_str(held),
                _ => out.reasoning.get_or_insert_with(String::new).push_str(held),
            }
        }
        self.sent = self.text.len();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(p: ReasoningParser, text: &str) -> (Option<String>, String) {
        let s = p.split(text);
        (s.reasoning, s.content)
    }

    fn some(s: &str) -> Option<String> {
        Some(s.to_string())
    }

    /// A prompt that ends by opening the block makes a `qwen3` answer think from its start: GLM 4.7's answer
    /// `Hmm.</think>Yes.` was all content, with its `</think>`, before the split read the prompt.
    #[test]
    fn a_prompt_that_opens_the_block_starts_the_answer_thinking() {
        let glm45: ReasoningParser = "glm45".parse().expect("a parser");
        let opened = glm45.after_prompt("<|user|>\nHi<|assistant|><think>").expect("a parser");
        assert_eq!(split(opened, "Hmm.</think>Yes."), (some("Hmm."), "Yes.".to_string()));
        assert_eq!(split(glm45, "Hmm.</think>Yes."), (None, "Hmm.</think>Yes.".to_string()), "as it was");
        for prompt in ["<|assistant|></think>", "<|im_start|>assistant\n", "<think>x</think>\n"] {
            assert_eq!(glm45.after_prompt(prompt), Some(ReasoningParser::Qwen3), "{prompt:?}");
        }
        assert_eq!(ReasoningParser::Gemma4.after_prompt("<|channel>"), Some(ReasoningParser::Gemma4));
    }

    /// A prompt that closes the block leaves an answer that thinks from its start nothing to think: Seed-OSS's
    /// template closes it when `thinking_budget` is 0, and the answer was all thinking.
    #[test]
    fn a_prompt_that_closes_the_block_leaves_no_thinking() {
        let seed: ReasoningParser = "seed_oss".parse().expect("a parser");
        assert_eq!(split(seed, "Hmm.</seed:think>Yes."), (some("Hmm."), "Yes.".to_string()));
        assert_eq!(split(seed, "Yes."), (some("Yes."), String::new()), "thinking from the start");
        let closed =
            "<seed:bos>assistant\n<seed:think>\n<seed:cot_budget_reflect>0</seed:cot_budget_reflect>\n</seed:think>";
        assert_eq!(seed.after_prompt(closed), None);
        assert_eq!(seed.after_prompt("<seed:bos>assistant\n"), Some(seed));
        assert_eq!(ReasoningParser::DeepSeekR1.after_prompt("<think>\n\n</think>\n\n"), None);
        assert_eq!(ReasoningParser::DeepSeekR1.after_prompt("<think>\n"), Some(ReasoningParser::DeepSeekR1));
    }

    /// Kimi K2 thinks unless `chat_template_kwargs` turns `thinking` off, as vLLM reads it.
    #[test]
    fn kimi_k2_thinks_unless_turned_off() {
        let kimi: ReasoningParser = "kimi_k2".parse().expect("a parser");
        let args = |v: serde_json::Value| v.as_object().cloned();
        assert_eq!(kimi.for_request(None), Some(ReasoningParser::DeepSeekR1));
        assert_eq!(
            kimi.for_request(args(serde_json::json!({"thinking": true})).as_ref()),
            Some(ReasoningParser::DeepSeekR1)
        );
        assert_eq!(kimi.for_request(args(serde_json::json!({"thinking": false})).as_ref()), None);
        assert!(kimi.needs_control_text() && ReasoningParser::SeedOss.needs_control_text());
    }

    #[test]
    fn parsers_go_by_vllms_names() {
        for (name, parser) in NAMES {
            assert_eq!(name.parse::<ReasoningParser>(), Ok(parser));
            let v = serde_json::Value::from(name);
            assert_eq!(serde_json::from_value::<ReasoningParser>(v).expect("known"), parser);
        }
        assert!("granite".parse::<ReasoningParser>().is_err_and(|e| e.contains("deepseek_r1")));
    }

    #[test]
    fn thinking_is_split_from_the_answer() {
        use ReasoningParser::{DeepSeekR1, Qwen3};
        for p in [DeepSeekR1, Qwen3] {
            assert_eq!(split(p, "<think>Hmm.</think>\n\nYes."), (some("Hmm."), "\n\nYes.".to_string()), "{p:?}");
            assert_eq!(split(p, "\n<think>\nHmm.\n</think>Yes."), (some("\nHmm.\n"), "Yes.".to_string()), "{p:?}");
            assert_eq!(split(p, "<think> </think>Yes."), (None, "Yes.".to_string()), "{p:?}: blank thinking");
        }
        // DeepSeek R1's template opens the block: its answers think from the start, to the end if cut short.
        assert_eq!(split(DeepSeekR1, "Hmm.</think>Yes."), (some("Hmm."), "Yes.".to_string()));
        assert_eq!(split(DeepSeekR1, "Hmm, still"), (some("Hmm, still"), String::new()));
        // Qwen3 thinks only when it opens the block.
        assert_eq!(split(Qwen3, "Yes."), (None, "Yes.".to_string()));
        assert_eq!(split(Qwen3, "Hmm.</think>Yes."), (None, "Hmm.</think>Yes.".to_string()));
        assert_eq!(split(Qwen3, "<think>Hmm, still"), (some("Hmm, still"), String::new()));
        // Gemma 4's channel, its label left out.
        let gemma = ReasoningParser::Gemma4;
        assert_eq!(split(gemma, "<|channel>thought\nHmm.<channel|>Yes."), (some("Hmm."), "Yes.".to_string()));
        assert_eq!(split(gemma, "<|channel>Hmm.<channel|>Yes."), (some("Hmm."), "Yes.".to_string()));
        assert_eq!(split(gemma, "<|channel>thought\n<channel|>Yes."), (None, "Yes.".to_string()));
        assert_eq!(split(gemma, "Yes. <think>x</think>"), (None, "Yes. <think>x</think>".to_string()));
        // Streamed a character at a time, the label whole and nothing after it (found by the property test).
        let mut stream = ReasoningStream::new(gemma);
        let text = "<|channel>thought\n";
        let mut thought = String::new();
        for c in text.chars() {
            thought.push_str(&stream.push(&c.to_string()).reasoning.unwrap_or_default());
        }
        thought.push_str(&stream.end("").reasoning.unwrap_or_default());
        assert_eq!((thought.as_str(), split(gemma, text)), ("", (None, String::new())));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]
        /// However an answer of words, markers and their parts is cut into streamed pieces, the thinking and the
        /// content sent add up to the whole answer's split.
        #[test]
        fn a_streamed_split_is_the_whole_one(
            which in 0usize..5,
            parts in proptest::collection::vec(0usize..16, 0..16),
            cuts in proptest::collection::vec(1usize..6, 1..40),
        ) {
            const THINK: &[&str] = &["<think>", "</think>", "Hmm ", "<th", "ink>", "</th", "\n", "é", "<"];
            const CHANNEL: &[&str] =
                &["<|channel>", "<channel|>", "thought\n", "thou", "<|chan", "nel>", "\n", "é", "<"];
            // gpt-oss's messages: headers of every kind, the markers whole and in parts.
            const HARMONY: &[&str] = &["<|channel|>analysis<|message|>", "<|channel|>", "final", "commentary",
                " to=functions.now", " <|constrain|>json", "<|message|>", "<|end|>", "<|start|>assistant", "<|st",
                "<|e", "nd|>", "Hmm, ", "{\"a\": 1}", "\n", "é"];
            const SEED: &[&str] = &["<seed:think>", "</seed:think>", "Hmm ", "<seed:", "think>", "</seed", "\n", "é", "<"];
            let (parser, pieces) = [
                (ReasoningParser::DeepSeekR1, THINK),
                (ReasoningParser::Qwen3, THINK),
                (ReasoningParser::Gemma4, CHANNEL),
                (ReasoningParser::GptOss, HARMONY),
                (ReasoningParser::SeedOss, SEED),
            ][which];
            let text: String = parts.iter().map(|&i| pieces[i % pieces.len()]).collect();
            let mut stream = ReasoningStream::new(parser);
            let (mut reasoning, mut content) = (String::new(), String::new());
            let mut add = |s: Split| {
                reasoning.push_str(&s.reasoning.unwrap_or_default());
                content.push_str(&s.content);
            };
            for piece in super::super::markers::pieces(&text, &cuts) {
                add(stream.push(&piece));
            }
            add(stream.end(""));
            let whole = parser.split(&text);
            proptest::prop_assert_eq!(&content, &whole.content);
            match whole.reasoning {
                Some(r) => proptest::prop_assert_eq!(reasoning, r),
                None => proptest::prop_assert!(reasoning.trim().is_empty(), "{:?}", reasoning),
            }
        }
    }
}
