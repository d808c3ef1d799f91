//! A hint to the processor to start loading a cache line the caller will touch soon. The pool's eviction runs
//! walk their victims in an order they know ahead (the LRU list), and each victim's slot state and map entry is a
//! miss on a large pool: asking for the next victims' lines while this one is handled lets those misses overlap
//! instead of queueing one behind another.

/// Starts loading the cache line holding `value`; never faults and changes nothing the program can observe.
#[inline(always)]
pub fn prefetch<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    #[allow(unsafe_code)]
    // SAFETY: `_mm_prefetch` is a hint: it reads nothing architecturally and cannot fault, whatever the address
    // (here a valid reference besides); SSE is part of the x86_64 baseline, so the instruction is always there.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>((value as *const T).cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}
