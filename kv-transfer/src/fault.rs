//! Fault injection for tests: a [`BlockSource`] wrapper that drops, delays, truncates or corrupts blocks on
//! command, so every failure a network or a dying peer can cause is reproducible on loopback.

use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;

use crate::frame::ErrorCode;
use crate::lease::LeaseId;
use crate::quic::BlockSource;

/// What to do to a block as it is served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Refuse the read as if the owner failed mid-transfer.
    Drop,
    /// Serve it after a pause.
    Delay(Duration),
    /// Serve only the first half of its bytes.
    Truncate,
    /// Flip one byte.
    Corrupt,
}

/// Serves blocks from `inner`, applying the faults set for particular block positions.
#[derive(Debug)]
pub struct FaultySource<S> {
    inner: S,
    faults: Mutex<Vec<(u32, Fault)>>,
}

impl<S: BlockSource> FaultySource<S> {
    pub fn new(inner: S) -> FaultySource<S> {
        FaultySource { inner, faults: Mutex::new(Vec::new()) }
    }

    /// Applies `fault` to block `index` from now on (replacing an earlier fault for it).
    pub fn inject(&self, index: u32, fault: Fault) {
        if let Ok(mut f) = self.faults.lock() {
            f.retain(|(i, _)| *i != index);
            f.push((index, fault));
        }
    }

    /// Removes every fault.
    pub fn heal(&self) {
        if let Ok(mut f) = self.faults.lock() {
            f.clear();
        }
    }

    fn fault(&self, index: u32) -> Option<Fault> {
        self.faults.lock().ok()?.iter().find(|(i, _)| *i == index).map(|(_, f)| *f)
    }
}

impl<S: BlockSource> BlockSource for FaultySource<S> {
    fn release(&self, lease: LeaseId) {
        self.inner.release(lease);
    }

    fn read(&self, lease: LeaseId, index: u32) -> Result<(u64, Bytes), (ErrorCode, String)> {
        let (sum, bytes) = self.inner.read(lease, index)?;
        Ok(match self.fault(index) {
            None => (sum, bytes),
            Some(Fault::Drop) => return Err((ErrorCode::Internal, format!("injected drop of block {index}"))),
            Some(Fault::Delay(d)) => {
                std::thread::sleep(d);
                (sum, bytes)
            }
            Some(Fault::Truncate) => (sum, bytes.slice(..bytes.len() / 2)),
            Some(Fault::Corrupt) => {
                let mut v = bytes.to_vec();
                if let Some(b) = v.get_mut(bytes.len() / 2) {
                    *b ^= 0x5A;
                }
                (sum, Bytes::from(v))
            }
        })
    }
}
