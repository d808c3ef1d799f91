//! An engine's KV event stream as the router reads it: bytes as a ZMTP frame, and as a MessagePack event batch
//! (vLLM's or SGLang's) translated into the router's blocks. Errors, never a panic, and never more engine blocks
//! remembered than the limit.
#![no_main]

use kv_cache::BlockSize;
use libfuzzer_sys::fuzz_target;
use router::external::events::chain::EngineBlocks;
use router::external::events::{wire, zmtp};

fuzz_target!(|data: &[u8]| {
    let _ = zmtp::decode_frame(data);
    let _ = zmtp::parse_ready(data);
    let Some((&size, payload)) = data.split_first() else { return };
    if let Ok(batch) = wire::decode(payload) {
        let mut blocks = EngineBlocks::new(BlockSize::new(u32::from(size % 32) + 1).expect("non-zero"), 256);
        for event in &batch.events {
            let _ = blocks.apply(event);
            assert!(blocks.len() <= 256);
        }
    }
});
