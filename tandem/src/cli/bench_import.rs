//! `tandem bench transfer`'s last part: the decode worker's whole shared-memory path, into a real engine. The same
//! prompt-sized run of blocks is imported by the engine the way the worker hands them over: straight from the
//! owner's mapped region (each block copied into a fresh KV block and checked there, what the worker does), and
//! copied out into fresh buffers and checked first, then imported (what it did before). Both include the block
//! pool's work (allocation, eviction, registration), so they are comparable with each other and, as throughput,
//! with the plain socket of the same run.

use std::num::NonZeroU32;
use std::path::Path;
use std::time::{Duration, Instant};

use bytes::Bytes;
use engine::generate::{Engine, EngineConfig, Request, Stepper};
use kv_transfer::bench::TransportFigure;
use kv_transfer::descriptor::{BlockDescriptor, RegionKey};
use kv_transfer::lease::LeaseId;
use worker::pull::Pulled;

/// Imports about `total` bytes of blocks `runs` times each way; the best of each.
pub fn measure(model: &Path, total: usize, runs: usize) -> Result<Vec<TransportFigure>, String> {
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

    let (mut mapped_best, mut copied_best) = (Duration::MAX, Duration::MAX);
    for run in 0..2 * runs.max(1) {
        // A prompt of its own per import (its blocks are new to the engine), one token past its full blocks.
        let prompt: Vec<u32> = (0..n * bt + 1).map(|t| 1000 + ((t * 7 + run * 131) % 30_000) as u32).collect();
        let request = Request::greedy(prompt, NonZeroU32::MIN);
        // Alternate which way goes first.
        let mapped = (run % 2 == 0) == (run / 2 % 2 == 0);
        let started = Instant::now();
        let pulled = if mapped {
            Pulled::mapped(kv_transfer::shm::MappedBlocks::open(region.path(), &descs).map_err(display)?)
        } else {
            let copied = kv_transfer::shm::pull(region.path(), &descs).map_err(display)?;
            Pulled::Received(copied.into_iter().map(|(i, b)| (i as usize, b)).collect())
        };
        stepper.submit(run as u64, &request, false, &pulled).map_err(display)?;
        let took = started.elapsed();
        let imported = stepper.engine().counters().imported_blocks;
        stepper.cancel(run as u64);
        if imported != ((run + 1) * n) as u64 {
            return Err(format!("import {run}: {imported} blocks imported in all, expected {}", (run + 1) * n));
        }
        let best = if mapped { &mut mapped_best } else { &mut copied_best };
        *best = (*best).min(took);
    }
    drop(region);
    let bytes = n * block_bytes;
    Ok(vec![
        kv_transfer::bench::figure("shm_into_engine", bytes, mapped_best),
        kv_transfer::bench::figure("shm_copied_then_engine", bytes, copied_best),
    ])
}

fn display(e: impl std::fmt::Display) -> String {
    e.to_string()
}
