//! `tandem bench transfer`'s last part: the decode worker's whole paths, into a real engine. The same prompt-sized
//! run of blocks is imported by the engine the way the worker hands them over: straight from the owner's mapped
//! region (kept mapped across imports, each block copied into a fresh KV block and checked there: what the worker
//! does on one host), copied out into fresh buffers and checked first, then imported (what it did before); pulled
//! over QUIC on loopback and copied by the engine from the packets they arrived in (what the worker does across
//! hosts), and gathered into buffers and checked first, then imported (before). All include the block pool's work
//! (allocation, eviction, registration), so they are comparable with each other and, as throughput, with the plain
//! socket of the same run.

use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use engine::generate::{Engine, EngineConfig, Request, Stepper};
use kv_transfer::bench::{LeasedBlocks, TransportFigure};
use kv_transfer::descriptor::{BlockDescriptor, RegionKey};
use kv_transfer::lease::LeaseId;
use kv_transfer::quic::{PullRequest, QuicClient, QuicServer};
use worker::pull::Pulled;

/// The ways blocks reach the engine, in the order of the figures.
const WAYS: [&str; 4] = ["shm_into_engine", "shm_copied_then_engine", "quic_into_engine", "quic_gathered_then_engine"];

/// Imports about `total` bytes of blocks `runs` times each way, the QUIC pulls on `runtime`; the best of each.
pub fn measure(
    runtime: &tokio::runtime::Runtime,
    model: &Path,
    total: usize,
    runs: usize,
) -> Result<Vec<TransportFigure>, String> {
    let bt = EngineConfig::default().block_tokens;
    let small = EngineConfig { kv_blocks: 1, max_model_len: Some(bt), ..EngineConfig::default() };
    let block_bytes = Engine::open(model, small).map_err(display)?.block_bytes();
    let n = (total / block_bytes).max(1);
    // Room for one import and a few blocks more: every later import evicts the one before, as a busy worker does.
    let config =
        EngineConfig { kv_blocks: n + 8, host_blocks: 0, max_model_len: Some((n + 1) * bt), ..EngineConfig::default() };
    let mut stepper = Stepper::new(Engine::open(model, config).map_err(display)?);

    let dir = Path::new(kv_transfer::shm::DEFAULT_DIR);
    let dir = if dir.is_dir() { dir.to_path_buf() } else { std::env::temp_dir() };
    let owner = kv_transfer::shm::ShmDir::open(&dir, &format!("import{}", std::process::id())).map_err(display)?;
    let data: Vec<Bytes> =
        (0..n).map(|i| Bytes::from((0..block_bytes).map(|j| (i * 31 + j * 7) as u8).collect::<Vec<u8>>())).collect();
    let (region, offsets) = owner.create_region(LeaseId(0x1a9), &data).map_err(display)?;
    let descs: Vec<(u32, BlockDescriptor)> = (0u32..)
        .zip(offsets.iter().zip(&data))
        .map(|(i, (&offset, b))| {
            let checksum = kv_transfer::checksum(b);
            (i, BlockDescriptor { seq_hash: None, region: RegionKey(0), offset, len: b.len() as u64, checksum })
        })
        .collect();

    let _entered = runtime.enter();
    let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
    let ca = kv_transfer::tls::DevCa::generate().map_err(display)?;
    let leased = LeasedBlocks::new(&data);
    let quic_descs = leased.descriptors();
    let server =
        QuicServer::bind(loopback, &ca.issue("owner", &[]).map_err(display)?, Arc::new(leased)).map_err(display)?;
    let client = QuicClient::new(&ca.issue("reader", &[]).map_err(display)?, loopback).map_err(display)?;
    let request = |addr| PullRequest {
        addr,
        server_name: "localhost",
        lease: LeaseId(0x1a9),
        blocks: &quic_descs,
        streams: 4,
        timeout: Duration::from_secs(120),
        traceparent: None,
    };
    let addr = server.local_addr().map_err(display)?;

    // The file stays mapped from one import to the next, as the worker keeps an owner's store mapped.
    let stores = kv_transfer::shm::StoreMaps::default();
    let mut best = [Duration::MAX; WAYS.len()];
    for run in 0..WAYS.len() * runs.max(1) {
        // A prompt of its own per import (its blocks are new to the engine), one token past its full blocks.
        let prompt: Vec<u32> = (0..n * bt + 1).map(|t| 1000 + ((t * 7 + run * 131) % 30_000) as u32).collect();
        let request_tokens = Request::greedy(prompt, NonZeroU32::MIN);
        // Each round takes the ways in another order.
        let way = (run + run / WAYS.len()) % WAYS.len();
        let started = Instant::now();
        let pulled = match way {
            0 => Pulled::mapped(stores.blocks(region.path(), &descs).map_err(display)?),
            1 => Pulled::received(kv_transfer::shm::pull(region.path(), &descs).map_err(display)?),
            2 => {
                Pulled::Arrived(runtime.block_on(client.pull_in_place(request(addr))).map_err(display)?, Arc::default())
            }
            _ => Pulled::received(runtime.block_on(client.pull(request(addr))).map_err(display)?),
        };
        stepper.submit(run as u64, request_tokens, false, &pulled).map_err(display)?;
        let took = started.elapsed();
        drop(pulled);
        let imported = stepper.engine().counters().imported_blocks;
        stepper.cancel(run as u64);
        if imported != ((run + 1) * n) as u64 {
            return Err(format!("import {run}: {imported} blocks imported in all, expected {}", (run + 1) * n));
        }
        best[way] = best[way].min(took);
    }
    drop(region);
    runtime.block_on(server.close());
    let bytes = n * block_bytes;
    Ok(WAYS.iter().zip(best).map(|(way, best)| kv_transfer::bench::figure(way, bytes, best)).collect())
}

fn display(e: impl std::fmt::Display) -> String {
    e.to_string()
}
