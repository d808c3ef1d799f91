//! The paged KV store: fixed-size blocks of f16 K and V, one contiguous range per block.
//!
//! Layout of one block (published as part of a worker's identity, so a receiver can refuse another):
//! `[layer][k, v][kv_head][token_in_block][dim]`, f16, little-endian.

use std::sync::Arc;

use half::f16;

use crate::kv_memory::Values;
pub use crate::kv_memory::{Pinned, PinnedBlock, Unpinned};
use crate::model::ModelConfig;

/// Index of a block in a [`KvStore`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

/// Shape of a KV block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvLayout {
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_tokens: usize,
}

impl KvLayout {
    /// The layout for `config` with blocks of `block_tokens` tokens.
    pub fn for_model(config: &ModelConfig, block_tokens: usize) -> KvLayout {
        KvLayout { layers: config.n_layers, kv_heads: config.n_kv_heads, head_dim: config.head_dim, block_tokens }
    }

    /// f16 values in one (layer, k-or-v, head) slab of a block.
    pub fn head_elems(&self) -> usize {
        self.block_tokens * self.head_dim
    }

    /// f16 values in one block.
    pub fn block_elems(&self) -> usize {
        self.layers * 2 * self.kv_heads * self.head_elems()
    }

    /// Bytes in one block.
    pub fn block_bytes(&self) -> usize {
        self.block_elems() * 2
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_tokens)
    }

    fn head_offset(&self, layer: usize, kv: usize, head: usize) -> usize {
        ((layer * 2 + kv) * self.kv_heads + head) * self.head_elems()
    }
}

/// Which half of the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvPart {
    K = 0,
    V = 1,
}

/// Storage for `capacity` blocks. Its blocks can be pinned ([`KvStore::pin`]) for readers on other threads.
#[derive(Debug)]
pub struct KvStore {
    layout: KvLayout,
    data: Values,
    /// Blocks, kept apart from `data`: a layout of empty blocks (the simulator's) holds no data at all.
    capacity: usize,
    /// Per block, how many times it was handed out whole to be overwritten ([`KvStore::block_mut`]: imports,
    /// onboards): a device backend mirroring the store re-uploads a block whose generation moved.
    generations: Vec<u64>,
}

impl KvStore {
    /// Zeroed storage for `capacity` blocks, committed now: every page is written once here (as vLLM claims its
    /// KV cache at start), so a machine without the memory fails at start-up rather than mid-run, and the worker's
    /// resident memory does not creep up as blocks are first used (which would hide a real leak).
    pub fn new(layout: KvLayout, capacity: usize) -> KvStore {
        let data = Values::zeroed(capacity, layout.block_elems());
        KvStore { layout, data, capacity, generations: vec![0; capacity] }
    }

    /// [`KvStore::new`] in a new file at `path` (owner-only, meant for shared memory such as `/dev/shm`), mapped
    /// shared, so that other processes of the user on this host can map it and read pinned blocks where they lie.
    /// The file's pages are allocated now: a filesystem without the room refuses here. Removed when the store's
    /// memory goes (its last pin included).
    pub fn in_file(layout: KvLayout, capacity: usize, path: &std::path::Path) -> std::io::Result<KvStore> {
        let data = Values::in_file(path, capacity, layout.block_elems())?;
        Ok(KvStore { layout, data, capacity, generations: vec![0; capacity] })
    }

    /// The file the store lives in, when it was made with [`KvStore::in_file`].
    pub fn file(&self) -> Option<&std::path::Path> {
        self.data.file()
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Number of blocks.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    fn base(&self, block: BlockId) -> usize {
        block.0 as usize * self.layout.block_elems()
    }

    /// All tokens of one head's K or V in a block: `block_tokens × head_dim` values.
    pub fn head(&self, block: BlockId, layer: usize, part: KvPart, head: usize) -> &[f16] {
        let s = self.base(block) + self.layout.head_offset(layer, part as usize, head);
        self.data.read(s, self.layout.head_elems())
    }

    /// One whole block.
    pub fn block(&self, block: BlockId) -> &[f16] {
        self.data.read(self.base(block), self.layout.block_elems())
    }

    /// One whole block, to overwrite (its generation moves on). Panics when the block is pinned.
    pub fn block_mut(&mut self, block: BlockId) -> &mut [f16] {
        self.generations[block.0 as usize] += 1;
        let s = self.base(block);
        self.data.write(block.0 as usize, s, self.layout.block_elems())
    }

    /// Holds `blocks` for readers on any thread (a lease serving them): none is written until the pin is dropped,
    /// which hands the blocks to `unpinned`. The caller gives the pin one pool reference to each block, so the
    /// pool neither frees nor evicts them meanwhile; the engine drops those references when it takes them back.
    pub fn pin(&self, blocks: Vec<u32>, unpinned: Arc<Unpinned>) -> Pinned {
        self.data.pin(blocks, unpinned)
    }

    /// Whether a pin holds `block`.
    pub fn pinned(&self, block: BlockId) -> bool {
        self.data.pinned(block.0 as usize)
    }

    /// How many times `block` was handed out by [`KvStore::block_mut`]; [`KvStore::write`] leaves it alone.
    pub fn generation(&self, block: BlockId) -> u64 {
        self.generations[block.0 as usize]
    }

    /// Stores one token's K or V for one head.
    pub fn write(&mut self, block: BlockId, layer: usize, part: KvPart, head: usize, slot: usize, values: &[f32]) {
        let hd = self.layout.head_dim;
        let s = self.base(block) + self.layout.head_offset(layer, part as usize, head) + slot * hd;
        crate::kernels::f32_to_f16(&values[..hd], self.data.write(block.0 as usize, s, hd));
    }

    /// One whole block's values, without moving its generation: a GPU backend handing back the K/V its steps
    /// wrote into its own copy of the block, which that copy already holds.
    pub fn write_block_f16(&mut self, block: BlockId, values: &[f16]) {
        let s = self.base(block);
        self.data.write(block.0 as usize, s, self.layout.block_elems()).copy_from_slice(values);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_store_of_empty_blocks_still_has_its_blocks() {
        let layout = KvLayout { layers: 1, kv_heads: 1, head_dim: 0, block_tokens: 16 };
        let mut kv = KvStore::new(layout, 5);
        assert_eq!((kv.capacity(), layout.block_bytes()), (5, 0));
        assert!(kv.block(BlockId(4)).is_empty() && kv.block_mut(BlockId(4)).is_empty());
    }
}
