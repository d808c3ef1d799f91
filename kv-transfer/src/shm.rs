//! The shared-memory transport, for workers on one host: the owner writes a lease's blocks into a file in shared
//! memory (`/dev/shm` by default), readable only by its user and named by the unguessable lease id; the reader
//! maps it and copies the blocks it needs itself — a one-sided read — checking each block's length and checksum.
//!
//! Every owner holds an exclusive lock on a file of its own in the directory (`tandem-kv-<owner>.lock`) for as
//! long as it runs, and names its regions after itself (`tandem-kv-<owner>-<lease>`). A region whose owner's lock
//! can be taken (its process is gone, however it ended) or that has no lock file at all is stale: [`ShmDir::open`]
//! removes such files, so a crashed worker's regions do not outlive the next start on the host. A region is
//! written only when the filesystem has room for it (containers often get 64 MiB), and a failed write leaves no
//! file behind.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;

use crate::checksum;
use crate::descriptor::BlockDescriptor;
use crate::lease::LeaseId;
use crate::quic::TransferError;

mod stores;

pub use stores::StoreMaps;

/// Where shared-memory regions live when nothing else is said.
pub const DEFAULT_DIR: &str = "/dev/shm";
/// Every file this transport makes starts so.
const PREFIX: &str = "tandem-kv-";
/// An owner's KV store is `{PREFIX}<owner>{STORE}`.
const STORE: &str = "-store";
/// Room left free beside a new region, for everything else that uses the filesystem.
const HEADROOM: u64 = 4 << 20;

/// One owner's place in a shared-memory directory, held while the owner runs.
#[derive(Debug)]
pub struct ShmDir {
    dir: PathBuf,
    owner: String,
    lock: PathBuf,
    /// Holds the exclusive lock; the lock goes when the process does, however it ends.
    _held: fs::File,
    swept: usize,
}

/// A lease's blocks in a shared-memory file, removed when dropped.
#[derive(Debug)]
pub struct ShmRegion {
    path: PathBuf,
}

/// Whether `name` is one of this transport's files, and whose (the owner's name up to the next `-` or `.lock`).
fn owner_of(name: &str) -> Option<&str> {
    let rest = name.strip_prefix(PREFIX)?;
    let owner = rest.strip_suffix(".lock").unwrap_or(rest);
    owner.split('-').next().filter(|o| !o.is_empty())
}

/// The store a handle names (`named`, the owner's path to it), as a file of `dir`, this reader's own shared-memory
/// directory, or `None` when the name is not a store's (`tandem-kv-<owner>-store`, the owner letters and digits).
/// Only the file name is taken: readers with the same host id share the directory (same device and inode), so a
/// store is found in the reader's own, and a handle cannot make a reader map any other file it can open.
pub fn store_in(dir: &Path, named: &str) -> Option<PathBuf> {
    let name = Path::new(named).file_name()?.to_str()?;
    let owner = name.strip_prefix(PREFIX)?.strip_suffix(STORE)?;
    valid_owner(owner).then(|| dir.join(name))
}

/// Owners are named by letters and digits only, so that their files' names parse back.
fn valid_owner(owner: &str) -> bool {
    !owner.is_empty() && owner.chars().all(|c| c.is_ascii_alphanumeric())
}

impl ShmDir {
    /// Takes `owner`'s place in `dir` (an owner is one running process: pass a fresh id per start) and removes
    /// the files of owners that are gone.
    pub fn open(dir: &Path, owner: &str) -> Result<ShmDir, TransferError> {
        if !valid_owner(owner) {
            return Err(TransferError::Stream(format!("shared-memory owner {owner:?} must be letters and digits")));
        }
        let lock = dir.join(format!("{PREFIX}{owner}.lock"));
        let held = fs::OpenOptions::new().write(true).create(true).truncate(false).open(&lock)?;
        held.try_lock().map_err(|e| TransferError::Stream(format!("{}: {e}", lock.display())))?;
        let swept = sweep(dir, owner)?;
        Ok(ShmDir { dir: dir.to_path_buf(), owner: owner.to_string(), lock, _held: held, swept })
    }

    /// Where this owner's engine keeps its device KV store, when it keeps it here (a new file; same-host readers map
    /// the leased blocks out of it). Named after the owner, so a crashed owner's store is swept like its regions.
    pub fn store_path(&self) -> PathBuf {
        self.dir.join(format!("{PREFIX}{}{STORE}", self.owner))
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Stale files removed when this owner arrived.
    pub fn swept(&self) -> usize {
        self.swept
    }

    /// Writes `blocks` back to back into a new owner-only file; the i-th block is at offset `i * len` for
    /// equal-length blocks (the offsets are returned). Refused, with nothing written, when the filesystem lacks
    /// the room; on any error the file is gone.
    pub fn create_region(&self, lease: LeaseId, blocks: &[Bytes]) -> Result<(ShmRegion, Vec<u64>), TransferError> {
        use std::os::unix::fs::OpenOptionsExt;
        let size: u64 = blocks.iter().map(|b| b.len() as u64).sum();
        room_for(size, free_bytes(&self.dir)?, &self.dir)?;
        let path = self.dir.join(format!("{PREFIX}{}-{:032x}", self.owner, lease.0));
        let f = fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path)?;
        // From here the region owns the file: any early return removes it.
        let region = ShmRegion { path };
        let mut offsets = Vec::with_capacity(blocks.len());
        let mut w = std::io::BufWriter::new(f);
        let mut at = 0u64;
        for b in blocks {
            offsets.push(at);
            w.write_all(b)?;
            at += b.len() as u64;
        }
        w.flush()?;
        Ok((region, offsets))
    }
}

impl Drop for ShmDir {
    /// The owner's KV store goes with it (the memory of a file in `/dev/shm` is the host's until the file is
    /// removed; a process still mapping it keeps its mapping), then its lock.
    fn drop(&mut self) {
        let _ = fs::remove_file(self.store_path());
        let _ = fs::remove_file(&self.lock);
    }
}

/// Removes every file in `dir` whose owner (other than `me`) has no lock file or no longer holds its lock.
fn sweep(dir: &Path, me: &str) -> Result<usize, TransferError> {
    let names: Vec<String> =
        fs::read_dir(dir)?.filter_map(|e| e.ok()).filter_map(|e| e.file_name().into_string().ok()).collect();
    let mut dead: std::collections::HashMap<String, bool> = std::collections::HashMap::new();
    let mut removed = 0;
    for name in &names {
        let Some(owner) = owner_of(name) else { continue };
        if owner == me {
            continue;
        }
        let gone = *dead.entry(owner.to_string()).or_insert_with(|| {
            match fs::OpenOptions::new().write(true).open(dir.join(format!("{PREFIX}{owner}.lock"))) {
                // Nobody holds the lock: its owner is gone (this handle lets go of it when dropped).
                Ok(f) => f.try_lock().is_ok(),
                // No lock file at all: a file no live owner can be holding.
                Err(_) => true,
            }
        });
        if gone && fs::remove_file(dir.join(name)).is_ok() {
            removed += 1;
        }
    }
    Ok(removed)
}

/// Whether a region of `size` bytes fits in `free` bytes, keeping [`HEADROOM`] for everything else.
fn room_for(size: u64, free: u64, dir: &Path) -> Result<(), TransferError> {
    if size.saturating_add(HEADROOM) <= free {
        return Ok(());
    }
    Err(TransferError::Io(std::io::Error::new(
        std::io::ErrorKind::StorageFull,
        format!("{} has {free} bytes free; a region of {size} bytes does not fit", dir.display()),
    )))
}

/// Bytes an unprivileged writer can still put on the filesystem holding `dir`.
fn free_bytes(dir: &Path) -> Result<u64, TransferError> {
    let st = rustix::fs::statvfs(dir).map_err(std::io::Error::from)?;
    Ok(st.f_bavail.saturating_mul(st.f_frsize))
}

impl ShmRegion {
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ShmRegion {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.path);
    }
}

/// Blocks of another owner's region (a lease's region file, or the owner's whole KV store), mapped and
/// bounds-checked, to be read where they lie: the decode worker's engine copies each straight into one of its KV
/// blocks and checks the copy there ([`MappedBlocks::copy_checked`]), so a pull needs no buffer of its own. Opened
/// alone ([`MappedBlocks::open`]), only the blocks asked for are mapped (each run of adjacent ones once, populated in
/// one call rather than faulted page by page); through [`StoreMaps`], they are read from its kept mapping of the
/// whole store.
#[derive(Debug)]
pub struct MappedBlocks {
    maps: Vec<Arc<memmap2::Mmap>>,
    /// Per block: its position, which mapping holds it and its bytes' range there, and the owner's checksum.
    blocks: Vec<(u32, usize, std::ops::Range<usize>, u64)>,
}

impl MappedBlocks {
    /// Maps the blocks of `blocks` (position, descriptor) from the file at `path`, checking that each lies
    /// inside it. A lease's region stays readable once its owner unlinks it; the blocks of a store stay as they
    /// are only while the lease pins them, so a reader of a store releases the lease after its copies are checked.
    pub fn open(path: &Path, blocks: &[(u32, BlockDescriptor)]) -> Result<MappedBlocks, TransferError> {
        let file = fs::File::open(path)?;
        let size = file.metadata()?.len();
        let mut spans: Vec<(u32, u64, u64, u64)> = Vec::with_capacity(blocks.len());
        for &(index, d) in blocks {
            let end = d.offset.checked_add(d.len).filter(|&e| e <= size);
            let end = end.ok_or(TransferError::Integrity { index, what: "outside the shared region" })?;
            spans.push((index, d.offset, end, d.checksum));
        }
        // Runs of blocks that follow one another in the file, in the order asked: one mapping each.
        let mut maps = Vec::new();
        let mut out = Vec::with_capacity(spans.len());
        let mut k = 0;
        while k < spans.len() {
            let mut last = k;
            while last + 1 < spans.len() && spans[last + 1].1 == spans[last].2 {
                last += 1;
            }
            let (start, end) = (spans[k].1, spans[last].2);
            // memmap2 starts the mapping on the page holding `start` and hands out the bytes from `start` on. Empty
            // blocks (a modelled engine's) need no mapping.
            let at = maps.len();
            if end > start {
                maps.push(Arc::new(map(&file, start, usize::try_from(end - start).map_err(std::io::Error::other)?)?));
            }
            for &(index, offset, block_end, sum) in &spans[k..=last] {
                let from = (offset - start) as usize;
                out.push((index, at, from..from + (block_end - offset) as usize, sum));
            }
            k = last + 1;
        }
        Ok(MappedBlocks { maps, blocks: out })
    }

    /// The blocks of `blocks` in `map`, a mapping of a whole file ([`StoreMaps`]), each checked to lie inside it.
    fn within(map: Arc<memmap2::Mmap>, blocks: &[(u32, BlockDescriptor)]) -> Result<MappedBlocks, TransferError> {
        let size = map.len() as u64;
        let mut out = Vec::with_capacity(blocks.len());
        for &(index, d) in blocks {
            let end = d.offset.checked_add(d.len).filter(|&e| e <= size);
            let end = end.ok_or(TransferError::Integrity { index, what: "outside the shared region" })?;
            out.push((index, 0, d.offset as usize..end as usize, d.checksum));
        }
        Ok(MappedBlocks { maps: vec![map], blocks: out })
    }

    /// How many blocks.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// The `k`-th block: its position and its bytes in the mapping (not yet checked).
    pub fn block(&self, k: usize) -> (u32, &[u8]) {
        let (index, map, range, _) = &self.blocks[k];
        (*index, if range.is_empty() { &[] } else { &self.maps[*map][range.clone()] })
    }

    /// Copies the `k`-th block into `dst` (as long as the block) and checks the copy.
    pub fn copy_checked(&self, k: usize, dst: &mut [u8]) -> Result<(), TransferError> {
        let (index, bytes) = self.block(k);
        if bytes.len() != dst.len() {
            return Err(TransferError::Integrity { index, what: "wrong length" });
        }
        dst.copy_from_slice(bytes);
        self.check(k, dst)
    }

    /// Checks a copy of the `k`-th block against the owner's checksum: check the copy, not the mapping, so that
    /// what is checked is what is used.
    pub fn check(&self, k: usize, copy: &[u8]) -> Result<(), TransferError> {
        let (index, _, range, sum) = &self.blocks[k];
        if copy.len() != range.len() {
            return Err(TransferError::Integrity { index: *index, what: "wrong length" });
        }
        if checksum(copy) != *sum {
            return Err(TransferError::Integrity { index: *index, what: "checksum mismatch" });
        }
        Ok(())
    }

    /// Bytes over all blocks.
    pub fn bytes(&self) -> u64 {
        self.blocks.iter().map(|(_, _, r, _)| r.len() as u64).sum()
    }
}

/// Copies `blocks` (position, descriptor) out of the region at `path`; all verified, or an error and none. The
/// blocks land in one allocation (each returned `Bytes` a slice of it).
pub fn pull(path: &Path, blocks: &[(u32, BlockDescriptor)]) -> Result<Vec<(u32, Bytes)>, TransferError> {
    let mut buf = Vec::new();
    let ranges = pull_into(path, blocks, &mut buf)?;
    let all = Bytes::from(buf);
    Ok(ranges.into_iter().map(|(index, r)| (index, all.slice(r))).collect())
}

/// [`pull`] into `dst` (cleared first; its capacity is reused): the blocks one after another, in the order given,
/// each checked after it is copied. Returns each block's position and its bytes' range in `dst`.
pub fn pull_into(
    path: &Path,
    blocks: &[(u32, BlockDescriptor)],
    dst: &mut Vec<u8>,
) -> Result<Vec<(u32, std::ops::Range<usize>)>, TransferError> {
    let mapped = MappedBlocks::open(path, blocks)?;
    dst.clear();
    dst.reserve(usize::try_from(mapped.bytes()).unwrap_or(usize::MAX));
    let mut out = Vec::with_capacity(mapped.len());
    for k in 0..mapped.len() {
        let (index, bytes) = mapped.block(k);
        let start = dst.len();
        dst.extend_from_slice(bytes);
        mapped.check(k, &dst[start..])?;
        out.push((index, start..dst.len()));
    }
    Ok(out)
}

#[allow(unsafe_code)]
fn map(file: &fs::File, offset: u64, len: usize) -> std::io::Result<memmap2::Mmap> {
    // SAFETY: the owner writes a lease's region once, before any handle naming it exists, and afterwards only
    // unlinks it (never truncates or rewrites); it writes a block of its store only when no lease pins it, and a
    // reader holds the lease until its copies are checked. So the bytes read stay unchanged while they are read;
    // were a lease to expire mid-copy regardless, the copy's checksum would fail, not pass a changed block.
    unsafe { memmap2::MmapOptions::new().offset(offset).len(len).populate().map(file) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::descriptor::RegionKey;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("tandem-shm-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).expect("dir");
        d
    }

    /// Each block's descriptor in its region (at `offsets`), positions numbered from `first`.
    fn described(offsets: &[u64], blocks: &[Bytes], first: u32) -> Vec<(u32, BlockDescriptor)> {
        let desc = |(&offset, b): (&u64, &Bytes)| BlockDescriptor {
            seq_hash: None,
            region: RegionKey(0),
            offset,
            len: b.len() as u64,
            checksum: checksum(b),
        };
        (first..).zip(offsets.iter().zip(blocks).map(desc)).collect()
    }

    #[test]
    fn blocks_round_trip_and_damage_is_caught() {
        let dir = scratch("round-trip");
        let owner = ShmDir::open(&dir, "a1").expect("owner");
        let blocks: Vec<Bytes> = (0..4u8).map(|i| Bytes::from(vec![i; 4096])).collect();
        let (region, offsets) = owner.create_region(LeaseId(0xfeed), &blocks).expect("region");
        let descs = described(&offsets, &blocks, 0);
        let got = pull(region.path(), &descs[1..]).expect("pulls");
        assert_eq!(got.iter().map(|(_, b)| b.clone()).collect::<Vec<_>>(), blocks[1..].to_vec());
        // Into a buffer the caller keeps: the blocks in the order asked, the buffer's room reused.
        let mut dst = Vec::with_capacity(3 * 4096);
        let room = dst.as_ptr();
        let order = [descs[3], descs[0], descs[2]];
        let ranges = pull_into(region.path(), &order, &mut dst).expect("pulls into");
        assert_eq!(dst.as_ptr(), room, "no new allocation");
        for ((index, range), want) in ranges.iter().zip([3, 0, 2]) {
            assert_eq!((*index, &dst[range.clone()]), (want, &blocks[want as usize][..]));
        }
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(fs::metadata(region.path()).expect("meta").permissions().mode() & 0o077, 0, "owner-only");
        let mut bad = descs.clone();
        bad[2].1.checksum ^= 1;
        assert!(matches!(pull(region.path(), &bad), Err(TransferError::Integrity { index: 2, .. })));
        bad[2].1.offset = 1 << 40;
        assert!(matches!(
            pull(region.path(), &bad),
            Err(TransferError::Integrity { what: "outside the shared region", .. })
        ));
        let path = region.path().to_path_buf();
        drop(region);
        assert!(!path.exists(), "the region is removed with its lease");
        drop(owner);
        assert_eq!(fs::read_dir(&dir).expect("dir").count(), 0, "the owner's lock file goes with it");
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn mapped_blocks_are_read_in_place_checked_by_their_copy_and_outlive_the_file() {
        let dir = scratch("mapped");
        let owner = ShmDir::open(&dir, "m1").expect("owner");
        let blocks: Vec<Bytes> = (0..3u8).map(|i| Bytes::from(vec![i + 7; 4096])).collect();
        let (region, offsets) = owner.create_region(LeaseId(0xbeef), &blocks).expect("region");
        let descs = described(&offsets, &blocks, 10);
        let mapped = MappedBlocks::open(region.path(), &[descs[2], descs[0]]).expect("maps");
        // The owner lets the lease go (the file is unlinked): the mapping still reads the blocks.
        drop(region);
        assert_eq!((mapped.len(), mapped.bytes()), (2, 8192));
        let (index, bytes) = mapped.block(0);
        assert_eq!((index, bytes), (12, &blocks[2][..]));
        let mut copy = bytes.to_vec();
        assert!(mapped.check(0, &copy).is_ok());
        copy[100] ^= 1;
        assert!(matches!(
            mapped.check(0, &copy),
            Err(TransferError::Integrity { index: 12, what: "checksum mismatch" })
        ));
        assert!(matches!(
            mapped.check(1, &blocks[0][..4095]),
            Err(TransferError::Integrity { what: "wrong length", .. })
        ));
        drop((mapped, owner));
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn blocks_scattered_through_a_store_map_only_their_runs_at_any_offset() {
        let dir = scratch("store");
        let owner = ShmDir::open(&dir, "s1").expect("owner");
        // A store of 64 blocks of 5,000 bytes (not a page multiple), block k filled with k.
        let len = 5_000u64;
        let store: Vec<u8> = (0..64u8).flat_map(|k| vec![k; len as usize]).collect();
        fs::write(owner.store_path(), &store).expect("store");
        let block = |k: u8| Bytes::from(vec![k; len as usize]);
        let picked = [9u8, 10, 11, 40, 3];
        let descs: Vec<(u32, BlockDescriptor)> = picked
            .iter()
            .enumerate()
            .map(|(i, &k)| (i as u32, described(&[u64::from(k) * len], &[block(k)], i as u32)[0].1))
            .collect();
        let mapped = MappedBlocks::open(&owner.store_path(), &descs).expect("maps");
        assert_eq!(mapped.maps.len(), 3, "9-11 is one run; 40 and 3 one each");
        for (i, &k) in picked.iter().enumerate() {
            let (index, bytes) = mapped.block(i);
            assert_eq!((index, bytes), (i as u32, &block(k)[..]));
            assert!(mapped.check(i, bytes).is_ok());
        }
        let mut past = descs[3];
        past.1.offset = 63 * len + 1;
        assert!(matches!(
            MappedBlocks::open(&owner.store_path(), &[past]),
            Err(TransferError::Integrity { what: "outside the shared region", .. })
        ));
        // A store is the owner's like its regions: removed when the owner stops, and swept when it crashed (as
        // one whose lock file is gone: the store written again after the stop).
        let path = owner.store_path();
        drop((mapped, owner));
        assert!(!path.exists());
        fs::write(&path, b"left by a crash").expect("store");
        let next = ShmDir::open(&dir, "s2").expect("owner");
        assert_eq!((next.swept(), path.exists()), (1, false));
        drop(next);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_owner_that_stops_takes_its_store_and_lock_with_it() {
        let dir = scratch("stop");
        let owner = ShmDir::open(&dir, "stops").expect("owner");
        // As the engine makes it: the device KV store, mapped while the owner runs.
        fs::write(owner.store_path(), vec![7u8; 4096]).expect("store");
        let mapped = map(&fs::File::open(owner.store_path()).expect("open"), 0, 4096).expect("mapped");
        drop(owner);
        let left: Vec<String> =
            fs::read_dir(&dir).expect("dir").filter_map(|e| e.ok()?.file_name().into_string().ok()).collect();
        assert!(left.is_empty(), "nothing left behind: {left:?}");
        // A mapping made before still reads the store.
        assert!(mapped.iter().all(|&b| b == 7));
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_gone_owners_files_are_swept_and_a_live_owners_are_not() {
        let dir = scratch("sweep");
        let live = ShmDir::open(&dir, "live").expect("owner");
        let (kept, _) = live.create_region(LeaseId(1), &[Bytes::from_static(b"kept")]).expect("region");
        // A crashed owner: its lock file is there but nobody holds it; and a region with no lock file at all.
        fs::write(dir.join("tandem-kv-dead.lock"), b"").expect("lock");
        fs::write(dir.join(format!("tandem-kv-dead-{:032x}", 2)), b"stale").expect("region");
        fs::write(dir.join(format!("tandem-kv-orphan-{:032x}", 3)), b"stale").expect("region");
        fs::write(dir.join("unrelated"), b"not ours").expect("file");
        let next = ShmDir::open(&dir, "next").expect("owner");
        assert_eq!(next.swept(), 3, "the dead owner's lock and region, and the orphan");
        let mut left: Vec<String> =
            fs::read_dir(&dir).expect("dir").filter_map(|e| e.ok()?.file_name().into_string().ok()).collect();
        left.sort();
        assert_eq!(
            left,
            vec![
                format!("tandem-kv-live-{:032x}", 1),
                "tandem-kv-live.lock".to_string(),
                "tandem-kv-next.lock".to_string(),
                "unrelated".to_string()
            ]
        );
        assert!(kept.path().exists());
        // An owner name the file scheme cannot carry is refused.
        assert!(ShmDir::open(&dir, "a-b").is_err());
        drop((kept, live, next));
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_region_must_fit_beside_the_headroom() {
        let dir = Path::new("/dev/shm");
        // A container's 64 MiB /dev/shm holds a 47 MB prompt region, not two of them.
        let (mib, region) = (1u64 << 20, 47_185_920);
        assert!(room_for(region, 64 * mib, dir).is_ok());
        let refused = room_for(region, 64 * mib - region, dir);
        assert!(matches!(refused, Err(TransferError::Io(ref e)) if e.kind() == std::io::ErrorKind::StorageFull));
        assert!(room_for(u64::MAX - 1, u64::MAX - 1, dir).is_err(), "no overflow");
        // The real filesystem is asked, not assumed.
        assert!(free_bytes(&std::env::temp_dir()).expect("statvfs") > 0);
    }

    #[test]
    fn a_lease_whose_file_exists_is_refused_and_the_file_is_not_touched() {
        let dir = scratch("exists");
        let owner = ShmDir::open(&dir, "o1").expect("owner");
        let (first, _) = owner.create_region(LeaseId(5), &[Bytes::from_static(b"one")]).expect("region");
        assert!(owner.create_region(LeaseId(5), &[Bytes::from_static(b"two")]).is_err());
        assert_eq!(fs::read(first.path()).expect("still there"), b"one");
        drop((first, owner));
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_handle_names_a_store_only_and_only_in_the_readers_own_directory() {
        let dir = scratch("named");
        let owner = ShmDir::open(&dir, "ab12").expect("owner");
        let store = owner.store_path();
        assert_eq!(store_in(owner.dir(), &store.display().to_string()), Some(store.clone()));
        // The owner's directory as the handle spells it does not matter: the reader's own is the one.
        assert_eq!(store_in(&dir, "/somewhere/else/tandem-kv-ab12-store"), Some(store));
        for named in [
            "/etc/passwd",
            "/dev/shm/tandem-kv-ab12.lock",
            "/dev/shm/tandem-kv-ab12-00000000000000000000000000000005",
            "/dev/shm/tandem-kv--store",
            "/dev/shm/tandem-kv-a.b-store",
            "/dev/shm/tandem-kv-ab12-store/..",
            "",
        ] {
            assert_eq!(store_in(&dir, named), None, "{named}");
        }
        drop(owner);
        let _ = fs::remove_dir_all(&dir);
    }
}
