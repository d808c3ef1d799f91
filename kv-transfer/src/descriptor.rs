//! What a worker publishes about its KV blocks, and what a reader checks before trusting a handle.

use kv_cache::SeqHash;

use crate::lease::LeaseId;

/// Element type of stored K/V.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvDtype {
    F16,
    F32,
}

/// Order of the dimensions inside one block, outermost first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvOrder {
    /// `[layer][k, v][kv_head][token][dim]`: Tandem's CPU layout.
    LayerKvHeadTokenDim,
}

/// The shape of every block a worker stores; two workers exchange blocks only when these are equal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvLayoutDesc {
    pub dtype: KvDtype,
    pub order: KvOrder,
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub block_tokens: u32,
}

impl KvLayoutDesc {
    /// Bytes in one block.
    pub fn block_bytes(&self) -> u64 {
        let elem = match self.dtype {
            KvDtype::F16 => 2,
            KvDtype::F32 => 4,
        };
        u64::from(self.layers)
            * 2
            * u64::from(self.kv_heads)
            * u64::from(self.block_tokens)
            * u64::from(self.head_dim)
            * elem
    }
}

/// A registered storage region of a worker (its device tier, say).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegionKey(pub u64);

/// Where one block of a handle lives on its owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockDescriptor {
    /// The block's prefix hash; `None` for the trailing partial block, which is never shared.
    pub seq_hash: Option<SeqHash>,
    pub region: RegionKey,
    pub offset: u64,
    pub len: u64,
    /// xxh3 of the block's bytes at the time the handle was made.
    pub checksum: u64,
}

/// Everything a decode worker needs to pull a prefilled prompt's KV from its owner.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvHandle {
    /// The owner's transfer endpoint (`host:port`).
    pub endpoint: String,
    pub lease: LeaseId,
    pub model_fingerprint: String,
    pub layout: KvLayoutDesc,
    /// Tokens whose KV the blocks hold (the prompt).
    pub tokens: u32,
    /// One per block, in position order: every full block, then the partial one if any.
    pub blocks: Vec<BlockDescriptor>,
    /// The owner's KV store in shared memory, holding the blocks at the descriptors' offsets (same-host readers
    /// take only its file name and open it in their own directory: `shm::store_in`).
    pub shm_region: Option<String>,
    /// The owner's host and shared-memory domain: a reader uses `shm_region` only when its own is the same.
    pub host_id: String,
    /// The name the endpoint's certificate carries, which the reader verifies (empty: the endpoint's address, as
    /// protocol version 1 did).
    pub server_name: String,
}

/// Why a handle cannot be used here, naming what differs.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HandleError {
    #[error("model fingerprint differs: the handle's is {theirs}, this worker's is {ours}")]
    Model { theirs: String, ours: String },
    #[error("KV layout differs in {field}: the handle's is {theirs}, this worker's is {ours}")]
    Layout { field: &'static str, theirs: String, ours: String },
    #[error("the handle holds {blocks} blocks for {tokens} tokens of {block_tokens} per block")]
    BlockCount { blocks: usize, tokens: u32, block_tokens: u32 },
    #[error("block {index} is {len} bytes; a block of this layout is {want}")]
    BlockLen { index: usize, len: u64, want: u64 },
    #[error("block {index} is a full block without a hash, or the partial block with one")]
    Naming { index: usize },
}

impl KvHandle {
    /// Checks that this worker (model `fingerprint`, `layout`) can use the handle's blocks as they are.
    pub fn check_compatible(&self, fingerprint: &str, layout: &KvLayoutDesc) -> Result<(), HandleError> {
        if self.model_fingerprint != fingerprint {
            return Err(HandleError::Model { theirs: self.model_fingerprint.clone(), ours: fingerprint.to_string() });
        }
        let theirs = &self.layout;
        let differ = |field: &'static str, a: String, b: String| Err(HandleError::Layout { field, theirs: a, ours: b });
        if theirs.dtype != layout.dtype {
            return differ("dtype", format!("{:?}", theirs.dtype), format!("{:?}", layout.dtype));
        }
        if theirs.order != layout.order {
            return differ("order", format!("{:?}", theirs.order), format!("{:?}", layout.order));
        }
        for (field, a, b) in [
            ("layers", theirs.layers, layout.layers),
            ("kv_heads", theirs.kv_heads, layout.kv_heads),
            ("head_dim", theirs.head_dim, layout.head_dim),
            ("block_tokens", theirs.block_tokens, layout.block_tokens),
        ] {
            if a != b {
                return differ(field, a.to_string(), b.to_string());
            }
        }
        let bt = layout.block_tokens.max(1);
        let full = (self.tokens / bt) as usize;
        let expected = self.tokens.div_ceil(bt) as usize;
        if self.blocks.len() != expected {
            return Err(HandleError::BlockCount { blocks: self.blocks.len(), tokens: self.tokens, block_tokens: bt });
        }
        let want = layout.block_bytes();
        for (index, b) in self.blocks.iter().enumerate() {
            if b.len != want {
                return Err(HandleError::BlockLen { index, len: b.len, want });
            }
            if b.seq_hash.is_some() != (index < full) {
                return Err(HandleError::Naming { index });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayoutDesc {
        KvLayoutDesc {
            dtype: KvDtype::F16,
            order: KvOrder::LayerKvHeadTokenDim,
            layers: 30,
            kv_heads: 3,
            head_dim: 64,
            block_tokens: 16,
        }
    }

    fn handle(tokens: u32) -> KvHandle {
        let l = layout();
        let full = tokens / 16;
        let blocks = (0..tokens.div_ceil(16))
            .map(|i| BlockDescriptor {
                seq_hash: (i < full).then_some(SeqHash(u64::from(i) + 1)),
                region: RegionKey(1),
                offset: u64::from(i) * l.block_bytes(),
                len: l.block_bytes(),
                checksum: 0,
            })
            .collect();
        KvHandle {
            endpoint: "127.0.0.1:9100".into(),
            lease: LeaseId(7),
            model_fingerprint: "m".into(),
            layout: l,
            tokens,
            blocks,
            shm_region: None,
            host_id: String::new(),
            server_name: String::new(),
        }
    }

    #[test]
    fn smollm2_blocks_are_368640_bytes() {
        assert_eq!(layout().block_bytes(), 368_640);
    }

    #[test]
    fn compatible_handles_pass_and_mismatches_are_named() {
        assert_eq!(handle(40).check_compatible("m", &layout()), Ok(()));
        assert_eq!(handle(32).check_compatible("m", &layout()), Ok(()));
        let err = handle(40).check_compatible("other", &layout()).expect_err("model");
        assert!(err.to_string().contains("model fingerprint"));
        let mut l = layout();
        l.kv_heads = 4;
        let err = handle(40).check_compatible("m", &l).expect_err("layout").to_string();
        assert!(err.contains("kv_heads") && err.contains('3') && err.contains('4'), "{err}");
        let mut l = layout();
        l.dtype = KvDtype::F32;
        assert!(handle(40).check_compatible("m", &l).expect_err("dtype").to_string().contains("dtype"));
        let mut h = handle(40);
        h.blocks.pop();
        assert!(matches!(h.check_compatible("m", &layout()), Err(HandleError::BlockCount { .. })));
        let mut h = handle(40);
        h.blocks[2].seq_hash = Some(SeqHash(9));
        assert_eq!(h.check_compatible("m", &layout()), Err(HandleError::Naming { index: 2 }));
    }
}
