//! Owners' KV stores mapped once and kept: a decode worker pulls from the same few prefill workers again and again,
//! and mapping each prompt's blocks (populated page by page table entry) and unmapping them after every pull costs
//! as much as a good part of copying them. A store is mapped whole, unpopulated, at the first pull from it; its
//! pages are faulted in as blocks are first read and stay mapped for the next pulls. The mapping is let go when
//! the file at its path is gone or is another file (its owner stopped or restarted), checked at every pull and by
//! [`StoreMaps::sweep`], which the worker calls every few seconds, so a stopped owner's shared memory is not held
//! for long after it.

use std::collections::HashMap;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use super::MappedBlocks;
use crate::descriptor::BlockDescriptor;
use crate::quic::TransferError;

/// The stores this reader keeps mapped, by path.
#[derive(Debug, Default)]
pub struct StoreMaps {
    kept: Mutex<HashMap<PathBuf, Kept>>,
}

/// One store's mapping and the file it maps (device and inode: a restarted owner's new store at the same path is
/// another file).
#[derive(Debug)]
struct Kept {
    dev: u64,
    ino: u64,
    map: Arc<memmap2::Mmap>,
}

impl Kept {
    fn maps(&self, meta: &fs::Metadata) -> bool {
        self.dev == meta.dev() && self.ino == meta.ino() && self.map.len() as u64 == meta.len()
    }
}

impl StoreMaps {
    /// The blocks of `blocks` (position, descriptor) in the store at `path`, read through the kept mapping of the
    /// whole store, made now if there is none for this file. Each block must lie inside the store. As with
    /// [`MappedBlocks::open`], the blocks stay as they are only while the owner's lease pins them.
    pub fn blocks(&self, path: &Path, blocks: &[(u32, BlockDescriptor)]) -> Result<MappedBlocks, TransferError> {
        let file = fs::File::open(path)?;
        let meta = file.metadata()?;
        if meta.len() == 0 {
            // Nothing to map (a modelled engine's blocks hold nothing).
            return MappedBlocks::open(path, blocks);
        }
        let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        let_go_gone(&mut kept, Some(path));
        let map = match kept.get(path) {
            Some(k) if k.maps(&meta) => Arc::clone(&k.map),
            _ => {
                let map = Arc::new(map_whole(&file)?);
                kept.insert(path.to_path_buf(), Kept { dev: meta.dev(), ino: meta.ino(), map: Arc::clone(&map) });
                map
            }
        };
        drop(kept);
        MappedBlocks::within(map, blocks)
    }

    /// Lets go of the mappings of stores whose files are gone or replaced.
    pub fn sweep(&self) {
        let_go_gone(&mut self.kept.lock().unwrap_or_else(PoisonError::into_inner), None);
    }

    /// Stores mapped now.
    pub fn len(&self) -> usize {
        self.kept.lock().unwrap_or_else(PoisonError::into_inner).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Drops the mappings whose file is gone or is another file now, but `except`'s (looked at by the caller).
fn let_go_gone(kept: &mut HashMap<PathBuf, Kept>, except: Option<&Path>) {
    kept.retain(|p, k| Some(p.as_path()) == except || fs::metadata(p).is_ok_and(|m| k.maps(&m)));
}

#[allow(unsafe_code)]
fn map_whole(file: &fs::File) -> std::io::Result<memmap2::Mmap> {
    // SAFETY: as for the mappings of `MappedBlocks::open`: the owner never truncates or rewrites a store's blocks
    // while a lease pins them, and a reader reads only the blocks of a lease it holds, until its copies are checked;
    // a block changed regardless fails its copy's checksum. Blocks of other leases are not read through it.
    unsafe { memmap2::MmapOptions::new().map(file) }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;
    use crate::checksum;
    use crate::descriptor::RegionKey;

    fn descriptor(offset: u64, block: &[u8]) -> BlockDescriptor {
        BlockDescriptor {
            seq_hash: None,
            region: RegionKey(0),
            offset,
            len: block.len() as u64,
            checksum: checksum(block),
        }
    }

    #[test]
    fn a_store_is_mapped_once_remapped_when_replaced_and_let_go_when_gone() {
        let dir = std::env::temp_dir().join(format!("tandem-shm-stores-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).expect("dir");
        let (a, b) = (dir.join("a"), dir.join("b"));
        let len = 5_000usize;
        let store = |fill: u8| (0..8u8).flat_map(|k| vec![k.wrapping_add(fill); len]).collect::<Vec<u8>>();
        fs::write(&a, store(0)).expect("store a");
        fs::write(&b, store(100)).expect("store b");
        let block = |k: u8, fill: u8| Bytes::from(vec![k.wrapping_add(fill); len]);
        let ask = |k: u8, fill: u8| [(u32::from(k), descriptor(u64::from(k) * len as u64, &block(k, fill)))];
        let maps = StoreMaps::default();

        let first = maps.blocks(&a, &ask(3, 0)).expect("maps");
        let again = maps.blocks(&a, &ask(5, 0)).expect("maps");
        assert!(Arc::ptr_eq(&first.maps[0], &again.maps[0]), "one mapping for both pulls");
        let mut copy = vec![0u8; len];
        again.copy_checked(0, &mut copy).expect("the block, checked");
        assert_eq!(copy, block(5, 0));
        maps.blocks(&b, &ask(1, 100)).expect("maps b");
        assert_eq!(maps.len(), 2);

        // The owner of `a` restarts: a new file at the same path is mapped anew.
        fs::remove_file(&a).expect("gone");
        fs::write(&a, store(50)).expect("a new store a");
        let renewed = maps.blocks(&a, &ask(2, 50)).expect("maps the new store");
        assert!(!Arc::ptr_eq(&first.maps[0], &renewed.maps[0]));
        renewed.copy_checked(0, &mut copy).expect("the new store's block");
        // The owner of `b` stops: its mapping goes at the next pull from anyone, or the next sweep.
        fs::remove_file(&b).expect("gone");
        maps.blocks(&a, &ask(2, 50)).expect("maps");
        assert_eq!(maps.len(), 1, "b's mapping is let go");
        maps.sweep();
        assert_eq!(maps.len(), 1, "a's store is still there");
        fs::remove_file(&a).expect("gone");
        maps.sweep();
        assert!(maps.is_empty(), "a's mapping is let go without a pull");
        fs::write(&a, store(50)).expect("a store again");

        let outside = [(0, BlockDescriptor { offset: 8 * len as u64 - 1, ..descriptor(0, &block(0, 50)) })];
        assert!(matches!(
            maps.blocks(&a, &outside),
            Err(TransferError::Integrity { what: "outside the shared region", .. })
        ));
        assert!(maps.blocks(&b, &ask(1, 100)).is_err(), "a store that is gone");
        let _ = fs::remove_dir_all(&dir);
    }
}
