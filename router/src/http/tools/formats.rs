//! The formats models write tool calls in among their text, by vLLM's `--tool-call-parser` names: parsed out of a
//! whole answer, and found in a streamed one as it comes. A call must name one of the request's functions: a model
//! that writes a call of no tool has not called one. Where each call is marked (Hermes', Qwen3-Coder's, Mistral's,
//! Gemma 4's, DeepSeek's, GLM's, MiniMax's), the calls are those read one after the other from the first marker up to the first that is not a
//! call, which ends them as text after the last call does; none read, the answer is all content. A streamed answer
//! gets each call once it is whole, and the same calls as the whole answer. Where the whole answer is the calls
//! (Llama 3's JSON, pythonic), one that is not a call makes it all content.

use serde_json::Value;

use super::{Function, Made};
use super::{gemma4, pythonic};

/// A model's way of writing tool calls in free text.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(try_from = "String")]
pub enum ToolParser {
    /// `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call, after any text: Hermes',
    /// Qwen 2.5's and 3's, SmolLM3's.
    Hermes,
    /// The whole answer is calls, `{"name": ..., "parameters": {...}}` objects separated by `;`, after an optional
    /// `<|python_tag|>`: Llama 3.1–3.3's JSON calls (and Llama 4's, vLLM's `llama4_json`).
    Llama3Json,
    /// Text, then `[TOOL_CALLS]` and either a JSON array of `{"name", "arguments"}` (Mistral's tokenizers before
    /// v11) or `name{arguments}` with the marker before each call (v11 on; `[CALL_ID]id` and `[ARGS]` between
    /// them allowed). Call ids are 9 letters and digits, which Mistral's templates demand back.
    Mistral,
    /// The whole answer is a Python list of calls with keyword arguments of literal values, `[weather(city="Oslo"),
    /// now()]`, wrapped or not in `<|python_start|>` … `<|python_end|>`: Llama 3.2's and 4's (vLLM's
    /// `llama4_pythonic` too).
    Pythonic,
    /// Hermes' blocks holding XML rather than JSON, `<tool_call><function=NAME><parameter=KEY>value</parameter>...
    /// </function></tool_call>`: each value is text, read as the type the function's schema gives that parameter
    /// (a string as written, a number or boolean parsed, an object or array as JSON; text when it is not one):
    /// Qwen3-Coder's (vLLM's `qwen3_xml` too).
    Qwen3Coder,
    /// `<|tool_call>call:NAME{key:value,...}<tool_call|>` blocks after any text, values as Gemma 4's template
    /// writes them (text between `<|"|>` marks, bare keys): Gemma 4's. Its markers are control tokens, so the answer
    /// keeps their text.
    Gemma4,
    /// Text, then `<｜tool▁calls▁begin｜>` and calls each `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`, the arguments
    /// in a fenced JSON block, and `<｜tool▁call▁end｜>`: DeepSeek V3's and R1's (and the R1 distillations').
    DeepSeekV3,
    /// The same, each call `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{arguments}<｜tool▁call▁end｜>`: DeepSeek V3.1's.
    DeepSeekV31,
    /// DeepSeek's markup (DSML): text, then `<｜DSML｜function_calls>` (V3.2) or `<｜DSML｜tool_calls>` (V4) and calls
    /// each `<｜DSML｜invoke name="NAME">` with its parameters `<｜DSML｜parameter name="KEY" string="true|false">value
    /// </｜DSML｜parameter>` (a string as written, anything else as JSON) and `</｜DSML｜invoke>`.
    DeepSeekDsml,
    /// Hermes' blocks holding the name and then each argument as `<arg_key>KEY</arg_key><arg_value>value
    /// </arg_value>`, on lines of their own or not: GLM 4.5's, 4.6's and 4.7's. A value is read as these templates
    /// write it: a string parameter's as itself, any other as JSON (or as its schema's type when it is not JSON).
    Glm45,
    /// Text, then `<minimax:tool_call>` and calls each `<invoke name="NAME">` with its parameters `<parameter
    /// name="KEY">value</parameter>` (read as GLM's values are) and `</invoke>`, until `</minimax:tool_call>`:
    /// MiniMax M2's.
    MiniMaxM2,
    /// The whole answer is a JSON array of `{"name", "arguments"}` calls, after an optional `<|tool_call|>` (Granite
    /// 3.0's token, left out of the text when the vocabulary makes it a control token) and `<tool_call>` (3.1's):
    /// IBM Granite 3's.
    Granite,
    /// Qwen3-Coder's XML calls in `<seed:tool_call>` … `</seed:tool_call>` blocks: ByteDance's Seed-OSS's. Its markers
    /// may be control tokens, so the answer keeps their text.
    SeedOss,
    /// Text, then `<|tool_calls_section_begin|>` and calls each `<|tool_call_begin|>functions.NAME:N
    /// <|tool_call_argument_begin|>{arguments}<|tool_call_end|>`, then `<|tool_calls_section_end|>`: Kimi K2's. Its
    /// markers are control tokens, so the answer keeps their text; call ids are `functions.NAME:N` as its templates
    /// write them.
    KimiK2,
    /// gpt-oss's calls, messages to `functions.NAME` whose text is the arguments' JSON, as the `openai_gptoss`
    /// reasoning parser hands them on in the content (`to=functions.NAME<|message|>{...}`, [`super::super::harmony`]);
    /// it needs that parser.
    OpenAi,
}

/// Each parser's names, vLLM's aliases included.
const NAMES: [(&str, ToolParser); 20] = [
    ("hermes", ToolParser::Hermes),
    ("llama3_json", ToolParser::Llama3Json),
    ("llama4_json", ToolParser::Llama3Json),
    ("mistral", ToolParser::Mistral),
    ("pythonic", ToolParser::Pythonic),
    ("llama4_pythonic", ToolParser::Pythonic),
    ("qwen3_coder", ToolParser::Qwen3Coder),
    ("qwen3_xml", ToolParser::Qwen3Coder),
    ("gemma4", ToolParser::Gemma4),
    ("deepseek_v3", ToolParser::DeepSeekV3),
    ("deepseek_v31", ToolParser::DeepSeekV31),
    ("deepseek_v32", ToolParser::DeepSeekDsml),
    ("deepseek_v4", ToolParser::DeepSeekDsml),
    ("glm45", ToolParser::Glm45),
    ("glm47", ToolParser::Glm45),
    ("minimax_m2", ToolParser::MiniMaxM2),
    ("seed_oss", ToolParser::SeedOss),
    ("granite", ToolParser::Granite),
    ("kimi_k2", ToolParser::KimiK2),
    ("openai", ToolParser::OpenAi),
];

impl std::str::FromStr for ToolParser {
    type Err = String;

    fn from_str(s: &str) -> Result<ToolParser, String> {
        crate::http::by_name(&NAMES, s, "tool-call parser")
    }
}

impl TryFrom<String> for ToolParser {
    type Error = String;

    fn try_from(s: String) -> Result<ToolParser, String> {
        s.parse()
    }
}

/// Hermes' blocks.
const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";
/// Mistral's marker, and what may stand between a v11 call's name and its arguments.
const TOOL_CALLS: &str = "[TOOL_CALLS]";
const CALL_ID: &str = "[CALL_ID]";
const ARGS: &str = "[ARGS]";
/// Llama's markers (special tokens, in the text when the answer keeps them).
const PYTHON_TAG: &str = "<|python_tag|>";
const PYTHON_START: &str = "<|python_start|>";
const PYTHON_END: &str = "<|python_end|>";
/// DeepSeek's markers (tokens of their own that are not special: the answer keeps their text).
const DEEPSEEK_CALLS: &str = "<｜tool▁calls▁begin｜>";
const DEEPSEEK_CALL: &str = "<｜tool▁call▁begin｜>";
const DEEPSEEK_SEP: &str = "<｜tool▁sep｜>";
const DEEPSEEK_CALL_END: &str = "<｜tool▁call▁end｜>";
/// DeepSeek's markup: what every tag opens with, the calls' wrappers (V3.2's, V4's), a call's and a parameter's tags.
const DSML: &str = "<｜DSML｜";
const DSML_CALLS: [&str; 2] = ["<｜DSML｜function_calls>", "<｜DSML｜tool_calls>"];
const DSML_INVOKE: &str = "<｜DSML｜invoke name=\"";
const DSML_INVOKE_END: &str = "</｜DSML｜invoke>";
const DSML_PARAMETER: &str = "<｜DSML｜parameter name=\"";
const DSML_PARAMETER_END: &str = "</｜DSML｜parameter>";
/// GLM's argument tags.
const GLM_KEY: (&str, &str) = ("<arg_key>", "</arg_key>");
const GLM_VALUE: (&str, &str) = ("<arg_value>", "</arg_value>");
/// Granite 3.0's marker before its calls (3.1 on write Hermes' `<tool_call>` there).
const GRANITE_TOOL_CALL: &str = "<|tool_call|>";
/// Seed-OSS's blocks.
const SEED_BLOCK: (&str, &str) = ("<seed:tool_call>", "</seed:tool_call>");
/// Kimi K2's calls' section (and the singular spelling the model sometimes writes, which vLLM takes too), a call's
/// markers, and the marker between its id and its arguments.
const KIMI_SECTIONS: [&str; 2] = ["<|tool_calls_section_begin|>", "<|tool_call_section_begin|>"];
const KIMI_CALL: (&str, &str) = ("<|tool_call_begin|>", "<|tool_call_end|>");
const KIMI_ARGUMENTS: &str = "<|tool_call_argument_begin|>";
/// MiniMax M2's calls' wrapper, a call's tags and a parameter's.
const MINIMAX_CALLS: (&str, &str) = ("<minimax:tool_call>", "</minimax:tool_call>");
const MINIMAX_INVOKE: (&str, &str) = ("<invoke name=\"", "</invoke>");
const MINIMAX_PARAMETER: (&str, &str) = ("<parameter name=\"", "</parameter>");

/// Where calls open in a streamed answer's text so far.
#[derive(Debug, PartialEq)]
pub(super) enum Scan {
    /// A call opens here: everything from here on waits for the end.
    Opens(usize),
    /// No call opens before here; what follows may still turn out to open one (held back).
    ClearTo(usize),
}

impl ToolParser {
    /// The calls `text` makes of `functions`, with the text before them as content (none when it is only
    /// whitespace; text after the last call is left out, as vLLM's parsers leave it); `None` when it makes no call
    /// (then it is all content).
    pub fn parse(self, text: &str, functions: &[Function]) -> Option<Made> {
        let at = self.opening(text)?;
        let calls = match self {
            ToolParser::Llama3Json => llama3_json(&text[at..], functions),
            ToolParser::Pythonic => pythonic_calls(&text[at..], functions),
            ToolParser::Granite => granite_calls(&text[at..], functions),
            _ => {
                let mut rest = &text[at..];
                let mut calls = Vec::new();
                while let Some((made, used)) = self.next_calls(rest, functions, true) {
                    calls.extend(made);
                    rest = &rest[used..];
                }
                (!calls.is_empty()).then_some(calls)
            }
        }?;
        let content = &text[..at];
        Some(Made { content: (!content.trim().is_empty()).then(|| content.to_string()), calls })
    }

    /// Whether `piece`, added to a streamed answer, may have made a marked call whole: it holds the last character
    /// of what ends one.
    pub(super) fn may_close(self, piece: &str) -> bool {
        match self {
            ToolParser::Hermes
            | ToolParser::Qwen3Coder
            | ToolParser::Gemma4
            | ToolParser::DeepSeekV3
            | ToolParser::DeepSeekV31
            | ToolParser::DeepSeekDsml
            | ToolParser::Glm45
            | ToolParser::MiniMaxM2
            | ToolParser::SeedOss
            | ToolParser::KimiK2 => piece.contains('>'),
            ToolParser::Mistral => piece.contains(['}', ']']),
            ToolParser::OpenAi => piece.contains('}'),
            ToolParser::Llama3Json | ToolParser::Pythonic | ToolParser::Granite => false,
        }
    }

    /// The marked call that `rest` starts with (after whitespace; with Mistral's older format, the array of calls)
    /// once it is whole, and how much of `rest` it takes; `None` when it is not a call of `functions`, or not yet
    /// whole. `end`: `rest` is all there is, and a last block cut short stands when what came of it is whole. A
    /// call read before the end is read the same at the end, whatever follows it.
    pub(super) fn next_calls(self, rest: &str, functions: &[Function], end: bool) -> Option<(Vec<Call>, usize)> {
        let skipped = rest.len() - rest.trim_start().len();
        let (calls, tail) = match self {
            ToolParser::Hermes => block(&rest[skipped..], (OPEN, CLOSE), end, |body| hermes(body, functions))?,
            ToolParser::Qwen3Coder => block(&rest[skipped..], (OPEN, CLOSE), end, |body| qwen3_coder(body, functions))?,
            ToolParser::SeedOss => block(&rest[skipped..], SEED_BLOCK, end, |body| qwen3_coder(body, functions))?,
            ToolParser::KimiK2 => {
                let text = unwrapped(&rest[skipped..], &KIMI_SECTIONS);
                block(text, KIMI_CALL, end, |body| kimi_k2(body, functions))?
            }
            ToolParser::Mistral => mistral(&rest[skipped..], functions)?,
            ToolParser::Gemma4 => {
                let (name, arguments, used) = gemma4::call(&rest[skipped..], end)?;
                let name = known(functions, &name)?.name.clone();
                (vec![(name, arguments.to_string())], &rest[skipped + used..])
            }
            ToolParser::DeepSeekV3 | ToolParser::DeepSeekV31 => {
                let text = unwrapped(&rest[skipped..], &[DEEPSEEK_CALLS]);
                let body = |body: &str| match self {
                    ToolParser::DeepSeekV3 => deepseek_v3(body, functions),
                    _ => deepseek_v31(body, functions),
                };
                block(text, (DEEPSEEK_CALL, DEEPSEEK_CALL_END), end, body)?
            }
            ToolParser::DeepSeekDsml => invoke(&rest[skipped..], &DSML_TAGS, end, functions, dsml_value)?,
            ToolParser::Glm45 => block(&rest[skipped..], (OPEN, CLOSE), end, |body| glm(body, functions))?,
            ToolParser::MiniMaxM2 => invoke(&rest[skipped..], &MINIMAX_TAGS, end, functions, minimax_value)?,
            ToolParser::OpenAi => harmony_call(&rest[skipped..], functions)?,
            ToolParser::Llama3Json | ToolParser::Pythonic | ToolParser::Granite => return None,
        };
        Some((calls, rest.len() - tail.len()))
    }

    /// Whether the answer must keep its control tokens' text for calls to be found (Mistral's and Gemma 4's
    /// markers are such tokens, and vLLM keeps them for these parsers too).
    pub fn needs_control_text(self) -> bool {
        matches!(self, ToolParser::Mistral | ToolParser::Gemma4 | ToolParser::SeedOss | ToolParser::KimiK2)
    }

    /// Where the first call in a whole answer opens.
    pub(super) fn opening(self, text: &str) -> Option<usize> {
        match self.scan(text, 0) {
            Scan::Opens(at) => Some(at),
            Scan::ClearTo(_) => None,
        }
    }

    /// Where calls open in `text`, the first `sent` bytes of which are known to open none.
    pub(super) fn scan(self, text: &str, sent: usize) -> Scan {
        match self {
            ToolParser::Hermes | ToolParser::Qwen3Coder | ToolParser::Glm45 => marked(text, sent, &[OPEN]),
            ToolParser::MiniMaxM2 => marked(text, sent, &[MINIMAX_CALLS.0]),
            ToolParser::SeedOss => marked(text, sent, &[SEED_BLOCK.0]),
            ToolParser::KimiK2 => marked(text, sent, &KIMI_SECTIONS),
            ToolParser::OpenAi => marked(text, sent, &[super::super::harmony::CALL]),
            ToolParser::Mistral => marked(text, sent, &[TOOL_CALLS]),
            ToolParser::Gemma4 => marked(text, sent, &[gemma4::OPEN]),
            ToolParser::DeepSeekV3 | ToolParser::DeepSeekV31 => marked(text, sent, &[DEEPSEEK_CALLS]),
            // Any tag opens the calls (the wrapper is V3.2's or V4's; a call without it is taken too).
            ToolParser::DeepSeekDsml => marked(text, sent, &[DSML]),
            ToolParser::Llama3Json => leading(text, sent, "{", &[PYTHON_TAG]),
            ToolParser::Pythonic => leading(text, sent, "[", &[PYTHON_START]),
            ToolParser::Granite => leading(text, sent, "[", &[GRANITE_TOOL_CALL, OPEN]),
        }
    }
}

/// Calls open at one of `markers`, anywhere: the first one after `sent`, or, while none, an end of `text` that may
/// be the start of one held back.
fn marked(text: &str, sent: usize, markers: &[&str]) -> Scan {
    // A marker that began in the held-back end is found again from `sent`.
    if let Some(i) = markers.iter().filter_map(|m| text[sent..].find(m)).min() {
        return Scan::Opens(sent + i);
    }
    let held = super::super::markers::held(text, markers);
    Scan::ClearTo((text.len() - held).max(sent))
}

/// Calls are the whole answer, which (after any whitespace) opens with `first` or with one of `markers`: decided at
/// the answer's start, held while that start is whitespace or part of a marker.
fn leading(text: &str, sent: usize, first: &str, markers: &[&str]) -> Scan {
    if sent > 0 {
        return Scan::ClearTo(text.len());
    }
    let start = text.trim_start();
    if start.starts_with(first) || markers.iter().any(|m| start.starts_with(m)) {
        Scan::Opens(0)
    } else if markers.iter().any(|m| m.starts_with(start)) {
        Scan::ClearTo(0)
    } else {
        Scan::ClearTo(text.len())
    }
}

/// The function of this name among the request's (a call of any other is not a call).
fn known<'f>(functions: &'f [Function], name: &str) -> Option<&'f Function> {
    functions.iter().find(|f| f.name == name)
}

/// A call object's function (one of `functions`) and its arguments as JSON text, from the first of `keys` present
/// (given as text, taken as it is; absent or null, `{}`).
fn call_of(call: &Value, functions: &[Function], keys: &[&str]) -> Option<Call> {
    let name = call.get("name")?.as_str().filter(|n| known(functions, n).is_some())?;
    let arguments = match keys.iter().find_map(|k| call.get(*k)) {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(v) => v.to_string(),
    };
    Some((name.to_string(), arguments))
}

/// The JSON value `s` starts with, and the text after it.
pub(super) fn json_prefix(s: &str) -> Option<(Value, &str)> {
    let mut values = serde_json::Deserializer::from_str(s).into_iter::<Value>();
    let value = values.next()?.ok()?;
    Some((value, &s[values.byte_offset()..]))
}

/// A call by name and arguments as JSON text.
pub type Call = (String, String);

/// The block `text` opens with, between `markers` (its opening and closing), read by `call` from its body trimmed,
/// and the text after it.
fn block<'t>(
    text: &'t str,
    markers: (&str, &str),
    end: bool,
    call: impl FnOnce(&str) -> Option<Call>,
) -> Option<(Vec<Call>, &'t str)> {
    let (body, after) = until_close(text.strip_prefix(markers.0)?, markers.1, end)?;
    Some((vec![call(body.trim())?], after))
}

/// A call's body (`text` up to `close`) and the text after it; a body not closed stands at the `end` only.
fn until_close<'t>(text: &'t str, close: &str, end: bool) -> Option<(&'t str, &'t str)> {
    match text.find(close) {
        Some(at) => Some((&text[..at], &text[at + close.len()..])),
        None => end.then_some((text, "")),
    }
}

/// `text` without the calls' wrapper it opens with, when it opens with one of `wrappers` (the first call's).
fn unwrapped<'t>(text: &'t str, wrappers: &[&str]) -> &'t str {
    wrappers.iter().find_map(|w| text.strip_prefix(w)).map_or(text, str::trim_start)
}

/// A DeepSeek V3 call's body: `function<｜tool▁sep｜>NAME`, then the arguments' JSON object in a ```json block.
fn deepseek_v3(body: &str, functions: &[Function]) -> Option<Call> {
    let (kind, rest) = body.split_once(DEEPSEEK_SEP)?;
    let (name, rest) = rest.split_once('\n')?;
    let json = rest.trim().strip_prefix("```json")?.strip_suffix("```")?;
    let arguments: Value = serde_json::from_str(json).ok()?;
    let function = known(functions, name.trim())?;
    (kind.trim() == "function" && arguments.is_object()).then(|| (function.name.clone(), arguments.to_string()))
}

/// A Kimi K2 call's body: its id, `functions.NAME:N` (or `NAME:N`), then `<|tool_call_argument_begin|>` and the
/// arguments' JSON object.
fn kimi_k2(body: &str, functions: &[Function]) -> Option<Call> {
    let (id, json) = body.split_once(KIMI_ARGUMENTS)?;
    let (name, n) = id.trim().rsplit_once(':')?;
    let name = name.strip_prefix("functions.").unwrap_or(name);
    let arguments: Value = serde_json::from_str(json.trim()).ok()?;
    let function = known(functions, name)?;
    (!n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) && arguments.is_object())
        .then(|| (function.name.clone(), arguments.to_string()))
}

/// A DeepSeek V3.1 call's body: `NAME<｜tool▁sep｜>` and the arguments' JSON object.
fn deepseek_v31(body: &str, functions: &[Function]) -> Option<Call> {
    let (name, json) = body.split_once(DEEPSEEK_SEP)?;
    let arguments: Value = serde_json::from_str(json.trim()).ok()?;
    let function = known(functions, name.trim())?;
    arguments.is_object().then(|| (function.name.clone(), arguments.to_string()))
}

/// How a format that writes each call as an invoke with named parameters marks it (DeepSeek's DSML, MiniMax M2's):
/// the calls' opening wrappers (before the first call), a closing one that may stand before the next call, a call's
/// tags (its name between the first and a `"`) and a parameter's (its key likewise, then any attributes up to `>`).
struct Invokes {
    wrappers: &'static [&'static str],
    between: Option<&'static str>,
    invoke: (&'static str, &'static str),
    parameter: (&'static str, &'static str),
}

const DSML_TAGS: Invokes = Invokes {
    wrappers: &DSML_CALLS,
    between: None,
    invoke: (DSML_INVOKE, DSML_INVOKE_END),
    parameter: (DSML_PARAMETER, DSML_PARAMETER_END),
};
const MINIMAX_TAGS: Invokes = Invokes {
    wrappers: &[MINIMAX_CALLS.0],
    between: Some(MINIMAX_CALLS.1),
    invoke: MINIMAX_INVOKE,
    parameter: MINIMAX_PARAMETER,
};

/// The invoke `text` opens with (after the calls' wrapper, or a closing and an opening one), read with `value` (of a
/// parameter's attributes, its text and its schema's type), and the text after it; a call not closed stands at the
/// `end` only.
fn invoke<'t>(
    text: &'t str,
    tags: &Invokes,
    end: bool,
    functions: &[Function],
    value: impl Fn(&str, &str, Option<&Value>) -> Option<Value>,
) -> Option<(Vec<Call>, &'t str)> {
    let text = tags.between.and_then(|w| text.strip_prefix(w)).map_or(text, str::trim_start);
    let (name, open) = unwrapped(text, tags.wrappers).strip_prefix(tags.invoke.0)?.split_once('"')?;
    let (mut body, after) = until_close(open.trim_start().strip_prefix('>')?, tags.invoke.1, end)?;
    let function = known(functions, name)?;
    let mut arguments = serde_json::Map::new();
    loop {
        body = body.trim_start();
        if body.is_empty() {
            return Some((vec![(function.name.clone(), Value::Object(arguments).to_string())], after));
        }
        let (key, tail) = body.strip_prefix(tags.parameter.0)?.split_once('"')?;
        let (attributes, tail) = tail.split_once('>')?;
        let (raw, tail) = tail.split_once(tags.parameter.1)?;
        let value = value(attributes.trim(), raw, function.param_type(key))?;
        if arguments.insert(key.to_string(), value).is_some() {
            return None;
        }
        body = tail;
    }
}

/// A DSML parameter's value: `string="true"`, as written; `string="false"`, JSON (a model's value that is not JSON is
/// read as its schema's type, as Qwen3-Coder's are).
fn dsml_value(attributes: &str, raw: &str, kind: Option<&Value>) -> Option<Value> {
    match attributes.strip_prefix("string=\"")?.strip_suffix('"')? {
        "true" => Some(Value::String(raw.to_string())),
        "false" => Some(serde_json::from_str(raw.trim()).unwrap_or_else(|_| typed(raw, kind))),
        _ => None,
    }
}

/// A MiniMax M2 parameter's value (no attributes), as GLM's are read.
fn minimax_value(attributes: &str, raw: &str, kind: Option<&Value>) -> Option<Value> {
    attributes.is_empty().then(|| written(raw.trim(), kind))
}

/// The gpt-oss call `text` opens with, as the harmony reader hands it on: `to=functions.NAME<|message|>` and the
/// arguments' JSON object, and the text after it. Its JSON ends it.
fn harmony_call<'t>(text: &'t str, functions: &[Function]) -> Option<(Vec<Call>, &'t str)> {
    let (name, json) = text.strip_prefix(super::super::harmony::CALL)?.split_once("<|message|>")?;
    let (arguments, after) = json_prefix(json)?;
    let function = known(functions, name.trim())?;
    arguments.is_object().then(|| (vec![(function.name.clone(), arguments.to_string())], after))
}

/// A GLM block's body: the function's name, then its arguments' keys and values between their tags.
fn glm(body: &str, functions: &[Function]) -> Option<Call> {
    let at = body.find(GLM_KEY.0).unwrap_or(body.len());
    let function = known(functions, body[..at].trim())?;
    let mut rest = &body[at..];
    let mut arguments = serde_json::Map::new();
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            return Some((function.name.clone(), Value::Object(arguments).to_string()));
        }
        let (key, tail) = rest.strip_prefix(GLM_KEY.0)?.split_once(GLM_KEY.1)?;
        let (raw, tail) = tail.trim_start().strip_prefix(GLM_VALUE.0)?.split_once(GLM_VALUE.1)?;
        let key = key.trim();
        if arguments.insert(key.to_string(), written(raw.trim(), function.param_type(key))).is_some() {
            return None;
        }
        rest = tail;
    }
}

/// A value as GLM's and MiniMax's templates write it: a string parameter's as itself, any other as JSON; one that is
/// not JSON is read as its schema's type (a model's `True`, say).
fn written(raw: &str, kind: Option<&Value>) -> Value {
    match type_name(kind) {
        Some("string") => Value::String(raw.to_string()),
        _ => serde_json::from_str(raw).unwrap_or_else(|_| typed(raw, kind)),
    }
}

/// The type a parameter's schema gives (`kind`: a type name, or a list of them beside `null`).
fn type_name(kind: Option<&Value>) -> Option<&str> {
    match kind {
        Some(Value::String(s)) => Some(s.as_str()),
        Some(Value::Array(kinds)) => kinds.iter().filter_map(Value::as_str).find(|k| *k != "null"),
        _ => None,
    }
}

/// A Hermes block's body: a JSON object with the name and `arguments`.
fn hermes(body: &str, functions: &[Function]) -> Option<Call> {
    call_of(&serde_json::from_str(body).ok()?, functions, &["arguments"])
}

/// A Qwen3-Coder block's body: the function and its parameters in XML.
fn qwen3_coder(body: &str, functions: &[Function]) -> Option<Call> {
    let (name, mut rest) = body.strip_prefix("<function=")?.split_once('>')?;
    let function = known(functions, name.trim())?;
    let mut arguments = serde_json::Map::new();
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix("</function>") {
            return after.trim().is_empty().then(|| (function.name.clone(), Value::Object(arguments).to_string()));
        }
        let (key, tail) = rest.strip_prefix("<parameter=")?.split_once('>')?;
        let (raw, tail) = tail.split_once("</parameter>")?;
        // The value sits on lines of its own.
        let raw = raw.strip_prefix('\n').unwrap_or(raw);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        let key = key.trim();
        if arguments.insert(key.to_string(), typed(raw, function.param_type(key))).is_some() {
            return None;
        }
        rest = tail;
    }
}

/// A parameter's text as the type its schema gives (`kind`: a type name, or a list of them beside `null`): text as
/// written for a string or an unknown parameter; `null` as null; a number, boolean, object or array parsed (an
/// object or array as JSON or as a Python literal), or left as text when it does not parse as one.
fn typed(raw: &str, kind: Option<&Value>) -> Value {
    let name = type_name(kind);
    let text = || Value::String(raw.to_string());
    if raw.trim() == "null" && name != Some("string") {
        return Value::Null;
    }
    let raw_t = raw.trim();
    match name {
        None | Some("string") => text(),
        Some("integer") => raw_t.parse::<i64>().map(Value::from).unwrap_or_else(|_| text()),
        Some("number") => match raw_t.parse::<f64>().ok().filter(|f| f.is_finite()) {
            Some(f) if f.fract() == 0.0 && f.abs() < 9.0e15 => Value::from(f as i64),
            Some(f) => serde_json::Number::from_f64(f).map_or_else(text, Value::Number),
            None => text(),
        },
        Some("boolean") => match raw_t {
            "true" | "True" => Value::Bool(true),
            "false" | "False" => Value::Bool(false),
            _ => text(),
        },
        // An object or array as JSON, or as Python writes it (vLLM reads these with `ast.literal_eval` too).
        Some(_) => serde_json::from_str(raw_t).ok().or_else(|| pythonic::literal(raw_t)).unwrap_or_else(text),
    }
}

fn llama3_json(text: &str, functions: &[Function]) -> Option<Vec<Call>> {
    let start = text.trim_start();
    let mut rest = start.strip_prefix(PYTHON_TAG).unwrap_or(start).trim_start();
    let mut calls = Vec::new();
    loop {
        let (call, after) = json_prefix(rest)?;
        calls.push(call_of(&call, functions, &["parameters", "arguments"])?);
        let after = after.trim_start();
        if after.is_empty() {
            return Some(calls);
        }
        rest = after.strip_prefix(';')?.trim_start();
    }
}

/// The Mistral call `text` opens with (before v11, the array of calls, each a call or none is), and the text after
/// it. Its JSON ends it, so it is whole or not whatever follows.
fn mistral<'t>(text: &'t str, functions: &[Function]) -> Option<(Vec<Call>, &'t str)> {
    let after = text.strip_prefix(TOOL_CALLS)?.trim_start();
    if after.starts_with(['[', '{']) {
        // Before v11: an array of call objects (or one).
        let (value, tail) = json_prefix(after)?;
        let calls = match value {
            Value::Array(items) => items.iter().map(|item| call_of(item, functions, &["arguments"])).collect(),
            call @ Value::Object(_) => call_of(&call, functions, &["arguments"]).map(|c| vec![c]),
            _ => None,
        }?;
        return Some((calls, tail));
    }
    // v11 on: `name`, then `[CALL_ID]id` and `[ARGS]` or neither, then the arguments' object.
    let end = after.find(['{', '['])?;
    let name = after[..end].trim();
    let mut tail = &after[end..];
    if let Some(id) = tail.strip_prefix(CALL_ID) {
        tail = &id[id.find(['{', '['])?..];
    }
    tail = tail.strip_prefix(ARGS).unwrap_or(tail).trim_start();
    let (arguments, after) = json_prefix(tail)?;
    if !arguments.is_object() || known(functions, name).is_none() {
        return None;
    }
    Some((vec![(name.to_string(), arguments.to_string())], after))
}

fn pythonic_calls(text: &str, functions: &[Function]) -> Option<Vec<Call>> {
    let start = text.trim_start();
    let inner = start.strip_prefix(PYTHON_START).unwrap_or(start);
    let (calls, rest) = pythonic::calls(inner)?;
    let rest = rest.trim_start();
    if !rest.strip_prefix(PYTHON_END).unwrap_or(rest).trim().is_empty() || calls.is_empty() {
        return None;
    }
    calls
        .into_iter()
        .map(|(name, arguments)| {
            known(functions, &name).is_some().then(|| (name, Value::Object(arguments).to_string()))
        })
        .collect()
}

/// Granite's answer: after its markers (each optional), a JSON array of calls, and nothing after it.
fn granite_calls(text: &str, functions: &[Function]) -> Option<Vec<Call>> {
    let start = text.trim_start();
    let start = start.strip_prefix(GRANITE_TOOL_CALL).unwrap_or(start).trim_start();
    let start = start.strip_prefix(OPEN).unwrap_or(start).trim_start();
    let (value, after) = json_prefix(start)?;
    let items = value.as_array().filter(|items| !items.is_empty() && after.trim().is_empty())?;
    items.iter().map(|item| call_of(item, functions, &["arguments"])).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn functions() -> Vec<Function> {
        super::super::tests::known(&["weather", "now"])
    }

    fn calls(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter().map(|(n, a)| (n.to_string(), a.to_string())).collect()
    }

    /// DeepSeek's: text, the calls' marker, each call between its own markers, V3's with a fenced JSON block.
    #[test]
    fn deepseek_marked_calls_are_calls() {
        let v3 = "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>weather\n```json\n{\"city\": \"Oslo\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        let made = ToolParser::DeepSeekV3.parse(v3, &functions()).expect("calls");
        assert_eq!(made.content.as_deref(), Some("Let me check."));
        assert_eq!(made.calls, calls(&[("weather", r#"{"city":"Oslo"}"#), ("now", "{}")]));
        let v31 = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>weather<｜tool▁sep｜>{\"city\": \"Oslo\"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        let made = ToolParser::DeepSeekV31.parse(v31, &functions()).expect("calls");
        assert_eq!((made.content, made.calls), (None, calls(&[("weather", r#"{"city":"Oslo"}"#), ("now", "{}")])));
        // Cut short after whole arguments: still the call.
        let cut = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>{}";
        assert_eq!(ToolParser::DeepSeekV31.parse(cut, &functions()).map(|m| m.calls.len()), Some(1));
        for (parser, not_calls) in [
            (ToolParser::DeepSeekV31, "No calls."),
            (
                ToolParser::DeepSeekV31,
                "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>rain<｜tool▁sep｜>{}<｜tool▁call▁end｜>",
            ),
            (
                ToolParser::DeepSeekV31,
                "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>[1]<｜tool▁call▁end｜>",
            ),
            (ToolParser::DeepSeekV31, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>now{}<｜tool▁call▁end｜>"),
            (
                ToolParser::DeepSeekV3,
                "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n{}<｜tool▁call▁end｜>",
            ),
            (
                ToolParser::DeepSeekV3,
                "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>other<｜tool▁sep｜>now\n```json\n{}\n```<｜tool▁call▁end｜>",
            ),
        ] {
            assert_eq!(parser.parse(not_calls, &functions()), None, "{not_calls}");
        }
    }

    /// DeepSeek's markup: each invoke a call, string parameters as written, the others as JSON.
    #[test]
    fn dsml_invokes_are_calls() {
        let parse = |text: &str| ToolParser::DeepSeekDsml.parse(text, &functions());
        let v32 = "Checking.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">New York, \"NY\"</｜DSML｜parameter>\n<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n<｜DSML｜parameter name=\"tags\" string=\"false\">[\"a\", {\"b\": null}]</｜DSML｜parameter>\n</｜DSML｜invoke>\n<｜DSML｜invoke name=\"now\">\n</｜DSML｜invoke>\n</｜DSML｜function_calls>";
        let made = parse(v32).expect("calls");
        assert_eq!(made.content.as_deref(), Some("Checking.\n\n"));
        let args: Value = serde_json::from_str(&made.calls[0].1).expect("json");
        assert_eq!(args, serde_json::json!({"city": "New York, \"NY\"", "days": 3, "tags": ["a", {"b": null}]}));
        assert_eq!(made.calls[1], ("now".to_string(), "{}".to_string()));
        let v4 = "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"now\">\n<｜DSML｜parameter name=\"tz\" string=\"true\">UTC</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
        assert_eq!(parse(v4).expect("a call").calls, calls(&[("now", r#"{"tz":"UTC"}"#)]));
        for not_calls in [
            "<｜DSML｜function_calls><｜DSML｜invoke name=\"rain\"></｜DSML｜invoke>",
            "<｜DSML｜function_calls><｜DSML｜invoke name=\"now\"><｜DSML｜parameter name=\"a\">1</｜DSML｜parameter></｜DSML｜invoke>",
            "<｜DSML｜function_calls><｜DSML｜invoke name=\"now\"><｜DSML｜parameter name=\"a\" string=\"true\">1</｜DSML｜parameter><｜DSML｜parameter name=\"a\" string=\"true\">2</｜DSML｜parameter></｜DSML｜invoke>",
            "<｜DSML｜function_calls>now()",
        ] {
            assert_eq!(parse(not_calls), None, "{not_calls}");
        }
    }

    /// GLM's blocks: the name, then keys and values between their tags, with line breaks (4.5, 4.6) or without
    /// (4.7); a string parameter's value as written, any other as JSON.
    #[test]
    fn glm_blocks_are_calls() {
        let params = serde_json::json!({"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "code": {"type": "string"}}});
        let f = vec![Function { name: "weather".into(), params }, functions().remove(1)];
        let parse = |text: &str| ToolParser::Glm45.parse(text, &f);
        let v45 = "Checking.\n<tool_call>weather\n<arg_key>city</arg_key>\n<arg_value>New York</arg_value>\n\
                   <arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>code</arg_key>\n<arg_value>42</arg_value>\n\
                   <arg_key>tags</arg_key>\n<arg_value>[\"a\", 1]</arg_value>\n</tool_call>\n<tool_call>now\n</tool_call>";
        let made = parse(v45).expect("calls");
        assert_eq!(made.content.as_deref(), Some("Checking.\n"));
        let args: Value = serde_json::from_str(&made.calls[0].1).expect("json");
        assert_eq!(args, serde_json::json!({"city": "New York", "days": 3, "code": "42", "tags": ["a", 1]}));
        assert_eq!(made.calls[1], ("now".to_string(), "{}".to_string()));
        let v47 = "<tool_call>weather<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>";
        assert_eq!(parse(v47).expect("a call").calls, calls(&[("weather", r#"{"city":"Oslo"}"#)]));
        for not_calls in [
            "<tool_call>rain\n</tool_call>",
            "<tool_call>now<arg_key>a</arg_key></tool_call>",
            "<tool_call>now<arg_value>1</arg_value></tool_call>",
            "<tool_call>now<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>a</arg_key><arg_value>2</arg_value></tool_call>",
            "<tool_call>{\"name\": \"now\"}</tool_call>",
        ] {
            assert_eq!(parse(not_calls), None, "{not_calls}");
        }
    }

    /// MiniMax M2's: each invoke a call, within one wrapper or several; values as GLM's are.
    #[test]
    fn minimax_invokes_are_calls() {
        let parse = |text: &str| ToolParser::MiniMaxM2.parse(text, &functions());
        let text = "Let me see.\n<minimax:tool_call>\n<invoke name=\"weather\"><parameter name=\"city\">Oslo, \"NO\"</parameter>\n\
                    <parameter name=\"days\">3</parameter>\n</invoke>\n<invoke name=\"now\"></invoke>\n</minimax:tool_call>\n\
                    <minimax:tool_call><invoke name=\"now\"><parameter name=\"tz\">UTC</parameter></invoke></minimax:tool_call>";
        let made = parse(text).expect("calls");
        assert_eq!(made.content.as_deref(), Some("Let me see.\n"));
        let args: Value = serde_json::from_str(&made.calls[0].1).expect("json");
        assert_eq!(args, serde_json::json!({"city": "Oslo, \"NO\"", "days": 3}));
        assert_eq!(made.calls[1..], calls(&[("now", "{}"), ("now", r#"{"tz":"UTC"}"#)]));
        for not_calls in [
            "<minimax:tool_call><invoke name=\"rain\"></invoke></minimax:tool_call>",
            "<minimax:tool_call><invoke name=\"now\"><parameter name=\"a\">1</invoke></minimax:tool_call>",
            "<minimax:tool_call><invoke name=\"now\"><parameter name=\"a\">1</parameter><parameter name=\"a\">2</parameter></invoke>",
            "<minimax:tool_call>now()</minimax:tool_call>",
        ] {
            assert_eq!(parse(not_calls), None, "{not_calls}");
        }
    }

    /// Granite 3's: the whole answer is an array of calls, after `<|tool_call|>` (3.0), `<tool_call>` (3.1) or
    /// neither; anything else, or anything after the array, makes it content.
    #[test]
    fn granite_arrays_are_calls() {
        let parse = |text: &str| ToolParser::Granite.parse(text, &functions());
        let two = r#"[{"name": "weather", "arguments": {"city": "Oslo"}}, {"name": "now", "arguments": {}}]"#;
        for lead in ["", "<|tool_call|>", " <|tool_call|> <tool_call>", "<tool_call>\n"] {
            let made = parse(&format!("{lead}{two}")).expect("calls");
            assert_eq!((made.content, made.calls), (None, calls(&[("weather", r#"{"city":"Oslo"}"#), ("now", "{}")])));
        }
        for not_calls in [
            "Sure. <|tool_call|>[{\"name\": \"now\", \"arguments\": {}}]",
            "<|tool_call|>[{\"name\": \"now\", \"arguments\": {}}] and more",
            "<|tool_call|>[{\"name\": \"rain\", \"arguments\": {}}]",
            "<|tool_call|>{\"name\": \"now\", \"arguments\": {}}",
            "<|tool_call|>[]",
        ] {
            assert_eq!(parse(not_calls), None, "{not_calls}");
        }
    }

    /// Seed-OSS's: Qwen3-Coder's calls, each in a `<seed:tool_call>` block, values without lines of their own.
    #[test]
    fn seed_oss_blocks_are_qwen3_coders_calls() {
        let parse = |text: &str| ToolParser::SeedOss.parse(text, &functions());
        let text = "Checking.\n<seed:tool_call>\n<function=weather>\n<parameter=city>Oslo</parameter>\n\
                    <parameter=days>3</parameter>\n</function>\n</seed:tool_call>\n<seed:tool_call>\n<function=now>\n\
                    </function>\n</seed:tool_call>";
        let made = parse(text).expect("calls");
        assert_eq!(made.content.as_deref(), Some("Checking.\n"));
        assert_eq!(made.calls, calls(&[("weather", r#"{"city":"Oslo","days":"3"}"#), ("now", "{}")]));
        for not_calls in [
            "<seed:tool_call><function=rain></function></seed:tool_call>",
            "<tool_call><function=now></function></tool_call>",
            "<seed:tool_call>{\"name\": \"now\"}</seed:tool_call>",
        ] {
            assert_eq!(parse(not_calls), None, "{not_calls}");
        }
    }

    /// Kimi K2's: calls in a section, each with its id (`functions.NAME:N`, or `NAME:N`) and its arguments' JSON
    /// object; a call of no tool, an id without its number, or arguments that are not an object, are not calls.
    #[test]
    fn kimi_k2_sections_are_calls() {
        let parse = |text: &str| ToolParser::KimiK2.parse(text, &functions());
        let text = "Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.weather:0\
                    <|tool_call_argument_begin|>{\"city\": \"Oslo\"}<|tool_call_end|>\n<|tool_call_begin|> now:1 \
                    <|tool_call_argument_begin|> {} <|tool_call_end|><|tool_calls_section_end|>";
        let made = parse(text).expect("calls");
        assert_eq!(made.content.as_deref(), Some("Checking."));
        assert_eq!(made.calls, calls(&[("weather", r#"{"city":"Oslo"}"#), ("now", "{}")]));
        let cut = "<|tool_calls_section_begin|><|tool_call_begin|>functions.now:0<|tool_call_argument_begin|>{}";
        assert_eq!(parse(cut).expect("a call cut short at the end").calls, calls(&[("now", "{}")]));
        let singular =
            "Hm.<|tool_call_section_begin|><|tool_call_begin|>now:0<|tool_call_argument_begin|>{}<|tool_call_end|>";
        let made = parse(singular).expect("the section's singular spelling");
        assert_eq!((made.content.as_deref(), made.calls), (Some("Hm."), calls(&[("now", "{}")])));
        for not_calls in [
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.rain:0<|tool_call_argument_begin|>{}<|tool_call_end|>",
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.now<|tool_call_argument_begin|>{}<|tool_call_end|>",
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.now:x<|tool_call_argument_begin|>{}<|tool_call_end|>",
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.now:0<|tool_call_argument_begin|>[]<|tool_call_end|>",
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.now:0{}<|tool_call_end|>",
        ] {
            assert_eq!(parse(not_calls), None, "{not_calls}");
        }
    }

    /// gpt-oss's calls as the harmony reader hands them on: a call whose JSON is whole; a call of no tool, or
    /// arguments that are not an object, are not calls.
    #[test]
    fn harmony_calls_are_calls() {
        let parse = |text: &str| ToolParser::OpenAi.parse(text, &functions());
        let made = parse("Checking.to=functions.weather<|message|>{\"city\": \"Oslo\"}").expect("a call");
        assert_eq!(
            (made.content.as_deref(), made.calls),
            (Some("Checking."), calls(&[("weather", r#"{"city":"Oslo"}"#)]))
        );
        for not_calls in [
            "to=functions.rain<|message|>{}",
            "to=functions.now<|message|>[1]",
            "to=functions.now<|message|>{\"a\": ",
            "to=functions.now{}",
        ] {
            assert_eq!(parse(not_calls), None, "{not_calls}");
        }
    }

    #[test]
    fn parsers_go_by_vllms_names() {
        for (name, parser) in NAMES {
            assert_eq!(name.parse::<ToolParser>(), Ok(parser));
            assert_eq!(serde_json::from_value::<ToolParser>(Value::from(name)).expect("known"), parser);
        }
        let e = "granite_20b_fc".parse::<ToolParser>().expect_err("unknown");
        assert!(e.contains("granite_20b_fc") && e.contains("llama3_json"), "{e}");
        assert!(serde_json::from_value::<ToolParser>(Value::from("granite_20b_fc")).is_err());
    }

    /// Hermes' format: calls in `<tool_call>` blocks after any text, parsed only when each is a call of a known
    /// function; anything else is content.
    #[test]
    fn hermes_blocks_are_calls() {
        let parse = |text: &str| ToolParser::Hermes.parse(text, &functions());
        let text = "Let me look.\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\n\
                    <tool_call>{\"name\": \"now\"}</tool_call>";
        let made = parse(text).expect("calls");
        assert_eq!(made.content.as_deref(), Some("Let me look.\n"));
        assert_eq!(made.calls, calls(&[("weather", r#"{"city":"Oslo"}"#), ("now", "{}")]));
        let bare = parse(r#"<tool_call>{"name": "now", "arguments": "{}"}</tool_call>"#).expect("a call");
        assert_eq!((bare.content, bare.calls), (None, calls(&[("now", "{}")])), "arguments given as text");
        // Cut short after a whole call's JSON: still that call.
        assert_eq!(parse(r#"<tool_call>{"name": "now", "arguments": {}}"#).map(|m| m.calls.len()), Some(1));
        // A block that is not a call ends the calls, as text after them does.
        let then_not = r#"<tool_call>{"name": "now"}</tool_call><tool_call>{"name": "rain"}</tool_call><tool_call>{"name": "now"}</tool_call>"#;
        assert_eq!(parse(then_not).expect("a call").calls, calls(&[("now", "{}")]));
        for not_calls in [
            "No tools needed.",
            r#"<tool_call>{"name": "rain", "arguments": {}}</tool_call>"#,
            r#"<tool_call>{"name": "now", "argum"#,
            "<tool_call>not json</tool_call>",
        ] {
            assert_eq!(parse(not_calls), None, "{not_calls}");
        }
    }

    /// Llama 3's JSON: the whole answer is calls, `parameters` (or `arguments`), several separated by `;`.
    #[test]
    fn llama3_json_answers_are_calls() {
        let parse = |text: &str| ToolParser::Llama3Json.parse(text, &functions());
        let made = parse(r#"{"name": "weather", "parameters": {"city": "Oslo"}}"#).expect("a call");
        assert_eq!((made.content, made.calls), (None, calls(&[("weather", r#"{"city":"Oslo"}"#)])));
        let two = "\n<|python_tag|>{\"name\": \"now\", \"arguments\": {}}; {\"name\": \"weather\", \"parameters\": {\"city\": \"Rome\"}}\n";
        assert_eq!(parse(two).expect("two").calls, calls(&[("now", "{}"), ("weather", r#"{"city":"Rome"}"#)]));
        for not_calls in [
            "It is sunny.",
            r#"The call: {"name": "now", "parameters": {}}"#,
            r#"{"name": "rain", "parameters": {}}"#,
            r#"{"name": "now", "parameters": {}} and more"#,
            r#"{"name": "now", "parameters": {"#,
            r#"{"answer": 42}"#,
        ] {
            assert_eq!(parse(not_calls), None, "{not_calls}");
        }
    }

    /// Mistral's: content, then the marker and a JSON array (before v11) or `name{...}` calls (v11 on).
    #[test]
    fn mistral_marked_calls_are_calls() {
        let parse = |text: &str| ToolParser::Mistral.parse(text, &functions());
        let old = r#"Sure. [TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Oslo"}}, {"name": "now", "arguments": {}}]"#;
        let made = parse(old).expect("calls");
        assert_eq!(made.content.as_deref(), Some("Sure. "));
        assert_eq!(made.calls, calls(&[("weather", r#"{"city":"Oslo"}"#), ("now", "{}")]));
        let new = r#"[TOOL_CALLS]weather{"city": "Oslo"}[TOOL_CALLS]now[ARGS]{}[TOOL_CALLS]now[CALL_ID]a1b2c3d4e[ARGS]{"tz": "UTC"}"#;
        let made = parse(new).expect("calls");
        assert_eq!(made.content, None);
        assert_eq!(made.calls, calls(&[("weather", r#"{"city":"Oslo"}"#), ("now", "{}"), ("now", r#"{"tz":"UTC"}"#)]));
        let then_not = r#"[TOOL_CALLS]now{}[TOOL_CALLS]rain{}[TOOL_CALLS]now{}"#;
        assert_eq!(parse(then_not).expect("a call").calls, calls(&[("now", "{}")]), "the calls before one that is not");
        for not_calls in [
            "No calls here.",
            r#"[TOOL_CALLS]rain{}"#,
            r#"[TOOL_CALLS] [{"name": "now", "arguments": {}}, {"name": "rain", "arguments": {}}]"#,
            r#"[TOOL_CALLS]now"#,
            r#"[TOOL_CALLS]now["list"]"#,
            r#"[TOOL_CALLS] [{"name": "now", "arguments": {}"#,
            r#"[TOOL_CALLS] "now""#,
        ] {
            assert_eq!(parse(not_calls), None, "{not_calls}");
        }
    }

    /// Pythonic: the whole answer is a list of calls with keyword arguments.
    #[test]
    fn pythonic_lists_are_calls() {
        let parse = |text: &str| ToolParser::Pythonic.parse(text, &functions());
        let made = parse(r#"[weather(city="Oslo", days=3, hourly=True), now()]"#).expect("calls");
        assert_eq!(made.content, None);
        assert_eq!(made.calls, calls(&[("weather", r#"{"city":"Oslo","days":3,"hourly":true}"#), ("now", "{}")]));
        let wrapped = "<|python_start|>[now(tz='UTC')]<|python_end|>";
        assert_eq!(parse(wrapped).expect("a call").calls, calls(&[("now", r#"{"tz":"UTC"}"#)]));
        for not_calls in
            ["It is sunny.", "[rain()]", "[now('UTC')]", "[now()] done", "[]", "[now(tz=x)]", "[now(tz='UTC'"]
        {
            assert_eq!(parse(not_calls), None, "{not_calls}");
        }
    }

    /// Qwen3-Coder's XML: each parameter's text read as its schema's type.
    #[test]
    fn qwen3_coder_blocks_are_calls_with_typed_parameters() {
        let params = serde_json::json!({"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "ratio": {"type": "number"},
            "hourly": {"type": "boolean"}, "tags": {"type": "array"}, "zone": {"type": ["string", "null"]},
            "limit": {"type": ["integer", "null"]}}});
        let f = vec![Function { name: "weather".into(), params }, functions().remove(1)];
        let parse = |text: &str| ToolParser::Qwen3Coder.parse(text, &f);
        let text = "Looking.\n<tool_call>\n<function=weather>\n<parameter=city>\nNew York\n</parameter>\n\
                    <parameter=days>\n3\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n<parameter=hourly>\ntrue\n\
                    </parameter>\n<parameter=tags>\n[\"a\", 1]\n</parameter>\n<parameter=zone>\n 12 \n</parameter>\n\
                    <parameter=limit>\nnull\n</parameter>\n<parameter=extra>\n7\n</parameter>\n</function>\n</tool_call>\n\
                    <tool_call>\n<function=now>\n</function>\n</tool_call>";
        let made = parse(text).expect("calls");
        assert_eq!(made.content.as_deref(), Some("Looking.\n"));
        let args: Value = serde_json::from_str(&made.calls[0].1).expect("json");
        assert_eq!(
            args,
            serde_json::json!({"city": "New York", "days": 3, "ratio": 0.5, "hourly": true, "tags": ["a", 1],
                               "zone": " 12 ", "limit": null, "extra": "7"})
        );
        assert_eq!(made.calls[1], ("now".to_string(), "{}".to_string()));
        // An array or object as Python writes it (Seed-OSS's template shows values so), read as vLLM reads it.
        let python = "<tool_call><function=weather><parameter=tags>['a', (1, True)]</parameter></function></tool_call>";
        assert_eq!(parse(python).expect("a call").calls[0].1, r#"{"tags":["a",[1,true]]}"#);
        // A value that is not its type stays text.
        let loose = "<tool_call><function=weather><parameter=days>three</parameter></function></tool_call>";
        assert_eq!(parse(loose).expect("a call").calls[0].1, r#"{"days":"three"}"#);
        for not_calls in [
            "<tool_call><function=rain></function></tool_call>",
            "<tool_call><function=now><parameter=a>1</parameter></tool_call>",
            "<tool_call><function=now><parameter=a>1</parameter><parameter=a>2</parameter></function></tool_call>",
            "<tool_call>{\"name\": \"now\"}</tool_call>",
        ] {
            assert_eq!(parse(not_calls), None, "{not_calls}");
        }
    }
}
