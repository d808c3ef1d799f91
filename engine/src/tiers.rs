//! Where the pool's host and disk tiers keep their bytes, and the executor of the pool's copy actions.
//!
//! The host tier is a second [`KvStore`] in RAM. The disk tier is one file per slot under a directory, each with
//! a header (magic, the block's sequence hash, payload length, xxh3 checksum of the payload), so a corrupt or
//! truncated file is caught when it is read and never fed to the model.
//!
//! Restart policy: the disk tier is **cleared at start-up**. A worker that restarts announces a new instance and
//! starts its event stream from an empty snapshot; files from a previous process (possibly cut short by a crash)
//! are deleted rather than trusted.

use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use half::f16;
use kv_cache::SeqHash;
use kv_cache::events::Tier;
use kv_cache::pool::{Action, Location};

use crate::kv::{BlockId, KvStore};

const MAGIC: &[u8; 4] = b"TKVB";
const HEADER: usize = 4 + 8 + 8 + 8;
const EXTENSION: &str = "kvblock";

/// Why a tier operation failed.
#[derive(Debug, thiserror::Error)]
pub enum TierError {
    #[error("disk tier directory {path}: {source}")]
    Dir { path: PathBuf, source: io::Error },
    #[error("disk block {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("disk block {path} is corrupt: {what}")]
    Corrupt { path: PathBuf, what: &'static str },
    #[error("the pool asked to copy between {from:?} and {to:?}, which this engine does not store")]
    Unsupported { from: Location, to: Location },
}

/// The disk tier: one checksummed file per slot.
#[derive(Debug)]
pub struct DiskTier {
    dir: PathBuf,
    /// An exclusive lock on the directory for as long as the tier lives (released when the process ends, however
    /// it ends): two workers given one directory would delete each other's blocks.
    _lock: fs::File,
}

impl DiskTier {
    /// Opens `dir` for the disk tier: creates it, locks it (refused while another live process holds it), and
    /// deletes blocks of an earlier run.
    pub fn open(dir: &Path) -> Result<DiskTier, TierError> {
        let err = |source| TierError::Dir { path: dir.to_path_buf(), source };
        fs::create_dir_all(dir).map_err(err)?;
        let lock =
            fs::OpenOptions::new().write(true).create(true).truncate(false).open(dir.join(".lock")).map_err(err)?;
        lock.try_lock().map_err(|_| {
            err(io::Error::new(io::ErrorKind::ResourceBusy, "in use by another worker (give each its own --disk-dir)"))
        })?;
        for entry in fs::read_dir(dir).map_err(err)? {
            let path = entry.map_err(err)?.path();
            if path.extension().is_some_and(|e| e == EXTENSION) {
                fs::remove_file(&path).map_err(err)?;
            }
        }
        let probe = dir.join(".write-probe");
        fs::write(&probe, b"ok").map_err(err)?;
        fs::remove_file(&probe).map_err(err)?;
        Ok(DiskTier { dir: dir.to_path_buf(), _lock: lock })
    }

    /// The file of `slot`.
    pub fn path(&self, slot: u32) -> PathBuf {
        self.dir.join(format!("slot-{slot:06}.{EXTENSION}"))
    }

    /// Writes a block (to a temporary name first, so a crash never leaves a half-written file under the real one).
    pub fn write(&self, slot: u32, seq: SeqHash, block: &[f16]) -> Result<(), TierError> {
        let path = self.path(slot);
        let io = |source| TierError::Io { path: path.clone(), source };
        let payload: &[u8] = bytemuck::cast_slice(block);
        let mut header = Vec::with_capacity(HEADER);
        header.extend_from_slice(MAGIC);
        header.extend_from_slice(&seq.0.to_le_bytes());
        header.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        header.extend_from_slice(&xxhash_rust::xxh3::xxh3_64(payload).to_le_bytes());
        let tmp = path.with_extension("partial");
        let mut f = fs::File::create(&tmp).map_err(io)?;
        f.write_all(&header).map_err(io)?;
        f.write_all(payload).map_err(io)?;
        drop(f);
        fs::rename(&tmp, &path).map_err(io)
    }

    /// Reads the block in `slot`, which must be `seq`, into `out`, checking length and checksum.
    pub fn read(&self, slot: u32, seq: SeqHash, out: &mut [f16]) -> Result<(), TierError> {
        let path = self.path(slot);
        let corrupt = |what| TierError::Corrupt { path: path.clone(), what };
        let mut f = fs::File::open(&path).map_err(|source| TierError::Io { path: path.clone(), source })?;
        let mut header = [0u8; HEADER];
        f.read_exact(&mut header).map_err(|_| corrupt("truncated header"))?;
        let word = |i: usize| u64::from_le_bytes(header[i..i + 8].try_into().unwrap_or_default());
        if &header[..4] != MAGIC {
            return Err(corrupt("bad magic"));
        }
        if word(4) != seq.0 {
            return Err(corrupt("holds another block"));
        }
        let payload: &mut [u8] = bytemuck::cast_slice_mut(out);
        if word(12) != payload.len() as u64 {
            return Err(corrupt("wrong length"));
        }
        f.read_exact(payload).map_err(|_| corrupt("truncated payload"))?;
        if f.read(&mut [0u8; 1]).map_err(|source| TierError::Io { path: path.clone(), source })? != 0 {
            return Err(corrupt("trailing bytes"));
        }
        if xxhash_rust::xxh3::xxh3_64(payload) != word(20) {
            return Err(corrupt("checksum mismatch"));
        }
        Ok(())
    }
}

/// The bytes of every tier, and the copies between them.
#[derive(Debug)]
pub struct TierStores {
    pub device: KvStore,
    pub host: Option<KvStore>,
    pub disk: Option<DiskTier>,
    /// Disk blocks read and verified ahead of an onboarding copy, by disk slot.
    staged: Vec<(u32, Vec<f16>)>,
}

impl TierStores {
    pub fn new(device: KvStore, host: Option<KvStore>, disk: Option<DiskTier>) -> TierStores {
        TierStores { device, host, disk, staged: Vec::new() }
    }

    /// Reads and verifies a disk block that is about to be onboarded. On error the caller discards the block
    /// from the pool (it will be recomputed).
    pub fn stage_disk_block(&mut self, slot: u32, seq: SeqHash) -> Result<(), TierError> {
        let Some(disk) = &self.disk else { return Ok(()) };
        let mut buf = vec![f16::ZERO; self.device.layout().block_elems()];
        disk.read(slot, seq, &mut buf)?;
        self.staged.push((slot, buf));
        Ok(())
    }

    /// Performs the pool's copies in order.
    pub fn execute(&mut self, actions: &[Action]) -> Result<(), TierError> {
        // Blocks that hold nothing (the simulator's) have nothing to copy in memory: only disk files are written.
        let empty = self.device.layout().block_elems() == 0;
        for &Action::Copy { from, to, block } in actions {
            let unsupported = || TierError::Unsupported { from, to };
            match (from.tier, to.tier) {
                (Tier::Device, Tier::Host) => {
                    let host = self.host.as_mut().ok_or_else(unsupported)?;
                    if !empty {
                        host.block_mut(BlockId(to.slot)).copy_from_slice(self.device.block(BlockId(from.slot)));
                    }
                }
                (Tier::Host, Tier::Device) => {
                    let host = self.host.as_ref().ok_or_else(unsupported)?;
                    if !empty {
                        self.device.block_mut(BlockId(to.slot)).copy_from_slice(host.block(BlockId(from.slot)));
                    }
                }
                (Tier::Host, Tier::Disk) => {
                    let (host, disk) = (self.host.as_ref(), self.disk.as_ref());
                    let (Some(host), Some(disk)) = (host, disk) else { return Err(unsupported()) };
                    disk.write(to.slot, block, host.block(BlockId(from.slot)))?;
                }
                (Tier::Disk, Tier::Device) => {
                    let at = self.staged.iter().position(|(s, _)| *s == from.slot);
                    match at {
                        Some(i) => {
                            let (_, buf) = self.staged.swap_remove(i);
                            self.device.block_mut(BlockId(to.slot)).copy_from_slice(&buf);
                        }
                        None => {
                            let disk = self.disk.as_ref().ok_or_else(unsupported)?;
                            disk.read(from.slot, block, self.device.block_mut(BlockId(to.slot)))?;
                        }
                    }
                }
                _ => return Err(unsupported()),
            }
        }
        self.staged.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_disk_directory_serves_one_worker_at_a_time() {
        let dir = std::env::temp_dir().join(format!("tandem-disk-lock-{}", std::process::id()));
        let first = DiskTier::open(&dir).expect("opens");
        let second = DiskTier::open(&dir).expect_err("a second tier on the same directory is refused");
        assert!(second.to_string().contains("in use"), "{second}");
        drop(first);
        DiskTier::open(&dir).expect("free again once the first is gone");
        let _ = fs::remove_dir_all(&dir);
    }
}
