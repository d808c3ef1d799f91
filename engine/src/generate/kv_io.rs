//! KV blocks leaving and entering the engine: exporting a finished prompt's blocks (the prefill side of
//! disaggregation) and importing blocks pulled from another worker (the decode side), which then count as cached
//! prefix like any other.

use std::sync::Arc;

use kv_cache::SeqHash;
use kv_cache::events::BlockMeta;
use kv_cache::pool::{LOOK_AHEAD, PoolError, PrefixMatch, Registered};

use super::sequence::Seq;
use super::{Engine, EngineError};
use crate::kv::{BlockId, Pinned, PinnedBlock};

/// The KV of a prompt: every block covering its tokens, in position order, **pinned** where it lies in the
/// exporting engine's KV store (no copy): the blocks stay held (neither written, freed nor evicted) until the last
/// clone of this, and the last slice made by [`ExportedKv::shared_block`], is dropped; then the engine takes them
/// back. Readable from any thread.
#[derive(Clone, Debug)]
pub struct ExportedKv {
    pub tokens: usize,
    /// Each block's identity; `None` for the trailing partial block.
    pub metas: Vec<Option<BlockMeta>>,
    blocks: Arc<Pinned>,
}

impl ExportedKv {
    /// Blocks exported.
    pub fn len(&self) -> usize {
        self.metas.len()
    }

    pub fn is_empty(&self) -> bool {
        self.metas.is_empty()
    }

    /// The bytes of block `i`.
    pub fn block(&self, i: usize) -> &[u8] {
        self.blocks.block(i)
    }

    /// Where block `i` starts in the exporting engine's device store, in bytes: its offset in the store's file when
    /// the store lives in one ([`Engine::device_file`]).
    pub fn offset(&self, i: usize) -> u64 {
        self.blocks.offset(i)
    }

    /// Block `i` as shared bytes that keep the pin for as long as they live (what a lease serves).
    pub fn shared_block(&self, i: usize) -> bytes::Bytes {
        assert!(i < self.blocks.len(), "block {i} of {}", self.blocks.len());
        bytes::Bytes::from_owner(PinnedBlock { pinned: Arc::clone(&self.blocks), k: i })
    }
}

/// Two exports are equal when they cover the same tokens with the same blocks, byte for byte.
impl PartialEq for ExportedKv {
    fn eq(&self, other: &ExportedKv) -> bool {
        self.tokens == other.tokens
            && self.metas == other.metas
            && (0..self.len()).all(|i| self.block(i) == other.block(i))
    }
}

impl Eq for ExportedKv {}

/// Blocks of a prompt pulled from another worker, read where they lie (the packets they arrived in, the owner's
/// shared-memory region, mapped, or a buffer they were gathered into): the engine copies each into a fresh device
/// block and checks the copy there before registering it, so a block needs no buffer of its own on the way in and
/// none becomes visible unchecked.
pub trait PulledBlocks: Send {
    /// How many blocks.
    fn count(&self) -> usize;
    /// The `k`-th block's position in the prompt and its length in bytes.
    fn block(&self, k: usize) -> (usize, usize);
    /// Copies the `k`-th block into `dst` (its device block, as long as the block) and checks the copy there; the
    /// error says why it is not that block.
    fn copy_into(&self, k: usize, dst: &mut [u8]) -> Result<(), String>;
}

/// Blocks received into buffers of their own and checked on receipt.
impl PulledBlocks for Vec<(usize, bytes::Bytes)> {
    fn count(&self) -> usize {
        self.len()
    }

    fn block(&self, k: usize) -> (usize, usize) {
        (self[k].0, self[k].1.len())
    }

    fn copy_into(&self, k: usize, dst: &mut [u8]) -> Result<(), String> {
        dst.copy_from_slice(&self[k].1);
        Ok(())
    }
}

/// Blocks the caller already holds (the simulator's exports, tests).
impl PulledBlocks for &[(usize, &[u8])] {
    fn count(&self) -> usize {
        self.len()
    }

    fn block(&self, k: usize) -> (usize, usize) {
        (self[k].0, self[k].1.len())
    }

    fn copy_into(&self, k: usize, dst: &mut [u8]) -> Result<(), String> {
        dst.copy_from_slice(self[k].1);
        Ok(())
    }
}

impl Engine {
    /// Pins the blocks of `s`'s prompt for readers: the sequence's references to them pass to the pin (call
    /// before the rest are released), and come back through [`Engine::reclaim_pinned`] when it ends. The backend
    /// writes its latest K/V of them back first; when it cannot, nothing is pinned.
    pub(super) fn export(&mut self, s: &mut Seq) -> Result<ExportedKv, EngineError> {
        let bt = self.config.block_tokens;
        let tokens = s.prompt_len.min(s.computed);
        let full = tokens / bt;
        let count = tokens.div_ceil(bt).min(s.blocks.len());
        let hashes = s.hashes(full, self.block_size());
        let metas = (0..count)
            .map(|i| {
                (i < full).then(|| BlockMeta {
                    seq: hashes.seq[i],
                    local: hashes.local[i],
                    parent: i.checked_sub(1).map(|p| hashes.seq[p]),
                })
            })
            .collect();
        self.backend.write_back(&mut self.stores.device, &s.blocks[..count])?;
        let blocks: Vec<u32> = s.blocks.drain(..count).map(|b| b.0).collect();
        for &b in &blocks {
            self.pins.add(b);
        }
        let pinned = self.stores.device.pin(blocks, Arc::clone(&self.unpinned));
        Ok(ExportedKv { tokens, metas, blocks: Arc::new(pinned) })
    }

    /// Drops the pool's references held by pins that have ended: those blocks become cached (or free) again.
    pub fn reclaim_pinned(&mut self) {
        for slot in self.unpinned.take() {
            // Only references a pin took over come back here, each once.
            let _ = self.pool.release(slot);
            self.pins.remove(slot);
        }
    }

    /// Device blocks in use only because pins hold them (a lease's, waiting to be read), not by any sequence.
    pub fn leased_blocks(&self) -> usize {
        self.pins.iter().filter(|&(slot, pins)| self.pool.references(slot) == pins).count()
    }

    /// How many of `hashes`' leading blocks this engine holds, per tier.
    pub fn lookup(&self, hashes: &[SeqHash]) -> PrefixMatch {
        self.pool.lookup(hashes)
    }

    /// Bytes in one KV block of this engine.
    pub fn block_bytes(&self) -> usize {
        self.stores.device.layout().block_bytes()
    }

    /// Prompt tokens of `s` that the pool already holds on some tier (whole reusable blocks).
    pub(super) fn cached_prefix_tokens(&self, s: &mut Seq) -> usize {
        let bt = self.config.block_tokens;
        let reusable = (s.tokens.len().saturating_sub(1)) / bt;
        s.hashes(reusable, self.block_size());
        let hashes = &s.hashes.seq[..reusable];
        if reusable > 0 && self.held_prefix(&s.pinned, hashes) == reusable {
            // A pulled prompt whose whole reusable prefix is held for it (the common case): the lookup would find
            // just these blocks on the device.
            return reusable * bt;
        }
        let m = self.pool.lookup(hashes);
        (m.device + m.host + m.disk) * bt
    }

    /// How many of `hashes`' leading blocks are the device blocks `pinned` holds, in order (a pulled prompt's
    /// blocks held for its sequence): read from the blocks' own slots, no lookup.
    pub(super) fn held_prefix(&self, pinned: &[BlockId], hashes: &[SeqHash]) -> usize {
        let held = |(b, h): &(&BlockId, &SeqHash)| self.pool.meta(b.0).is_some_and(|m| m.seq == **h);
        pinned.iter().zip(hashes).take_while(held).count()
    }

    /// Stores full blocks pulled from another worker, then holds the prompt's whole cached prefix for a sequence
    /// that has not started yet, so that nothing evicts those blocks before it runs (the sequence releases the
    /// hold when it is admitted). `tokens` is the prompt (its full blocks name the imported ones); `blocks` gives
    /// bytes by block position; blocks already held anywhere are skipped. Every block's position and length are
    /// checked before any is stored, and each copy is checked ([`PulledBlocks::copy_into`]) before it is registered:
    /// all or nothing. Returns the held device blocks.
    pub(super) fn import_pinned(
        &mut self,
        s: &mut Seq,
        blocks: &dyn PulledBlocks,
    ) -> Result<Vec<BlockId>, EngineError> {
        let bt = self.config.block_tokens;
        let len = s.tokens.len();
        let full = len / bt;
        let hashes = s.hashes(full, self.block_size()).clone();
        self.check_pulled(len, blocks)?;
        // Blocks stored here stay referenced (not evictable) until the prefix is held; then their own reference goes.
        let mut stored: Vec<u32> = Vec::new();
        let held = self.store_blocks(&hashes, blocks, &mut stored).and_then(|()| {
            // Only whole blocks before the last token are ever reused (one token is always computed).
            let reusable = (len.saturating_sub(1)) / bt;
            self.hold(&hashes.seq[..reusable.min(full)])
        });
        for &slot in stored.iter().rev() {
            self.pool.release(slot).map_err(EngineError::Pool)?;
        }
        self.counters.imported_blocks += stored.len() as u64;
        held
    }

    /// Stores full blocks of `tokens` pulled from another worker as cached blocks, for a request that is yet to
    /// come (blocks already held anywhere are skipped): nothing holds them afterwards, so they are evicted as any
    /// cached block would be. Checked as [`Engine::import_pinned`] checks, all or nothing. Returns how many blocks
    /// were stored.
    pub fn import_cached(
        &mut self,
        namespace: Option<&kv_cache::CacheNamespace>,
        tokens: &[u32],
        blocks: &dyn PulledBlocks,
    ) -> Result<usize, EngineError> {
        self.reclaim_pinned();
        self.check_pulled(tokens.len(), blocks)?;
        let full = tokens.len() / self.config.block_tokens;
        let hashes = kv_cache::block_hashes(&tokens[..full * self.config.block_tokens], self.block_size(), namespace);
        let mut stored: Vec<u32> = Vec::new();
        let result = self.store_blocks(&hashes, blocks, &mut stored);
        for &slot in stored.iter().rev() {
            self.pool.release(slot).map_err(EngineError::Pool)?;
        }
        self.counters.imported_blocks += stored.len() as u64;
        result.map(|()| stored.len())
    }

    /// Every pulled block is a full block of a `len`-token prompt, of this engine's block size.
    fn check_pulled(&self, len: usize, blocks: &dyn PulledBlocks) -> Result<(), EngineError> {
        let full = len / self.config.block_tokens;
        let want = self.block_bytes();
        for (i, bytes) in (0..blocks.count()).map(|k| blocks.block(k)) {
            if i >= full {
                return Err(EngineError::Config(format!("block {i} is not a full block of a {len}-token prompt")));
            }
            if bytes != want {
                return Err(EngineError::Config(format!(
                    "block {i} has {bytes} bytes; this engine's blocks have {want}"
                )));
            }
        }
        Ok(())
    }

    /// References the device blocks of the cached prefix `seq` (onboarding host and disk ones), for a sequence that
    /// has not started yet; all or nothing.
    fn hold(&mut self, seq: &[SeqHash]) -> Result<Vec<BlockId>, EngineError> {
        let acquired = self.pool.acquire(seq);
        if let Err(e) = self.execute(&acquired.actions) {
            for &slot in acquired.slots.iter().rev() {
                let _ = self.pool.release(slot);
            }
            return Err(e);
        }
        Ok(acquired.slots.into_iter().map(BlockId).collect())
    }

    /// Writes each block the pool does not hold yet into a fresh device block and checks the copy there; when every
    /// copy passes, registers them (the slots stay referenced and are listed in `stored`), else frees them all.
    /// The fresh blocks are allocated in one call, so that the evictions making room for them are logged as runs.
    fn store_blocks(
        &mut self,
        hashes: &kv_cache::BlockHashes,
        blocks: &dyn PulledBlocks,
        stored: &mut Vec<u32>,
    ) -> Result<(), EngineError> {
        let mut fresh: Vec<(BlockMeta, usize)> = Vec::with_capacity(blocks.count());
        for k in 0..blocks.count() {
            if k + LOOK_AHEAD < blocks.count() {
                self.pool.prefetch(hashes.seq[blocks.block(k + LOOK_AHEAD).0]);
            }
            let i = blocks.block(k).0;
            let meta = BlockMeta {
                seq: hashes.seq[i],
                local: hashes.local[i],
                parent: i.checked_sub(1).map(|p| hashes.seq[p]),
            };
            if self.pool.find(meta.seq).is_none() {
                fresh.push((meta, k));
            }
        }
        let (mut actions, mut slots) = (Vec::new(), Vec::new());
        let allocated = self.pool.allocate_many(fresh.len(), &mut slots, &mut actions);
        let copied = self.execute(&actions);
        // Every copy is checked before any block is registered: a failed check leaves nothing findable.
        let mut checked = Ok(());
        for (&slot, &(_, k)) in slots.iter().zip(&fresh) {
            let dst: &mut [u8] = bytemuck::cast_slice_mut(self.stores.device.block_mut(BlockId(slot)));
            let i = blocks.block(k).0;
            if let Err(why) = blocks.copy_into(k, dst) {
                checked = Err(EngineError::Import(format!("pulled block {i}: {why}")));
                break;
            }
        }
        for (j, (&slot, &(meta, _))) in slots.iter().zip(&fresh).enumerate() {
            // The evictions that made room went through other lines: ask again for the lookups ahead.
            if let Some(&(ahead, _)) = fresh.get(j + LOOK_AHEAD) {
                self.pool.prefetch(ahead.seq);
            }
            if checked.is_err() {
                // Never registered, so never visible: the slot goes back free.
                self.pool.release(slot).map_err(EngineError::Pool)?;
                continue;
            }
            match (&copied, self.pool.register(slot, meta)) {
                (Ok(()), Ok(Registered::New)) => stored.push(slot),
                (_, registered) => {
                    self.pool.release(slot).map_err(EngineError::Pool)?;
                    registered.map_err(EngineError::Pool)?;
                }
            }
        }
        copied?;
        checked?;
        match allocated {
            Ok(()) => Ok(()),
            Err(PoolError::OutOfBlocks) => Err(self.out_of_capacity()),
            Err(e) => Err(EngineError::Pool(e)),
        }
    }
}

/// How many pins hold each device slot, and which slots any pin holds (a sparse set over the slots: adding,
/// removing and listing cost nothing per slot not pinned).
#[derive(Debug, Default)]
pub(super) struct PinCounts {
    /// Per slot: its pins, and its place in `held`.
    count: Vec<u32>,
    at: Vec<u32>,
    held: Vec<u32>,
}

impl PinCounts {
    pub fn new(slots: usize) -> PinCounts {
        PinCounts { count: vec![0; slots], at: vec![0; slots], held: Vec::new() }
    }

    fn add(&mut self, slot: u32) {
        let s = slot as usize;
        if self.count[s] == 0 {
            self.at[s] = self.held.len() as u32;
            self.held.push(slot);
        }
        self.count[s] += 1;
    }

    fn remove(&mut self, slot: u32) {
        let s = slot as usize;
        match self.count.get(s) {
            Some(0) | None => {}
            Some(1) => {
                self.count[s] = 0;
                let at = self.at[s] as usize;
                self.held.swap_remove(at);
                if let Some(&moved) = self.held.get(at) {
                    self.at[moved as usize] = at as u32;
                }
            }
            Some(_) => self.count[s] -= 1,
        }
    }

    /// Every pinned slot with its pins.
    fn iter(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.held.iter().map(|&s| (s, self.count[s as usize]))
    }
}

#[cfg(test)]
mod tests {
    use super::PinCounts;

    #[test]
    fn pin_counts_list_exactly_the_pinned_slots_with_their_pins() {
        let mut p = PinCounts::new(10);
        for s in [3, 5, 7, 5] {
            p.add(s);
        }
        let listed = |p: &PinCounts| {
            let mut v: Vec<(u32, u32)> = p.iter().collect();
            v.sort_unstable();
            v
        };
        assert_eq!(listed(&p), vec![(3, 1), (5, 2), (7, 1)]);
        p.remove(3);
        assert_eq!(listed(&p), vec![(5, 2), (7, 1)]);
        p.remove(5);
        p.remove(9);
        assert_eq!(listed(&p), vec![(5, 1), (7, 1)]);
        p.remove(7);
        p.remove(5);
        p.add(7);
        assert_eq!(listed(&p), vec![(7, 1)]);
    }
}
