//! Transfer throughput on loopback: the same bytes over the QUIC transport (mutual TLS, parallel streams, every
//! block verified) and over a plain TCP socket (no TLS, no framing, no checks) as the baseline.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::checksum;
use crate::descriptor::{BlockDescriptor, RegionKey};
use crate::frame::ErrorCode;
use crate::lease::LeaseId;
use crate::quic::{BlockSource, PullRequest, QuicClient, QuicServer, TransferError};
use crate::tls::DevCa;

/// One transport's result.
#[derive(Clone, Debug, Serialize)]
pub struct TransportFigure {
    pub transport: &'static str,
    /// Best of the runs, in gigabytes (10^9 bytes) per second.
    pub gb_per_s: f64,
    pub best_ms: f64,
}

/// The whole comparison.
#[derive(Clone, Debug, Serialize)]
pub struct TransferReport {
    pub bytes: usize,
    pub blocks: usize,
    pub block_bytes: usize,
    pub streams: usize,
    pub runs: usize,
    pub transports: Vec<TransportFigure>,
    /// QUIC throughput as a fraction of raw TCP's.
    pub quic_vs_tcp: f64,
    /// Shared memory's throughput (into a reused buffer, as TCP's reader) as a fraction of raw TCP's.
    pub shm_vs_tcp: f64,
    /// The decode worker's whole shared-memory path into a real engine (`shm_into_engine`, measured by the
    /// caller, which has an engine) as a fraction of raw TCP's.
    pub shm_into_engine_vs_tcp: Option<f64>,
    /// The decode worker's whole QUIC path into a real engine (`quic_into_engine`), the same way.
    pub quic_into_engine_vs_tcp: Option<f64>,
}

/// Blocks with their checksums, taken once when they were leased, as a worker's leases keep them: what the
/// benchmarks' QUIC servers serve.
pub struct LeasedBlocks(Vec<(u64, Bytes)>);

impl LeasedBlocks {
    pub fn new(blocks: &[Bytes]) -> LeasedBlocks {
        LeasedBlocks(blocks.iter().map(|b| (checksum(b), b.clone())).collect())
    }

    /// Descriptors of every block, by position (`offset` as if laid out back to back).
    pub fn descriptors(&self) -> Vec<(u32, BlockDescriptor)> {
        let mut offset = 0;
        (0u32..)
            .zip(&self.0)
            .map(|(i, (sum, b))| {
                let len = b.len() as u64;
                let d = BlockDescriptor { seq_hash: None, region: RegionKey(0), offset, len, checksum: *sum };
                offset += len;
                (i, d)
            })
            .collect()
    }
}

impl BlockSource for LeasedBlocks {
    fn read(&self, _lease: LeaseId, index: u32) -> Result<(u64, Bytes), (ErrorCode, String)> {
        self.0.get(index as usize).cloned().ok_or((ErrorCode::BadRequest, "no such block".to_string()))
    }
}

/// `bytes` moved in `best`.
pub fn figure(transport: &'static str, bytes: usize, best: Duration) -> TransportFigure {
    TransportFigure { transport, gb_per_s: bytes as f64 / best.as_secs_f64() / 1e9, best_ms: best.as_secs_f64() * 1e3 }
}

/// Moves `total` bytes in blocks of `block_bytes` over each transport `runs` times; keeps each one's best.
pub async fn run(
    total: usize,
    block_bytes: usize,
    streams: usize,
    runs: usize,
) -> Result<TransferReport, TransferError> {
    let n = total.div_ceil(block_bytes).max(1);
    let data: Vec<Bytes> = (0..n)
        .map(|b| {
            Bytes::from(
                (0..block_bytes).map(|i| (i as u32 ^ b as u32).wrapping_mul(2_654_435_761) as u8).collect::<Vec<u8>>(),
            )
        })
        .collect();
    let bytes = n * block_bytes;
    let loopback = SocketAddr::from(([127, 0, 0, 1], 0));

    let ca = DevCa::generate()?;
    let leased = LeasedBlocks::new(&data);
    let descriptors = leased.descriptors();
    let server = QuicServer::bind(loopback, &ca.issue("owner", &[])?, Arc::new(leased))?;
    let client = QuicClient::new(&ca.issue("reader", &[])?, loopback)?;
    let mut quic_best = Duration::MAX;
    for _ in 0..runs.max(1) {
        let req = PullRequest {
            addr: server.local_addr()?,
            server_name: "localhost",
            lease: LeaseId(1),
            blocks: &descriptors,
            streams,
            timeout: Duration::from_secs(120),
            traceparent: None,
        };
        let t = Instant::now();
        let got = client.pull(req).await?;
        quic_best = quic_best.min(t.elapsed());
        if got.len() != n {
            return Err(TransferError::Incomplete { got: got.len(), want: n });
        }
    }
    server.close().await;

    // Raw TCP: the server writes the same blocks back to back; the client reads them into one buffer.
    let listener = tokio::net::TcpListener::bind(loopback).await?;
    let addr = listener.local_addr()?;
    let payload = data.clone();
    let serve = tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let mut ask = [0u8; 1];
            if sock.read_exact(&mut ask).await.is_err() {
                continue;
            }
            for b in &payload {
                if sock.write_all(b).await.is_err() {
                    break;
                }
            }
        }
    });
    let mut buf = vec![0u8; bytes];
    let mut tcp_best = Duration::MAX;
    for _ in 0..runs.max(1) {
        let t = Instant::now();
        let mut sock = tokio::net::TcpStream::connect(addr).await?;
        sock.write_all(&[1]).await?;
        sock.read_exact(&mut buf).await?;
        tcp_best = tcp_best.min(t.elapsed());
    }
    serve.abort();

    // Shared memory: the owner's region written once; each run maps it and copies every block out, checking each
    // copy: into one buffer reused across runs, as the TCP reader's is (`shm::pull_into`: what the decode worker's
    // path costs, its engine copying each mapped block into a warm KV block and checking it there), and into
    // fresh memory (`shm::pull`, the worker's path before the engine read mapped blocks itself).
    let dir = std::path::Path::new(crate::shm::DEFAULT_DIR);
    let dir = if dir.is_dir() { dir.to_path_buf() } else { std::env::temp_dir() };
    let owner = crate::shm::ShmDir::open(&dir, &format!("bench{}", std::process::id()))?;
    let (region, offsets) = owner.create_region(LeaseId(0xbe4c), &data)?;
    let shm_descs: Vec<(u32, BlockDescriptor)> =
        descriptors.iter().zip(&offsets).map(|(&(i, d), &offset)| (i, BlockDescriptor { offset, ..d })).collect();
    let (mut fresh_best, mut shm_best) = (Duration::MAX, Duration::MAX);
    let mut reused = Vec::new();
    for _ in 0..runs.max(1) {
        let t = Instant::now();
        let got = crate::shm::pull(region.path(), &shm_descs)?.len();
        fresh_best = fresh_best.min(t.elapsed());
        let t = Instant::now();
        let into = crate::shm::pull_into(region.path(), &shm_descs, &mut reused)?.len();
        shm_best = shm_best.min(t.elapsed());
        if let Some(got) = [got, into].into_iter().find(|&g| g != n) {
            return Err(TransferError::Incomplete { got, want: n });
        }
    }
    drop(region);

    let quic = figure("quic", bytes, quic_best);
    let tcp = figure("tcp", bytes, tcp_best);
    let shm = figure("shm", bytes, shm_best);
    let shm_fresh = figure("shm_fresh_buffers", bytes, fresh_best);
    Ok(TransferReport {
        bytes,
        blocks: n,
        block_bytes,
        streams,
        runs,
        quic_vs_tcp: quic.gb_per_s / tcp.gb_per_s,
        shm_vs_tcp: shm.gb_per_s / tcp.gb_per_s,
        shm_into_engine_vs_tcp: None,
        quic_into_engine_vs_tcp: None,
        transports: vec![quic, shm, shm_fresh, tcp],
    })
}
