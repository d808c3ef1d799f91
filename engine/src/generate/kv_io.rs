//! KV blocks leaving and entering the engine: exporting a finished prompt's blocks (the prefill side of
//! disaggregation) and importing blocks pulled from another worker (the decode side), which then count as cached
//! prefix like any other.

use kv_cache::events::BlockMeta;
use kv_cache::pool::{PrefixMatch, Registered};
use kv_cache::{CacheNamespace, SeqHash, block_hashes};

use super::sequence::Seq;
use super::{Engine, EngineError};
use crate::kv::BlockId;

/// One exported block: its bytes (the engine's KV layout) and, for a full block, its identity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportedBlock {
    /// `None` for the trailing partial block.
    pub meta: Option<BlockMeta>,
    pub bytes: Vec<u8>,
}

/// The KV of a prompt: every block covering its tokens, in position order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportedKv {
    pub tokens: usize,
    pub blocks: Vec<ExportedBlock>,
}

impl Engine {
    /// Copies the KV of `s`'s prompt out of its blocks (call before they are released).
    pub(super) fn export(&self, s: &Seq) -> ExportedKv {
        let bt = self.config.block_tokens;
        let tokens = s.prompt_len.min(s.computed);
        let full = tokens / bt;
        let hashes = block_hashes(&s.tokens[..full * bt], self.block_size(), s.namespace.as_ref());
        let blocks = s.blocks[..tokens.div_ceil(bt).min(s.blocks.len())]
            .iter()
            .enumerate()
            .map(|(i, &b)| ExportedBlock {
                meta: (i < full).then(|| BlockMeta {
                    seq: hashes.seq[i],
                    local: hashes.local[i],
                    parent: i.checked_sub(1).map(|p| hashes.seq[p]),
                }),
                bytes: bytemuck::cast_slice(self.stores.device.block(b)).to_vec(),
            })
            .collect();
        ExportedKv { tokens, blocks }
    }

    /// How many of `hashes`' leading blocks this engine holds, per tier.
    pub fn lookup(&self, hashes: &[SeqHash]) -> PrefixMatch {
        self.pool.lookup(hashes)
    }

    /// Bytes in one KV block of this engine.
    pub fn block_bytes(&self) -> usize {
        self.stores.device.layout().block_bytes()
    }

    /// Stores full blocks pulled from another worker as cached blocks, so that a request with this prefix reuses
    /// them. `tokens` is the prompt (its full blocks name the imported ones); `blocks` gives bytes by block
    /// position. Blocks already held anywhere are skipped. Returns how many were stored.
    pub fn import(
        &mut self,
        tokens: &[u32],
        namespace: Option<&CacheNamespace>,
        blocks: &[(usize, &[u8])],
    ) -> Result<usize, EngineError> {
        let bt = self.config.block_tokens;
        let full = tokens.len() / bt;
        let hashes = block_hashes(&tokens[..full * bt], self.block_size(), namespace);
        let want = self.block_bytes();
        let mut stored = 0;
        for &(i, bytes) in blocks {
            if i >= full {
                return Err(EngineError::Config(format!(
                    "block {i} is not a full block of a {}-token prompt",
                    tokens.len()
                )));
            }
            if bytes.len() != want {
                return Err(EngineError::Config(format!(
                    "block {i} has {} bytes; this engine's blocks have {want}",
                    bytes.len()
                )));
            }
            let meta = BlockMeta {
                seq: hashes.seq[i],
                local: hashes.local[i],
                parent: i.checked_sub(1).map(|p| hashes.seq[p]),
            };
            if self.pool.find(meta.seq).is_some() {
                continue;
            }
            let mut actions = Vec::new();
            let slot = self.pool.allocate(&mut actions).map_err(EngineError::Pool)?;
            self.execute(&actions)?;
            let dst: &mut [u8] = bytemuck::cast_slice_mut(self.stores.device.block_mut(BlockId(slot)));
            dst.copy_from_slice(bytes);
            if self.pool.register(slot, meta).map_err(EngineError::Pool)? == Registered::New {
                stored += 1;
            }
            self.pool.release(slot).map_err(EngineError::Pool)?;
        }
        self.counters.imported_blocks += stored as u64;
        Ok(stored)
    }
}
