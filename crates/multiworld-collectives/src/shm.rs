//! Same-host shared memory for large all-reduces, reduces, broadcasts,
//! all-gathers, reduce-scatters, gathers, scatters and
//! all-to-alls: the data
//! move through one
//! memory segment mapped by every member. Once it is set up, every call of the
//! group also agrees through it ([`agree`]: each member's descriptor in its
//! slot, then a barrier), and the TCP mesh carries only the setup, eager
//! payloads and the TCP algorithms (and, as for every call, detects a lost
//! member).
//!
//! **Setting up** (once per group, inside the first call that picks the
//! shared-memory algorithm; see `COLLECTIVES.md`): member 0 creates an anonymous
//! memory file (`memfd`, sealed against resizing), writes a random 128-bit nonce
//! into its header, and sends every other member an *offer* (its pid, the file
//! descriptor number, the size and the nonce) over the authenticated mesh. Each
//! member opens `/proc/<pid>/fd/<fd>`, maps it and checks the size and the nonce,
//! so a member on another host (or in another pid namespace, or another user)
//! fails the check instead of mapping some other file; it answers yes or no.
//! Member 0 tells every member the outcome: all yes, and the group uses the
//! segment from then on; any no, and the group uses the TCP ring for good. Every
//! member reaches the same state, so later calls agree on the algorithm. The file
//! has no name, so nothing is left behind if a process dies: its memory goes when
//! the last member unmaps it.
//!
//! **Layout.** A 4 KiB header (magic, nonce, and a line per member with its
//! arrival counter and abandoned word), the descriptor slots (two per
//! member), then three
//! buffers, each with one slot per member; a slot holds one *piece* of the tensor
//! (`CollectiveConfig::shm_piece_bytes`). A call works through its tensor piece
//! by piece, piece `k` in buffer `k mod 3`.
//!
//! **One piece** `k` of an all-reduce, on member `p` (the piece is split into
//! `n` segments as in the ring) goes through three phases:
//! 1. *publish*: copy the piece's segments other than `p` into `p`'s slot;
//! 2. *reduce*: reduce segment `p` over every member's copy **in rank order**
//!    (`x0 op x1 op ...`, exactly the sequential reference), writing the result
//!    into the caller's tensor and into segment `p` of `p`'s slot;
//! 3. *take*: copy the other members' reduced segments from their slots.
//!
//! Step `t` of a call takes piece `t − 2`, reduces piece `t − 1` and publishes
//! piece `t`, then every member signals and waits for the others' signals:
//! one barrier per step, `pieces + 1` in all. Each phase of a step reads only
//! what the others wrote before the previous barrier, the three phases of a
//! step use three different buffers, and a buffer is written again (piece
//! `k + 3`, step `k + 3`) only after the step that last read it (step `k + 2`)
//! has ended on every member. The agreement round that starts every call
//! orders calls the same way, so the last step needs no barrier.
//!
//! **Large tensors** (at least [`STREAM_MIN_BYTES`]) are written back into the
//! caller's memory with non-temporal stores on x86-64: they would not stay in
//! the caches anyway, and ordinary stores would first read every line and push
//! the pieces in flight out of the caches.
//!
//! **A call dropped while it uses the segment** leaves its member's arrivals
//! out of step; that member's next call abandons the segment
//! ([`Segment::abandon`]): the others stop waiting for it, and from that call
//! on every member agrees over TCP (see `COLLECTIVES.md` §7a).
//!
//! **Trust.** Only members that proved the world's secret get an offer, and the
//! file can only be opened by the same user. A member that broke the protocol
//! could corrupt results, as it could by sending wrong data over TCP; it cannot
//! make others fault: the file is sealed against shrinking and growing, and
//! every other member checks those seals before mapping it.

// The segment is memory shared with other processes: mapping it and reading and
// writing it need raw pointers. Every `unsafe` block below says why it is sound.
#![allow(unsafe_code)]

use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::desc::{self, Desc, Kind};
use crate::group::{Algorithm, CollectiveConfig, Ctx};
use crate::util::{Scratch, even_segments, try_join_all};
use multiworld_tcp::{Error, Result};
use multiworld_types::{DType, Rank, Tensor};
use multiworld_types::{ElemOp, Kernel, ReduceOp};

/// Size of the segment header (keeps the slots page-aligned).
const HEADER: usize = 4096;
/// Buffers in the segment, each with one slot per member: a step of a call
/// works on three pieces at once (see the module docs).
const BUFFERS: usize = 3;
/// Tensors of at least this many bytes are written back with non-temporal
/// stores (see the module docs).
const STREAM_MIN_BYTES: usize = 8 << 20;
/// "MWSHM\0v3" as a little-endian word (v2: three buffers, one barrier per
/// step; v3: descriptor slots and per-member abandoned words).
const MAGIC: u64 = u64::from_le_bytes(*b"MWSHM\0v3");
/// Offset, within a member's counter line, of its abandoned word: 0 while
/// the member uses the segment; once it has abandoned it, the sequence number
/// of its first call that does not use it, plus one. Written once.
const ABANDONED_IN_LINE: usize = 8;
/// Elements reduced per block (the running result stays in the L1/L2 cache).
const BLOCK_BYTES: usize = 32 << 10;
/// Bytes copied or reduced between two yields to the runtime, so that a
/// current-thread runtime keeps serving its sockets (and sees a lost member).
const YIELD_BYTES: usize = 1 << 20;
/// Words of an offer: present, pid, fd, size, nonce (2).
const OFFER_WORDS: usize = 6;
/// Offset of member 0's arrival counter in the header; each member's counter has
/// its own 64-byte cache line.
const COUNTERS: usize = 64;
/// Most members a group may have to use shared memory (one counter line each
/// in the header).
pub(crate) const MAX_MEMBERS: usize = (HEADER - COUNTERS) / 64;
/// Checks of the other members' counters, without yielding, before a barrier
/// yields between checks (`CollectiveConfig::shm_spin`) and then sleeps.
const SPINS: usize = 64;
/// Longest one futex sleep of a waiting thread (it re-checks after).
const WAIT_SLICE: Duration = Duration::from_millis(10);
/// Longest a blocking-pool thread waits before handing back to the call.
const BLOCKING_WAIT: Duration = Duration::from_millis(100);

/// Whether a group moves the data of large all-reduces through shared memory.
/// See [`crate::Group::shared_memory`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SharedMemory {
    /// Not tried yet: the first call that would use it sets it up.
    Untried,
    /// Every member maps the group's segment; large all-reduces use it.
    Active {
        /// Size of the segment (memory is only committed where it is written).
        segment_bytes: usize,
    },
    /// The members cannot (or chose not to) share memory; the group uses the
    /// TCP algorithms for good.
    Unavailable {
        /// Why, as seen by this member.
        reason: String,
    },
}

impl fmt::Display for SharedMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SharedMemory::Untried => f.write_str("not tried yet"),
            SharedMemory::Active { segment_bytes } => write!(f, "active ({segment_bytes} byte segment)"),
            SharedMemory::Unavailable { reason } => write!(f, "unavailable: {reason}"),
        }
    }
}

/// Size of the segment for pieces of `piece_bytes` (rounded down to a
/// multiple of 64) in a group of `n`, or `None` when such a group cannot use
/// shared memory (too many members, pieces under 64 bytes, or a size that does
/// not fit in memory). The same answer on every member, as both are agreed.
pub(crate) fn segment_len(piece_bytes: usize, n: usize) -> Option<usize> {
    let piece = piece_bytes & !63;
    if !(2..=MAX_MEMBERS).contains(&n) || piece == 0 {
        return None;
    }
    piece
        .checked_mul(BUFFERS * n)?
        .checked_add(HEADER)?
        .checked_add(desc_area(n)?)
        .filter(|&len| isize::try_from(len).is_ok())
}

/// Bytes of the descriptor slots of a group of `n`, after the header: two
/// per member (calls alternate between them by the parity of their sequence
/// number), each one descriptor's words; rounded up to whole pages so that
/// the buffers after them stay page-aligned.
fn desc_area(n: usize) -> Option<usize> {
    2usize
        .checked_mul(n)?
        .checked_mul(desc::words(n))?
        .checked_mul(8)?
        .checked_next_multiple_of(4096)
}

/// A member abandoned the segment: a call of its that used it was
/// cancelled, so its arrivals no longer match the others' (see
/// [`Segment::abandon`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Abandoned {
    /// The sequence number of the abandoning member's first call that does
    /// not use the segment: from this call on, it agrees over TCP.
    pub from: u64,
    /// The abandoning member's index.
    pub by: usize,
}

impl Abandoned {
    /// The error of a call that needed the abandoning member's arrival.
    pub(crate) fn error(self, members: &[Rank]) -> Error {
        Error::invalid(format!(
            "{} abandoned the group's shared memory (a call of its that used it was cancelled): \
             this call cannot complete, and the group's calls from #{} on use TCP",
            member_name(members, self.by),
            self.from
        ))
    }
}

/// "rank r" for member `p` of `members`.
pub(crate) fn member_name(members: &[Rank], p: usize) -> String {
    members
        .get(p)
        .map_or_else(|| format!("member {p}"), |r| format!("rank {r}"))
}

/// How a barrier through the segment ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Barrier {
    /// Every member arrived.
    Passed,
    /// It cannot pass: a member abandoned the segment before arriving (see
    /// `Segment::blocked`). `target` is the arrival the barrier waited for.
    Abandoned { by: Abandoned, target: u32 },
}

/// A group's shared-memory state (kept between calls).
#[derive(Clone)]
pub(crate) enum ShmState {
    Untried,
    Ready(Arc<Segment>),
    Unavailable(String),
}

/// What a call's plan may assume of the group's segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ShmChoice {
    /// Not tried yet: a call that picks shared memory sets it up.
    Possible,
    /// Set up.
    Ready,
    /// Unavailable for good.
    No,
}

impl ShmState {
    /// Whether the shared-memory algorithm may still be chosen, and whether
    /// the segment is set up.
    pub(crate) fn choice(&self) -> ShmChoice {
        match self {
            ShmState::Untried => ShmChoice::Possible,
            ShmState::Ready(_) => ShmChoice::Ready,
            ShmState::Unavailable(_) => ShmChoice::No,
        }
    }

    pub(crate) fn status(&self) -> SharedMemory {
        match self {
            ShmState::Untried => SharedMemory::Untried,
            ShmState::Ready(s) => SharedMemory::Active { segment_bytes: s.len },
            ShmState::Unavailable(r) => SharedMemory::Unavailable { reason: r.clone() },
        }
    }
}

/// What a group's calls share about its segment outside the state they take
/// turns with: the segment once set up (for the agreement round, and for a
/// member whose setting-up call was dropped to abandon it), and the mark that
/// the current call has begun to use it.
///
/// The mark is set by the agreement round through the segment and by
/// [`ensure`], and cleared when the call ends by itself. A call dropped while
/// it is set leaves its member's arrivals out of step with the others': its
/// next call abandons the segment ([`Segment::abandon`]), so that the others
/// stop waiting for it and every member's later calls use TCP; one dropped
/// before, as a gather that ended up on TCP, changes nothing.
#[derive(Default)]
pub(crate) struct ShmShared {
    pub(crate) segment: std::sync::OnceLock<Arc<Segment>>,
    pub(crate) in_use: std::sync::atomic::AtomicBool,
}

/// The group's shared-memory state lent to a call that may use the segment
/// (see `Call::lend_shm`): a copy of it, which goes back to the group when the
/// call ends, and what the group's calls share about it.
pub(crate) struct ShmLoan {
    pub(crate) state: ShmState,
    pub(crate) shared: Arc<ShmShared>,
}

// ---------------------------------------------------------------------------
// The segment

/// A mapped segment.
pub(crate) struct Segment {
    map: memmap2::MmapRaw,
    len: usize,
    /// Arrivals this member has made (the members move in lockstep, so this is
    /// also what every member's counter reaches at the current barrier).
    arrivals: AtomicU32,
    /// How long a barrier keeps checking between yields before it sleeps
    /// (`CollectiveConfig::shm_spin`, set when the group keeps the segment).
    spin: Duration,
}

/// What member 0 sends: where to find the segment and how to recognise it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Offer {
    pid: u64,
    fd: u64,
    len: u64,
    nonce: [u64; 2],
}

impl Offer {
    fn encode(&self) -> Vec<u64> {
        vec![1, self.pid, self.fd, self.len, self.nonce[0], self.nonce[1]]
    }

    fn decode(w: &[u64]) -> Option<Offer> {
        match w {
            [1, pid, fd, len, n0, n1] => Some(Offer {
                pid: *pid,
                fd: *fd,
                len: *len,
                nonce: [*n0, *n1],
            }),
            _ => None,
        }
    }
}

impl Segment {
    /// Creates a segment of `len` bytes; returns it, the file (to keep open until
    /// every member has mapped it) and the offer.
    #[cfg(target_os = "linux")]
    fn create(len: usize) -> std::result::Result<(Segment, std::fs::File, Offer), String> {
        use nix::fcntl::{FcntlArg, SealFlag, fcntl};
        use nix::sys::memfd::{MFdFlags, memfd_create};
        use std::os::fd::AsRawFd;

        let fd = memfd_create(
            "multiworld-collectives",
            MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
        )
        .map_err(|e| format!("memfd_create: {e}"))?;
        let file = std::fs::File::from(fd);
        file.set_len(len as u64)
            .map_err(|e| format!("sizing the segment to {len} bytes: {e}"))?;
        fcntl(
            &file,
            FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL),
        )
        .map_err(|e| format!("sealing the segment: {e}"))?;
        let seg = Segment::map(&file, len)?;
        let nonce = [rand::random::<u64>(), rand::random::<u64>()];
        seg.write_header(nonce);
        let offer = Offer {
            pid: u64::from(std::process::id()),
            fd: u64::try_from(file.as_raw_fd()).map_err(|_| "negative file descriptor".to_owned())?,
            len: len as u64,
            nonce,
        };
        Ok((seg, file, offer))
    }

    #[cfg(not(target_os = "linux"))]
    fn create(_len: usize) -> std::result::Result<(Segment, std::fs::File, Offer), String> {
        Err("shared memory between members needs Linux".to_owned())
    }

    /// Opens the segment member 0 offered, if it is this host's and the one it
    /// described.
    #[cfg(target_os = "linux")]
    fn open(offer: &Offer, want_len: usize) -> std::result::Result<Segment, String> {
        if offer.len != want_len as u64 {
            return Err(format!(
                "offered a {} byte segment, this member expects {want_len} bytes",
                offer.len
            ));
        }
        let path = format!("/proc/{}/fd/{}", offer.pid, offer.fd);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| format!("opening {path}: {e} (not the same host, pid namespace or user?)"))?;
        let meta = file.metadata().map_err(|e| format!("{path}: {e}"))?;
        if meta.len() != offer.len {
            return Err(format!(
                "{path} has {} bytes, not the offered {}",
                meta.len(),
                offer.len
            ));
        }
        // Only a file that cannot shrink is safe to map: one truncated under
        // this member would fault it (SIGBUS) at its next access.
        let seals = nix::fcntl::fcntl(&file, nix::fcntl::FcntlArg::F_GET_SEALS)
            .map_err(|e| format!("{path}: no seals to read ({e}): not a sealed memfd, refusing to map it"))?;
        let needed = nix::fcntl::SealFlag::F_SEAL_SHRINK | nix::fcntl::SealFlag::F_SEAL_GROW;
        if !nix::fcntl::SealFlag::from_bits_truncate(seals).contains(needed) {
            return Err(format!(
                "{path} is not sealed against resizing: refusing to map it"
            ));
        }
        let seg = Segment::map(&file, want_len)?;
        if seg.header() != (MAGIC, offer.nonce) {
            return Err(format!(
                "{path} is not the offered segment (another host's process?)"
            ));
        }
        Ok(seg)
    }

    #[cfg(not(target_os = "linux"))]
    fn open(_offer: &Offer, _want_len: usize) -> std::result::Result<Segment, String> {
        Err("shared memory between members needs Linux".to_owned())
    }

    fn map(file: &std::fs::File, len: usize) -> std::result::Result<Segment, String> {
        if len < HEADER {
            return Err(format!("a segment needs at least {HEADER} bytes"));
        }
        let map = memmap2::MmapOptions::new()
            .len(len)
            .map_raw(file)
            .map_err(|e| format!("mapping the segment: {e}"))?;
        Ok(Segment {
            map,
            len,
            arrivals: AtomicU32::new(0),
            spin: Duration::ZERO,
        })
    }

    fn write_header(&self, nonce: [u64; 2]) {
        let p = self.map.as_mut_ptr().cast::<u64>();
        // SAFETY: the mapping is at least HEADER bytes, page-aligned, and nobody
        // else has it yet (it is written before the offer is sent).
        unsafe {
            p.write_volatile(MAGIC);
            p.add(1).write_volatile(nonce[0]);
            p.add(2).write_volatile(nonce[1]);
        }
    }

    fn header(&self) -> (u64, [u64; 2]) {
        let p = self.map.as_ptr().cast::<u64>();
        // SAFETY: as in `write_header`; the header is only written before the
        // offer, so it does not change while it is read.
        unsafe {
            (
                p.read_volatile(),
                [p.add(1).read_volatile(), p.add(2).read_volatile()],
            )
        }
    }

    /// Member `p`'s arrival counter.
    fn counter(&self, p: usize) -> Result<&AtomicU32> {
        if p >= MAX_MEMBERS {
            return Err(Error::invalid(format!(
                "internal: no arrival counter for member {p}"
            )));
        }
        // SAFETY: the counter lies inside the header (checked above), is 4-byte
        // aligned (64-byte lines in a page-aligned mapping) and lives as long as
        // `self`; every member only touches it atomically.
        Ok(unsafe { AtomicU32::from_ptr(self.map.as_mut_ptr().add(COUNTERS + 64 * p).cast::<u32>()) })
    }

    /// Whether every member other than `me` has made arrival `target`.
    fn all_arrived(&self, n: usize, me: usize, target: u32) -> Result<bool> {
        for q in (0..n).filter(|&q| q != me) {
            let v = self.counter(q)?.load(Ordering::Acquire);
            // Counters wrap; the others are never more than one arrival ahead.
            if (v.wrapping_sub(target) as i32) < 0 {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Whether the barrier for arrival `target` of call `seq` has passed, or
    /// can no longer pass; `None`: wait on.
    ///
    /// It cannot pass when a member that will never arrive abandoned the
    /// segment: one that abandoned it from call `seq` or earlier (it agrees
    /// over TCP from then on, so it does not come; every member then does
    /// this call's agreement over TCP), or one that is behind and abandoned
    /// it from a later call (this call was dropped on it). A member that is
    /// behind and has not abandoned it may still come. The counters are read
    /// again after an abandoned word: a member's arrivals come before its
    /// abandoning.
    fn blocked(&self, n: usize, me: usize, target: u32, seq: u64) -> Result<Option<Barrier>> {
        if self.all_arrived(n, me, target)? {
            return Ok(Some(Barrier::Passed));
        }
        let behind = |q: usize| -> Result<bool> {
            Ok((self.counter(q)?.load(Ordering::Acquire).wrapping_sub(target) as i32) < 0)
        };
        let mut later = None;
        for q in (0..n).filter(|&q| q != me) {
            match self.abandoned_from(q)? {
                Some(from) if from <= seq => {
                    return Ok(Some(Barrier::Abandoned {
                        by: Abandoned { from, by: q },
                        target,
                    }));
                }
                Some(from) if later.is_none() && behind(q)? => later = Some(Abandoned { from, by: q }),
                _ => {}
            }
        }
        Ok(later.map(|by| Barrier::Abandoned { by, target }))
    }

    /// Sleeps (blocking this thread) until the barrier for arrival `target` of
    /// call `seq` passes or cannot pass (`Segment::blocked`), or `limit` has
    /// passed (`None`). An abandoning member wakes every counter; one that
    /// abandons between the check and the sleep is seen after the slice
    /// (at most [`WAIT_SLICE`]).
    fn wait_blocking(
        &self,
        n: usize,
        me: usize,
        target: u32,
        seq: u64,
        limit: Duration,
    ) -> Result<Option<Barrier>> {
        let started = Instant::now();
        loop {
            if let Some(b) = self.blocked(n, me, target, seq)? {
                return Ok(Some(b));
            }
            // Sleep on the first counter still behind.
            let mut first_behind = None;
            for q in (0..n).filter(|&q| q != me) {
                let c = self.counter(q)?;
                let v = c.load(Ordering::Acquire);
                if (v.wrapping_sub(target) as i32) < 0 {
                    first_behind = Some((c, v));
                    break;
                }
            }
            let Some((c, v)) = first_behind else {
                continue;
            };
            let left = limit.saturating_sub(started.elapsed());
            if left.is_zero() {
                return Ok(None);
            }
            futex::wait(c, v, left.min(WAIT_SLICE));
        }
    }

    /// Member `p`'s abandoned word.
    fn abandoned_word(&self, p: usize) -> Result<&AtomicU64> {
        if p >= MAX_MEMBERS {
            return Err(Error::invalid(format!(
                "internal: no abandoned word for member {p}"
            )));
        }
        // SAFETY: the word lies inside the header, in member `p`'s counter
        // line (checked above), is 8-byte aligned (64-byte lines in a
        // page-aligned mapping) and lives as long as `self`; every member
        // only touches it atomically.
        Ok(unsafe {
            AtomicU64::from_ptr(
                self.map
                    .as_mut_ptr()
                    .add(COUNTERS + 64 * p + ABANDONED_IN_LINE)
                    .cast::<u64>(),
            )
        })
    }

    /// From which call on member `p` abandoned the segment, if it has.
    fn abandoned_from(&self, p: usize) -> Result<Option<u64>> {
        let w = self.abandoned_word(p)?.load(Ordering::Acquire);
        Ok(w.checked_sub(1))
    }

    /// The member of `n` that abandoned the segment from the earliest call,
    /// if any has.
    pub(crate) fn abandonment(&self, n: usize) -> Option<Abandoned> {
        (0..n)
            .filter_map(|q| {
                Some(Abandoned {
                    from: self.abandoned_from(q).ok()??,
                    by: q,
                })
            })
            .min_by_key(|a| a.from)
    }

    /// Member `me` of `n` gives up the segment: a call of its that used it was
    /// cancelled (its arrivals no longer match the others'), and its call
    /// `from` and every later one agree over TCP. Members waiting at a
    /// barrier that cannot pass without it stop waiting ([`Barrier::Abandoned`]).
    pub(crate) fn abandon(&self, n: usize, me: usize, from: u64) {
        if let Ok(w) = self.abandoned_word(me) {
            // Written once: a member off the segment never comes back.
            let _ = w.compare_exchange(0, from.saturating_add(1), Ordering::Release, Ordering::Relaxed);
        }
        for q in 0..n {
            if let Ok(c) = self.counter(q) {
                futex::wake(c);
            }
        }
    }

    /// The descriptors of call `seq` of the members (other than `me`) that
    /// made arrival `target` (they wrote them before arriving, and do not
    /// write that slot again before this member's next arrival).
    pub(crate) fn arrived_descs(&self, n: usize, me: usize, target: u32, seq: u64) -> Vec<Option<Vec<u64>>> {
        (0..n)
            .map(|p| {
                let arrived = p != me
                    && self
                        .counter(p)
                        .is_ok_and(|c| (c.load(Ordering::Acquire).wrapping_sub(target) as i32) >= 0);
                arrived.then(|| self.desc_of(n, p, seq).ok()).flatten()
            })
            .collect()
    }

    /// Where member `p`'s descriptor slot for call `seq` starts, as a word
    /// pointer; fails if it is not inside the descriptor area.
    fn desc_ptr(&self, n: usize, p: usize, seq: u64) -> Result<*mut u64> {
        let words = desc::words(n);
        let slot = (seq % 2) as usize * n + p;
        let off = HEADER + slot * words * 8;
        if p >= n || desc_area(n).is_none_or(|a| off + words * 8 > HEADER + a) || off + words * 8 > self.len {
            return Err(Error::invalid(format!(
                "internal: no descriptor slot for member {p} of {n}"
            )));
        }
        // SAFETY: inside the mapping (checked above) and 8-byte aligned (the
        // mapping is page-aligned and `off` a multiple of 8).
        Ok(unsafe { self.map.as_mut_ptr().add(off) }.cast::<u64>())
    }

    /// Writes this member's descriptor of call `seq` into its slot. Only this
    /// member writes the slot, and nobody reads it before this member's next
    /// arrival (see [`agree`]).
    pub(crate) fn put_desc(&self, n: usize, me: usize, seq: u64, words: &[u64]) -> Result<()> {
        if words.len() != desc::words(n) {
            return Err(Error::invalid("internal: a descriptor of the wrong length"));
        }
        let p = self.desc_ptr(n, me, seq)?;
        // SAFETY: `p` points at `words.len()` words of this member's slot
        // (`desc_ptr`), which no other member touches until this member
        // arrives; the source is a different allocation.
        unsafe { std::ptr::copy_nonoverlapping(words.as_ptr(), p, words.len()) };
        Ok(())
    }

    /// Member `p`'s descriptor of call `seq`, read after a barrier that `p`
    /// arrived at after writing it.
    pub(crate) fn desc_of(&self, n: usize, p: usize, seq: u64) -> Result<Vec<u64>> {
        let words = desc::words(n);
        let ptr = self.desc_ptr(n, p, seq)?;
        let mut out = vec![0u64; words];
        // SAFETY: as in `put_desc`; `p` does not write this slot again before
        // this member has arrived at the next call's barrier.
        unsafe { std::ptr::copy_nonoverlapping(ptr.cast_const(), out.as_mut_ptr(), words) };
        Ok(out)
    }

    /// Bytes per slot for a group of `n`: three buffers of `n` slots after the
    /// header and the descriptor slots, each a multiple of 64 bytes.
    fn slot_bytes(&self, n: usize) -> usize {
        let base = HEADER + desc_area(n).unwrap_or(self.len);
        (self.len.saturating_sub(base) / (BUFFERS * n.max(1))) & !63
    }

    /// Elements `range` of slot `slot` of buffer `buf`, as a typed pointer.
    /// Fails (instead of pointing outside the mapping) if they do not fit.
    fn ptr<T>(&self, n: usize, buf: usize, slot: usize, range: &Range<usize>) -> Result<*mut T> {
        let sb = self.slot_bytes(n);
        let size = std::mem::size_of::<T>();
        if buf >= BUFFERS || slot >= n || range.start > range.end || range.end.saturating_mul(size) > sb {
            return Err(Error::invalid(format!(
                "internal: elements {range:?} of slot {slot} of buffer {buf} outside the segment"
            )));
        }
        let off = HEADER + desc_area(n).unwrap_or(0) + (buf * n + slot) * sb + range.start * size;
        // SAFETY: `off + range.len() * size` is within the mapping (checked
        // above: the slot lies inside `len`), and the offset keeps `T`'s
        // alignment (the mapping is page-aligned, slots are multiples of 64 bytes
        // and the element offset is a multiple of `size`).
        Ok(unsafe { self.map.as_mut_ptr().add(off) }.cast::<T>())
    }

    /// A shared view of slot elements. The protocol guarantees that no member
    /// writes them while this call reads them (see the module docs).
    fn read<T>(&self, n: usize, buf: usize, slot: usize, range: Range<usize>) -> Result<&[T]> {
        let p = self.ptr::<T>(n, buf, slot, &range)?;
        // SAFETY: in bounds and aligned (`ptr`); the element types used here are
        // plain numbers, valid for any bit pattern; the phases of the protocol
        // keep writers out of this range while the view lives.
        Ok(unsafe { std::slice::from_raw_parts(p, range.len()) })
    }

    /// A mutable view of slot elements that only this member writes, and nobody
    /// reads, in the current phase.
    #[allow(clippy::mut_from_ref)]
    fn write<T>(&self, n: usize, buf: usize, slot: usize, range: Range<usize>) -> Result<&mut [T]> {
        let p = self.ptr::<T>(n, buf, slot, &range)?;
        // SAFETY: as in `read`; in this phase only this member touches the range
        // and the call makes one view of it at a time.
        Ok(unsafe { std::slice::from_raw_parts_mut(p, range.len()) })
    }
}

/// Sleeping on a counter in the segment until another member changes it.
#[cfg(target_os = "linux")]
mod futex {
    use std::sync::atomic::AtomicU32;
    use std::time::Duration;

    /// Sleeps while `word` holds `expected`, at most `timeout` (wakes early on
    /// [`wake`], a signal, or spuriously: callers re-check).
    pub(super) fn wait(word: &AtomicU32, expected: u32, timeout: Duration) {
        let ts = libc::timespec {
            tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
            // Below 10^9, so it fits a c_long on every target.
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        // SAFETY: `word` is a valid, aligned u32 for the whole call; FUTEX_WAIT
        // (the shared variant, as the word is in memory shared between
        // processes) only reads it, and `ts` outlives the call.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                libc::FUTEX_WAIT,
                expected,
                &ts as *const libc::timespec,
                std::ptr::null::<u32>(),
                0u32,
            );
        }
    }

    /// Wakes every member sleeping on `word`.
    pub(super) fn wake(word: &AtomicU32) {
        // SAFETY: as in `wait`; FUTEX_WAKE does not touch the word's memory.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                libc::FUTEX_WAKE,
                i32::MAX,
                std::ptr::null::<libc::timespec>(),
                std::ptr::null::<u32>(),
                0u32,
            );
        }
    }
}

/// Elsewhere no segment is ever set up; waiting just yields.
#[cfg(not(target_os = "linux"))]
mod futex {
    use std::sync::atomic::AtomicU32;
    use std::time::Duration;

    pub(super) fn wait(_word: &AtomicU32, _expected: u32, _timeout: Duration) {
        std::thread::yield_now();
    }

    pub(super) fn wake(_word: &AtomicU32) {}
}

// ---------------------------------------------------------------------------
// Setting up

/// The segment a call uses, setting it up if this group has not tried yet;
/// `None` when the call was not planned on shared memory (no state lent to
/// it) or the members cannot share memory (the caller then runs its TCP
/// algorithm). Every member calls it in the same call, and all reach the
/// same state.
pub(crate) async fn ensure<'s>(
    cx: Ctx<'_>,
    loan: Option<&'s mut ShmLoan>,
) -> Result<Option<&'s Arc<Segment>>> {
    let Some(loan) = loan else {
        return Ok(None);
    };
    loan.shared.in_use.store(true, Ordering::Relaxed);
    let state = &mut loan.state;
    if let ShmState::Untried = state {
        *state = setup(cx, &loan.shared).await?;
    }
    Ok(match state {
        ShmState::Ready(seg) => Some(seg),
        _ => None,
    })
}

/// Why a member with `CollectiveConfig::shared_memory` false declines.
const TURNED_OFF: &str = "shared memory is turned off in this member's CollectiveConfig";

/// Sets up the group's segment (see the module docs). A segment this member
/// created or mapped is kept in `shared` at once, before the verdict: if the
/// call is dropped from then on, the member's next call can still abandon it
/// for the others, who may already use it.
async fn setup(cx: Ctx<'_>, shared: &ShmShared) -> Result<ShmState> {
    let keep = |mut seg: Segment| {
        seg.spin = cx.cfg.shm_spin;
        Arc::clone(shared.segment.get_or_init(|| Arc::new(seg)))
    };
    let n = cx.n();
    let Some(len) = segment_len(cx.cfg.shm_piece_bytes, n) else {
        return Err(Error::invalid(
            "internal: shared memory chosen for a group that cannot use it",
        ));
    };
    let rank = cx.comm.rank();
    if cx.me == 0 {
        let created = if cx.cfg.shared_memory {
            Segment::create(len).map(|(seg, file, offer)| (keep(seg), file, offer))
        } else {
            Err(TURNED_OFF.to_owned())
        };
        let words = match &created {
            Ok((_, _, offer)) => offer.encode(),
            Err(_) => vec![0; OFFER_WORDS],
        };
        let offers: Vec<_> = cx.peers().map(|q| (q, Tensor::from(words.clone()))).collect();
        try_join_all(offers.iter().map(|(q, t)| cx.send(*q, t))).await?;
        let answers = try_join_all(cx.peers().map(|q| async move {
            let t = cx.recv_new(q, Tensor::zeros(DType::U64, [1])?).await?;
            Ok((q, t.as_slice::<u64>()?.first().copied().unwrap_or(0)))
        }))
        .await?;
        let refused = answers.iter().find(|(_, ok)| *ok != 1).map(|(q, _)| *q);
        let outcome = match (&created, refused) {
            (Err(e), _) => Err(format!("member 0 (rank {rank}) could not share memory: {e}")),
            (Ok(_), Some(q)) => Err(format!(
                "rank {} could not map the segment (its log says why)",
                cx.members[q]
            )),
            (Ok(_), None) => Ok(()),
        };
        let verdict = [u64::from(outcome.is_ok()), refused.map_or(u64::MAX, |q| q as u64)];
        try_join_all(cx.peers().map(|q| cx.send(q, &verdict[..]))).await?;
        Ok(match (created, outcome) {
            // The file closes here; every member has its mapping.
            (Ok((seg, _file, _)), Ok(())) => ShmState::Ready(seg),
            (_, Err(reason)) | (Err(reason), _) => {
                tracing::info!(rank = %rank, group = cx.group_id, %reason, "collectives use TCP only");
                ShmState::Unavailable(reason)
            }
        })
    } else {
        let w = cx.recv_new(0, Tensor::zeros(DType::U64, [OFFER_WORDS])?).await?;
        let opened = if !cx.cfg.shared_memory {
            Err(TURNED_OFF.to_owned())
        } else {
            match Offer::decode(w.as_slice::<u64>()?) {
                Some(offer) => Segment::open(&offer, len).map(keep),
                None => Err(format!("rank {} made no offer", cx.members[0])),
            }
        };
        if let Err(reason) = &opened {
            tracing::info!(rank = %rank, group = cx.group_id, %reason, "cannot map the group's shared memory");
        }
        cx.send(0, &[u64::from(opened.is_ok())][..]).await?;
        let v = cx.recv_new(0, Tensor::zeros(DType::U64, [2])?).await?;
        let v = v.as_slice::<u64>()?;
        let (ok, who) = (v.first() == Some(&1), v.get(1).copied().unwrap_or(u64::MAX));
        Ok(match opened {
            Ok(seg) if ok => ShmState::Ready(seg),
            Err(reason) => ShmState::Unavailable(reason),
            Ok(_) => {
                let reason = match usize::try_from(who).ok().and_then(|q| cx.members.get(q)) {
                    Some(r) => format!("rank {r} could not map the segment (its log says why)"),
                    None => format!("rank {} could not share memory (its log says why)", cx.members[0]),
                };
                tracing::info!(rank = %rank, group = cx.group_id, %reason, "collectives use TCP only");
                ShmState::Unavailable(reason)
            }
        })
    }
    .inspect(|s| {
        if let ShmState::Ready(seg) = s {
            tracing::debug!(rank = %rank, group = cx.group_id, n, bytes = seg.len, "shared-memory segment mapped");
        }
    })
}

// ---------------------------------------------------------------------------
// The algorithm

/// A barrier through the segment: publishes this member's arrival (after its
/// writes, `Release`) and waits until every other member has arrived too
/// (`Acquire`, so their writes are visible). After a short spin, the waiting is
/// done on a blocking-pool thread that sleeps on the members' counters (a
/// futex), so no runtime thread is held: other tasks (other ranks in this
/// runtime, other worlds, the call's guard watching for a lost member or a
/// deadline) keep running. A call that ends early leaves that thread to finish
/// its current wait (at most [`BLOCKING_WAIT`]). On a thread that only waits
/// for this call ([`multiworld_tcp::as_blocking_caller`]: a Python thread in a
/// blocking call) the sleeping is done on that thread, in slices of
/// [`WAIT_SLICE`], which saves the hand-off to the pool's thread and back.
///
/// A barrier that cannot pass because a member abandoned the segment
/// (`Segment::blocked`) ends the wait with an error.
async fn arrive_and_wait(cx: Ctx<'_>, seg: &Arc<Segment>) -> Result<()> {
    match arrive_and_wait_as(cx.n(), cx.me, cx.seq, seg).await? {
        Barrier::Passed => Ok(()),
        Barrier::Abandoned { by, .. } => Err(by.error(cx.members)),
    }
}

/// [`arrive_and_wait`] as member `me` of `n` in call `seq`, telling how the
/// barrier ended.
async fn arrive_and_wait_as(n: usize, me: usize, seq: u64, seg: &Arc<Segment>) -> Result<Barrier> {
    let target = seg.arrivals.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
    let mine = seg.counter(me)?;
    mine.store(target, Ordering::Release);
    futex::wake(mine);
    for _ in 0..SPINS {
        if let Some(b) = seg.blocked(n, me, target, seq)? {
            return Ok(b);
        }
        std::hint::spin_loop();
    }
    // Then check between yields, for as long as the group's setting says:
    // the other members are usually a piece's copy away, and a sleep costs
    // two or three thread wake-ups more than that. Yielding the thread lets
    // a member that shares this core run; yielding the task lets the
    // runtime's other tasks run.
    if !seg.spin.is_zero() {
        let began = Instant::now();
        while began.elapsed() < seg.spin {
            std::thread::yield_now();
            tokio::task::yield_now().await;
            if let Some(b) = seg.blocked(n, me, target, seq)? {
                return Ok(b);
            }
        }
    }
    loop {
        if multiworld_tcp::on_blocking_caller() {
            // The caller's own thread, waiting for nothing else: it sleeps
            // here, woken straight by the last member to arrive, then lets
            // the call's other branches run between slices.
            if let Some(b) = seg.wait_blocking(n, me, target, seq, WAIT_SLICE)? {
                return Ok(b);
            }
            tokio::task::yield_now().await;
            continue;
        }
        let s = Arc::clone(seg);
        let done = tokio::task::spawn_blocking(move || s.wait_blocking(n, me, target, seq, BLOCKING_WAIT))
            .await
            .map_err(|e| Error::invalid(format!("internal: shared-memory wait failed: {e}")))??;
        if let Some(b) = done {
            return Ok(b);
        }
    }
}

/// The agreement round of call `seq` through the segment (a group whose
/// segment is set up; see `Ctx::exchange` in `group.rs`): writes `words`, this
/// member's descriptor, into its slot for the call's parity, arrives, and
/// once every member has, reads theirs (`None` in this member's place).
///
/// Slots alternate by parity: a member writes its slot of parity `seq % 2`
/// again in call `seq + 2`, after passing call `seq + 1`'s barrier, which
/// every member reaches only after reading call `seq`'s descriptors. The
/// barrier also orders the calls' data: whatever a member did in the previous
/// call happened before its arrival here.
///
/// Returns [`NotAgreed`] if the barrier cannot pass because a member
/// abandoned the segment.
pub(crate) async fn agree(
    n: usize,
    me: usize,
    seq: u64,
    seg: &Arc<Segment>,
    words: &[u64],
) -> Result<std::result::Result<Vec<Option<Vec<u64>>>, NotAgreed>> {
    seg.put_desc(n, me, seq, words)?;
    match arrive_and_wait_as(n, me, seq, seg).await? {
        Barrier::Abandoned { by, target } => Ok(Err(NotAgreed {
            by,
            arrived: seg.arrived_descs(n, me, target, seq),
        })),
        Barrier::Passed => Ok(Ok((0..n)
            .map(|p| {
                if p == me {
                    Ok(None)
                } else {
                    seg.desc_of(n, p, seq).map(Some)
                }
            })
            .collect::<Result<_>>()?)),
    }
}

/// An agreement round through the segment that cannot complete: who
/// abandoned the segment, and the descriptors of the members that had
/// arrived (`None` for the others and this member), whose eager payloads
/// this member must still drop.
#[derive(Debug)]
pub(crate) struct NotAgreed {
    pub by: Abandoned,
    pub arrived: Vec<Option<Vec<u64>>>,
}

/// How a member copies a large range through the segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Copier {
    /// Its thread alone: the collectives that reduce, where one thread's
    /// reduction is the bound and helpers only take the cores and memory
    /// bandwidth it needs (a 64 MiB reduce of 4 processes on 16 cores:
    /// 23 ms alone, 35 ms with helpers).
    Alone,
    /// Its thread and the copy pool's ([`copy_shared`]): the collectives
    /// that only move data (64 MiB on 16 cores: broadcast of 2 processes
    /// 8.9 → 2.9 ms, scatter of 4 18.9 → 8.3 ms).
    Shared,
}

/// Copies `src` into `dst` in pieces, yielding to the runtime between them;
/// with `stream`, through non-temporal stores where the target has them.
async fn copy_yielding<T: Copy + Send + Sync>(dst: &mut [T], src: &[T], stream: bool, by: Copier) {
    let step = (YIELD_BYTES / std::mem::size_of::<T>().max(1)).max(1);
    for (d, s) in dst.chunks_mut(step).zip(src.chunks(step)) {
        match by {
            Copier::Alone => copy(d, s, stream),
            Copier::Shared => copy_shared(d, s, stream),
        }
        tokio::task::yield_now().await;
    }
}

/// Copies `src` into `dst` (as many elements as both hold), with
/// non-temporal stores from [`STREAM_MIN_BYTES`] on: the copy of a member's
/// own part into its output in the collectives, whatever their path. Such a
/// copy does not stay in the caches anyway; 64 MiB here: 6.2–6.4 ms against
/// 9.0–9.6 ms for `copy_from_slice`. Public for the benchmarks' physical
/// references (`mw-rank-bench run copy-floor`).
pub fn copy_large<T: Copy + Send + Sync>(dst: &mut [T], src: &[T]) {
    copy_shared(dst, src, std::mem::size_of_val(src) >= STREAM_MIN_BYTES);
}

/// Ranges of at least this many bytes are copied by this thread and the
/// copy pool's together, when the process has one ([`copy_threads`]).
const SHARED_COPY_MIN_BYTES: usize = 256 << 10;

/// Threads that copy one range of [`SHARED_COPY_MIN_BYTES`] or more together
/// (the calling thread included): `MULTIWORLD_SHM_COPY_THREADS` if set to a
/// whole number (at least 1), else a quarter of the CPUs, 1 to 4 (1 up to 7
/// CPUs: on the 2-core VM the members' own threads fill the cores; 4 from
/// 16). One thread of a many-core server copies far below what its memory
/// can take (a 16-core host here: 64 MiB in 12.2 ms).
pub(crate) fn copy_threads() -> usize {
    static THREADS: OnceLock<usize> = OnceLock::new();
    *THREADS.get_or_init(|| {
        std::env::var("MULTIWORLD_SHM_COPY_THREADS")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or_else(|| {
                std::thread::available_parallelism()
                    .map_or(1, |n| n.get() / 4)
                    .clamp(1, 4)
            })
            .clamp(1, 64)
    })
}

/// The pool whose threads help [`copy_shared`] (`copy_threads() − 1` of
/// them, started on first use); `None` with one copy thread, or if the
/// pool cannot start (copies are then made by the calling thread alone).
fn copy_pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        let helpers = copy_threads().checked_sub(1).filter(|&h| h > 0)?;
        rayon::ThreadPoolBuilder::new()
            .num_threads(helpers)
            .thread_name(|i| format!("mw-copy-{i}"))
            .build()
            .inspect_err(|e| tracing::warn!(error = %e, "no copy pool: shared-memory copies use one thread"))
            .ok()
    })
    .as_ref()
}

/// [`copy`], split between this thread and the copy pool's threads when the
/// range is large enough and the process has a pool. Every part is written
/// before this returns (the pool's scope ends only when each part is done,
/// and each part's non-temporal stores are fenced), so a barrier arrival
/// after it publishes all of them.
fn copy_shared<T: Copy + Send + Sync>(dst: &mut [T], src: &[T], stream: bool) {
    let len = dst.len().min(src.len());
    let (dst, src) = (&mut dst[..len], &src[..len]);
    let size = std::mem::size_of::<T>().max(1);
    let pool = copy_pool().filter(|_| len * size >= SHARED_COPY_MIN_BYTES);
    let Some(pool) = pool else {
        copy(dst, src, stream);
        return;
    };
    // Parts of whole cache lines (64 bytes), one per thread.
    let per_line = (64 / size).max(1);
    let part = len
        .div_ceil(pool.current_num_threads() + 1)
        .next_multiple_of(per_line);
    pool.in_place_scope(|scope| {
        let mut parts = dst.chunks_mut(part).zip(src.chunks(part));
        let mine = parts.next();
        for (d, s) in parts {
            scope.spawn(move |_| copy(d, s, stream));
        }
        if let Some((d, s)) = mine {
            copy(d, s, stream);
        }
    });
}

/// Copies `src` into `dst` (the shorter length of the two); with `stream`,
/// through non-temporal stores where the target has them.
fn copy<T: Copy>(dst: &mut [T], src: &[T], stream: bool) {
    let len = dst.len().min(src.len());
    let (dst, src) = (&mut dst[..len], &src[..len]);
    #[cfg(target_arch = "x86_64")]
    if stream {
        stream_copy(dst, src);
        return;
    }
    let _ = stream;
    dst.copy_from_slice(src);
}

/// Copies `src` into the same-length `dst` with non-temporal stores (SSE2,
/// which every x86-64 has), then fences them so that they are ordered before
/// whatever this thread stores next (a barrier's arrival included).
#[cfg(target_arch = "x86_64")]
fn stream_copy<T: Copy>(dst: &mut [T], src: &[T]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    const LANE: usize = std::mem::size_of::<__m128i>();
    debug_assert_eq!(dst.len(), src.len());
    let bytes = std::mem::size_of_val(dst).min(std::mem::size_of_val(src));
    let d = dst.as_mut_ptr().cast::<u8>();
    let s = src.as_ptr().cast::<u8>();
    let head = d.align_offset(LANE).min(bytes);
    let body = (bytes - head) / (4 * LANE) * (4 * LANE);
    // SAFETY: `dst` and `src` are distinct slices (one is borrowed mutably) of
    // at least `bytes` bytes, `T` is plain data (copied bytewise anyway); the
    // head and tail are copied bytewise, the body 16 bytes at a time with
    // unaligned loads and stores to `d + head + i`, which is 16-byte aligned;
    // every access stays below `bytes`. SSE2 is part of the x86-64 baseline.
    unsafe {
        std::ptr::copy_nonoverlapping(s, d, head);
        let mut i = head;
        while i < head + body {
            let v = [
                _mm_loadu_si128(s.add(i).cast()),
                _mm_loadu_si128(s.add(i + LANE).cast()),
                _mm_loadu_si128(s.add(i + 2 * LANE).cast()),
                _mm_loadu_si128(s.add(i + 3 * LANE).cast()),
            ];
            for (j, v) in v.into_iter().enumerate() {
                _mm_stream_si128(d.add(i + j * LANE).cast(), v);
            }
            i += 4 * LANE;
        }
        std::ptr::copy_nonoverlapping(s.add(i), d.add(i), bytes - i);
        _mm_sfence();
    }
}

/// All-reduce of `data` in place through the segment (see the module docs).
pub(crate) async fn all_reduce<T: Kernel>(
    cx: Ctx<'_>,
    seg: &Arc<Segment>,
    sc: &mut Scratch,
    data: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let (n, size) = (cx.n(), std::mem::size_of::<T>().max(1));
    let piece = seg.slot_bytes(n) / size;
    if piece == 0 {
        return Err(Error::invalid("internal: shared-memory slots too small"));
    }
    let pieces = data.len().div_ceil(piece);
    if pieces == 0 {
        return Ok(());
    }
    let mut acc = sc.take(T::DTYPE, (BLOCK_BYTES / size).max(1))?;
    let stream = std::mem::size_of_val(data) >= STREAM_MIN_BYTES;
    let total = data.len();
    let piece_range = |k: usize| k * piece..((k + 1) * piece).min(total);
    let io = Io { seg, n, me: cx.me };
    // Step `t` takes piece `t - 2`'s results, reduces piece `t - 1` and
    // publishes piece `t`, each in its own buffer; one barrier per step.
    for t in 0..pieces + 2 {
        if let Some(k) = t.checked_sub(2) {
            io.take(k % BUFFERS, &mut data[piece_range(k)], stream).await?;
        }
        if let Some(k) = t.checked_sub(1).filter(|&k| k < pieces) {
            let a = acc.as_mut_slice::<T>()?;
            io.reduce(k % BUFFERS, &mut data[piece_range(k)], a, op, stream)
                .await?;
        }
        if t < pieces {
            io.publish(t % BUFFERS, &data[piece_range(t)]).await?;
        }
        // After the last step nothing is left to order: the next call's
        // agreement round starts only once every member has finished this one.
        if t < pieces + 1 {
            arrive_and_wait(cx, seg).await?;
        }
    }
    sc.give(acc);
    Ok(())
}

/// Broadcast of `data` (bytes) from member `root` through the segment: step
/// `t` has the root copy piece `t` into its slot of buffer `t mod 3` and
/// every other member copy piece `t − 1` out of the root's slot; one barrier
/// per step, `pieces` in all (the agreement round of the next call orders
/// the last step, as for the all-reduce). Piece `k + 3` overwrites piece
/// `k`'s buffer at step `k + 3`, after the step that read it (`k + 1`) has
/// ended on every member. Only the root's slots are used: the steps of
/// [`route`] from the root's own slot.
pub(crate) async fn broadcast(cx: Ctx<'_>, seg: &Arc<Segment>, data: &mut [u8], root: usize) -> Result<()> {
    let m = Moves::from_sender_slots(seg, cx.n(), data.len())?;
    if cx.me == root {
        route(cx, seg, &m, &[(root, &*data)], &mut []).await
    } else {
        route(cx, seg, &m, &[], &mut [(root, data)]).await
    }
}

/// All-gather of every member's `input` (bytes) into `outputs` (one per
/// member, in member order; `outputs[p]` as long as member `p`'s input, which
/// every member knows: the sizes are agreed) through the segment: step `t`
/// has every member copy piece `t` of its input into its slot of buffer
/// `t mod 3` and piece `t − 1` of every other member's input out of their
/// slots; one barrier per step, as many as the longest input needs (the next
/// call's agreement round orders the last step). Piece `k` is written in step
/// `k` and read in step `k + 1`; its buffer is written again in step `k + 3`,
/// after every member has left step `k + 2`: the steps of [`route`], each
/// member's input from its own slot to every other member.
pub(crate) async fn all_gather(
    cx: Ctx<'_>,
    seg: &Arc<Segment>,
    input: &[u8],
    outputs: &mut [&mut [u8]],
) -> Result<()> {
    let (n, me) = (cx.n(), cx.me);
    if outputs.len() != n || outputs[me].len() != input.len() {
        return Err(Error::invalid("internal: shared-memory all-gather sizes"));
    }
    let longest = outputs.iter().map(|o| o.len()).max().unwrap_or(0);
    let m = Moves::from_sender_slots(seg, n, longest)?;
    let stream = outputs.iter().map(|o| o.len()).sum::<usize>() >= STREAM_MIN_BYTES;
    copy_yielding(outputs[me], input, stream, Copier::Shared).await;
    let mut recvs: Vec<(usize, &mut [u8])> = outputs
        .iter_mut()
        .enumerate()
        .filter(|(q, _)| *q != me)
        .map(|(q, o)| (q, &mut **o))
        .collect();
    route(cx, seg, &m, &[(me, input)], &mut recvs).await
}

// ---------------------------------------------------------------------------
// Gather, scatter and the all-to-alls: each member's own data to others

/// Which slot of a buffer (and which part of it) carries the data that one
/// member sends another, in a call that moves each member's own data to other
/// members (gather, scatter, the all-to-alls).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Routes {
    /// Scatter: only the root sends; what member `q` gets goes through slot `q`.
    IntoReceiverSlot,
    /// Gather: only the root receives; what member `q` sends goes through slot `q`.
    FromSenderSlot,
    /// All-to-all: every pair; member `p`'s slot is cut into `n` equal parts
    /// (multiples of 64 bytes), part `q` for what `p` sends `q`.
    Pairs,
}

impl Routes {
    /// Bytes one step carries from one member to another, with slots of
    /// `slot` bytes in a group of `n`.
    pub(crate) fn capacity(self, slot: usize, n: usize) -> usize {
        match self {
            Routes::Pairs => (slot / n.max(1)) & !63,
            Routes::IntoReceiverSlot | Routes::FromSenderSlot => slot,
        }
    }

    /// The slot, and the byte offset in it, of the part that carries what
    /// `src` sends `dst`, for parts of `cap` bytes.
    fn place(self, src: usize, dst: usize, cap: usize) -> (usize, usize) {
        match self {
            Routes::IntoReceiverSlot => (dst, 0),
            Routes::FromSenderSlot => (src, 0),
            Routes::Pairs => (src, dst * cap),
        }
    }
}

/// How one gather, scatter or all-to-all moves its data through the segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Moves {
    routes: Routes,
    /// Bytes one step carries between two members.
    cap: usize,
    /// Steps (barriers) of the call.
    steps: usize,
}

impl Moves {
    /// Moves through each sender's own slot ([`Routes::FromSenderSlot`], a
    /// whole slot per step) in as many steps as `longest` bytes need: a
    /// broadcast's, an all-gather's, a reduce's (their sizes are agreed, so
    /// every member counts the same steps).
    fn from_sender_slots(seg: &Segment, n: usize, longest: usize) -> Result<Moves> {
        let cap = seg.slot_bytes(n);
        if cap == 0 {
            return Err(Error::invalid("internal: shared-memory slots too small"));
        }
        Ok(Moves {
            routes: Routes::FromSenderSlot,
            cap,
            steps: longest.div_ceil(cap),
        })
    }
}

/// Whether a gather, scatter or all-to-all of a group of `n` moves its data
/// through the segment, and how: `bytes(p, q)` is what member `p` sends member
/// `q` (known to every member from the descriptors after the agreement), so
/// every member gets the same answer. Yes when the group's pieces allow it, some
/// pair has data, and the members move at least `shm_min_bytes` between them in
/// all (at any size with [`Algorithm::SharedMemory`]). With
/// [`Algorithm::Auto`] a member that sends a little (up to `eager_max_bytes`)
/// has already sent it over TCP, so such calls never get here (see
/// [`plan_after_agreement`]). The caller has already checked
/// that the group may use shared memory for the call.
pub(crate) fn plan_moves(
    routes: Routes,
    n: usize,
    cfg: &CollectiveConfig,
    piece: usize,
    bytes: impl Fn(usize, usize) -> u64,
) -> Option<Moves> {
    segment_len(piece, n)?;
    let cap = routes.capacity(piece & !63, n);
    if cap == 0 {
        return None;
    }
    let (mut steps, mut total) = (0u64, 0u64);
    for p in 0..n {
        for q in (0..n).filter(|&q| q != p) {
            let b = bytes(p, q);
            total = total.saturating_add(b);
            steps = steps.max(b.div_ceil(cap as u64));
        }
    }
    let forced = cfg.algorithm == Algorithm::SharedMemory;
    if steps == 0 || (!forced && total < cfg.shm_min_bytes as u64) {
        return None;
    }
    Some(Moves {
        routes,
        cap,
        steps: usize::try_from(steps).ok()?,
    })
}

/// The bytes of a slot the calls of a group of `n` plan with: those of its
/// segment once it is set up (`shared`; the same on every member), which
/// keeps them after a later `CollectiveConfig` asks for another size, else
/// the config's `shm_piece_bytes` (with which the segment will be set up).
pub(crate) fn piece_bytes(shared: &ShmShared, cfg: &CollectiveConfig, n: usize) -> usize {
    shared
        .segment
        .get()
        .map_or(cfg.shm_piece_bytes, |seg| seg.slot_bytes(n))
}

/// The routes of a kind sized after the agreement (`None` for other kinds).
pub(crate) fn routes_of(kind: Kind) -> Option<Routes> {
    match kind {
        Kind::Scatter => Some(Routes::IntoReceiverSlot),
        Kind::Gather => Some(Routes::FromSenderSlot),
        Kind::AllToAll | Kind::AllToAllSingle => Some(Routes::Pairs),
        _ => None,
    }
}

/// [`plan_moves`] for a call whose every member's descriptor `descs` was
/// agreed on: `None` (TCP) unless `may` (the group may use shared memory for
/// the call, which the agreed algorithm and dtype decide) and no member sent
/// a payload eagerly. The same answer on every member.
pub(crate) fn plan_after_agreement(cx: Ctx<'_>, descs: &[Desc], may: bool) -> Option<Moves> {
    let n = cx.n();
    let first = descs.first()?;
    let routes = routes_of(first.kind)?;
    let es = first.dtype?.size() as u64;
    if !may || descs.len() != n {
        return None;
    }
    let eager = |p: usize, q: usize| desc::eager_payload(&descs[p], p, q, cx.members).is_some();
    if (0..n).any(|p| (0..n).any(|q| eager(p, q))) {
        return None;
    }
    let root = first.root_index(cx.members);
    let elems = |p: usize, q: usize| -> u64 {
        let d = &descs[p];
        match first.kind {
            // Only the root sends: the counts it gives each member.
            Kind::Scatter if Some(p) == root => d.a.get(q).copied().unwrap_or(0),
            // Only the root receives: each member's input.
            Kind::Gather if Some(q) == root => d.count,
            Kind::AllToAll | Kind::AllToAllSingle => d.a.get(q).copied().unwrap_or(0),
            _ => 0,
        }
    };
    let piece = piece_bytes(cx.shm, cx.cfg, n);
    plan_moves(routes, n, cx.cfg, piece, |p, q| elems(p, q).saturating_mul(es))
}

/// Moves each `(member, bytes)` of `sends` to that member and fills each
/// `(member, buffer)` of `recvs` with what that member sends this one, through
/// the segment as `m` plans: step `t` has every member copy part `t` (of
/// `m.cap` bytes) of each of its sends into its place in buffer `t mod 3`, and
/// part `t − 1` of each of its receives out of the sender's place; one barrier
/// per step, `m.steps` in all (the next call's agreement round orders the last
/// step). Part `k` is written in step `k` and read in step `k + 1`; its buffer
/// is written again in step `k + 3`, after every member has left step `k + 2`.
/// Every member makes the same number of steps whatever it moves itself.
pub(crate) async fn route(
    cx: Ctx<'_>,
    seg: &Arc<Segment>,
    m: &Moves,
    sends: &[(usize, &[u8])],
    recvs: &mut [(usize, &mut [u8])],
) -> Result<()> {
    route_by(cx, seg, m, sends, recvs, Copier::Shared).await
}

/// [`route`], its copies made `by` one thread or shared.
async fn route_by(
    cx: Ctx<'_>,
    seg: &Arc<Segment>,
    m: &Moves,
    sends: &[(usize, &[u8])],
    recvs: &mut [(usize, &mut [u8])],
    by: Copier,
) -> Result<()> {
    let (n, me) = (cx.n(), cx.me);
    if m.cap == 0 || m.cap > m.routes.capacity(seg.slot_bytes(n), n) {
        return Err(Error::invalid(
            "internal: shared-memory parts do not fit the slots",
        ));
    }
    let part = |len: usize, k: usize| (k * m.cap).min(len)..((k + 1) * m.cap).min(len);
    let stream = recvs.iter().map(|(_, b)| b.len()).sum::<usize>() >= STREAM_MIN_BYTES;
    for t in 0..m.steps + 1 {
        if t < m.steps {
            for &(q, data) in sends {
                let r = part(data.len(), t);
                if !r.is_empty() {
                    let (slot, at) = m.routes.place(me, q, m.cap);
                    let dst = seg.write::<u8>(n, t % BUFFERS, slot, at..at + r.len())?;
                    copy_yielding(dst, &data[r], false, by).await;
                }
            }
        }
        if let Some(k) = t.checked_sub(1) {
            for (p, out) in recvs.iter_mut() {
                let r = part(out.len(), k);
                if !r.is_empty() {
                    let (slot, at) = m.routes.place(*p, me, m.cap);
                    let src = seg.read::<u8>(n, k % BUFFERS, slot, at..at + r.len())?;
                    copy_yielding(&mut out[r], src, stream, by).await;
                }
            }
        }
        if t < m.steps {
            arrive_and_wait(cx, seg).await?;
        }
    }
    Ok(())
}

/// Reduce-scatter through the segment: `inputs[q]` is this member's
/// contribution to member `q`'s segment (the same lengths on every member),
/// and `output` gets segment `me` reduced over every member **in rank order**.
/// The contributions travel as an all-to-all's payloads do (part `q` of the
/// sender's slot, see [`Routes::Pairs`]): step `t` has every member copy part
/// `t` of each other member's contribution into its slot of buffer `t mod 3`,
/// and reduce part `t − 1` of its own segment over every member's copy (its
/// own read from `inputs[me]`), in blocks that stay in the L1/L2 cache,
/// straight into `output`. One barrier per step; the same buffer discipline as
/// [`route`].
pub(crate) async fn reduce_scatter<T: Kernel>(
    cx: Ctx<'_>,
    seg: &Arc<Segment>,
    sc: &mut Scratch,
    output: &mut [T],
    inputs: &[&[T]],
    op: ReduceOp,
) -> Result<()> {
    let (n, me, size) = (cx.n(), cx.me, std::mem::size_of::<T>().max(1));
    let cap = Routes::Pairs.capacity(seg.slot_bytes(n), n) / size;
    if cap == 0 || inputs.len() != n || inputs[me].len() != output.len() {
        return Err(Error::invalid("internal: shared-memory reduce-scatter sizes"));
    }
    let steps = inputs.iter().map(|x| x.len().div_ceil(cap)).max().unwrap_or(0);
    let mut acc = sc.take(T::DTYPE, (BLOCK_BYTES / size).max(1))?;
    let stream = std::mem::size_of_val(output) >= STREAM_MIN_BYTES;
    let part = |len: usize, k: usize| (k * cap).min(len)..((k + 1) * cap).min(len);
    let mut done = 0;
    for t in 0..steps + 1 {
        if t < steps {
            for q in (0..n).filter(|&q| q != me) {
                let r = part(inputs[q].len(), t);
                if !r.is_empty() {
                    let dst = seg.write::<T>(n, t % BUFFERS, me, q * cap..q * cap + r.len())?;
                    copy_yielding(dst, &inputs[q][r], false, Copier::Alone).await;
                }
            }
        }
        if let Some(k) = t.checked_sub(1) {
            let r = part(output.len(), k);
            let (a, own) = (acc.as_mut_slice::<T>()?, Some(inputs[me]));
            let fold = Fold {
                seg,
                n,
                me,
                buf: k % BUFFERS,
                op,
                stream,
            };
            fold.range(me * cap, r, own, output, a, &mut done).await?;
        }
        if t < steps {
            arrive_and_wait(cx, seg).await?;
        }
    }
    sc.give(acc);
    Ok(())
}

/// Reduce to member `root` through the segment: every other member's `data`
/// travels as a gather's payload does (its own slot, [`Routes::FromSenderSlot`]),
/// and the root reduces it **in rank order** straight into its `data`, which
/// holds its own contribution: step `t` has every other member copy piece `t`
/// into its slot of buffer `t mod 3`, and the root reduce piece `t − 1` over
/// every member's copy, in blocks that stay in the L1/L2 cache. One barrier per
/// step (`pieces`; the next call's agreement round orders the last step).
/// This is the root's side ([`reduce_send`] the others').
pub(crate) async fn reduce_root<T: Kernel>(
    cx: Ctx<'_>,
    seg: &Arc<Segment>,
    sc: &mut Scratch,
    data: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let (n, me, size) = (cx.n(), cx.me, std::mem::size_of::<T>().max(1));
    let m = Moves::from_sender_slots(seg, n, std::mem::size_of_val(data))?;
    let (len, cap, pieces) = (data.len(), m.cap / size, m.steps);
    let part = |k: usize| (k * cap).min(len)..((k + 1) * cap).min(len);
    let mut acc = sc.take(T::DTYPE, (BLOCK_BYTES / size).max(1))?;
    let stream = std::mem::size_of_val(data) >= STREAM_MIN_BYTES;
    let mut done = 0;
    for t in 0..pieces + 1 {
        if let Some(k) = t.checked_sub(1) {
            let fold = Fold {
                seg,
                n,
                me,
                buf: k % BUFFERS,
                op,
                stream,
            };
            fold.range(0, part(k), None, data, acc.as_mut_slice::<T>()?, &mut done)
                .await?;
        }
        if t < pieces {
            arrive_and_wait(cx, seg).await?;
        }
    }
    sc.give(acc);
    Ok(())
}

/// A member's side of a reduce to member `root` ([`reduce_root`]): its
/// `data` (bytes), piece by piece into its slot, as a gather's payload.
pub(crate) async fn reduce_send(cx: Ctx<'_>, seg: &Arc<Segment>, data: &[u8], root: usize) -> Result<()> {
    let m = Moves::from_sender_slots(seg, cx.n(), data.len())?;
    route_by(cx, seg, &m, &[(root, data)], &mut [], Copier::Alone).await
}

/// The rank-order reduction of one piece that the other members' copies lie
/// in buffer `buf` for (a reduce's root, a reduce-scatter's member).
struct Fold<'a> {
    seg: &'a Segment,
    n: usize,
    me: usize,
    buf: usize,
    op: ReduceOp,
    /// Write the results with non-temporal stores.
    stream: bool,
}

impl Fold<'_> {
    /// Reduces elements `r` over every member's copy in rank order, in
    /// blocks of `acc`'s length, into `out[r]`: member `q`'s element
    /// `r.start + i` lies at element `base + i` of its slot; this member's
    /// own is `own[r]`, or with `None` `out[r]` itself (read before it is
    /// overwritten). Yields to the runtime every [`YIELD_BYTES`] read
    /// (`done` counts them across calls).
    async fn range<T: Kernel>(
        &self,
        base: usize,
        r: Range<usize>,
        own: Option<&[T]>,
        out: &mut [T],
        acc: &mut [T],
        done: &mut usize,
    ) -> Result<()> {
        let (n, me, size) = (self.n, self.me, std::mem::size_of::<T>());
        let mut at = r.start;
        while at < r.end {
            let b = at..(at + acc.len()).min(r.end);
            let a = &mut acc[..b.len()];
            let off = base + (b.start - r.start);
            fold_block(a, n, self.op, |q| match (q == me, own) {
                (true, Some(own)) => Ok(&own[b.clone()]),
                (true, None) => Ok(&out[b.clone()]),
                (false, _) => self.seg.read::<T>(n, self.buf, q, off..off + b.len()),
            })?;
            copy(&mut out[b.clone()], a, self.stream);
            *done += b.len() * size * n;
            if *done >= YIELD_BYTES {
                *done = 0;
                tokio::task::yield_now().await;
            }
            at = b.end;
        }
        Ok(())
    }
}

/// Reduces one block over every member's copy in rank order into `a`
/// (`x0 op x1 op ...`, then the division of an average): `src(q)` is member
/// `q`'s copy, as long as `a`. The first two copies are combined in one
/// pass (`a = x0 op x1`), not copied and then combined.
fn fold_block<'s, T: Kernel>(
    a: &mut [T],
    n: usize,
    op: ReduceOp,
    src: impl FnMut(usize) -> Result<&'s [T]>,
) -> Result<()> {
    fold_members(a, None, n, op.elem(), src)?;
    if op == ReduceOp::Avg {
        T::divide(a, n);
    }
    Ok(())
}

/// [`fold_block`] with the result written into `dst` rather than `a`
/// (scratch here, as long as `dst`): the last combination writes `dst`
/// itself, which saves copying the result out of `a`. The same operations
/// in the same order as [`fold_block`], so the same bits.
fn fold_block_into<'s, T: Kernel>(
    a: &mut [T],
    dst: &mut [T],
    n: usize,
    op: ReduceOp,
    src: impl FnMut(usize) -> Result<&'s [T]>,
) -> Result<()> {
    fold_members(a, Some(&mut *dst), n, op.elem(), src)?;
    if op == ReduceOp::Avg {
        T::divide(dst, n);
    }
    Ok(())
}

/// `x0 op x1 op ... op x(n−1)` in rank order (`src(q)` is `xq`, as long as
/// `a`), into `a`, or with `dst` into `dst` (`a` then holds the partial
/// results before the last member's). Every pass but the last reads and
/// writes `a`, which stays in the L1/L2 cache.
fn fold_members<'s, T: Kernel>(
    a: &mut [T],
    dst: Option<&mut [T]>,
    n: usize,
    eop: ElemOp,
    mut src: impl FnMut(usize) -> Result<&'s [T]>,
) -> Result<()> {
    let len = a.len();
    if dst.as_ref().is_some_and(|d| d.len() != len) {
        return Err(Error::invalid("internal: shared-memory block sizes"));
    }
    let mut next = |q: usize| -> Result<&'s [T]> {
        let s = src(q)?;
        if s.len() != len {
            return Err(Error::invalid("internal: shared-memory block sizes"));
        }
        Ok(s)
    };
    if n == 0 {
        return Err(Error::invalid("internal: a reduction over no member"));
    }
    match dst {
        Some(dst) if n == 1 => dst.copy_from_slice(next(0)?),
        Some(dst) if n == 2 => T::combine(eop, dst, next(0)?, next(1)?),
        dst => {
            // The members folded into `a`; with `dst`, the last goes there.
            let k = if dst.is_some() { n - 1 } else { n };
            if k == 1 {
                a.copy_from_slice(next(0)?);
            } else {
                let (x0, x1) = (next(0)?, next(1)?);
                T::combine(eop, a, x0, x1);
                for q in 2..k {
                    T::combine_assign(eop, a, next(q)?);
                }
            }
            if let Some(dst) = dst {
                T::combine(eop, dst, a, next(n - 1)?);
            }
        }
    }
    Ok(())
}

/// One member's view of the segment during a call: the three phases of a
/// piece `x` in buffer `buf`.
struct Io<'a> {
    seg: &'a Segment,
    n: usize,
    me: usize,
}

impl Io<'_> {
    /// Phase 1: copies the piece's segments other than this member's into its
    /// slot.
    async fn publish<T: Copy + Send + Sync>(&self, buf: usize, x: &[T]) -> Result<()> {
        let (n, me) = (self.n, self.me);
        for (q, s) in even_segments(x.len(), n).into_iter().enumerate() {
            if q != me {
                copy_yielding(
                    self.seg.write::<T>(n, buf, me, s.clone())?,
                    &x[s],
                    false,
                    Copier::Alone,
                )
                .await;
            }
        }
        Ok(())
    }

    /// Phase 2: reduces this member's segment of the piece over every
    /// member's copy in rank order, in blocks of `acc`'s length, into `x` and
    /// into this member's slot.
    async fn reduce<T: Kernel>(
        &self,
        buf: usize,
        x: &mut [T],
        acc: &mut [T],
        op: ReduceOp,
        stream: bool,
    ) -> Result<()> {
        let (n, me, seg) = (self.n, self.me, self.seg);
        let size = std::mem::size_of::<T>();
        let mine = even_segments(x.len(), n)[me].clone();
        let mut done = 0;
        let mut at = mine.start;
        while at < mine.end {
            let b = at..(at + acc.len()).min(mine.end);
            let a = &mut acc[..b.len()];
            // The result goes into this member's own part of its slot (which
            // its publish phase left alone and nobody reads until the next
            // barrier), then from there into the tensor.
            let slot = seg.write::<T>(n, buf, me, b.clone())?;
            fold_block_into(a, slot, n, op, |q| {
                if q == me {
                    Ok(&x[b.clone()])
                } else {
                    seg.read::<T>(n, buf, q, b.clone())
                }
            })?;
            copy(&mut x[b.clone()], slot, stream);
            done += b.len() * size * n;
            if done >= YIELD_BYTES {
                done = 0;
                tokio::task::yield_now().await;
            }
            at = b.end;
        }
        Ok(())
    }

    /// Phase 3: copies the other members' reduced segments of the piece from
    /// their slots into `x`.
    async fn take<T: Copy + Send + Sync>(&self, buf: usize, x: &mut [T], stream: bool) -> Result<()> {
        let (n, me) = (self.n, self.me);
        for (q, s) in even_segments(x.len(), n).into_iter().enumerate() {
            if q != me {
                copy_yielding(
                    &mut x[s.clone()],
                    self.seg.read::<T>(n, buf, q, s)?,
                    stream,
                    Copier::Alone,
                )
                .await;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Member 0's segment and member 1's view of it, in one process.
    #[cfg(target_os = "linux")]
    fn two_members() -> (Arc<Segment>, Arc<Segment>, std::fs::File) {
        let len = segment_len(4096, 2).unwrap();
        let (a, file, offer) = Segment::create(len).unwrap();
        let b = Segment::open(&offer, len).unwrap();
        (Arc::new(a), Arc::new(b), file)
    }

    /// A member maps only a segment sealed against resizing: an offer of a
    /// file of the right size and header that could be truncated under it
    /// (a plain memfd, a regular file) is refused.
    #[cfg(target_os = "linux")]
    #[test]
    fn an_offered_file_that_could_shrink_is_refused() {
        use nix::sys::memfd::{MFdFlags, memfd_create};
        use std::os::fd::AsRawFd;

        let len = segment_len(4096, 2).unwrap();
        let nonce = [7, 9];
        let unsealed = std::fs::File::from(memfd_create("unsealed", MFdFlags::MFD_CLOEXEC).unwrap());
        let dir = std::env::temp_dir().join(format!("mw-shm-seal-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let regular = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.join("segment"))
            .unwrap();
        for file in [&unsealed, &regular] {
            file.set_len(len as u64).unwrap();
            Segment::map(file, len).unwrap().write_header(nonce);
            let offer = Offer {
                pid: u64::from(std::process::id()),
                fd: file.as_raw_fd() as u64,
                len: len as u64,
                nonce,
            };
            let e = Segment::open(&offer, len)
                .err()
                .expect("an unsealed file was mapped");
            assert!(e.contains("seal"), "{e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
        // The runtime's own segments are sealed, and open.
        let (_a, _b, _file) = two_members();
    }

    /// A runtime whose only blocking-pool thread is held until the returned
    /// sender is dropped or sent to: a wait that hands its sleeping to the
    /// pool cannot end meanwhile.
    fn runtime_with_its_pool_held() -> (tokio::runtime::Runtime, std::sync::mpsc::Sender<()>) {
        let rt = multiworld_testkit::runtime_with_one_blocking_thread(1);
        let release = multiworld_testkit::hold_blocking_pool(&rt);
        (rt, release)
    }

    /// Member 1 arrives at its next barrier after `after`, on its own thread.
    #[cfg(target_os = "linux")]
    fn arrives_late(b: &Arc<Segment>, after: Duration) -> std::thread::JoinHandle<()> {
        let b = Arc::clone(b);
        std::thread::spawn(move || {
            std::thread::sleep(after);
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            // Member 0 is already there: no waiting, so no blocking pool.
            rt.block_on(arrive_and_wait_as(2, 1, 0, &b)).unwrap();
        })
    }

    /// A barrier waited for on a blocking caller's thread sleeps there, not
    /// on the blocking pool: it ends when the late member arrives although
    /// the runtime's only pool thread is held. The same wait from a thread
    /// that is not a blocking caller needs the pool, so it cannot end while
    /// the pool is held (the premise of the first half).
    #[cfg(target_os = "linux")]
    #[test]
    fn a_blocking_callers_barrier_sleeps_on_its_own_thread() {
        let (a, b, _file) = two_members();
        let (rt, release) = runtime_with_its_pool_held();
        let late = arrives_late(&b, Duration::from_millis(100));
        let t0 = Instant::now();
        let r = multiworld_tcp::as_blocking_caller(|| {
            rt.block_on(async {
                tokio::time::timeout(Duration::from_secs(10), arrive_and_wait_as(2, 0, 0, &a)).await
            })
        });
        let took = t0.elapsed();
        late.join().unwrap();
        assert!(matches!(r, Ok(Ok(Barrier::Passed))), "{r:?}");
        assert!(
            took >= Duration::from_millis(100),
            "ended before member 1 arrived: {took:?}"
        );
        assert!(took < Duration::from_secs(5), "took {took:?}");

        // Not a blocking caller: the wait goes to the held pool.
        let late = arrives_late(&b, Duration::from_millis(100));
        let r = rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(1), arrive_and_wait_as(2, 0, 0, &a)).await
        });
        late.join().unwrap();
        assert!(r.is_err(), "the wait ended while the pool was held: {r:?}");
        release.send(()).unwrap();
    }

    /// With a spin (`CollectiveConfig::shm_spin`), a barrier keeps checking
    /// between yields before it hands its sleeping to the pool: a member that
    /// arrives within it lets the barrier pass although the runtime's only
    /// pool thread is held (without a spin the same wait cannot end: see
    /// above), and the task's yields let the rest of its future run meanwhile.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_barrier_checks_between_yields_for_its_spin_before_it_sleeps() {
        let len = segment_len(4096, 2).unwrap();
        let (mut a, _file, offer) = Segment::create(len).unwrap();
        a.spin = Duration::from_secs(30);
        let (a, b) = (Arc::new(a), Arc::new(Segment::open(&offer, len).unwrap()));
        let (rt, release) = runtime_with_its_pool_held();
        let late = arrives_late(&b, Duration::from_millis(100));
        let t0 = Instant::now();
        let (r, other_branch) = rt.block_on(async {
            let barrier = tokio::time::timeout(Duration::from_secs(10), arrive_and_wait_as(2, 0, 0, &a));
            let other = async {
                tokio::time::sleep(Duration::from_millis(20)).await;
                t0.elapsed()
            };
            tokio::join!(barrier, other)
        });
        let took = t0.elapsed();
        late.join().unwrap();
        assert!(matches!(r, Ok(Ok(Barrier::Passed))), "{r:?}");
        assert!(
            took >= Duration::from_millis(100),
            "ended before member 1 arrived: {took:?}"
        );
        assert!(took < Duration::from_secs(5), "took {took:?}");
        assert!(
            other_branch < Duration::from_millis(100),
            "the spin held the future until {other_branch:?}"
        );
        release.send(()).unwrap();
    }

    /// While a blocking caller sleeps at a barrier that a member never
    /// reaches, the other branches of its future still run between slices
    /// (in a call: the guard that sees a lost member or a deadline).
    #[cfg(target_os = "linux")]
    #[test]
    fn a_blocking_callers_barrier_lets_the_rest_of_its_future_run() {
        let (a, _b, _file) = two_members();
        let (rt, _release) = runtime_with_its_pool_held();
        let t0 = Instant::now();
        let other_branch = multiworld_tcp::as_blocking_caller(|| {
            rt.block_on(async {
                tokio::select! {
                    r = arrive_and_wait_as(2, 0, 0, &a) => panic!("member 1 never arrives: {r:?}"),
                    () = tokio::time::sleep(Duration::from_millis(50)) => t0.elapsed(),
                }
            })
        });
        assert!(other_branch >= Duration::from_millis(50), "{other_branch:?}");
        assert!(
            other_branch < Duration::from_secs(2),
            "the sleeping held the future for {other_branch:?}"
        );
    }

    /// Non-temporal copies equal plain ones for every alignment of either
    /// side, lengths around the 64-byte body included, and touch nothing
    /// past the end.
    #[test]
    fn streamed_copies_equal_plain_copies() {
        let src: Vec<u8> = (0..4096u32).map(|i| (i * 31 % 251) as u8).collect();
        for stream in [false, true] {
            for so in 0..17 {
                for dof in 0..17 {
                    for len in [0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 1000, 4000] {
                        let mut dst = vec![0xEEu8; 4096 + 64];
                        copy(&mut dst[dof..dof + len], &src[so..so + len], stream);
                        assert_eq!(&dst[dof..dof + len], &src[so..so + len], "{so} {dof} {len}");
                        assert!(dst[..dof].iter().all(|&b| b == 0xEE), "{so} {dof} {len}");
                        assert!(dst[dof + len..].iter().all(|&b| b == 0xEE), "{so} {dof} {len}");
                    }
                }
            }
        }
        // Typed: f32 results written back with streaming stores.
        let a: Vec<f32> = (0..10_001).map(|i| i as f32 * 0.5).collect();
        let mut b = vec![0f32; 10_001];
        copy(&mut b[1..], &a[1..], true);
        assert_eq!(b[0], 0.0);
        assert_eq!(&b[1..], &a[1..]);
    }

    #[test]
    fn moves_are_planned_from_sizes_every_member_knows() {
        const MIB: u64 = 1 << 20;
        let mut cfg = CollectiveConfig::default();
        let plan = |r, n, cfg: &CollectiveConfig, b: &dyn Fn(usize, usize) -> u64| {
            plan_moves(r, n, cfg, cfg.shm_piece_bytes, b).map(|m| (m.cap, m.steps))
        };
        // Scatter of 1 MiB to each of 2 others: one slot, one step; a byte
        // more to one of them, two steps for every member.
        let from_root = |extra: u64| {
            move |p: usize, q: usize| {
                if p == 0 && q != 0 {
                    MIB + extra * q as u64
                } else {
                    0
                }
            }
        };
        assert_eq!(
            plan(Routes::IntoReceiverSlot, 3, &cfg, &from_root(0)),
            Some((1 << 20, 1))
        );
        assert_eq!(
            plan(Routes::IntoReceiverSlot, 3, &cfg, &from_root(1)),
            Some((1 << 20, 2))
        );
        // All-to-all of 4: each pair gets a quarter of a slot.
        assert_eq!(plan(Routes::Pairs, 4, &cfg, &|_, _| MIB), Some((256 << 10, 4)));
        // 80 % of the threshold in all is below it; forced, it goes through.
        let each = cfg.shm_min_bytes as u64 * 2 / 5;
        let to_root = move |p: usize, q: usize| if q == 0 && p != 0 { each } else { 0 };
        assert_eq!(plan(Routes::FromSenderSlot, 3, &cfg, &to_root), None);
        cfg.algorithm = Algorithm::SharedMemory;
        assert_eq!(
            plan(Routes::FromSenderSlot, 3, &cfg, &to_root),
            Some((1 << 20, 1))
        );
        // Nothing to move (only a member to itself), even forced.
        assert_eq!(
            plan(Routes::Pairs, 3, &cfg, &|p, q| if p == q { MIB } else { 0 }),
            None
        );
        // A group of one; pieces too small for a part per pair.
        assert_eq!(plan(Routes::Pairs, 1, &cfg, &|_, _| MIB), None);
        cfg.shm_piece_bytes = 191;
        assert_eq!(plan(Routes::Pairs, 3, &cfg, &|_, _| MIB), None);
        assert_eq!(
            plan(Routes::FromSenderSlot, 3, &cfg, &to_root),
            usize::try_from(each.div_ceil(128)).ok().map(|steps| (128, steps))
        );
        // Sizes from the network cannot overflow the sums.
        cfg.shm_piece_bytes = 1 << 20;
        assert_eq!(
            plan(Routes::Pairs, 2, &cfg, &|_, _| u64::MAX),
            usize::try_from(u64::MAX.div_ceil(512 << 10))
                .ok()
                .map(|s| (512 << 10, s))
        );
    }

    /// Members 0, 1 and 2 of one segment, in one process.
    #[cfg(target_os = "linux")]
    fn three_members() -> (Vec<Arc<Segment>>, std::fs::File) {
        let len = segment_len(4096, 3).unwrap();
        let (a, file, offer) = Segment::create(len).unwrap();
        let b = Segment::open(&offer, len).unwrap();
        let c = Segment::open(&offer, len).unwrap();
        (vec![Arc::new(a), Arc::new(b), Arc::new(c)], file)
    }

    /// Member `me` of 3 arrives at its next barrier of call `seq` after
    /// `after`, on its own thread, and waits there; returns how it ended.
    #[cfg(target_os = "linux")]
    fn arrives_at(
        seg: &Arc<Segment>,
        me: usize,
        seq: u64,
        after: Duration,
    ) -> std::thread::JoinHandle<Barrier> {
        let seg = Arc::clone(seg);
        std::thread::spawn(move || {
            std::thread::sleep(after);
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(arrive_and_wait_as(3, me, seq, &seg)).unwrap()
        })
    }

    /// A member that abandons the segment ends the others' waits at the
    /// barriers it will never reach, and only those: a barrier it reached
    /// before abandoning waits on for a slow member that is still alive; the
    /// next one, which it never reaches, ends at once for everyone; a later
    /// call's barrier reports that the call agrees over TCP.
    #[cfg(target_os = "linux")]
    #[test]
    fn abandoning_the_segment_ends_only_the_waits_it_would_hang() {
        let (m, _file) = three_members();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        // Call 6: member 2 arrives at the first barrier, then its call is
        // dropped and its next call (7) abandons the segment; member 1 is
        // slow but comes.
        let two = arrives_at(&m[2], 2, 6, Duration::ZERO);
        std::thread::sleep(Duration::from_millis(20));
        m[2].abandon(3, 2, 7);
        let one = arrives_at(&m[1], 1, 6, Duration::from_millis(150));
        let t0 = Instant::now();
        let first = rt.block_on(arrive_and_wait_as(3, 0, 6, &m[0])).unwrap();
        assert_eq!(first, Barrier::Passed, "member 2 had arrived; member 1 came");
        assert!(
            t0.elapsed() >= Duration::from_millis(100),
            "did not wait for member 1"
        );
        assert_eq!(one.join().unwrap(), Barrier::Passed);
        assert_eq!(two.join().unwrap(), Barrier::Passed);
        // The next barrier of call 6: member 2 never comes.
        let abandoned = Barrier::Abandoned {
            by: Abandoned { from: 7, by: 2 },
            target: 2,
        };
        let one = arrives_at(&m[1], 1, 6, Duration::ZERO);
        let t0 = Instant::now();
        let second = rt
            .block_on(async {
                tokio::time::timeout(Duration::from_secs(5), arrive_and_wait_as(3, 0, 6, &m[0])).await
            })
            .unwrap()
            .unwrap();
        assert_eq!(second, abandoned);
        assert_eq!(one.join().unwrap(), abandoned);
        assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
        // Call 7's agreement: member 2 agrees over TCP from there.
        let third = rt.block_on(arrive_and_wait_as(3, 0, 7, &m[0])).unwrap();
        assert_eq!(
            third,
            Barrier::Abandoned {
                by: Abandoned { from: 7, by: 2 },
                target: 3
            }
        );
        assert_eq!(m[1].abandonment(3), Some(Abandoned { from: 7, by: 2 }));
    }

    /// A member sleeping on a pool thread is woken by an abandoning; the
    /// earliest call wins among several members; a member abandons once.
    #[cfg(target_os = "linux")]
    #[test]
    fn abandoning_wakes_sleepers_and_is_written_once() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let (c, d, _file) = two_members();
        let d2 = Arc::clone(&d);
        let abandoner = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            d2.abandon(2, 1, 3);
        });
        let t0 = Instant::now();
        let r = rt.block_on(arrive_and_wait_as(2, 0, 2, &c)).unwrap();
        abandoner.join().unwrap();
        assert_eq!(
            r,
            Barrier::Abandoned {
                by: Abandoned { from: 3, by: 1 },
                target: 1
            }
        );
        assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
        c.abandon(2, 0, 5);
        assert_eq!(
            d.abandonment(2),
            Some(Abandoned { from: 3, by: 1 }),
            "the earlier call"
        );
        d.abandon(2, 1, 1);
        assert_eq!(
            c.abandonment(2),
            Some(Abandoned { from: 3, by: 1 }),
            "written once"
        );
    }

    /// The agreement through the segment: each member reads the other's
    /// descriptor of the same call, from the slot of the call's parity.
    #[cfg(target_os = "linux")]
    #[test]
    fn descriptors_go_through_their_slots() {
        let (a, b, _file) = two_members();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let words = desc::words(2);
        for seq in 0..5u64 {
            let mine: Vec<u64> = (0..words as u64).map(|w| seq * 100 + w).collect();
            let theirs: Vec<u64> = (0..words as u64).map(|w| seq * 1000 + w).collect();
            let (a2, b2, t2) = (Arc::clone(&a), Arc::clone(&b), theirs.clone());
            let other = rt.spawn(async move { agree(2, 1, seq, &b2, &t2).await });
            let got = rt.block_on(agree(2, 0, seq, &a2, &mine)).unwrap().unwrap();
            let got_other = rt.block_on(other).unwrap().unwrap().unwrap();
            assert_eq!(got, vec![None, Some(theirs)], "call {seq}");
            assert_eq!(got_other, vec![Some(mine), None], "call {seq}");
        }
        assert!(
            a.put_desc(2, 0, 0, &[1, 2, 3]).is_err(),
            "a descriptor of the wrong length"
        );
        assert!(a.desc_of(2, 2, 0).is_err(), "no member 2");
    }

    #[test]
    fn segment_sizes_follow_the_pieces() {
        // Descriptor slots: 2 × 4 × 16 words fit in a page.
        assert_eq!(segment_len(1 << 20, 4), Some(HEADER + 4096 + (12 << 20)));
        assert_eq!(
            segment_len(100, 2),
            Some(HEADER + 4096 + 3 * 2 * 64),
            "rounded down to 64"
        );
        // 2 × 63 × 134 words: 33 pages.
        assert_eq!(
            segment_len(64, MAX_MEMBERS),
            Some(HEADER + 33 * 4096 + 3 * 63 * 64)
        );
        assert_eq!(segment_len(63, 2), None, "pieces under 64 bytes");
        assert_eq!(segment_len(1 << 20, 1), None, "a group of one");
        assert_eq!(segment_len(1 << 20, MAX_MEMBERS + 1), None, "too many members");
        assert_eq!(segment_len(usize::MAX, 2), None, "overflow");
        assert_eq!(segment_len(usize::MAX / 8, 4), None, "overflow");
        assert_eq!(segment_len(isize::MAX as usize / 6, 2), None, "beyond isize");
    }

    /// Member `q`'s block: floats whose sum depends on the order.
    fn member_block(q: usize, len: usize) -> Vec<f32> {
        (0..len)
            .map(|i| {
                let i = i as f32;
                match q {
                    0 => 1.0e8 + i,
                    1 => 3.7 + i * 0.37,
                    2 => 5.3 - i * 0.11,
                    3 => -1.0e8,
                    _ => 0.77 * i,
                }
            })
            .collect()
    }

    /// `x0 op x1 op ...` one member at a time, the order the results must
    /// keep bit for bit.
    fn naive(blocks: &[Vec<f32>], op: ReduceOp) -> Vec<f32> {
        let mut acc = blocks[0].clone();
        for b in &blocks[1..] {
            f32::combine_assign(op.elem(), &mut acc, b);
        }
        if op == ReduceOp::Avg {
            f32::divide(&mut acc, blocks.len());
        }
        acc
    }

    #[test]
    fn folds_keep_rank_order_bit_for_bit_into_scratch_or_a_destination() {
        let len = 37;
        for n in 1..=5 {
            let blocks: Vec<Vec<f32>> = (0..n).map(|q| member_block(q, len)).collect();
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Product] {
                let want = naive(&blocks, op);
                let src = |q: usize| Ok(&blocks[q][..]);
                let mut a = vec![0.0f32; len];
                fold_block(&mut a, n, op, src).unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a), bits(&want), "fold_block n={n} {op:?}");
                let (mut a, mut dst) = (vec![0.0f32; len], vec![0.0f32; len]);
                fold_block_into(&mut a, &mut dst, n, op, src).unwrap();
                assert_eq!(bits(&dst), bits(&want), "fold_block_into n={n} {op:?}");
            }
        }
        // With 3 members, another order gives other bits: the check above
        // can tell.
        let blocks: Vec<Vec<f32>> = (0..3).map(|q| member_block(q, len)).collect();
        let reversed: Vec<Vec<f32>> = blocks.iter().rev().cloned().collect();
        assert_ne!(naive(&blocks, ReduceOp::Sum), naive(&reversed, ReduceOp::Sum));
    }

    #[test]
    fn folds_refuse_blocks_of_other_lengths_and_no_members() {
        let (short, full) = (vec![1.0f32; 3], vec![1.0f32; 4]);
        let mut a = vec![0.0f32; 4];
        let mut dst = vec![0.0f32; 4];
        let src = |q: usize| Ok(if q == 1 { &short[..] } else { &full[..] });
        assert!(fold_block(&mut a, 2, ReduceOp::Sum, src).is_err());
        assert!(fold_block_into(&mut a, &mut dst, 3, ReduceOp::Sum, src).is_err());
        assert!(fold_block_into(&mut a, &mut dst[..3], 1, ReduceOp::Sum, |_| Ok(&full[..])).is_err());
        assert!(fold_block(&mut a, 0, ReduceOp::Sum, |_| Ok(&full[..])).is_err());
        assert!(fold_block_into(&mut a, &mut dst, 0, ReduceOp::Sum, |_| Ok(&full[..])).is_err());
    }
}
