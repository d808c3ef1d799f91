//! A fixed-length array for the pool's and the index's large tables, whose memory is asked to be backed by huge
//! pages. Those tables (block locations, slot states, the index's block map) are read at random, one entry per
//! block, and a simulated cluster's add up to tens of MiB: with 4 KiB pages nearly every such read also misses the
//! TLB, and the page walk is a second miss before the entry's own. A table of [`HUGE_FROM`] bytes or more is
//! placed on 2 MiB boundaries and advised (`MADV_HUGEPAGE`) before it is first written, so that where the system
//! grants huge pages on advice (`/sys/kernel/mm/transparent_hugepage/enabled` set to `madvise` or `always`), one
//! TLB entry covers 2 MiB of it. The advice is a hint: where it is refused, the table works the same on small pages.

use std::alloc::{Layout, alloc, dealloc, handle_alloc_error};
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// A huge page's size (x86_64 and aarch64 with 4 KiB base pages).
const HUGE_PAGE: usize = 2 << 20;

/// Tables at least this large get memory of their own, advised for huge pages; smaller ones are plain allocations
/// (a huge page for each would waste more than it saves).
pub const HUGE_FROM: usize = 512 << 10;

/// `len` values of `T` in one allocation that never grows.
pub struct Table<T: Copy> {
    ptr: NonNull<T>,
    len: usize,
    memory: Memory,
}

/// Where a table's values live.
enum Memory {
    /// Nothing allocated: no values, or values of size 0 (the pointer dangles, well aligned).
    None,
    /// The global allocator's, with this layout.
    Heap(Layout),
    /// A private anonymous mapping, the values at its first 2 MiB boundary, advised for huge pages from there. Its
    /// own mapping, because memory an allocator hands out may already be backed by small pages, which advice does
    /// not change. Unmapped when dropped.
    #[cfg(target_os = "linux")]
    Mapped(#[allow(dead_code)] memmap2::MmapMut),
}

// SAFETY: a `Table<T>` owns its values as a `Box<[T]>` would; sending or sharing it is sending or sharing them.
#[allow(unsafe_code)]
unsafe impl<T: Copy + Send> Send for Table<T> {}
// SAFETY: as above; `&Table<T>` hands out only `&T`.
#[allow(unsafe_code)]
unsafe impl<T: Copy + Sync> Sync for Table<T> {}

impl<T: Copy> Table<T> {
    /// `len` copies of `value`.
    pub fn filled(len: usize, value: T) -> Table<T> {
        let bytes = len.checked_mul(size_of::<T>()).expect("table size overflows usize");
        let (ptr, memory) = if bytes == 0 {
            (NonNull::<T>::dangling().cast::<u8>(), Memory::None)
        } else {
            match map_huge(bytes) {
                Some(mapped) => mapped,
                None => {
                    let layout = Layout::array::<T>(len).expect("table layout");
                    #[allow(unsafe_code)]
                    // SAFETY: `layout` has a non-zero size (`bytes > 0`).
                    let raw = unsafe { alloc(layout) };
                    let Some(ptr) = NonNull::new(raw) else { handle_alloc_error(layout) };
                    (ptr, Memory::Heap(layout))
                }
            }
        };
        let ptr = ptr.cast::<T>();
        for i in 0..len {
            #[allow(unsafe_code)]
            // SAFETY: `i < len`, and the memory holds `len` values of `T`, aligned for `T` (a mapping is 2 MiB
            // aligned); nothing was there to drop. With `bytes == 0`, `T` has size 0 and the writes touch nothing.
            unsafe {
                ptr.add(i).write(value)
            };
        }
        Table { ptr, len, memory }
    }
}

impl<T: Copy> Drop for Table<T> {
    fn drop(&mut self) {
        if let Memory::Heap(layout) = self.memory {
            #[allow(unsafe_code)]
            // SAFETY: allocated in `filled` with this layout; `T: Copy` values need no drop.
            unsafe {
                dealloc(self.ptr.as_ptr().cast::<u8>(), layout)
            }
        }
    }
}

impl<T: Copy> Deref for Table<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        #[allow(unsafe_code)]
        // SAFETY: `len` values were written in `filled` and live until drop (or `len` is 0 or `T` has size 0,
        // and the pointer is dangling and well aligned).
        unsafe {
            std::slice::from_raw_parts(self.ptr.as_ptr(), self.len)
        }
    }
}

impl<T: Copy> DerefMut for Table<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        #[allow(unsafe_code)]
        // SAFETY: as in `deref`, and `&mut self` makes the borrow unique.
        unsafe {
            std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len)
        }
    }
}

impl<T: Copy> Default for Table<T> {
    fn default() -> Table<T> {
        Table { ptr: NonNull::dangling(), len: 0, memory: Memory::None }
    }
}

impl<T: Copy> Clone for Table<T> {
    fn clone(&self) -> Table<T> {
        let Some(&first) = self.first() else { return Table::default() };
        let mut copy = Table::filled(self.len, first);
        copy.copy_from_slice(self);
        copy
    }
}

impl<T: Copy + fmt::Debug> fmt::Debug for Table<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// A fresh mapping holding at least `bytes` (from [`HUGE_FROM`] on) at a 2 MiB boundary, advised for huge pages;
/// `None` for a smaller table, or if the system refuses the mapping (the caller then takes heap memory).
#[cfg(target_os = "linux")]
fn map_huge(bytes: usize) -> Option<(NonNull<u8>, Memory)> {
    if bytes < HUGE_FROM {
        return None;
    }
    let size = bytes.checked_next_multiple_of(HUGE_PAGE)?;
    // One huge page more than the table, so that a 2 MiB boundary with room after it lies inside; the part before
    // it is never touched, so it takes no memory.
    let map = memmap2::MmapMut::map_anon(size.checked_add(HUGE_PAGE)?).ok()?;
    let base = map.as_ptr() as usize;
    let offset = base.next_multiple_of(HUGE_PAGE) - base;
    // A hint: if it is refused, the table works the same on small pages.
    let _ = map.advise_range(memmap2::Advice::HugePage, offset, size);
    let start = NonNull::new(map.as_ptr().wrapping_add(offset).cast_mut())?;
    Some((start, Memory::Mapped(map)))
}

#[cfg(not(target_os = "linux"))]
fn map_huge(_bytes: usize) -> Option<(NonNull<u8>, Memory)> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_hold_what_is_written_at_every_size() {
        for len in [0, 1, 7, HUGE_FROM / 8 - 1, HUGE_FROM / 8, HUGE_FROM / 8 + 3, 3 * HUGE_PAGE / 8 + 5] {
            let mut t = Table::filled(len, 7u64);
            assert_eq!(t.len(), len);
            assert!(t.iter().all(|&v| v == 7));
            for (i, v) in t.iter_mut().enumerate() {
                *v = i as u64;
            }
            let c = t.clone();
            assert!(c.iter().enumerate().all(|(i, &v)| v == i as u64), "len {len}");
            if len * 8 >= HUGE_FROM {
                assert_eq!(t.as_ptr() as usize % HUGE_PAGE, 0, "a large table starts on a huge page");
            }
        }
        assert!(Table::<u32>::default().is_empty());
        let zst = Table::filled(5, ());
        assert_eq!(zst.len(), 5);
    }
}
