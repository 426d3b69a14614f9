//! Transparent huge pages for large tensors the runtime allocates.
//!
//! A fresh large allocation is mapped lazily: its first write faults in one
//! 4 KiB page at a time, each zeroed by the kernel. On the project machine
//! that made a copy into a fresh 64 MiB buffer take 31–35 ms against 6 ms
//! with 2 MiB pages (measured with numpy, which asks for huge pages the
//! same way for arrays of 4 MiB and more). Where the kernel's
//! `transparent_hugepage/enabled` is `madvise` (a common default), a range
//! gets huge pages only when it asks for them; with `always` it has them
//! anyway, and with `never` the advice is ignored.

/// Size from which a tensor's memory asks for huge pages (numpy's threshold).
pub const HUGE_PAGES_FROM: usize = 4 << 20;

/// Advises the kernel to back the whole pages of `buf` with huge pages
/// (Linux; nothing elsewhere). Advice only: a refusal changes nothing but
/// speed, so its error is ignored.
pub fn advise(buf: &[u8]) {
    #[cfg(target_os = "linux")]
    linux::advise(buf);
    #[cfg(not(target_os = "linux"))]
    let _ = buf;
}

#[cfg(target_os = "linux")]
mod linux {
    /// The whole pages inside `buf`: their start and length in bytes.
    pub(super) fn whole_pages(start: usize, len: usize, page: usize) -> Option<(usize, usize)> {
        let first = start.checked_next_multiple_of(page)?;
        let end = (start.checked_add(len)? / page) * page;
        (end > first).then(|| (first, end - first))
    }

    #[allow(unsafe_code)]
    pub(super) fn advise(buf: &[u8]) {
        // SAFETY: sysconf only reads a constant of the system.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        let Ok(page) = usize::try_from(page) else {
            return;
        };
        if page == 0 {
            return;
        }
        let Some((first, len)) = whole_pages(buf.as_ptr() as usize, buf.len(), page) else {
            return;
        };
        // SAFETY: [first, first + len) lies inside `buf`, memory this process
        // owns; MADV_HUGEPAGE changes how the kernel backs those pages, never
        // their contents or the mapping's validity.
        let _ = unsafe { libc::madvise(first as *mut libc::c_void, len, libc::MADV_HUGEPAGE) };
    }

    #[cfg(test)]
    mod tests {
        use super::whole_pages;

        #[test]
        fn only_whole_pages_inside_the_buffer_are_advised() {
            assert_eq!(whole_pages(4096, 8192, 4096), Some((4096, 8192)));
            assert_eq!(whole_pages(4112, 3 * 4096, 4096), Some((8192, 2 * 4096)));
            assert_eq!(whole_pages(4112, 4096, 4096), None);
            assert_eq!(whole_pages(usize::MAX - 10, 5, 4096), None);
        }

        /// The `VmFlags` line of the mapping of this process that holds `addr`.
        fn vm_flags(addr: usize) -> Option<String> {
            let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
            let mut inside = false;
            for line in smaps.lines() {
                let range = line.split_whitespace().next().unwrap_or("");
                if let Some((a, b)) = range.split_once('-') {
                    if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                        inside = (a..b).contains(&addr);
                        continue;
                    }
                }
                if inside && line.starts_with("VmFlags:") {
                    return Some(line.to_owned());
                }
            }
            None
        }

        #[test]
        fn large_tensors_ask_for_huge_pages_and_small_ones_do_not() {
            use crate::{DType, HUGE_PAGES_FROM, Tensor};
            // A kernel built without transparent huge pages refuses the
            // advice; a sandbox may show no `VmFlags`: nothing to check.
            if !std::path::Path::new("/sys/kernel/mm/transparent_hugepage/enabled").exists() {
                eprintln!("skipped: this kernel has no transparent huge pages");
                return;
            }
            let large = Tensor::zeros(DType::U8, [HUGE_PAGES_FROM]).unwrap();
            let middle = large.as_bytes().as_ptr() as usize + HUGE_PAGES_FROM / 2;
            let Some(flags) = vm_flags(middle) else {
                eprintln!("skipped: /proc/self/smaps shows no VmFlags here");
                return;
            };
            // `hg`: the range was advised MADV_HUGEPAGE.
            assert!(flags.split_whitespace().any(|f| f == "hg"), "{flags}");
            let small = Tensor::zeros(DType::U8, [HUGE_PAGES_FROM - 4096]).unwrap();
            let middle = small.as_bytes().as_ptr() as usize + (HUGE_PAGES_FROM - 4096) / 2;
            if let Some(flags) = vm_flags(middle) {
                assert!(!flags.split_whitespace().any(|f| f == "hg"), "{flags}");
            }
        }
    }
}
