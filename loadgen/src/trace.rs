//! Workload files: Mooncake/aiperf `mooncake_trace` JSONL and the Azure LLM inference CSVs, read into one
//! request list. Parsing is pure: text in, requests (or the first bad line, named) out.

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
    /// What a router recording says about the request (`tandem router --record-trace`).
    pub recorded: Option<Recorded>,
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
    input_length: usize,
    output_length: usize,
    #[serde(default)]
    hash_ids: Vec<u64>,
    session_id: Option<String>,
    delay: Option<f64>,
    // aiperf accepts a literal prompt in place of lengths; lengths are what a replay needs, so it is ignored.
    #[serde(default)]
    #[allow(dead_code)]
    text_input: Option<String>,
    /// A router recording's own fields.
    tandem: Option<Recorded>,
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

/// Reads a workload file: an Azure LLM trace CSV (it starts with `TIMESTAMP,`) or `mooncake_trace` JSONL.
pub fn read(path: &std::path::Path) -> Result<Vec<TraceRequest>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let parsed = if text.starts_with("TIMESTAMP,") { parse_azure(&text) } else { parse_mooncake(&text) };
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
        if l.input_length == 0 {
            return Err(bad("input_length must be at least 1".into()));
        }
        if l.timestamp.is_none() && (l.session_id.is_none() || out.is_empty()) {
            return Err(bad("a request without a timestamp must continue an earlier turn of its session".into()));
        }
        if l.timestamp.is_some_and(|t| !(t.is_finite() && t >= 0.0))
            || l.delay.is_some_and(|d| !(d.is_finite() && d >= 0.0))
        {
            return Err(bad("timestamp and delay must be non-negative milliseconds".into()));
        }
        out.push(TraceRequest {
            arrival_ms: l.timestamp,
            input_length: l.input_length,
            output_length: l.output_length.max(1),
            hash_ids: l.hash_ids,
            session_id: l.session_id,
            delay_ms: l.delay,
            recorded: l.tandem,
        });
    }
    if out.is_empty() {
        return Err(TraceError::Empty);
    }
    Ok(out)
}

/// Reads an Azure LLM inference trace CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`): arrivals and lengths, no
/// prefix information (every prompt is its own).
pub fn parse_azure(text: &str) -> Result<Vec<TraceRequest>, TraceError> {
    let mut out = Vec::new();
    let mut first: Option<f64> = None;
    for (i, line) in text.lines().enumerate().skip(1).filter(|(_, l)| !l.trim().is_empty()) {
        let bad = |why: &str| TraceError::Line { line: i + 1, why: why.to_string() };
        let mut cols = line.split(',');
        let (Some(ts), Some(ctx), Some(gen_)) = (cols.next(), cols.next(), cols.next()) else {
            return Err(bad("expected TIMESTAMP,ContextTokens,GeneratedTokens"));
        };
        let at = azure_timestamp_ms(ts.trim()).ok_or_else(|| bad("TIMESTAMP is not `YYYY-MM-DD HH:MM:SS.fffffff`"))?;
        let input: usize = ctx.trim().parse().map_err(|_| bad("ContextTokens is not a count"))?;
        let output: usize = gen_.trim().parse().map_err(|_| bad("GeneratedTokens is not a count"))?;
        let start = *first.get_or_insert(at);
        out.push(TraceRequest {
            arrival_ms: Some((at - start).max(0.0)),
            input_length: input.max(1),
            output_length: output.max(1),
            ..TraceRequest::default()
        });
    }
    if out.is_empty() {
        return Err(TraceError::Empty);
    }
    Ok(out)
}

/// Milliseconds since 1970 of `2023-11-16 18:15:46.6805900` (UTC assumed; only differences are used).
fn azure_timestamp_ms(s: &str) -> Option<f64> {
    let (date, time) = s.split_once(' ')?;
    let mut d = date.split('-').map(str::parse::<i64>);
    let (y, m, day) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    let mut t = time.split(':');
    let (h, min, sec) =
        (t.next()?.parse::<f64>().ok()?, t.next()?.parse::<f64>().ok()?, t.next()?.parse::<f64>().ok()?);
    Some(days_from_civil(y, m, day) as f64 * 86_400_000.0 + (h * 3600.0 + min * 60.0 + sec) * 1000.0)
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
{"input_length": 900, "output_length": 7, "hash_ids": [0, 2], "session_id": "a", "delay": 300}
"#;
        let r = parse_mooncake(text).expect("parses");
        assert_eq!(r.len(), 3);
        assert_eq!(r[0].hash_ids, [0, 1]);
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
    fn a_bad_line_is_named() {
        let e = parse_mooncake("{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1}\n{\"timestamp\": 1}\n")
            .expect_err("refused");
        assert!(e.to_string().starts_with("line 2:"), "{e}");
        let e = parse_mooncake("{\"input_length\": 5, \"output_length\": 1}\n").expect_err("refused");
        assert!(e.to_string().contains("timestamp"), "{e}");
        assert!(matches!(parse_mooncake("\n"), Err(TraceError::Empty)));
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
}
