//! Recording the router's traffic as a trace `tandem sim` replays: per request the arrival time, the prompt's
//! length, its token budget, its tenant namespace, its block hashes and what the router decided, in the Mooncake
//! JSONL format with a header line; and, once the request has ended, a line of its own with the tokens it actually
//! generated (a replay decodes those, not the budget). No text and no token ids are written, and the block hashes are re-keyed with
//! a secret drawn for each recording (HMAC-SHA256): equal blocks stay equal, so the prefix structure survives, but
//! nobody can test a guessed prompt against the file by hashing it with the public seed.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use kv_cache::SeqHash;
use ring::hmac;
use serde_json::{Value, json};

use crate::scheduler::Decision;

/// The header line's key: what marks a file as a Tandem recording.
pub const HEADER: &str = "tandem_recording";

/// The key of a line giving a recorded request's actual output: `{"tandem_output": {"request": N, "output_tokens":
/// K, "finish_reason": F}}`, `N` counting the request lines from 0, written once the request has ended (after its
/// own line, not necessarily in its order). `F` is the choice's finish reason, or `incomplete` when it ended
/// without one (a failure, a client gone).
pub const OUTPUT: &str = "tandem_output";

/// Recordings started by this process, for telling them apart.
static RECORDINGS: AtomicU64 = AtomicU64::new(0);

/// Where a request went in a recording: which recording, and its request number there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    recording: u64,
    request: u64,
}

/// Why a recording could not start or go on.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("{path}: {source}")]
    File { path: PathBuf, source: std::io::Error },
    #[error("no random source for the recording's key")]
    Random,
}

/// One request as recorded.
#[derive(Clone, Debug)]
pub struct Arrival<'a> {
    pub input_length: usize,
    /// The request's token budget (`max_tokens`, or the default the router gave it).
    pub max_tokens: u32,
    pub namespace: Option<&'a str>,
    pub hashes: &'a [SeqHash],
    /// vLLM's request priority (written when not 0).
    pub priority: i32,
}

/// What the router did with it: the decision, or why it refused (`RouteError::kind`).
#[derive(Clone, Copy, Debug)]
pub enum Outcome<'a> {
    Routed(&'a Decision),
    Refused(&'a str),
}

/// A recording in progress: the file, its key, and its clock.
pub struct Recording {
    /// This recording among the process's (`Entry::recording`).
    id: u64,
    path: PathBuf,
    file: std::io::BufWriter<std::fs::File>,
    key: hmac::Key,
    started: Instant,
    requests: u64,
    /// Each decision's candidates as scored are written too (`Decision::candidates`): larger lines, for finding
    /// where a simulator's decisions part from the router's.
    candidates: bool,
}

impl std::fmt::Debug for Recording {
    /// Never the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recording").field("path", &self.path).field("requests", &self.requests).finish_non_exhaustive()
    }
}

impl Recording {
    /// Creates `path` (never overwriting a file) and writes the header: the block size the hashes are of, and when
    /// the recording started. `candidates`: each decision with its candidates as scored.
    pub fn start(path: &Path, block_size: u32, candidates: bool) -> Result<Recording, RecordError> {
        let file_error = |source| RecordError::File { path: path.to_path_buf(), source };
        let file = std::fs::OpenOptions::new().write(true).create_new(true).open(path).map_err(file_error)?;
        let key = hmac::Key::generate(hmac::HMAC_SHA256, &ring::rand::SystemRandom::new())
            .map_err(|_| RecordError::Random)?;
        let mut r = Recording {
            id: RECORDINGS.fetch_add(1, Ordering::Relaxed),
            path: path.to_path_buf(),
            file: std::io::BufWriter::new(file),
            key,
            started: Instant::now(),
            requests: 0,
            candidates,
        };
        let started_unix_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let header = json!({ HEADER: { "version": 1, "block_size": block_size, "started_unix_ms": started_unix_ms,
                                       "hash_ids": "hmac-sha256 of each block's chained hash, keyed per recording" } });
        r.write(&header)?;
        Ok(r)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Requests recorded so far.
    pub fn requests(&self) -> u64 {
        self.requests
    }

    /// Appends one request, `arrived` being when it reached the router; returns where it went.
    pub fn push(&mut self, arrived: Instant, a: &Arrival<'_>, outcome: Outcome<'_>) -> Result<Entry, RecordError> {
        let ms = arrived.saturating_duration_since(self.started).as_secs_f64() * 1000.0;
        let line = line(ms, a, outcome, self.candidates, |h| rekey(&self.key, h));
        self.write(&line)?;
        self.requests += 1;
        Ok(Entry { recording: self.id, request: self.requests - 1 })
    }

    /// Appends what request `entry` generated, once it has ended: `tokens` output tokens, `finish` its finish reason
    /// (or `incomplete`). Nothing when the request was recorded by another recording (this one started after it).
    pub fn push_output(&mut self, entry: Entry, tokens: usize, finish: &str) -> Result<(), RecordError> {
        if entry.recording != self.id {
            return Ok(());
        }
        self.write(&json!({ OUTPUT: { "request": entry.request, "output_tokens": tokens, "finish_reason": finish } }))
    }

    /// One line, flushed at once: a recording read while it runs (or after a crash) is whole up to its last line.
    fn write(&mut self, v: &Value) -> Result<(), RecordError> {
        let file_error = |source| RecordError::File { path: self.path.clone(), source };
        writeln!(self.file, "{v}").map_err(file_error)?;
        self.file.flush().map_err(file_error)
    }
}

/// A block hash under the recording's key: the first 8 bytes of HMAC-SHA256 over its little-endian bytes, kept below
/// 2^53 so that every JSON reader keeps it exact.
fn rekey(key: &hmac::Key, h: SeqHash) -> u64 {
    let tag = hmac::sign(key, &h.0.to_le_bytes());
    let mut b = [0u8; 8];
    b.copy_from_slice(&tag.as_ref()[..8]);
    u64::from_le_bytes(b) >> 11
}

/// One request's line: the Mooncake fields, and Tandem's own under `tandem`.
fn line(ms: f64, a: &Arrival<'_>, outcome: Outcome<'_>, candidates: bool, rekey: impl Fn(SeqHash) -> u64) -> Value {
    let decision = match outcome {
        Outcome::Routed(d) => {
            let mut v = json!({
                "policy": d.policy.as_str(),
                "prefill": d.prefill.as_ref().filter(|_| d.disaggregate).map(|c| c.worker.as_str()),
                "decode": d.decode.worker.as_str(),
                "disaggregate": d.disaggregate,
                "reason": d.reason.as_str(),
                "margin": d.prefill_margin().map(|m| (m * 1000.0).round() / 1000.0),
            });
            if let (true, Value::Object(m)) = (candidates, &mut v) {
                m.insert("candidates".into(), json!(d.candidates()));
            }
            v
        }
        Outcome::Refused(kind) => json!({ "refused": kind }),
    };
    let mut v = json!({
        "timestamp": (ms * 1000.0).round() / 1000.0,
        "input_length": a.input_length,
        "output_length": a.max_tokens,
        "hash_ids": a.hashes.iter().map(|h| rekey(*h)).collect::<Vec<u64>>(),
        "tandem": { "namespace": a.namespace, "decision": decision },
    });
    if a.priority != 0 {
        v["priority"] = a.priority.into();
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::config::Policy;
    use crate::scheduler::view::WorkerId;
    use crate::scheduler::{Choice, Reason, Scored};

    #[test]
    fn rekeying_keeps_equality_and_hides_the_public_hashes() {
        let rng = ring::rand::SystemRandom::new();
        let (k1, k2) = (
            hmac::Key::generate(hmac::HMAC_SHA256, &rng).expect("key"),
            hmac::Key::generate(hmac::HMAC_SHA256, &rng).expect("key"),
        );
        let a = kv_cache::block_hashes(&(0..64).collect::<Vec<u32>>(), kv_cache::BlockSize::DEFAULT, None).seq;
        let b =
            kv_cache::block_hashes(&(0..48).chain(900..916).collect::<Vec<u32>>(), kv_cache::BlockSize::DEFAULT, None)
                .seq;
        let ra: Vec<u64> = a.iter().map(|h| rekey(&k1, *h)).collect();
        let rb: Vec<u64> = b.iter().map(|h| rekey(&k1, *h)).collect();
        // The shared prefix stays shared, the rest differs, and no id is the public hash.
        assert_eq!(ra[..3], rb[..3]);
        assert_ne!(ra[3], rb[3]);
        assert!(a.iter().zip(&ra).all(|(h, r)| h.0 != *r && *r < 1 << 53));
        // Another recording's key gives other ids for the same prompt.
        assert!(a.iter().zip(&ra).all(|(h, r)| rekey(&k2, *h) != *r));
    }

    #[test]
    fn a_recording_is_a_trace_with_a_header_and_is_never_overwritten() {
        let dir = std::env::temp_dir().join(format!("tandem-record-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("traffic.jsonl");
        let _ = std::fs::remove_file(&path);
        let mut r = Recording::start(&path, 16, false).expect("starts");
        let hashes = kv_cache::block_hashes(&(0..40).collect::<Vec<u32>>(), kv_cache::BlockSize::DEFAULT, None).seq;
        let a = Arrival { input_length: 40, max_tokens: 7, namespace: Some("tenant-a"), hashes: &hashes, priority: 0 };
        r.push(Instant::now(), &a, Outcome::Refused("all_busy")).expect("written");
        let second = r.push(Instant::now(), &a, Outcome::Refused("all_busy")).expect("written");
        r.push_output(second, 3, "stop").expect("written");
        // A request recorded by another recording is not this one's.
        let other = dir.join("other.jsonl");
        let _ = std::fs::remove_file(&other);
        let mut o = Recording::start(&other, 16, false).expect("starts");
        let elsewhere = o.push(Instant::now(), &a, Outcome::Refused("all_busy")).expect("written");
        r.push_output(elsewhere, 9, "length").expect("nothing to write");
        assert_eq!(r.requests(), 2);
        let text = std::fs::read_to_string(&path).expect("readable while recording");
        let lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).expect("JSON")).collect();
        assert_eq!(lines[0][HEADER]["block_size"], 16);
        assert_eq!(lines[1]["input_length"], 40);
        assert_eq!(lines[1]["output_length"], 7);
        assert_eq!(lines[1]["hash_ids"].as_array().map(Vec::len), Some(2));
        assert_eq!(lines[1]["tandem"]["namespace"], "tenant-a");
        assert_eq!(lines[1]["tandem"]["decision"]["refused"], "all_busy");
        assert_eq!(lines.len(), 4, "the header, two requests, one output");
        assert_eq!(lines[3][OUTPUT], json!({"request": 1, "output_tokens": 3, "finish_reason": "stop"}));
        assert!(!text.contains(&hashes[0].0.to_string()), "no public hash in the file");
        assert!(Recording::start(&path, 16, false).is_err(), "an existing file is not overwritten");
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn scored(worker: &str, id: u32, cost: f64, active_prefill_tokens: u64) -> Scored {
        Scored {
            worker: worker.into(),
            id: WorkerId(id),
            device_blocks: 2,
            host_blocks: 0,
            disk_blocks: 0,
            active_prefill_tokens,
            active_blocks: 10,
            active_overlap_blocks: 1,
            potential_decode_blocks: 12,
            capacity_blocks: 100,
            active_requests: 1,
            speed_factor: 1.0,
            affinity_credit: 0.0,
            cost,
            predicted: false,
        }
    }

    #[test]
    fn candidates_are_written_only_when_asked_for() {
        let prefill = Choice {
            worker: "p0".into(),
            id: WorkerId(0),
            candidates: vec![scored("p0", 0, 40.0, 512), scored("p1", 1, 72.0, 1024)],
        };
        let decode = Choice { worker: "d0".into(), id: WorkerId(2), candidates: vec![scored("d0", 2, 0.1, 0)] };
        let d = Decision {
            policy: Policy::Kv,
            prefill: Some(prefill),
            decode,
            disaggregate: true,
            reason: Reason::PrefillRemote,
            request_blocks: 4,
            isl: 64,
        };
        let hashes = kv_cache::block_hashes(&(0..64).collect::<Vec<u32>>(), kv_cache::BlockSize::DEFAULT, None).seq;
        let a = Arrival { input_length: 64, max_tokens: 8, namespace: None, hashes: &hashes, priority: -3 };
        let plain = line(0.0, &a, Outcome::Routed(&d), false, |h| h.0 >> 11);
        assert_eq!(plain["tandem"]["decision"]["prefill"], "p0");
        assert_eq!(plain["tandem"]["decision"]["margin"], 32.0);
        assert_eq!(plain["priority"], -3, "a request's priority, the trace's own field");
        assert!(plain["tandem"]["decision"].get("candidates").is_none());
        let explained = line(0.0, &a, Outcome::Routed(&d), true, |h| h.0 >> 11);
        let c = &explained["tandem"]["decision"]["candidates"];
        assert_eq!(c["prefill"][1]["worker"], "p1");
        assert_eq!(c["prefill"][1]["active_prefill_tokens"], 1024);
        assert_eq!(c["prefill"][1]["cost"], 72.0);
        assert_eq!(c["decode"][0]["worker"], "d0");
        // The rest of the line is the plain one.
        let mut without = explained.clone();
        without["tandem"]["decision"].as_object_mut().expect("object").remove("candidates");
        assert_eq!(without, plain);
    }
}
