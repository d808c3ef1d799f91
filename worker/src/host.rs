//! Which host and shared-memory domain a worker is in. Two workers may read each other's shared-memory regions
//! only when their ids are equal: the same boot of the same kernel (`boot_id`) and the same shared-memory
//! directory (device and inode), which containers with their own `/dev/shm` do not share.

use std::path::Path;

/// This process's host id; with `shm_dir`, the directory is part of it.
pub fn host_id(shm_dir: Option<&Path>) -> String {
    use std::os::unix::fs::MetadataExt;
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown-boot".to_string());
    match shm_dir.and_then(|d| std::fs::metadata(d).ok()) {
        Some(m) => format!("{boot}/{:x}:{:x}", m.dev(), m.ino()),
        None => boot,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shared_memory_directory_is_part_of_the_id() {
        let a = std::env::temp_dir().join(format!("tandem-host-a-{}", std::process::id()));
        let b = std::env::temp_dir().join(format!("tandem-host-b-{}", std::process::id()));
        std::fs::create_dir_all(&a).expect("dir");
        std::fs::create_dir_all(&b).expect("dir");
        assert_eq!(host_id(Some(&a)), host_id(Some(&a)), "stable");
        assert_ne!(host_id(Some(&a)), host_id(Some(&b)), "another directory is another domain");
        assert!(host_id(Some(&a)).starts_with(&host_id(None)), "same boot");
        let _ = std::fs::remove_dir_all(&a);
        let _ = std::fs::remove_dir_all(&b);
    }
}
