//! Transparent huge pages for the tables that ask for them, and for nothing else.
//!
//! mimalloc is built with `no_thp`, so at start-up it switches transparent huge pages off for the whole process
//! (`prctl(PR_SET_THP_DISABLE)`): huge pages under the allocator's churned memory cost more in the kernel's zeroing
//! than they saved (ARCHITECTURE.md, "Allocator"). That switch also refuses the pages the block pool's and the
//! router index's large tables ask for with `MADV_HUGEPAGE` (`kv_cache::table`). Where the system backs only
//! advised memory with huge pages (`enabled` is `[madvise]`), turning the switch back on gives those tables huge
//! pages and leaves the allocator's memory on small ones, since mimalloc built so never advises its own. Under
//! `always` the switch stays off: every allocation would get them.

/// Where the kernel says which memory it backs with transparent huge pages.
const THP_MODE: &str = "/sys/kernel/mm/transparent_hugepage/enabled";

/// Lets memory advised for huge pages get them, if the system grants them on advice only. Call once, early in
/// `main` (the allocator has switched them off by then). Nothing happens where the mode cannot be read.
pub fn allow_advised() {
    let Ok(mode) = std::fs::read_to_string(THP_MODE) else { return };
    if advice_only(&mode) {
        #[cfg(target_os = "linux")]
        // Failing leaves the process as the allocator set it: the tables work the same on small pages.
        let _ = rustix::thread::disable_transparent_huge_pages(false);
    }
}

/// Whether `mode` (the file's text, the current choice in brackets) backs only advised memory with huge pages.
fn advice_only(mode: &str) -> bool {
    mode.split_whitespace().any(|choice| choice == "[madvise]")
}

#[cfg(test)]
mod tests {
    use super::advice_only;

    #[test]
    fn only_the_madvise_mode_lets_advised_memory_have_huge_pages() {
        assert!(advice_only("always [madvise] never\n"));
        assert!(!advice_only("[always] madvise never\n"));
        assert!(!advice_only("always madvise [never]\n"));
        assert!(!advice_only(""));
    }
}
