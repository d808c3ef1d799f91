//! Workload files: Mooncake/aiperf `mooncake_trace` JSONL, Qwen Bailian JSONL, and the Azure LLM inference and
//! BurstGPT CSVs, read into one request list. Parsing is pure: text in, requests (or the first bad line, named) out.

use serde::Deserialize;

/// One request of a workload.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TraceRequest {
    /// Arrival in milliseconds from the trace's start; `None` for a later turn of a session that waits for the
    /// previous turn to finish (then `delay_ms` after it).
    pub arrival_ms: Option<f64>,
    pub input_length: usize,
    /// Output tokens to generate: in a router recording, what the request actually generated where its output line
    /// says (else its token budget).
    pub output_length: usize,
    /// Prefix-block ids (512-token blocks in Mooncake traces): equal leading ids mean equal leading tokens.
    pub hash_ids: Vec<u64>,
    pub session_id: Option<String>,
    /// For a session's later turn: milliseconds after the previous turn finished.
    pub delay_ms: Option<f64>,
    /// What a router recording says about the request (`tandem router --record-trace`); boxed, so that a trace of
    /// millions of requests without it takes a third of the memory.
    pub recorded: Option<Box<Recorded>>,
    /// The prompt itself, when the workload gives it (aiperf's `text_input`) instead of its length: it is sent as
    /// it is, and `input_length` is its token count once [`tokenize_literals`] has read it.
    pub literal: Option<Box<LiteralPrompt>>,
    /// vLLM's request priority (lower first; 0, the default, sends none): a JSONL trace's own `priority` field,
    /// which a router recording writes.
    pub priority: i32,
}

/// A prompt given as text, and its tokens (empty until [`tokenize_literals`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LiteralPrompt {
    pub text: String,
    pub tokens: Vec<u32>,
}

/// Tokenizes the literal prompts of `requests` with the served model's tokenizer, setting their `input_length`.
pub fn tokenize_literals(requests: &mut [TraceRequest], tokenizer: &engine::tokenizer::Tokenizer) {
    for r in requests {
        if let Some(l) = r.literal.as_mut() {
            l.tokens = tokenizer.encode(&l.text);
            r.input_length = l.tokens.len().max(1);
        }
    }
}

/// A recorded request's tenant and the router's decision, and how it ended.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct Recorded {
    pub namespace: Option<String>,
    pub decision: RecordedDecision,
    /// Its output line's figures: the token budget it had (the request line's `output_length`), and its finish
    /// reason (`incomplete` when it ended without one); `None` without an output line.
    #[serde(skip)]
    pub ended: Option<RecordedEnd>,
}

/// How a recorded request ended.
#[derive(Clone, Debug, PartialEq)]
pub struct RecordedEnd {
    pub max_tokens: usize,
    pub finish_reason: String,
}

/// The router's decision as recorded: the workers by name, or the refusal's kind.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct RecordedDecision {
    pub policy: Option<String>,
    /// The prefill worker when the request was disaggregated.
    pub prefill: Option<String>,
    pub decode: Option<String>,
    #[serde(default)]
    pub disaggregate: bool,
    pub reason: Option<String>,
    pub refused: Option<String>,
    /// How much cheaper the worker that computed the prompt was than the next best (0: a tie).
    pub margin: Option<f64>,
    /// Its candidates as the router scored them, in a recording made with `--record-candidates`.
    #[serde(default)]
    pub candidates: Option<RecordedCandidates>,
}

/// A decision's candidates as recorded: what a replay needs to move a failed prefill on as the router would have.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct RecordedCandidates {
    #[serde(default)]
    pub prefill: Vec<RecordedCandidate>,
    #[serde(default)]
    pub decode: Vec<RecordedCandidate>,
}

/// One candidate of a recorded decision: its name, the blocks it held of the prompt by tier, and its cost.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct RecordedCandidate {
    pub worker: String,
    #[serde(default)]
    pub device_blocks: usize,
    #[serde(default)]
    pub host_blocks: usize,
    #[serde(default)]
    pub disk_blocks: usize,
    #[serde(default)]
    pub cost: f64,
}

impl RecordedCandidate {
    /// The prompt's blocks it held, over every tier.
    pub fn held(&self) -> usize {
        self.device_blocks + self.host_blocks + self.disk_blocks
    }
}

/// The header line of a router recording.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct RecordingHeader {
    /// Tokens per block the `hash_ids` name.
    pub block_size: usize,
    pub started_unix_ms: Option<u64>,
}

/// The recording header of a JSONL workload, if it is a router recording.
pub fn recording_header(text: &str) -> Option<RecordingHeader> {
    let first = text.lines().find(|l| !l.trim().is_empty())?;
    let v: serde_json::Value = serde_json::from_str(first).ok()?;
    serde_json::from_value(v.get("tandem_recording")?.clone()).ok()
}

/// Why a workload file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("line {line}: {why}")]
    Line { line: usize, why: String },
    #[error("the trace has no requests")]
    Empty,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MooncakeLine {
    timestamp: Option<f64>,
    /// The prompt's length, or (aiperf) `text_input`, the prompt itself: exactly one of them.
    input_length: Option<usize>,
    output_length: usize,
    #[serde(default)]
    hash_ids: Vec<u64>,
    session_id: Option<String>,
    delay: Option<f64>,
    #[serde(default)]
    text_input: Option<String>,
    /// aiperf's chat payload form: refused by name (a replay here sends a prompt, not a conversation).
    #[serde(default)]
    messages: Option<serde_json::Value>,
    /// A router recording's own fields.
    tandem: Option<Recorded>,
    /// vLLM's request priority (not aiperf's field).
    #[serde(default)]
    priority: i32,
    /// aiperf's dataset type, which a file may spell out: only `mooncake_trace` is this format.
    #[serde(default, rename = "type")]
    kind: Option<String>,
}

/// A router recording's line with a request's actual output (`tandem_output`).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OutputLine {
    tandem_output: Output,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Output {
    /// The request, counting the recording's request lines from 0.
    request: usize,
    output_tokens: usize,
    finish_reason: String,
}

/// The kinds of workload file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// Mooncake/aiperf `mooncake_trace` JSONL (and router recordings, which extend it).
    Mooncake,
    /// Alibaba's Qwen Bailian usage traces: JSONL with `chat_id`, arrivals in seconds, 16-token block ids.
    Bailian,
    /// The Azure LLM inference trace CSVs (2023 and 2024): arrivals and lengths.
    Azure,
    /// BurstGPT's CSVs (Azure OpenAI GPT traffic): arrivals in seconds and lengths.
    BurstGpt,
    /// A first line that is neither a JSON object nor a CSV header of a trace this reads.
    Unknown,
}

/// Tokens per block id in the Bailian traces (`qwen_trace*_blksz_16.jsonl`).
pub const BAILIAN_BLOCK: usize = 16;

impl Format {
    /// The format of a workload file, from its first non-empty line.
    pub fn of(text: &str) -> Format {
        let first = text.trim_start_matches('\u{feff}').lines().find(|l| !l.trim().is_empty()).unwrap_or("");
        let header = first.to_ascii_lowercase();
        if first.trim_start().starts_with('{') || first.trim().is_empty() {
            if first.contains("\"chat_id\"") { Format::Bailian } else { Format::Mooncake }
        } else if header.contains("contexttokens") {
            Format::Azure
        } else if header.contains("request tokens") && header.contains("response tokens") {
            Format::BurstGpt
        } else {
            Format::Unknown
        }
    }
}

/// Tokens per block id that a workload file states by its format, from its first line: a router recording's
/// header, or a Bailian trace's 16; `None` where the reader decides (Mooncake's 512 by convention).
pub fn stated_block_size(first_line: &str) -> Option<usize> {
    match Format::of(first_line) {
        Format::Bailian => Some(BAILIAN_BLOCK),
        _ => recording_header(first_line).map(|h| h.block_size),
    }
}

/// Tokens per block id for the workload file at `path` (none: a synthetic workload): what the file states
/// ([`stated_block_size`]), else `given` (`--trace-block-size`), else Mooncake's 512. A `given` size the file
/// states otherwise is refused rather than ignored.
pub fn block_size(path: Option<&std::path::Path>, given: Option<usize>) -> Result<usize, String> {
    use std::io::BufRead;
    // Only the first line that is not blank is read, as the readers find it: the rest of a large trace is not
    // needed for it.
    let mut first = String::new();
    if let Some(p) = path {
        let f = std::fs::File::open(p).map_err(|e| format!("{}: {e}", p.display()))?;
        let mut lines = std::io::BufReader::new(f);
        while first.trim_start_matches('\u{feff}').trim().is_empty() {
            first.clear();
            if lines.read_line(&mut first).map_err(|e| format!("{}: {e}", p.display()))? == 0 {
                break;
            }
        }
    }
    match (stated_block_size(first.trim_start_matches('\u{feff}')), given) {
        (Some(stated), Some(g)) if g != stated => {
            Err(format!("the trace's block ids stand for {stated} tokens each, not the {g} of --trace-block-size"))
        }
        (Some(stated), _) => Ok(stated),
        (None, g) => Ok(g.unwrap_or(crate::prompt::DEFAULT_TRACE_BLOCK)),
    }
}

/// Why a file's first line names no format this reads.
const UNKNOWN_FORMAT: &str = "not a workload file this reads: the first line is neither a JSON object (Mooncake/aiperf \
    `mooncake_trace`, Qwen Bailian) nor the header of an Azure LLM trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens) \
    or a BurstGPT CSV (Timestamp,Model,Request tokens,Response tokens,...)";

/// Reads a workload file: `mooncake_trace` JSONL, a Bailian JSONL trace, or an Azure LLM or BurstGPT trace CSV
/// ([`Format::of`]). Azure, BurstGPT and Bailian requests come in arrival order whatever the file's order.
pub fn read(path: &std::path::Path) -> Result<Vec<TraceRequest>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
    let parsed = match Format::of(text) {
        Format::Azure => parse_azure(text),
        Format::BurstGpt => parse_burstgpt(text),
        Format::Bailian => parse_bailian(text),
        Format::Mooncake => parse_mooncake(text),
        Format::Unknown => Err(TraceError::Line { line: 1, why: UNKNOWN_FORMAT.into() }),
    };
    parsed.map_err(|e| format!("{}: {e}", path.display()))
}

/// Reads `mooncake_trace` JSONL: `timestamp` (ms), `input_length`, `output_length`, `hash_ids`, and optionally
/// `session_id` and `delay` (ms after the session's previous turn finished, for turns without a timestamp).
pub fn parse_mooncake(text: &str) -> Result<Vec<TraceRequest>, TraceError> {
    let mut out = Vec::new();
    let header = recording_header(text).is_some();
    let lines = text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()).skip(usize::from(header));
    for (i, line) in lines {
        let bad = |why: String| TraceError::Line { line: i + 1, why };
        if header && line.contains("\"tandem_output\"") {
            let o = serde_json::from_str::<OutputLine>(line).map_err(|e| bad(e.to_string()))?.tandem_output;
            let r: &mut TraceRequest =
                out.get_mut(o.request).ok_or_else(|| bad(format!("no request {} before this line", o.request)))?;
            let max_tokens = r.output_length;
            r.output_length = o.output_tokens.max(1);
            r.recorded.get_or_insert_default().ended = Some(RecordedEnd { max_tokens, finish_reason: o.finish_reason });
            continue;
        }
        let l: MooncakeLine = serde_json::from_str(line).map_err(|e| bad(e.to_string()))?;
        if l.messages.is_some() {
            return Err(
                bad("`messages` lines are not replayed: give the prompt as text_input, or input_length".into()),
            );
        }
        let (input_length, literal) = match (l.input_length, l.text_input) {
            (Some(0), None) => return Err(bad("input_length must be at least 1".into())),
            (Some(n), None) => (n, None),
            (None, Some(_)) if !l.hash_ids.is_empty() => {
                return Err(bad("hash_ids go with input_length, not with text_input".into()));
            }
            (None, Some(text)) if text.is_empty() => return Err(bad("text_input is empty".into())),
            // Its length is its token count, known once tokenized ([`tokenize_literals`]).
            (None, Some(text)) => (1, Some(Box::new(LiteralPrompt { text, tokens: Vec::new() }))),
            (Some(_), Some(_)) => return Err(bad("input_length and text_input exclude each other".into())),
            (None, None) => return Err(bad("a request needs input_length or text_input".into())),
        };
        if let Some(kind) = l.kind.filter(|k| k != "mooncake_trace") {
            return Err(bad(format!("type {kind:?} is not a mooncake_trace line")));
        }
        if l.timestamp.is_some_and(|t| !(t.is_finite() && t >= 0.0))
            || l.delay.is_some_and(|d| !(d.is_finite() && d >= 0.0))
        {
            return Err(bad("timestamp and delay must be non-negative milliseconds".into()));
        }
        out.push(TraceRequest {
            arrival_ms: l.timestamp,
            input_length,
            output_length: l.output_length.max(1),
            hash_ids: l.hash_ids,
            session_id: l.session_id,
            delay_ms: l.delay,
            recorded: l.tandem.map(Box::new),
            literal,
            priority: l.priority,
        });
    }
    if out.is_empty() {
        return Err(TraceError::Empty);
    }
    Ok(out)
}

/// A line of a Bailian trace. Every request carries its own arrival and its whole prompt (a later turn's history
/// included), so the session links (`chat_id`, `parent_chat_id`, `turn`) and the request's `type` change nothing a
/// replay sends; they are read so that a line with a field of another meaning is refused, not half read.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BailianLine {
    #[serde(rename = "chat_id")]
    _chat_id: i64,
    #[serde(default, rename = "parent_chat_id")]
    _parent_chat_id: Option<i64>,
    /// Seconds from the trace's start.
    timestamp: f64,
    input_length: usize,
    output_length: usize,
    #[serde(default, rename = "type")]
    _kind: Option<String>,
    #[serde(default, rename = "turn")]
    _turn: Option<u64>,
    #[serde(default)]
    hash_ids: Vec<u64>,
}

/// Reads a Qwen Bailian usage trace (JSONL: `chat_id`, `parent_chat_id`, `timestamp` in seconds, `input_length`,
/// `output_length`, `type`, `turn`, `hash_ids` of [`BAILIAN_BLOCK`]-token blocks), in arrival order.
pub fn parse_bailian(text: &str) -> Result<Vec<TraceRequest>, TraceError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let bad = |why: String| TraceError::Line { line: i + 1, why };
        let l: BailianLine = serde_json::from_str(line).map_err(|e| bad(e.to_string()))?;
        if l.input_length == 0 {
            return Err(bad("input_length must be at least 1".into()));
        }
        if !(l.timestamp.is_finite() && l.timestamp >= 0.0) {
            return Err(bad("timestamp must be non-negative seconds".into()));
        }
        out.push(TraceRequest {
            arrival_ms: Some(l.timestamp * 1000.0),
            input_length: l.input_length,
            output_length: l.output_length.max(1),
            hash_ids: l.hash_ids,
            ..TraceRequest::default()
        });
    }
    in_arrival_order(out)
}

/// Reads an Azure LLM inference trace CSV: a header naming `TIMESTAMP`, `ContextTokens` and `GeneratedTokens` (in
/// any order, among other columns), then one row per request; arrivals from the earliest row, in arrival order.
/// Lengths only: every prompt is its own.
pub fn parse_azure(text: &str) -> Result<Vec<TraceRequest>, TraceError> {
    csv_lengths(text, ["TIMESTAMP", "ContextTokens", "GeneratedTokens"], |cell| {
        azure_timestamp_ms(cell).ok_or("TIMESTAMP is not `YYYY-MM-DD HH:MM:SS[.fraction][+HH:MM]`")
    })
}

/// A trace CSV of arrivals and lengths: a header naming `columns` (the arrival, the prompt's length and the
/// output's, as the file spells them, found in any case and order among others), then one request per row, its
/// arrival read by `arrival_ms`. Arrivals count from the earliest row, in arrival order; a length of 0 is 1.
fn csv_lengths(
    text: &str,
    columns: [&str; 3],
    arrival_ms: impl Fn(&str) -> Result<f64, &'static str>,
) -> Result<Vec<TraceRequest>, TraceError> {
    let mut lines = text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty());
    let header = lines.next().map_or("", |(_, l)| l);
    let names: Vec<&str> = header.split(',').map(unquote).collect();
    let mut at = [0; 3];
    for (k, name) in columns.iter().enumerate() {
        at[k] = names.iter().position(|c| c.eq_ignore_ascii_case(name)).ok_or_else(|| TraceError::Line {
            line: 1,
            why: format!("the header names no {:?} column (expected {})", name.to_ascii_lowercase(), columns.join(",")),
        })?;
    }
    let mut out = Vec::new();
    for (i, line) in lines {
        let bad = |why: &str| TraceError::Line { line: i + 1, why: why.to_string() };
        let cols: Vec<&str> = line.split(',').map(unquote).collect();
        let cell = |k: usize| cols.get(at[k]).copied().ok_or_else(|| bad("fewer columns than the header"));
        let count = |k: usize| cell(k)?.parse::<usize>().map_err(|_| bad(&format!("{} is not a count", columns[k])));
        out.push(TraceRequest {
            arrival_ms: Some(arrival_ms(cell(0)?).map_err(bad)?),
            input_length: count(1)?.max(1),
            output_length: count(2)?.max(1),
            ..TraceRequest::default()
        });
    }
    let start = out.iter().filter_map(|r| r.arrival_ms).fold(f64::INFINITY, f64::min);
    for r in &mut out {
        r.arrival_ms = r.arrival_ms.map(|at| at - start);
    }
    in_arrival_order(out)
}

/// Reads a BurstGPT CSV (`BurstGPT_*.csv`): a header naming `Timestamp` (seconds from the trace's start),
/// `Request tokens` and `Response tokens` (in any order, among `Model`, `Total tokens` and `Log Type`), then one
/// row per request, put in arrival order. Lengths only: every prompt is its own. A row of 0 response tokens (a
/// failed request, in the files that keep them) asks for one token, as an Azure row of 0 does.
pub fn parse_burstgpt(text: &str) -> Result<Vec<TraceRequest>, TraceError> {
    csv_lengths(text, ["Timestamp", "Request tokens", "Response tokens"], |cell| match cell.parse::<f64>() {
        Ok(s) if s.is_finite() && s >= 0.0 => Ok(s * 1000.0),
        _ => Err("Timestamp is not a non-negative number of seconds"),
    })
}

/// Requests that each carry their arrival (and nothing that names another by its place), sorted by it; the order
/// of equal arrivals is kept.
fn in_arrival_order(mut out: Vec<TraceRequest>) -> Result<Vec<TraceRequest>, TraceError> {
    if out.is_empty() {
        return Err(TraceError::Empty);
    }
    out.sort_by(|a, b| a.arrival_ms.unwrap_or(0.0).total_cmp(&b.arrival_ms.unwrap_or(0.0)));
    Ok(out)
}

/// A CSV cell without its surrounding blanks and quotes.
fn unquote(cell: &str) -> &str {
    let t = cell.trim();
    t.strip_prefix('"').and_then(|t| t.strip_suffix('"')).unwrap_or(t)
}

/// Milliseconds since 1970 (UTC) of an Azure `TIMESTAMP`: `2023-11-16 18:15:46.6805900` (2023, UTC) or
/// `2024-05-10 00:00:00.009930+00:00` (2024, with its offset); a `T` between date and time and a `Z` are read too.
fn azure_timestamp_ms(s: &str) -> Option<f64> {
    let (date, time) = s.split_once([' ', 'T'])?;
    let mut d = date.split('-').map(str::parse::<i64>);
    let (y, m, day) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    let (clock, offset_min) = match time.strip_suffix('Z') {
        Some(clock) => (clock, 0.0),
        None => match time.find(['+', '-']) {
            Some(k) => (&time[..k], utc_offset_minutes(&time[k..])?),
            None => (time, 0.0),
        },
    };
    let mut t = clock.split(':');
    let (h, min, sec) =
        (t.next()?.parse::<f64>().ok()?, t.next()?.parse::<f64>().ok()?, t.next()?.parse::<f64>().ok()?);
    if t.next().is_some() || !(1..=12).contains(&m) || !(1..=31).contains(&day) {
        return None;
    }
    let local = days_from_civil(y, m, day) as f64 * 86_400_000.0 + (h * 3600.0 + min * 60.0 + sec) * 1000.0;
    Some(local - offset_min * 60_000.0)
}

/// `+HH:MM`, `+HHMM` or `+HH` (or with `-`) in minutes east of UTC.
fn utc_offset_minutes(s: &str) -> Option<f64> {
    let (sign, rest) = match s.as_bytes().first()? {
        b'+' => (1.0, &s[1..]),
        b'-' => (-1.0, &s[1..]),
        _ => return None,
    };
    let digits: String = rest.chars().filter(|c| *c != ':').collect();
    if !(digits.len() == 2 || digits.len() == 4) || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let hours: f64 = digits[..2].parse().ok()?;
    let minutes: f64 = if digits.len() == 4 { digits[2..].parse().ok()? } else { 0.0 };
    Some(sign * (hours * 60.0 + minutes))
}

/// Days from 1970-01-01 to a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (m + if m > 2 { -3 } else { 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mooncake_lines_read_with_sessions() {
        let text = r#"{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}

{"timestamp": 12.5, "input_length": 10, "output_length": 0, "hash_ids": [0], "session_id": "a"}
{"input_length": 900, "output_length": 7, "hash_ids": [0, 2], "session_id": "a", "delay": 300, "priority": -2}
"#;
        let r = parse_mooncake(text).expect("parses");
        assert_eq!(r.len(), 3);
        assert_eq!(r[0].hash_ids, [0, 1]);
        assert_eq!((r[0].priority, r[2].priority), (0, -2), "vLLM's priority, 0 when absent");
        let big = r#"{"timestamp": 0, "input_length": 6, "output_length": 5, "priority": 3000000000}"#;
        assert!(parse_mooncake(big).is_err(), "a priority past 32 bits");
        assert_eq!(r[1].arrival_ms, Some(12.5));
        assert_eq!(r[1].output_length, 1, "at least one output token");
        assert_eq!((r[2].arrival_ms, r[2].delay_ms), (None, Some(300.0)));
    }

    #[test]
    fn a_router_recording_reads_with_its_block_size_and_decisions() {
        let text = r#"{"tandem_recording": {"version": 1, "block_size": 16, "started_unix_ms": 5}}
{"timestamp": 0.5, "input_length": 40, "output_length": 7, "hash_ids": [11, 12], "tandem": {"namespace": "t1", "decision": {"policy": "kv", "prefill": "prefill-1", "decode": "decode-0", "disaggregate": true, "reason": "kv"}}}
{"timestamp": 3, "input_length": 20, "output_length": 2, "hash_ids": [11], "tandem": {"namespace": null, "decision": {"refused": "all_busy"}}}
"#;
        assert_eq!(recording_header(text).map(|h| h.block_size), Some(16));
        let r = parse_mooncake(text).expect("parses");
        assert_eq!(r.len(), 2);
        let d = &r[0].recorded.as_ref().expect("recorded").decision;
        assert_eq!(
            (d.prefill.as_deref(), d.decode.as_deref(), d.disaggregate),
            (Some("prefill-1"), Some("decode-0"), true)
        );
        assert_eq!(r[0].recorded.as_ref().and_then(|x| x.namespace.as_deref()), Some("t1"));
        assert_eq!(r[1].recorded.as_ref().and_then(|x| x.decision.refused.as_deref()), Some("all_busy"));
        assert_eq!(r[0].output_length, 7, "the budget, without an output line");
        assert_eq!(recording_header("{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1}"), None);
    }

    #[test]
    fn a_recordings_output_lines_give_the_tokens_generated() {
        let text = r#"{"tandem_recording": {"version": 1, "block_size": 16, "started_unix_ms": 5}}
{"timestamp": 0, "input_length": 40, "output_length": 64, "hash_ids": [1], "tandem": {"namespace": null, "decision": {"decode": "d0"}}}
{"timestamp": 1, "input_length": 40, "output_length": 32, "hash_ids": [1], "tandem": {"namespace": null, "decision": {"decode": "d0"}}}
{"tandem_output": {"request": 1, "output_tokens": 5, "finish_reason": "stop"}}
{"timestamp": 2, "input_length": 40, "output_length": 16, "hash_ids": [1], "tandem": {"namespace": null, "decision": {"decode": "d0"}}}
{"tandem_output": {"request": 0, "output_tokens": 0, "finish_reason": "incomplete"}}
"#;
        let r = parse_mooncake(text).expect("parses");
        assert_eq!(r.iter().map(|x| x.output_length).collect::<Vec<_>>(), [1, 5, 16]);
        let ended = |i: usize| r[i].recorded.as_ref().and_then(|x| x.ended.clone());
        assert_eq!(ended(1), Some(RecordedEnd { max_tokens: 32, finish_reason: "stop".into() }));
        assert_eq!(ended(0).map(|e| e.finish_reason), Some("incomplete".into()));
        assert_eq!(ended(2), None);
        let early = text.replace(r#""request": 1,"#, r#""request": 2,"#);
        let e = parse_mooncake(&early).expect_err("an output before its request");
        assert!(e.to_string().starts_with("line 4: no request 2"), "{e}");
    }

    #[test]
    fn aiperf_text_input_is_the_prompt_and_excludes_a_length() {
        let text = r#"{"timestamp": 0, "text_input": "What is the capital of France?", "output_length": 20}
{"timestamp": 5, "input_length": 30, "output_length": 2}
"#;
        let r = parse_mooncake(text).expect("parses");
        let literal = r[0].literal.as_ref().expect("the prompt itself");
        assert_eq!((literal.text.as_str(), literal.tokens.len()), ("What is the capital of France?", 0));
        assert!(r[1].literal.is_none());
        let refused = |line: &str, why: &str| {
            let e = parse_mooncake(line).expect_err(why);
            assert!(e.to_string().contains(why), "{e}");
        };
        refused(r#"{"timestamp": 0, "text_input": "hi", "input_length": 3, "output_length": 1}"#, "exclude each other");
        refused(r#"{"timestamp": 0, "text_input": "hi", "hash_ids": [1], "output_length": 1}"#, "hash_ids go with");
        refused(r#"{"timestamp": 0, "text_input": "", "output_length": 1}"#, "text_input is empty");
        refused(r#"{"timestamp": 0, "output_length": 1}"#, "needs input_length or text_input");
        refused(
            r#"{"timestamp": 0, "messages": [{"role": "user", "content": "hi"}], "output_length": 1}"#,
            "`messages`",
        );
    }

    #[test]
    fn a_bad_line_is_named() {
        let e = parse_mooncake("{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1}\n{\"timestamp\": 1}\n")
            .expect_err("refused");
        assert!(e.to_string().starts_with("line 2:"), "{e}");
        // No timestamp: a workload for an open- or closed-loop schedule (`crate::schedule::untimed` refuses it for
        // the trace's own).
        assert_eq!(parse_mooncake("{\"input_length\": 5, \"output_length\": 1}\n").expect("read")[0].arrival_ms, None);
        assert!(matches!(parse_mooncake("\n"), Err(TraceError::Empty)));
        let typed = r#"{"type": "mooncake_trace", "timestamp": 0, "input_length": 5, "output_length": 1}"#;
        assert_eq!(parse_mooncake(typed).expect("aiperf's own type").len(), 1);
        let e = parse_mooncake(&typed.replace("mooncake_trace", "single_turn")).expect_err("another type");
        assert!(e.to_string().contains("\"single_turn\""), "{e}");
    }

    #[test]
    fn azure_rows_become_offsets_from_the_first() {
        let text = "TIMESTAMP,ContextTokens,GeneratedTokens\n\
                    2023-11-16 23:59:59.5000000,374,44\n\
                    2023-11-17 00:00:00.7500000,396,109\n";
        let r = parse_azure(text).expect("parses");
        assert_eq!(r[0].arrival_ms, Some(0.0));
        assert!((r[1].arrival_ms.expect("timed") - 1250.0).abs() < 1e-6, "{:?}", r[1].arrival_ms);
        assert_eq!((r[1].input_length, r[1].output_length), (396, 109));
        assert!(r[1].hash_ids.is_empty());
        assert!(parse_azure("TIMESTAMP,ContextTokens,GeneratedTokens\nx,1,2\n").is_err());
    }

    #[test]
    fn azure_2024_rows_read_with_their_utc_offsets_in_any_order() {
        // The 2024 week-long traces write the offset and six digits; a file may also come with CRLF line ends,
        // quoted cells and the columns in another order among others (the multimodal trace adds `NumImages`).
        let text = "\u{feff}TIMESTAMP,NumImages,GeneratedTokens,ContextTokens\r\n\
                    2024-05-10 00:00:01.500000+00:00,0,10,4808\r\n\
                    \"2024-05-10 00:00:00.009930+00:00\",2,8,3180\r\n\
                    2024-05-10T05:30:02.000000+05:30,1,3,77\r\n";
        assert_eq!(Format::of(text), Format::Azure);
        let r = parse_azure(text.trim_start_matches('\u{feff}')).expect("parses");
        let at: Vec<f64> = r.iter().map(|x| (x.arrival_ms.expect("timed") * 1000.0).round() / 1000.0).collect();
        assert_eq!(at, [0.0, 1490.07, 1990.07], "from the earliest row, in arrival order");
        let lens: Vec<(usize, usize)> = r.iter().map(|x| (x.input_length, x.output_length)).collect();
        assert_eq!(lens, [(3180, 8), (4808, 10), (77, 3)], "columns found by name");
        let z = parse_azure(
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:00Z,1,1\n2024-05-09 23:00:00-01:00,1,1\n",
        );
        assert_eq!(z.expect("parses").iter().map(|x| x.arrival_ms).collect::<Vec<_>>(), [Some(0.0), Some(0.0)]);
    }

    #[test]
    fn burstgpt_rows_become_offsets_from_the_first_in_arrival_order() {
        let text = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n\
                    45,ChatGPT,1087,346,1433,Conversation log\n\
                    5,ChatGPT,472,18,490,Conversation log\n\
                    118.5,GPT-4,417,0,417,API log\n";
        assert_eq!(Format::of(text), Format::BurstGpt);
        let r = parse_burstgpt(text).expect("parses");
        let got: Vec<(Option<f64>, usize, usize)> =
            r.iter().map(|r| (r.arrival_ms, r.input_length, r.output_length)).collect();
        assert_eq!(got, [(Some(0.0), 472, 18), (Some(40_000.0), 1087, 346), (Some(113_500.0), 417, 1)]);
        let bad = parse_burstgpt("Timestamp,Request tokens,Response tokens\n-1,5,5\n").expect_err("negative");
        assert!(bad.to_string().contains("line 2"), "{bad}");
        let missing = parse_burstgpt("Timestamp,Request tokens\n1,5\n").expect_err("no column");
        assert!(missing.to_string().contains("Response tokens") || missing.to_string().contains("response tokens"));
    }

    #[test]
    fn a_file_of_no_known_format_is_refused_saying_which_it_reads() {
        assert_eq!(Format::of("time,prompt_len,output_len\n1,2,3\n"), Format::Unknown);
        assert_eq!(Format::of("\n{\"timestamp\": 0}"), Format::Mooncake);
        let dir = std::env::temp_dir().join(format!("tandem-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("other.csv");
        std::fs::write(&path, "time,prompt_len,output_len\n1,2,3\n").expect("write");
        let e = read(&path).expect_err("refused");
        assert!(e.contains("not a workload file this reads") && e.contains("BurstGPT"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn azure_files_that_do_not_fit_are_refused_with_the_reason() {
        let e = parse_azure("TIMESTAMP,Tokens,GeneratedTokens\n2024-05-10 00:00:00,1,1\n").expect_err("no context");
        assert!(e.to_string().contains("\"contexttokens\""), "{e}");
        let e = parse_azure("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:00+0x:00,1,1\n")
            .expect_err("a bad offset");
        assert!(e.to_string().starts_with("line 2: TIMESTAMP"), "{e}");
        let e = parse_azure("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:00,1\n").expect_err("short");
        assert!(e.to_string().contains("fewer columns"), "{e}");
        assert!(matches!(parse_azure("TIMESTAMP,ContextTokens,GeneratedTokens\n"), Err(TraceError::Empty)));
    }

    #[test]
    fn the_block_size_is_the_files_own_else_the_flags_else_512() {
        let dir = std::env::temp_dir().join(format!("tandem-trace-block-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        let file = |name: &str, text: &str| {
            let p = dir.join(name);
            std::fs::write(&p, text).expect("written");
            p
        };
        let mooncake = file("m.jsonl", "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1}\n");
        let bailian =
            file("b.jsonl", "{\"chat_id\": 1, \"timestamp\": 0, \"input_length\": 1, \"output_length\": 1}\n");
        let recording = file("r.jsonl", "{\"tandem_recording\": {\"version\": 1, \"block_size\": 32}}\n");
        // Blank lines (and a byte-order mark) before the first line, which the readers skip, are skipped here too.
        let bailian_late = file(
            "bl.jsonl",
            "\u{feff}\n  \r\n{\"chat_id\": 1, \"timestamp\": 0, \"input_length\": 1, \"output_length\": 1}\n",
        );
        assert_eq!(block_size(Some(&bailian_late), None), Ok(16));
        assert_eq!(block_size(Some(&file("e.jsonl", "\n\n")), Some(64)), Ok(64));
        assert_eq!(block_size(Some(&mooncake), None), Ok(512));
        assert_eq!(block_size(Some(&mooncake), Some(64)), Ok(64));
        assert_eq!(block_size(None, Some(64)), Ok(64));
        assert_eq!(block_size(Some(&bailian), None), Ok(16));
        assert_eq!(block_size(Some(&recording), Some(32)), Ok(32));
        let e = block_size(Some(&recording), Some(512)).expect_err("the flag contradicts the recording");
        assert!(e.contains("32 tokens") && e.contains("512"), "{e}");
        assert!(block_size(Some(&dir.join("absent.jsonl")), None).is_err());
        std::fs::remove_dir_all(&dir).expect("removed");
    }

    #[test]
    fn bailian_lines_read_in_seconds_with_their_block_size() {
        let text = r#"{"chat_id": 160, "parent_chat_id": 159, "timestamp": 62.5, "input_length": 40, "output_length": 80, "type": "text", "turn": 2, "hash_ids": [1, 2, 3]}
{"chat_id": 159, "parent_chat_id": -1, "timestamp": 61.114, "input_length": 20, "output_length": 0, "type": "search", "turn": 1, "hash_ids": [1, 2]}
"#;
        assert_eq!(Format::of(text), Format::Bailian);
        assert_eq!(stated_block_size(text.lines().next().expect("a line")), Some(BAILIAN_BLOCK));
        let r = parse_bailian(text).expect("parses");
        assert_eq!(r.iter().map(|x| x.arrival_ms).collect::<Vec<_>>(), [Some(61_114.0), Some(62_500.0)]);
        assert_eq!((r[0].input_length, r[0].output_length, r[0].hash_ids.clone()), (20, 1, vec![1, 2]));
        let e = parse_bailian(r#"{"chat_id": 1, "timestamp": 0, "input_length": 4, "output_length": 1, "user": "u"}"#)
            .expect_err("a field of another meaning");
        assert!(e.to_string().contains("unknown field `user`"), "{e}");
        assert_eq!(Format::of(r#"{"timestamp": 0, "input_length": 1, "output_length": 1}"#), Format::Mooncake);
        assert_eq!(stated_block_size(r#"{"timestamp": 0, "input_length": 1, "output_length": 1}"#), None);
    }
}
