//! The QUIC transport: quinn over UDP, TLS 1.3 with mutual authentication against the cluster CA.
//!
//! The owner runs a [`QuicServer`] over a [`BlockSource`]; a reader's [`QuicClient::pull`] opens a few streams in
//! parallel, sends one `Read` on each and receives `Block` frames. Every block is checked (position, length,
//! checksum against the frame and the handle's descriptor); the pull returns blocks only when all of them passed,
//! so a failed or partial transfer never leaves a half-written block for the model.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::task::JoinSet;
use tracing::Instrument;

use crate::checksum;
use crate::descriptor::BlockDescriptor;
use crate::frame::{
    BLOCK_HEADER, ErrorCode, Frame, FrameDecoder, FrameError, ReadRequest, encode_block_header, encode_done,
    encode_error, encode_read, encode_release,
};
use crate::incoming::{Arrived, Item, Reader};
use crate::lease::LeaseId;
use crate::paths::{self, PathKind};
use crate::tls::{Identity, TlsError};

/// Largest `Read` frame a server accepts: 16,384 block positions, more than an 8k-token prompt has.
const MAX_READ_FRAME: usize = 64 << 10;

/// What the owner serves: block bytes by lease and position.
pub trait BlockSource: Send + Sync + 'static {
    /// The checksum and bytes of block `index` of `lease`, or why not.
    fn read(&self, lease: LeaseId, index: u32) -> Result<(u64, Bytes), (ErrorCode, String)>;

    /// The reader is done with `lease`; unknown leases are ignored.
    fn release(&self, _lease: LeaseId) {}
}

/// Why a transfer failed.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("transfer endpoint: {0}")]
    Io(#[from] std::io::Error),
    #[error("cannot connect to {addr}: {reason}")]
    Connect { addr: SocketAddr, reason: String },
    #[error("transfer stream failed: {0}")]
    Stream(String),
    #[error("the owner refused: {code:?}: {message}")]
    Remote { code: ErrorCode, message: String },
    #[error("block {index} failed its check: {what}")]
    Integrity { index: u32, what: &'static str },
    #[error("the owner sent {got} of {want} blocks")]
    Incomplete { got: usize, want: usize },
    #[error("bad frame from the peer: {0}")]
    Frame(#[from] FrameError),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

/// A QUIC endpoint on a UDP socket bound to `addr`, advertising large datagrams ([`paths`]), a server with the
/// configurations `server` makes for the flow-control window its socket buffer allows. Must be called inside a
/// tokio runtime.
fn endpoint<C>(
    addr: SocketAddr,
    configs: impl FnOnce(u32) -> Result<PerPath<C>, TlsError>,
    server: impl FnOnce(&PerPath<C>) -> Option<quinn::ServerConfig>,
) -> Result<(quinn::Endpoint, PerPath<C>, u32), TransferError> {
    let (socket, recv_buffer) = paths::bind(addr)?;
    let window = paths::window_for(recv_buffer);
    let configs = configs(window)?;
    let runtime = quinn::default_runtime().ok_or_else(|| std::io::Error::other("no async runtime"))?;
    let endpoint = quinn::Endpoint::new(paths::endpoint_config(), server(&configs), socket, runtime)?;
    Ok((endpoint, configs, window))
}

/// One configuration per path kind ([`PathKind`]), made from one identity.
#[derive(Debug)]
struct PerPath<C> {
    loopback: Arc<C>,
    network: Arc<C>,
}

impl<C> PerPath<C> {
    fn new(mut make: impl FnMut(PathKind) -> Result<C, TlsError>) -> Result<PerPath<C>, TlsError> {
        Ok(PerPath { loopback: Arc::new(make(PathKind::Loopback)?), network: Arc::new(make(PathKind::Network)?) })
    }

    fn to(&self, peer: SocketAddr) -> Arc<C> {
        match PathKind::of(peer) {
            PathKind::Loopback => Arc::clone(&self.loopback),
            PathKind::Network => Arc::clone(&self.network),
        }
    }
}

fn server_configs(identity: &Identity, window: u32) -> Result<PerPath<quinn::ServerConfig>, TlsError> {
    PerPath::new(|path| identity.quic_server(paths::transport(path, window)))
}

fn client_configs(identity: &Identity, window: u32) -> Result<PerPath<quinn::ClientConfig>, TlsError> {
    PerPath::new(|path| identity.quic_client(paths::transport(path, window)))
}

fn stream_err(e: impl std::fmt::Display) -> TransferError {
    TransferError::Stream(e.to_string())
}

/// Serves reads of leased blocks.
#[derive(Debug)]
pub struct QuicServer {
    endpoint: quinn::Endpoint,
    accept: tokio::task::JoinHandle<()>,
    /// What a new connection gets, by the path it came over (replaced when the certificates rotate).
    configs: Arc<std::sync::RwLock<PerPath<quinn::ServerConfig>>>,
    window: u32,
}

impl QuicServer {
    /// Listens on `addr` (port 0: any free port). Must be called inside a tokio runtime.
    pub fn bind(
        addr: SocketAddr,
        identity: &Identity,
        source: Arc<dyn BlockSource>,
    ) -> Result<QuicServer, TransferError> {
        // Connections are accepted with the configuration for their path; the endpoint's own is the network one.
        let (endpoint, configs, window) = endpoint(
            addr,
            |window| server_configs(identity, window),
            |c| Some(quinn::ServerConfig::clone(&c.network)),
        )?;
        let configs = Arc::new(std::sync::RwLock::new(configs));
        let (ep, chosen) = (endpoint.clone(), Arc::clone(&configs));
        let accept = tokio::spawn(async move {
            while let Some(incoming) = ep.accept().await {
                let source = Arc::clone(&source);
                let config = chosen.read().unwrap_or_else(|p| p.into_inner()).to(incoming.remote_address());
                tokio::spawn(async move {
                    // A peer without a certificate from the cluster CA fails here and never sends a request.
                    let Ok(connecting) = incoming.accept_with(config) else { return };
                    let Ok(conn) = connecting.await else { return };
                    while let Ok((send, recv)) = conn.accept_bi().await {
                        tokio::spawn(serve_stream(send, recv, Arc::clone(&source)));
                    }
                });
            }
        });
        Ok(QuicServer { endpoint, accept, configs, window })
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.endpoint.local_addr()
    }

    /// What changes the identity this server presents while it runs.
    pub fn handle(&self) -> QuicServerHandle {
        QuicServerHandle { endpoint: self.endpoint.clone(), configs: Arc::clone(&self.configs), window: self.window }
    }

    /// Closes every connection and stops listening.
    pub async fn close(self) {
        self.endpoint.close(0u32.into(), b"shutdown");
        self.accept.abort();
        self.endpoint.wait_idle().await;
    }
}

/// Changes a running [`QuicServer`]'s identity.
#[derive(Clone, Debug)]
pub struct QuicServerHandle {
    endpoint: quinn::Endpoint,
    configs: Arc<std::sync::RwLock<PerPath<quinn::ServerConfig>>>,
    window: u32,
}

impl QuicServerHandle {
    /// Presents `identity` (and trusts its CA) from the next connection on; open connections keep theirs.
    pub fn set_identity(&self, identity: &Identity) -> Result<(), TransferError> {
        let configs = server_configs(identity, self.window)?;
        // The endpoint's own configuration too, so that nothing it does on its own keeps the old identity.
        self.endpoint.set_server_config(Some(quinn::ServerConfig::clone(&configs.network)));
        *self.configs.write().unwrap_or_else(|p| p.into_inner()) = configs;
        Ok(())
    }
}

async fn read_frame(
    recv: &mut quinn::RecvStream,
    dec: &FrameDecoder,
    buf: &mut BytesMut,
) -> Result<Option<Frame>, TransferError> {
    loop {
        if let Some(f) = dec.decode(buf)? {
            return Ok(Some(f));
        }
        match recv.read_chunk(usize::MAX, true).await.map_err(stream_err)? {
            Some(chunk) => buf.extend_from_slice(&chunk.bytes),
            None if buf.is_empty() => return Ok(None),
            None => return Err(TransferError::Stream("the stream ended inside a frame".into())),
        }
    }
}

async fn serve_stream(mut send: quinn::SendStream, mut recv: quinn::RecvStream, source: Arc<dyn BlockSource>) {
    let dec = FrameDecoder::new(MAX_READ_FRAME);
    let mut buf = BytesMut::new();
    let mut out = BytesMut::new();
    let request = match read_frame(&mut recv, &dec, &mut buf).await {
        Ok(Some(Frame::Read(r))) => r,
        Ok(Some(Frame::Release(lease))) => {
            source.release(lease);
            encode_done(&mut out);
            let _ = send.write_all(&out).await;
            let _ = send.finish();
            return;
        }
        Ok(_) => {
            encode_error(ErrorCode::BadRequest, "expected a read request", &mut out);
            let _ = send.write_all(&out).await;
            let _ = send.finish();
            return;
        }
        Err(e) => {
            encode_error(ErrorCode::BadRequest, &e.to_string(), &mut out);
            let _ = send.write_all(&out).await;
            let _ = send.finish();
            return;
        }
    };
    let span = tracing::info_span!(
        "kv_transfer.serve",
        traceparent = request.traceparent.as_deref(),
        blocks = request.blocks.len(),
    );
    telemetry::trace::set_parent(&span, request.traceparent.as_deref());
    serve_blocks(send, &request, source, out).instrument(span).await;
}

/// Answers one `Read`: a `Block` frame per position, or an `Error` that ends the stream.
async fn serve_blocks(
    mut send: quinn::SendStream,
    request: &ReadRequest,
    source: Arc<dyn BlockSource>,
    mut out: BytesMut,
) {
    for &index in &request.blocks {
        out.clear();
        match source.read(request.lease, index) {
            Ok((sum, bytes)) => {
                encode_block_header(index, sum, bytes.len(), &mut out);
                if send.write_all(&out).await.is_err() || send.write_chunk(bytes).await.is_err() {
                    return;
                }
            }
            Err((code, message)) => {
                encode_error(code, &message, &mut out);
                let _ = send.write_all(&out).await;
                let _ = send.finish();
                return;
            }
        }
    }
    out.clear();
    encode_done(&mut out);
    let _ = send.write_all(&out).await;
    let _ = send.finish();
}

/// What to pull.
#[derive(Clone, Debug)]
pub struct PullRequest<'a> {
    pub addr: SocketAddr,
    /// The name the owner's certificate must carry (`localhost` for a local cluster).
    pub server_name: &'a str,
    pub lease: LeaseId,
    /// Block positions wanted, with the handle's descriptor of each.
    pub blocks: &'a [(u32, BlockDescriptor)],
    /// Streams in parallel.
    pub streams: usize,
    /// Deadline for the whole pull, connection included.
    pub timeout: Duration,
    pub traceparent: Option<String>,
}

/// Connections a client keeps at most; past it the least recently used goes (owners come and go).
const MAX_CONNECTIONS: usize = 256;

/// A cached connection and when it was last handed out.
#[derive(Debug)]
struct Cached {
    conn: quinn::Connection,
    used: std::time::Instant,
}

/// Pulls blocks from owners, keeping one connection per owner for reuse: closed ones are dropped whenever a new
/// one is made, and no more than [`MAX_CONNECTIONS`] are kept.
#[derive(Debug)]
pub struct QuicClient {
    endpoint: quinn::Endpoint,
    /// What new connections present and trust (replaced when the certificates rotate).
    config: std::sync::RwLock<PerPath<quinn::ClientConfig>>,
    window: u32,
    connections: std::sync::Mutex<HashMap<(SocketAddr, String), Cached>>,
}

impl QuicClient {
    /// A client presenting `identity`, bound to an ephemeral port on `bind` (use an unspecified or loopback
    /// address). Must be called inside a tokio runtime.
    pub fn new(identity: &Identity, bind: SocketAddr) -> Result<QuicClient, TransferError> {
        let (endpoint, configs, window) = endpoint(bind, |window| client_configs(identity, window), |_| None)?;
        let config = std::sync::RwLock::new(configs);
        let connections = std::sync::Mutex::new(HashMap::new());
        Ok(QuicClient { endpoint, config, window, connections })
    }

    /// Presents `identity` (and trusts its CA) on the next new connection; reused ones keep theirs.
    pub fn set_identity(&self, identity: &Identity) -> Result<(), TransferError> {
        let config = client_configs(identity, self.window)?;
        *self.config.write().unwrap_or_else(|p| p.into_inner()) = config;
        Ok(())
    }

    /// Connections kept for reuse now (open or not yet noticed closed).
    pub fn cached_connections(&self) -> usize {
        self.connections.lock().map_or(0, |m| m.len())
    }

    /// UDP datagrams and bytes received so far on the connections kept now.
    pub fn received(&self) -> (u64, u64) {
        self.connections.lock().map_or((0, 0), |m| {
            m.values().map(|c| c.conn.stats().udp_rx).fold((0, 0), |(d, b), rx| (d + rx.datagrams, b + rx.bytes))
        })
    }

    /// A live connection to `addr`, reused when one is open.
    async fn connection(&self, addr: SocketAddr, server_name: &str) -> Result<quinn::Connection, TransferError> {
        let key = (addr, server_name.to_string());
        let cached = self.connections.lock().ok().and_then(|mut m| {
            let c = m.get_mut(&key)?;
            c.used = std::time::Instant::now();
            Some(c.conn.clone())
        });
        if let Some(conn) = cached.filter(|c| c.close_reason().is_none()) {
            return Ok(conn);
        }
        let connect_err = |e: &dyn std::fmt::Display| TransferError::Connect { addr, reason: e.to_string() };
        // The connection outlives this request (it is cached), so its driver task must not sit inside the
        // request's span (quinn instruments it with the current one): that would keep the request's trace open
        // for good. A fresh task has no current span.
        let (endpoint, name) = (self.endpoint.clone(), server_name.to_string());
        let config = self.config.read().unwrap_or_else(|p| p.into_inner()).to(addr);
        let conn = tokio::spawn(async move {
            match endpoint.connect_with(quinn::ClientConfig::clone(&config), addr, &name) {
                Ok(c) => c.await.map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            }
        })
        .await
        .map_err(|e| connect_err(&e))?
        .map_err(|e| connect_err(&e))?;
        if let Ok(mut m) = self.connections.lock() {
            m.retain(|_, c| c.conn.close_reason().is_none());
            if m.len() >= MAX_CONNECTIONS
                && let Some(oldest) = m.iter().min_by_key(|(_, c)| c.used).map(|(k, _)| k.clone())
            {
                m.remove(&oldest);
            }
            m.insert(key, Cached { conn: conn.clone(), used: std::time::Instant::now() });
        }
        Ok(conn)
    }

    /// Tells the owner the reader is done with `lease`, so it can unpin the blocks before the lease expires.
    pub async fn release(
        &self,
        addr: SocketAddr,
        server_name: &str,
        lease: LeaseId,
        timeout: Duration,
    ) -> Result<(), TransferError> {
        let work = async {
            let conn = self.connection(addr, server_name).await?;
            let (mut send, mut recv) = conn.open_bi().await.map_err(stream_err)?;
            let mut out = BytesMut::new();
            encode_release(lease, &mut out);
            send.write_all(&out).await.map_err(stream_err)?;
            send.finish().map_err(stream_err)?;
            let mut buf = BytesMut::new();
            match read_frame(&mut recv, &FrameDecoder::new(1024), &mut buf).await? {
                Some(Frame::Done) => Ok(()),
                Some(Frame::Error { code, message }) => Err(TransferError::Remote { code, message }),
                _ => Err(TransferError::Stream("unexpected answer to a release".into())),
            }
        };
        tokio::time::timeout(timeout, work).await.unwrap_or(Err(TransferError::Timeout(timeout)))
    }

    /// Pulls and verifies every requested block, each in one piece; all or nothing.
    pub async fn pull(&self, req: PullRequest<'_>) -> Result<Vec<(u32, Bytes)>, TransferError> {
        let gathered = self.pull_within(&req, Gather::Checked).await?;
        // Each block is one piece now: no copy.
        Ok(gathered.into_iter().map(|b| (b.index, b.contiguous(&mut BytesMut::new()))).collect())
    }

    /// Pulls every requested block and leaves each where it arrived (the decrypted packets it came in), checked
    /// against its descriptor (position, length, the owner's checksum) but not yet its content: the caller copies
    /// it to where it goes and checks it there ([`Arrived::copy_into`]), as the decode engine does into its KV
    /// blocks. All or nothing, in the order requested.
    pub async fn pull_in_place(&self, req: PullRequest<'_>) -> Result<Vec<Arrived>, TransferError> {
        self.pull_within(&req, Gather::InPlace).await
    }

    async fn pull_within(&self, req: &PullRequest<'_>, gather: Gather) -> Result<Vec<Arrived>, TransferError> {
        match tokio::time::timeout(req.timeout, self.pull_inner(req, gather)).await {
            Ok(r) => r,
            Err(_) => Err(TransferError::Timeout(req.timeout)),
        }
    }

    async fn pull_inner(&self, req: &PullRequest<'_>, gather: Gather) -> Result<Vec<Arrived>, TransferError> {
        let conn = self.connection(req.addr, req.server_name).await?;
        let streams = req.streams.clamp(1, req.blocks.len().max(1));
        let mut tasks = JoinSet::new();
        for s in 0..streams {
            let group: HashMap<u32, BlockDescriptor> =
                req.blocks.iter().skip(s).step_by(streams).map(|&(i, d)| (i, d)).collect();
            let read = ReadRequest {
                lease: req.lease,
                traceparent: req.traceparent.clone(),
                blocks: group.keys().copied().collect(),
            };
            let conn = conn.clone();
            tasks.spawn(async move { pull_stream(conn, read, group, gather).await });
        }
        let mut out = Vec::with_capacity(req.blocks.len());
        while let Some(joined) = tasks.join_next().await {
            out.extend(joined.map_err(stream_err)??);
        }
        let order: HashMap<u32, usize> = req.blocks.iter().enumerate().map(|(k, &(i, _))| (i, k)).collect();
        out.sort_by_key(|b| order.get(&b.index).copied());
        Ok(out)
    }
}

/// What a stream does with its blocks' bytes.
#[derive(Clone, Copy, Debug)]
enum Gather {
    /// Leaves them in the packets they arrived in, unchecked.
    InPlace,
    /// Gathers each block into one piece (of one buffer per stream) and checks its content there.
    Checked,
}

/// One stream of a pull: its blocks as they arrive, each checked against its descriptor (and gathered and checked
/// when asked).
async fn pull_stream(
    conn: quinn::Connection,
    read: ReadRequest,
    mut want: HashMap<u32, BlockDescriptor>,
    gather: Gather,
) -> Result<Vec<Arrived>, TransferError> {
    let (mut send, mut recv) = conn.open_bi().await.map_err(stream_err)?;
    let mut out = BytesMut::new();
    encode_read(&read, &mut out);
    send.write_all(&out).await.map_err(stream_err)?;
    send.finish().map_err(stream_err)?;
    let largest = want.values().map(|d| d.len as usize).max().unwrap_or(0);
    let mut reader = Reader::new(largest + BLOCK_HEADER);
    let total = want.len();
    let mut buf = match gather {
        Gather::InPlace => BytesMut::new(),
        Gather::Checked => BytesMut::with_capacity(want.values().map(|d| d.len as usize).sum()),
    };
    let mut got = Vec::with_capacity(total);
    let mut items = Vec::new();
    'stream: loop {
        let Some(chunk) = recv.read_chunk(usize::MAX, true).await.map_err(stream_err)? else {
            if !reader.at_boundary() {
                return Err(TransferError::Stream("the stream ended inside a frame".into()));
            }
            break;
        };
        reader.feed(chunk.bytes, &mut items)?;
        for item in items.drain(..) {
            match item {
                Item::Block(b) => {
                    let index = b.index;
                    let desc = want
                        .remove(&index)
                        .ok_or(TransferError::Integrity { index, what: "not requested, or sent twice" })?;
                    if b.len() as u64 != desc.len {
                        return Err(TransferError::Integrity { index, what: "wrong length" });
                    }
                    if b.checksum != desc.checksum {
                        return Err(TransferError::Integrity { index, what: "checksum mismatch" });
                    }
                    got.push(match gather {
                        Gather::InPlace => b,
                        Gather::Checked => {
                            let bytes = b.contiguous(&mut buf);
                            if checksum(&bytes) != desc.checksum {
                                return Err(TransferError::Integrity { index, what: "checksum mismatch" });
                            }
                            Arrived::whole(index, desc.checksum, bytes)
                        }
                    });
                }
                Item::Frame(Frame::Error { code, message }) => return Err(TransferError::Remote { code, message }),
                Item::Frame(Frame::Done) => break 'stream,
                Item::Frame(Frame::Block { .. } | Frame::Read(_) | Frame::Release(_)) => {
                    return Err(TransferError::Stream("the owner sent a reader's frame".into()));
                }
            }
        }
    }
    if !want.is_empty() {
        return Err(TransferError::Incomplete { got: got.len(), want: total });
    }
    Ok(got)
}
