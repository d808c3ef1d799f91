//! Exact mode: an engine's own KV events (vLLM's and SGLang's ZeroMQ publishers), followed into the router's index.
//!
//! The engine publishes each batch on a PUB socket as `[topic, sequence number (8 bytes, big-endian), MessagePack
//! batch]`, and keeps recent batches for a ROUTER replay socket that answers a start number with every batch from
//! there on, then an end marker (sequence −1). The router subscribes ([`zmtp`]), reads each batch ([`wire`]),
//! re-hashes the stored blocks from their token ids ([`chain`]) and applies the result to the worker's entry in
//! the index. On connecting it asks the replay socket for everything it still holds; a missing number is asked
//! for again; when the replay cannot fill the hole (no replay socket, or the batches are gone), or a batch cannot
//! be read, what the router knew of the worker is dropped and rebuilt from the events that follow.

pub mod chain;
pub mod msgpack;
pub mod wire;
pub mod zmtp;

use std::sync::Arc;
use std::time::Duration;

use kv_cache::BlockSize;
use tokio::sync::watch;

use self::chain::EngineBlocks;
use self::zmtp::{Connection, SocketType};
use crate::cluster::{Cluster, Refused};
use crate::scheduler::view::WorkerId;

/// Where an engine publishes its KV events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventSource {
    /// Its PUB socket, `tcp://host:port` (vLLM's and SGLang's `--kv-events-config` `endpoint`).
    pub endpoint: String,
    /// Its ROUTER replay socket (`replay_endpoint`), if it has one.
    pub replay: Option<String>,
    /// The topic it publishes under (`topic`; empty: everything on the socket).
    pub topic: String,
}

impl EventSource {
    /// Checks the endpoints' form.
    pub fn new(endpoint: &str, replay: Option<&str>, topic: &str) -> Result<EventSource, String> {
        zmtp::tcp_authority(endpoint).map_err(|e| e.to_string())?;
        if let Some(r) = replay {
            zmtp::tcp_authority(r).map_err(|e| e.to_string())?;
        }
        Ok(EventSource { endpoint: endpoint.into(), replay: replay.map(Into::into), topic: topic.into() })
    }

    /// Where data-parallel rank `rank` of the server publishes: each port plus the rank, as vLLM and SGLang offset
    /// them per rank.
    pub fn for_rank(&self, rank: u32) -> Result<EventSource, String> {
        let offset = |endpoint: &str| -> Result<String, String> {
            let authority = zmtp::tcp_authority(endpoint).map_err(|e| e.to_string())?;
            let (host, port) = authority.rsplit_once(':').ok_or_else(|| format!("{endpoint} has no port"))?;
            let port = port.parse::<u32>().map_err(|e| format!("{endpoint}: {e}"))? + rank;
            let port = u16::try_from(port).map_err(|_| format!("{endpoint}: rank {rank}'s port is past 65535"))?;
            Ok(format!("tcp://{host}:{port}"))
        };
        Ok(EventSource {
            endpoint: offset(&self.endpoint)?,
            replay: self.replay.as_deref().map(offset).transpose()?,
            topic: self.topic.clone(),
        })
    }
}

/// How long connecting, a handshake or one replayed batch may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Pause before connecting again after a failure.
const RETRY: Duration = Duration::from_secs(1);
/// How often a quiet stream checks that the worker is still up.
const MEMBERSHIP_CHECK: Duration = Duration::from_millis(500);
/// Batches one replay may return at most (vLLM and SGLang keep 10,000 by default).
const MAX_REPLAYED: usize = 1_000_000;

/// Follows `source` for external worker `id` until `stop`, while the worker is up; `rank`: the data-parallel rank
/// publishing there, whose number its batches carry.
pub async fn follow(
    cluster: &Arc<Cluster>,
    id: WorkerId,
    url: &str,
    source: &EventSource,
    rank: Option<u32>,
    max_blocks: usize,
    mut stop: watch::Receiver<bool>,
) {
    let mut blocks = EngineBlocks::new(BlockSize::new(cluster.model().block_size).unwrap_or_default(), max_blocks);
    let up = |c: &Cluster| c.member(id).is_some_and(|m| m.up);
    loop {
        // Events only mean something while the index has the worker: wait for it to be up.
        while !up(cluster) {
            tokio::select! {
                _ = tokio::time::sleep(MEMBERSHIP_CHECK) => {}
                _ = stop.wait_for(|&s| s) => return,
            }
        }
        let mut follower =
            Follower { cluster, id, blocks: &mut blocks, source, rank, expected: None, misranked: false };
        let result = tokio::select! {
            r = follower.run() => r,
            _ = stop.wait_for(|&s| s) => return,
        };
        match result {
            Ok(()) => {
                tracing::info!(worker = %url, "external worker went down; its KV events are followed again once it is back")
            }
            Err(e) => {
                tracing::warn!(worker = %url, endpoint = %source.endpoint, error = %e, "KV event stream failed; reconnecting")
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(RETRY) => {}
            _ = stop.wait_for(|&s| s) => return,
        }
    }
}

/// One connection's worth of following.
struct Follower<'a> {
    cluster: &'a Cluster,
    id: WorkerId,
    blocks: &'a mut EngineBlocks,
    source: &'a EventSource,
    /// The next sequence number due.
    expected: Option<u64>,
    /// The data-parallel rank publishing there, whose number its batches carry (`None`: not a rank's).
    rank: Option<u32>,
    /// A batch of another rank than the source's came (said once per connection).
    misranked: bool,
}

impl Follower<'_> {
    /// Until the connection fails (an error) or the worker is no longer up.
    async fn run(&mut self) -> Result<(), zmtp::Error> {
        let mut sub = Connection::connect(&self.source.endpoint, SocketType::Sub, CONNECT_TIMEOUT).await?;
        sub.subscribe(self.source.topic.as_bytes()).await?;
        // What the router knew may be stale: start from nothing and rebuild from the replay buffer.
        self.reset("connected");
        if self.source.replay.is_some() {
            self.catch_up(0).await?;
        }
        // A busy stream notices the worker going down when a batch cannot be applied; a quiet one by this check.
        let mut check = tokio::time::interval(MEMBERSHIP_CHECK);
        loop {
            let message = tokio::select! {
                m = sub.recv() => m?,
                _ = check.tick() => {
                    if !self.cluster.member(self.id).is_some_and(|m| m.up) {
                        return Ok(());
                    }
                    continue;
                }
            };
            let Some((seq, payload)) = numbered(&message) else {
                tracing::warn!(worker = ?self.id, frames = message.len(), "a KV event message of an unknown shape");
                continue;
            };
            if let Some(due) = self.expected.filter(|&due| seq > due) {
                tracing::debug!(worker = ?self.id, due, seq, "KV event batches missed");
                if self.source.replay.is_some() {
                    self.catch_up(due).await?;
                }
                if self.expected.is_some_and(|e| e < seq) {
                    self.reset("events lost");
                }
            }
            if !self.take(seq, payload) {
                return Ok(());
            }
        }
    }

    /// Applies batch `seq` unless it was applied already; `false` once the worker is down (nothing more applies).
    fn take(&mut self, seq: u64, payload: &[u8]) -> bool {
        if self.expected.is_some_and(|due| seq < due) {
            return true;
        }
        self.expected = Some(seq + 1);
        let batch = match wire::decode(payload) {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(worker = ?self.id, seq, error = %e, "an unreadable KV event batch");
                self.cluster.refused_batch(self.id, Refused::Unreadable);
                return self.reset("an unreadable batch");
            }
        };
        if let (Some(want), Some(got)) = (self.rank, batch.rank)
            && got != i64::from(want)
        {
            // The configured ports are not this rank's (another rank's cache would be taken for this one's).
            self.cluster.refused_batch(self.id, Refused::OtherRank);
            if !std::mem::replace(&mut self.misranked, true) {
                tracing::warn!(worker = ?self.id, endpoint = %self.source.endpoint, want, got,
                    "KV events of another data-parallel rank on this rank's port; not applied (check the endpoints)");
            }
            return true;
        }
        for event in &batch.events {
            match self.blocks.apply(event) {
                Ok(out) => {
                    if out.skipped > 0 {
                        tracing::debug!(worker = ?self.id, blocks = out.skipped, "engine blocks not followed");
                    }
                    if !self.cluster.apply_engine_events(self.id, &out.events) {
                        return false;
                    }
                }
                Err(e) => {
                    tracing::warn!(worker = ?self.id, error = %e, "dropping the view of an external worker");
                    return self.reset("too many blocks");
                }
            }
        }
        true
    }

    /// Asks the replay socket for every batch from `from` on and applies those not applied yet.
    async fn catch_up(&mut self, from: u64) -> Result<(), zmtp::Error> {
        let Some(endpoint) = &self.source.replay else { return Ok(()) };
        let mut dealer = Connection::connect(endpoint, SocketType::Dealer, CONNECT_TIMEOUT).await?;
        dealer.send(&[b"", &from.to_be_bytes()]).await?;
        for _ in 0..MAX_REPLAYED {
            let message = tokio::time::timeout(CONNECT_TIMEOUT, dealer.recv()).await.map_err(|_| {
                zmtp::Error::Io(std::io::Error::new(std::io::ErrorKind::TimedOut, "the replay socket went quiet"))
            })??;
            let Some((seq, payload)) = numbered(&message) else { continue };
            if seq == END {
                return Ok(());
            }
            // The first batch replayed after a hole is not the one due: the hole cannot be filled.
            if let Some(due) = self.expected
                && seq > due
            {
                self.reset("the replay buffer no longer holds the missed batches");
            }
            if !self.take(seq, payload) {
                return Ok(());
            }
        }
        Ok(())
    }

    /// Forgets what the router knew of the worker's cache; `false` when the worker is down.
    fn reset(&mut self, why: &str) -> bool {
        if !self.blocks.is_empty() || self.expected.is_some() {
            tracing::info!(worker = ?self.id, why, "rebuilding an external worker's cache view from its events");
        }
        self.blocks.clear();
        self.expected = None;
        self.cluster.apply_engine_events(self.id, &[kv_cache::events::KvEvent::Cleared { tier: None }])
    }
}

/// The end-of-replay marker's sequence number (−1).
const END: u64 = u64::MAX;

/// The sequence number and payload of a published or replayed message: its last two frames (a PUB message is
/// `[topic, seq, payload]`, a replayed one `["", topic, seq, payload]` in vLLM and recent SGLang, `["", seq,
/// payload]` in older ones).
fn numbered(message: &[Vec<u8>]) -> Option<(u64, &[u8])> {
    let [.., seq, payload] = message else { return None };
    let seq: [u8; 8] = seq.as_slice().try_into().ok()?;
    Some((u64::from_be_bytes(seq), payload))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_numbered_by_their_last_two_frames() {
        let seq = 7u64.to_be_bytes().to_vec();
        let published = vec![b"kv".to_vec(), seq.clone(), b"x".to_vec()];
        assert_eq!(numbered(&published), Some((7, &b"x"[..])));
        let replayed = vec![Vec::new(), seq.clone(), b"y".to_vec()];
        assert_eq!(numbered(&replayed), Some((7, &b"y"[..])));
        let end = vec![Vec::new(), Vec::new(), (-1i64).to_be_bytes().to_vec(), Vec::new()];
        assert_eq!(numbered(&end), Some((END, &b""[..])));
        assert_eq!(numbered(&[b"short".to_vec(), b"x".to_vec()]), None);
        assert_eq!(numbered(&[seq]), None);
        assert!(EventSource::new("tcp://127.0.0.1:5557", Some("tcp://127.0.0.1:5558"), "").is_ok());
        assert!(EventSource::new("ipc:///tmp/kv", None, "").is_err());
    }
}
