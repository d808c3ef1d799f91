//! A KV store's memory, shared between the engine, its one writer, and readers of **pinned** blocks on other
//! threads: a prefill worker's lease serves a finished prompt's blocks to decode workers straight from the store
//! while the engine goes on computing other sequences in other blocks.
//!
//! The rule that makes this sound: a block is written only while no pin holds it. The engine keeps it by
//! construction (a pin takes over a finished sequence's pool references, and the pool hands out only unreferenced
//! blocks to be written); the store checks it too, on every write, against a count of pins per block, so a
//! mistake is a panic on the engine thread rather than a torn block on the wire.

#![allow(unsafe_code)]

use std::cell::UnsafeCell;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use half::f16;

/// Where the values live.
enum Backing {
    Heap(#[allow(dead_code)] Box<[UnsafeCell<f16>]>),
    /// A file in shared memory, mapped: other processes on the host map it too, to read pinned blocks. The file
    /// goes when the memory does (mappings outlive its name).
    File {
        _map: memmap2::MmapRaw,
        path: PathBuf,
    },
}

impl Drop for Backing {
    fn drop(&mut self) {
        if let Backing::File { path, .. } = self {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// The values of every block, and how many pins hold each.
struct Memory {
    values: *mut f16,
    block_elems: usize,
    pins: Box<[AtomicU32]>,
    _backing: Backing,
}

// SAFETY: `values` points into `_backing`, which lives and stays put as long as this does. Values are written only
// through `&mut Values` (one writer) and only in blocks no pin holds (checked in `Values::write`); other threads
// read only pinned blocks, so no value is read and written at once.
unsafe impl Send for Memory {}
unsafe impl Sync for Memory {}

impl Memory {
    fn new(values: *mut f16, blocks: usize, block_elems: usize, backing: Backing) -> Memory {
        let pins = (0..blocks).map(|_| AtomicU32::new(0)).collect();
        Memory { values, block_elems, pins, _backing: backing }
    }

    /// Values in the store (one pin count per block).
    fn len(&self) -> usize {
        self.pins.len() * self.block_elems
    }

    /// `len` values from `start`, to read.
    fn read(&self, start: usize, len: usize) -> &[f16] {
        assert!(start.checked_add(len).is_some_and(|end| end <= self.len()), "a read stays within the store");
        // SAFETY: in bounds; no write to these values overlaps this borrow (the module's rule).
        unsafe { std::slice::from_raw_parts(self.values.add(start), len) }
    }
}

/// The store's values, owned by the store: the one handle that writes them.
pub(crate) struct Values {
    memory: Arc<Memory>,
}

impl std::fmt::Debug for Values {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let m = &self.memory;
        f.debug_struct("Values").field("values", &m.len()).field("block_elems", &m.block_elems).finish()
    }
}

impl Values {
    /// Zeroed values for `blocks` blocks of `block_elems`, every page written now (see `KvStore::new`).
    #[allow(clippy::slow_vector_initialization)]
    pub fn zeroed(blocks: usize, block_elems: usize) -> Values {
        let len = blocks * block_elems;
        // `vec![0; n]` would be a lazily mapped zeroed allocation; filling an uninitialised one writes every page.
        let mut bits: Vec<u16> = Vec::with_capacity(len);
        bits.resize(len, 0);
        let raw = Box::into_raw(bits.into_boxed_slice()) as *mut [UnsafeCell<f16>];
        // SAFETY: `UnsafeCell<f16>` has the layout of `f16`, a transparent `u16` for which every bit pattern is
        // valid; the length carries over with the slice pointer cast, and the allocation is the same.
        let cells = unsafe { Box::from_raw(raw) };
        let values = UnsafeCell::raw_get(cells.as_ptr());
        Values { memory: Arc::new(Memory::new(values, blocks, block_elems, Backing::Heap(cells))) }
    }

    /// Zeroed values for `blocks` blocks of `block_elems` in a new file at `path` (owner-only), mapped shared so
    /// that other processes of the same user can map it to read pinned blocks. The file's pages are allocated
    /// now (a filesystem without the room refuses here, not with a fault mid-run) and written once, as
    /// [`Values::zeroed`]'s are. The file is removed when the values go.
    pub fn in_file(path: &Path, blocks: usize, block_elems: usize) -> std::io::Result<Values> {
        use std::os::unix::fs::OpenOptionsExt;
        let len = blocks * block_elems;
        let bytes = (len * 2) as u64;
        let file = std::fs::OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(path)?;
        let backing_path = path.to_path_buf();
        let made = (|| {
            if bytes > 0 {
                rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, bytes)?;
            }
            memmap2::MmapOptions::new().len(len * 2).map_raw(&file)
        })();
        let map = match made {
            Ok(map) => map,
            Err(e) => {
                let _ = std::fs::remove_file(path);
                return Err(e);
            }
        };
        let values = map.as_mut_ptr().cast::<f16>();
        if len > 0 {
            // SAFETY: the mapping is `len` f16 long, page-aligned, and ours alone until this returns.
            unsafe { std::ptr::write_bytes(values, 0, len) };
        }
        let backing = Backing::File { _map: map, path: backing_path };
        Ok(Values { memory: Arc::new(Memory::new(values, blocks, block_elems, backing)) })
    }

    /// The file the values live in, when they live in one.
    pub fn file(&self) -> Option<&Path> {
        match &self.memory._backing {
            Backing::File { path, .. } => Some(path),
            Backing::Heap(_) => None,
        }
    }

    /// `len` values from `start`, to read (on the writer's thread, where no write races it).
    pub fn read(&self, start: usize, len: usize) -> &[f16] {
        self.memory.read(start, len)
    }

    /// `len` values from `start`, all within block `block`, to overwrite. Panics when a pin holds the block.
    pub fn write(&mut self, block: usize, start: usize, len: usize) -> &mut [f16] {
        let m = &*self.memory;
        let first = block * m.block_elems;
        assert!(start >= first && start + len <= first + m.block_elems, "a write stays within its block");
        assert_eq!(m.pins[block].load(Ordering::Acquire), 0, "block {block} is pinned: it must not be written");
        // SAFETY: in bounds (within a block of the store); `&mut self` makes this the only writable borrow for its
        // lifetime, and no other thread reads an unpinned block.
        unsafe { std::slice::from_raw_parts_mut(m.values.add(start), len) }
    }

    /// Whether a pin holds `block`.
    pub fn pinned(&self, block: usize) -> bool {
        self.memory.pins[block].load(Ordering::Acquire) > 0
    }

    /// Pins `blocks` for readers; the caller hands over one pool reference to each, which `unpinned` gets back
    /// when the pin is dropped.
    pub fn pin(&self, blocks: Vec<u32>, unpinned: Arc<Unpinned>) -> Pinned {
        for &b in &blocks {
            self.memory.pins[b as usize].fetch_add(1, Ordering::AcqRel);
        }
        Pinned { memory: Arc::clone(&self.memory), blocks, unpinned }
    }
}

/// Blocks whose pins have ended, waiting for the engine to drop its pool references to them (only the engine
/// touches its pool). Whoever drops the last pin wakes the engine when it is idle.
#[derive(Default)]
pub struct Unpinned {
    blocks: Mutex<Vec<u32>>,
    /// Whether `blocks` may hold any: the engine asks at every step, and nearly always none came back, which this
    /// tells without taking the lock.
    any: AtomicBool,
    wake: Mutex<Option<Box<dyn Fn() + Send + Sync>>>,
}

impl std::fmt::Debug for Unpinned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Unpinned").field("blocks", &self.blocks.lock().map(|b| b.len()).ok()).finish()
    }
}

impl Unpinned {
    /// Moves out every block given back so far. (A block given back while this runs is taken now or next time;
    /// either way its giver wakes the engine after.)
    pub fn take(&self) -> Vec<u32> {
        if !self.any.load(Ordering::Acquire) {
            return Vec::new();
        }
        let mut blocks = self.blocks.lock().unwrap_or_else(|p| p.into_inner());
        self.any.store(false, Ordering::Relaxed);
        std::mem::take(&mut *blocks)
    }

    /// Calls `wake` whenever blocks are given back (the engine's thread waits for commands when idle).
    pub fn on_return(&self, wake: impl Fn() + Send + Sync + 'static) {
        *self.wake.lock().unwrap_or_else(|p| p.into_inner()) = Some(Box::new(wake));
    }

    fn give_back(&self, blocks: &[u32]) {
        {
            let mut held = self.blocks.lock().unwrap_or_else(|p| p.into_inner());
            held.extend_from_slice(blocks);
            self.any.store(true, Ordering::Release);
        }
        if let Some(wake) = &*self.wake.lock().unwrap_or_else(|p| p.into_inner()) {
            wake();
        }
    }
}

/// Blocks of a store held for readers: none of them is written, freed or evicted until this is dropped, which
/// hands them back to the engine. Readable from any thread.
pub struct Pinned {
    memory: Arc<Memory>,
    blocks: Vec<u32>,
    unpinned: Arc<Unpinned>,
}

impl std::fmt::Debug for Pinned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pinned").field("blocks", &self.blocks).finish()
    }
}

impl Pinned {
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Where the `k`-th block starts in its store, in bytes (in the store's file, when it has one).
    pub fn offset(&self, k: usize) -> u64 {
        (self.blocks[k] as usize * self.memory.block_elems * 2) as u64
    }

    /// The bytes of the `k`-th block.
    pub fn block(&self, k: usize) -> &[u8] {
        let n = self.memory.block_elems;
        bytemuck::cast_slice(self.memory.read(self.blocks[k] as usize * n, n))
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        for &b in &self.blocks {
            // Release: every read of the block through this pin happens before the engine may write it again.
            self.memory.pins[b as usize].fetch_sub(1, Ordering::AcqRel);
        }
        self.unpinned.give_back(&self.blocks);
    }
}

/// One pinned block as an owner of bytes (`bytes::Bytes::from_owner`): the pin lasts while any slice of it does.
pub struct PinnedBlock {
    pub(crate) pinned: Arc<Pinned>,
    pub(crate) k: usize,
}

impl AsRef<[u8]> for PinnedBlock {
    fn as_ref(&self) -> &[u8] {
        self.pinned.block(self.k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pinned_block_reads_what_was_written_and_comes_back_when_dropped() {
        let mut values = Values::zeroed(3, 4);
        values.write(1, 4, 4).copy_from_slice(&[f16::from_f32(1.5); 4]);
        let unpinned = Arc::new(Unpinned::default());
        let pinned = values.pin(vec![1], Arc::clone(&unpinned));
        assert!(values.pinned(1) && !values.pinned(0));
        let reader = std::thread::spawn(move || pinned.block(0).to_vec());
        assert_eq!(reader.join().expect("read"), bytemuck::cast_slice::<f16, u8>(&[f16::from_f32(1.5); 4]));
        assert_eq!(unpinned.take(), vec![1]);
        assert!(!values.pinned(1));
        values.write(1, 4, 4).fill(f16::ZERO);
    }

    #[test]
    fn values_in_a_file_are_the_files_bytes_and_the_file_goes_with_the_last_pin() {
        let path = std::env::temp_dir().join(format!("tandem-kv-values-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let mut values = Values::in_file(&path, 4, 8).expect("made");
        assert_eq!(values.file(), Some(path.as_path()));
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&path).expect("meta").permissions().mode() & 0o077, 0, "owner-only");
        assert!(Values::in_file(&path, 4, 8).is_err(), "never another's file");
        values.write(2, 16, 8).copy_from_slice(&[f16::from_f32(-2.0); 8]);
        let pinned = values.pin(vec![2], Arc::new(Unpinned::default()));
        // Another reader of the file (a decode worker on this host) finds the block at the pin's offset.
        let file = std::fs::read(&path).expect("read");
        let at = pinned.offset(0) as usize;
        assert_eq!((at, &file[at..at + 16]), (32, pinned.block(0)));
        assert_eq!(pinned.block(0), bytemuck::cast_slice::<f16, u8>(&[f16::from_f32(-2.0); 8]));
        drop(values);
        assert!(path.exists(), "a pin keeps the store");
        drop(pinned);
        assert!(!path.exists());
        let missing = std::env::temp_dir().join("tandem-no-such-dir").join("store");
        assert!(Values::in_file(&missing, 4, 8).is_err());
    }

    #[test]
    #[should_panic(expected = "pinned")]
    fn writing_a_pinned_block_panics() {
        let mut values = Values::zeroed(2, 4);
        let _pinned = values.pin(vec![0], Arc::new(Unpinned::default()));
        values.write(0, 0, 4);
    }
}
