//! The QUIC transport on loopback with real TLS: blocks arrive intact over parallel streams; a peer with a
//! certificate from another CA can neither pull nor serve; unknown leases, corrupt and truncated blocks are
//! errors and yield nothing; a silent endpoint times out.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use kv_cache::SeqHash;
use kv_transfer::checksum;
use kv_transfer::descriptor::{BlockDescriptor, RegionKey};
use kv_transfer::frame::ErrorCode;
use kv_transfer::lease::LeaseId;
use kv_transfer::quic::{BlockSource, PullRequest, QuicClient, QuicServer, TransferError};
use kv_transfer::tls::{DevCa, Identity};

const BLOCK: usize = 368_640;

/// Blocks by lease, with a fault to inject and a count of reads served.
#[derive(Default)]
struct Source {
    leases: Mutex<HashMap<LeaseId, Vec<Bytes>>>,
    corrupt: Mutex<Option<u32>>,
    truncate: Mutex<Option<u32>>,
    reads: AtomicUsize,
}

impl BlockSource for Source {
    fn read(&self, lease: LeaseId, index: u32) -> Result<(u64, Bytes), (ErrorCode, String)> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        let leases = self.leases.lock().map_err(|_| (ErrorCode::Internal, "poisoned".to_string()))?;
        let blocks = leases.get(&lease).ok_or((ErrorCode::LeaseNotFound, format!("no lease {:x}", lease.0)))?;
        let block = blocks.get(index as usize).cloned().ok_or((ErrorCode::BadRequest, "no such block".to_string()))?;
        let sum = checksum(&block);
        let mut bytes = block.to_vec();
        if *self.corrupt.lock().map_err(|_| (ErrorCode::Internal, String::new()))? == Some(index) {
            bytes[1000] ^= 0x40;
        }
        if *self.truncate.lock().map_err(|_| (ErrorCode::Internal, String::new()))? == Some(index) {
            bytes.truncate(BLOCK / 2);
        }
        Ok((sum, Bytes::from(bytes)))
    }
}

fn blocks(n: usize) -> Vec<Bytes> {
    (0..n).map(|b| Bytes::from((0..BLOCK).map(|i| ((i * 31 + b * 7) % 251) as u8).collect::<Vec<u8>>())).collect()
}

fn descriptors(blocks: &[Bytes]) -> Vec<(u32, BlockDescriptor)> {
    blocks
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let d = BlockDescriptor {
                seq_hash: Some(SeqHash(i as u64)),
                region: RegionKey(0),
                offset: (i * BLOCK) as u64,
                len: BLOCK as u64,
                checksum: checksum(b),
            };
            (i as u32, d)
        })
        .collect()
}

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

struct Cluster {
    server: QuicServer,
    source: Arc<Source>,
    client: QuicClient,
    data: Vec<Bytes>,
}

fn cluster(server_id: &Identity, client_id: &Identity) -> Cluster {
    let data = blocks(8);
    let source = Arc::new(Source::default());
    source.leases.lock().expect("lock").insert(LeaseId(42), data.clone());
    let server = QuicServer::bind(loopback(), server_id, Arc::clone(&source) as Arc<dyn BlockSource>).expect("binds");
    let client = QuicClient::new(client_id, loopback()).expect("client");
    Cluster { server, source, client, data }
}

fn request<'a>(c: &Cluster, blocks: &'a [(u32, BlockDescriptor)], lease: u128) -> PullRequest<'a> {
    PullRequest {
        addr: c.server.local_addr().expect("addr"),
        server_name: "localhost",
        lease: LeaseId(lease),
        blocks,
        streams: 3,
        timeout: Duration::from_secs(10),
        traceparent: Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into()),
    }
}

#[tokio::test]
async fn blocks_arrive_intact_over_parallel_streams() {
    let ca = DevCa::generate().expect("ca");
    let c = cluster(&ca.issue("prefill-0", &[]).expect("cert"), &ca.issue("decode-0", &[]).expect("cert"));
    let want = descriptors(&c.data);
    // Only some blocks: the reader already holds the others.
    let subset: Vec<_> = want.iter().copied().filter(|(i, _)| i % 3 != 0).collect();
    let got = c.client.pull(request(&c, &subset, 42)).await.expect("pulls");
    assert_eq!(got.len(), subset.len());
    for (i, bytes) in got {
        assert_eq!(bytes, c.data[i as usize], "block {i}");
    }
    assert_eq!(c.source.reads.load(Ordering::Relaxed), subset.len(), "only the missing blocks were read");
    c.server.close().await;
}

/// Bulk blocks on loopback travel in large datagrams. Before, every datagram was at most 1,200 bytes: peers
/// advertised quinn's 1,472-byte payload limit, and once that was raised, offload batches of large datagrams were
/// refused by the kernel, taken for a black hole, and MTU discovery fell back to the minimum.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_transfers_use_large_datagrams() {
    let ca = DevCa::generate().expect("ca");
    let data = blocks(32);
    let source = Arc::new(Source::default());
    source.leases.lock().expect("lock").insert(LeaseId(42), data.clone());
    let id = ca.issue("prefill-0", &[]).expect("cert");
    let server = QuicServer::bind(loopback(), &id, Arc::clone(&source) as Arc<dyn BlockSource>).expect("binds");
    let client = QuicClient::new(&ca.issue("decode-0", &[]).expect("cert"), loopback()).expect("client");
    let c = Cluster { server, source, client, data };
    let want = descriptors(&c.data);
    for _ in 0..2 {
        let got = c.client.pull(request(&c, &want, 42)).await.expect("pulls");
        assert!(got.iter().all(|(i, b)| *b == c.data[*i as usize]));
    }
    let (datagrams, bytes) = c.client.received();
    assert!(bytes >= 2 * (32 * BLOCK) as u64, "{bytes} bytes");
    let mean = bytes / datagrams.max(1);
    assert!(mean > 8_000, "{datagrams} datagrams of {mean} bytes on average");
    c.server.close().await;
}

#[tokio::test]
async fn a_peer_from_another_ca_can_neither_pull_nor_serve() {
    let ours = DevCa::generate().expect("ca");
    let theirs = DevCa::generate().expect("ca");
    let c = cluster(&ours.issue("prefill-0", &[]).expect("cert"), &theirs.issue("intruder", &[]).expect("cert"));
    let want = descriptors(&c.data);
    let err = c.client.pull(request(&c, &want, 42)).await.expect_err("refused");
    assert!(matches!(err, TransferError::Connect { .. } | TransferError::Stream(_)), "{err}");
    assert_eq!(c.source.reads.load(Ordering::Relaxed), 0, "not a single block was read");
    c.server.close().await;
    // And a reader of our CA does not trust an owner from theirs.
    let c = cluster(&theirs.issue("rogue-owner", &[]).expect("cert"), &ours.issue("decode-0", &[]).expect("cert"));
    let err = c.client.pull(request(&c, &want, 42)).await.expect_err("refused");
    assert!(matches!(err, TransferError::Connect { .. } | TransferError::Stream(_)), "{err}");
    c.server.close().await;
}

#[tokio::test]
async fn unknown_leases_and_damaged_blocks_are_errors_that_yield_nothing() {
    let ca = DevCa::generate().expect("ca");
    let c = cluster(&ca.issue("prefill-0", &[]).expect("cert"), &ca.issue("decode-0", &[]).expect("cert"));
    let want = descriptors(&c.data);
    let err = c.client.pull(request(&c, &want, 7)).await.expect_err("no such lease");
    assert!(matches!(err, TransferError::Remote { code: ErrorCode::LeaseNotFound, .. }), "{err}");
    *c.source.corrupt.lock().expect("lock") = Some(5);
    let err = c.client.pull(request(&c, &want, 42)).await.expect_err("corrupt");
    assert!(matches!(err, TransferError::Integrity { index: 5, what: "checksum mismatch" }), "{err}");
    *c.source.corrupt.lock().expect("lock") = None;
    *c.source.truncate.lock().expect("lock") = Some(2);
    let err = c.client.pull(request(&c, &want, 42)).await.expect_err("truncated");
    assert!(matches!(err, TransferError::Integrity { index: 2, what: "wrong length" }), "{err}");
    *c.source.truncate.lock().expect("lock") = None;
    // A descriptor whose checksum does not match what the owner has.
    let mut wrong = want.clone();
    wrong[1].1.checksum ^= 1;
    assert!(matches!(c.client.pull(request(&c, &wrong, 42)).await, Err(TransferError::Integrity { index: 1, .. })));
    // After all that, a clean pull still works on the same connection machinery.
    assert_eq!(c.client.pull(request(&c, &want, 42)).await.expect("pulls").len(), 8);
    c.server.close().await;
}

/// Blocks left where they arrived are checked in the caller's copy: a damaged one fails there, the rest pass, and
/// the order is the request's.
#[tokio::test]
async fn blocks_pulled_in_place_are_checked_in_the_copy() {
    let ca = DevCa::generate().expect("ca");
    let c = cluster(&ca.issue("prefill-0", &[]).expect("cert"), &ca.issue("decode-0", &[]).expect("cert"));
    let mut want = descriptors(&c.data);
    want.reverse();
    *c.source.corrupt.lock().expect("lock") = Some(5);
    let arrived = c.client.pull_in_place(request(&c, &want, 42)).await.expect("arrives: the content is unchecked");
    assert_eq!(arrived.iter().map(|b| b.index).collect::<Vec<_>>(), want.iter().map(|(i, _)| *i).collect::<Vec<_>>());
    for b in &arrived {
        let mut copy = vec![0u8; BLOCK];
        match b.index {
            5 => assert_eq!(b.copy_into(&mut copy), Err("checksum mismatch")),
            i => {
                assert_eq!(b.copy_into(&mut copy), Ok(()));
                assert_eq!(copy, c.data[i as usize]);
            }
        }
    }
    // A block shorter than its descriptor never arrives.
    *c.source.corrupt.lock().expect("lock") = None;
    *c.source.truncate.lock().expect("lock") = Some(2);
    let err = c.client.pull_in_place(request(&c, &want, 42)).await.expect_err("truncated");
    assert!(matches!(err, TransferError::Integrity { index: 2, what: "wrong length" }), "{err}");
    c.server.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn injected_faults_are_caught_through_the_transport_trait() {
    use kv_transfer::Transport;
    use kv_transfer::fault::{Fault, FaultySource};
    let ca = DevCa::generate().expect("ca");
    let data = blocks(6);
    let inner = Source::default();
    inner.leases.lock().expect("lock").insert(LeaseId(42), data.clone());
    let source = Arc::new(FaultySource::new(inner));
    let server = QuicServer::bind(
        loopback(),
        &ca.issue("prefill-0", &[]).expect("cert"),
        Arc::clone(&source) as Arc<dyn BlockSource>,
    )
    .expect("binds");
    let client = QuicClient::new(&ca.issue("decode-0", &[]).expect("cert"), loopback()).expect("client");
    let transport: &dyn Transport = &client;
    assert_eq!(transport.name(), "quic");
    let want = descriptors(&data);
    let req = |timeout| PullRequest {
        addr: server.local_addr().expect("addr"),
        server_name: "localhost",
        lease: LeaseId(42),
        blocks: &want,
        streams: 2,
        timeout,
        traceparent: None,
    };
    let cases = [
        (Fault::Drop, "refused"),
        (Fault::Truncate, "wrong length"),
        (Fault::Corrupt, "checksum mismatch"),
        (Fault::Delay(Duration::from_millis(800)), "timeout"),
    ];
    for (fault, what) in cases {
        source.inject(3, fault);
        let err = transport.pull(req(Duration::from_millis(400))).await.expect_err(what);
        let ok = match fault {
            Fault::Drop => matches!(err, TransferError::Remote { code: ErrorCode::Internal, .. }),
            Fault::Truncate | Fault::Corrupt => matches!(err, TransferError::Integrity { index: 3, .. }),
            Fault::Delay(_) => matches!(err, TransferError::Timeout(_)),
        };
        assert!(ok, "{fault:?}: {err}");
        source.heal();
    }
    let got = transport.pull(req(Duration::from_secs(10))).await.expect("healed");
    assert_eq!(got.into_iter().map(|(_, b)| b).collect::<Vec<_>>(), data);
    server.close().await;
}

#[tokio::test]
async fn a_silent_endpoint_times_out() {
    let ca = DevCa::generate().expect("ca");
    let id = ca.issue("decode-0", &[]).expect("cert");
    let client = QuicClient::new(&id, loopback()).expect("client");
    // A UDP socket that never answers.
    let silent = std::net::UdpSocket::bind(loopback()).expect("bind");
    let blocks = descriptors(&blocks(1));
    let req = PullRequest {
        addr: silent.local_addr().expect("addr"),
        server_name: "localhost",
        lease: LeaseId(1),
        blocks: &blocks,
        streams: 1,
        timeout: Duration::from_millis(500),
        traceparent: None,
    };
    let started = std::time::Instant::now();
    let err = client.pull(req).await.expect_err("times out");
    assert!(matches!(err, TransferError::Timeout(_)), "{err}");
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn certificates_round_trip_through_pem_files() {
    let dir = std::env::temp_dir().join(format!("tandem-certs-{}", std::process::id()));
    let ca = DevCa::generate().expect("ca");
    ca.write(&dir).expect("ca written");
    let id = ca.issue("router", &["router.tandem.svc".to_string()]).expect("cert");
    id.write(&dir, "router").expect("written");
    let back =
        Identity::from_pem_files(&dir.join("ca.pem"), &dir.join("router.pem"), &dir.join("router.key")).expect("reads");
    assert_eq!(back.chain, id.chain);
    assert_eq!(back.ca, id.ca);
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(dir.join("router.key")).expect("meta").permissions().mode();
    assert_eq!(mode & 0o077, 0, "private keys are owner-only");
    let err = Identity::from_pem_files(&dir.join("missing.pem"), &dir.join("router.pem"), &dir.join("router.key"));
    assert!(err.expect_err("missing").to_string().contains("missing.pem"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn connections_to_owners_that_went_away_are_not_kept() {
    let ca = DevCa::generate().expect("ca");
    let reader = ca.issue("decode-0", &[]).expect("cert");
    let client = QuicClient::new(&reader, loopback()).expect("client");
    // Owners come and go: each is pulled from once, then shuts down.
    for i in 0..5 {
        let c = cluster(&ca.issue(&format!("prefill-{i}"), &[]).expect("cert"), &reader);
        let want = descriptors(&c.data);
        let req = PullRequest { addr: c.server.local_addr().expect("addr"), ..request(&c, &want[..1], 42) };
        client.pull(req).await.expect("pulls");
        c.server.close().await;
    }
    // Every pull made a new connection and dropped the closed ones: only the last owner's may still be listed.
    assert!(client.cached_connections() <= 1, "{} connections kept", client.cached_connections());
}
