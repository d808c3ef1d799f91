//! The shared-memory transport, for workers on one host: the owner writes a lease's blocks into a file in shared
//! memory (`/dev/shm` by default), readable only by its user and named by the unguessable lease id; the reader
//! maps it and copies the blocks it needs itself — a one-sided read — checking each block's length and checksum.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use bytes::Bytes;

use crate::checksum;
use crate::descriptor::BlockDescriptor;
use crate::lease::LeaseId;
use crate::quic::TransferError;

/// Where shared-memory regions live when nothing else is said.
pub const DEFAULT_DIR: &str = "/dev/shm";

/// A lease's blocks in a shared-memory file, removed when dropped.
#[derive(Debug)]
pub struct ShmRegion {
    path: PathBuf,
}

impl ShmRegion {
    /// Writes `blocks` back to back into a new owner-only file under `dir`; the i-th block is at offset
    /// `i * len` for equal-length blocks (the offsets are returned).
    pub fn create(dir: &Path, lease: LeaseId, blocks: &[Bytes]) -> Result<(ShmRegion, Vec<u64>), TransferError> {
        use std::os::unix::fs::OpenOptionsExt;
        let path = dir.join(format!("tandem-kv-{:032x}", lease.0));
        let mut f = fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path)?;
        let mut offsets = Vec::with_capacity(blocks.len());
        let mut at = 0u64;
        for b in blocks {
            offsets.push(at);
            f.write_all(b)?;
            at += b.len() as u64;
        }
        f.sync_data().ok();
        Ok((ShmRegion { path }, offsets))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ShmRegion {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.path);
    }
}

/// Copies `blocks` (position, descriptor) out of the region at `path`; all verified, or an error and none.
pub fn pull(path: &Path, blocks: &[(u32, BlockDescriptor)]) -> Result<Vec<(u32, Bytes)>, TransferError> {
    let file = fs::File::open(path)?;
    let map = map(&file)?;
    let mut out = Vec::with_capacity(blocks.len());
    for &(index, d) in blocks {
        let range = usize::try_from(d.offset)
            .ok()
            .zip(usize::try_from(d.len).ok())
            .and_then(|(o, l)| o.checked_add(l).map(|end| o..end))
            .filter(|r| r.end <= map.len())
            .ok_or(TransferError::Integrity { index, what: "outside the shared region" })?;
        let bytes = Bytes::copy_from_slice(&map[range]);
        if checksum(&bytes) != d.checksum {
            return Err(TransferError::Integrity { index, what: "checksum mismatch" });
        }
        out.push((index, bytes));
    }
    Ok(out)
}

#[allow(unsafe_code)]
fn map(file: &fs::File) -> std::io::Result<memmap2::Mmap> {
    // SAFETY: the owner writes a region once, before any handle naming it exists, and afterwards only unlinks
    // it (never truncates or rewrites), so the mapped bytes stay valid and unchanged while we read them.
    unsafe { memmap2::Mmap::map(file) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::descriptor::RegionKey;

    #[test]
    fn blocks_round_trip_and_damage_is_caught() {
        let dir = std::env::temp_dir();
        let blocks: Vec<Bytes> = (0..4u8).map(|i| Bytes::from(vec![i; 4096])).collect();
        let (region, offsets) =
            ShmRegion::create(&dir, LeaseId(0xfeed_0000 + u128::from(std::process::id())), &blocks).expect("region");
        let descs: Vec<(u32, BlockDescriptor)> = offsets
            .iter()
            .zip(&blocks)
            .enumerate()
            .map(|(i, (&offset, b))| {
                let d =
                    BlockDescriptor { seq_hash: None, region: RegionKey(0), offset, len: 4096, checksum: checksum(b) };
                (i as u32, d)
            })
            .collect();
        let got = pull(region.path(), &descs[1..]).expect("pulls");
        assert_eq!(got.iter().map(|(_, b)| b.clone()).collect::<Vec<_>>(), blocks[1..].to_vec());
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
    }
}
