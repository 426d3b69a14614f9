//! Receive matching, the pure core of a communicator's receive path: posted
//! receives waiting for messages, early ("unexpected") messages waiting for
//! receives, and the rule that decides where an arriving message's payload
//! goes before a byte of it is read. No I/O and no clock: the reader tasks in
//! `comm.rs` feed it what arrived and carry out what it decides.
//!
//! The rules, each unit-tested below without sockets:
//! - **Order.** A message from `from` on `tag` goes to the earliest posted
//!   receive it satisfies (its own source, or any source); receives whose
//!   caller went away (cancelled) are skipped.
//! - **Routing** ([`Matching::route`]): a posted receive takes the payload
//!   directly (zero-copy); otherwise it is read ahead into a pooled buffer when
//!   it fits the peer's budget of held bytes and is small (`eager_limit`) or a
//!   receive is waiting behind it on this connection (so that one is not
//!   blocked); otherwise it stays in the socket (TCP backpressure). Messages
//!   above [`WINDOWED_FROM`] are read ahead only while the peer's held bytes
//!   stay within [`READ_AHEAD_WINDOW`]: a stream of them keeps a few messages
//!   ahead of its receiver, not a whole budget's worth (a leader receiving
//!   from many worlds would otherwise drain one peer's socket far ahead of the
//!   others, and hold that much memory). A peer that is closing (`draining`)
//!   is always read, whatever the budget.
//! - **Any source** takes the earliest arrival over all ranks, so each
//!   sender's order is kept.
//! - **Cancel while arriving**: a receive cancelled after its payload started
//!   arriving gives the message back, to be stashed for the next receive.
//! - **Held bytes** per peer count what is buffered or being read ahead, and
//!   are released when a receive takes it.
//! - **Reopening** ([`reopens`]): a receive that takes a read-ahead message
//!   wakes the peer's reader, if it holds back a frame for lack of room,
//!   once the held bytes have fallen to half the limit that holds that frame
//!   back (at most to the room it needs), so that it reads ahead again
//!   while the receiver takes what is there (once per fall, not once per
//!   message).

use std::collections::{HashMap, VecDeque};

use multiworld_types::{DType, Rank, Source, Tag, Tensor};
use tokio::sync::oneshot;

use crate::error::Result;

/// Whether a receive that has just taken `taken` read-ahead bytes of a peer
/// (released: `held` are left) must wake that peer's reader, which holds back
/// a frame of `frame_len` bytes (no receive posted, no room to read it
/// ahead): the held bytes have just fallen to half the limit that holds such
/// a frame back (the read-ahead window, 1 MiB or `budget` if less, above
/// [`WINDOWED_FROM`]; `budget` at or below it), or to the room the frame
/// needs if that is less, so the reader can read it and more ahead while
/// the receiver takes what is there. Without it, a receiver that only takes
/// what was read ahead (`Communicator::try_recv`) drains the stash and finds
/// the reader still parked, and the next receive has to wait for it. Once
/// per fall, not once per message: each wake-up costs a thread hand-off.
/// The rule is that of a frame with no receive posted behind it on the
/// connection; one held back although a receive waits behind it (over the
/// budget) is woken the same way, at the same mark, or by its own 10 ms
/// look.
pub(crate) fn reopens(
    held: usize,
    taken: usize,
    frame_len: usize,
    eager_limit: usize,
    budget: usize,
) -> bool {
    let Some(room) = Matching::room(frame_len, eager_limit, budget) else {
        return false;
    };
    let limit = room.saturating_add(frame_len);
    let mark = (limit / 2).min(room);
    held <= mark && held.saturating_add(taken) > mark
}

/// Early messages above this many bytes are read ahead only within
/// [`READ_AHEAD_WINDOW`] (see the module docs).
pub(crate) const WINDOWED_FROM: usize = 16 << 10;
/// Most bytes held for one peer's early messages once a message above
/// [`WINDOWED_FROM`] is to be read ahead (sixteen 64 KiB messages).
pub(crate) const READ_AHEAD_WINDOW: usize = 1 << 20;
/// Most spare buffers kept for small unexpected messages...
const POOL_MAX: usize = 64;
/// ... and most bytes of capacity they may hold together.
const POOL_BYTES: usize = 1 << 20;
/// Empty per-tag queues kept before they are dropped (they avoid an
/// allocation per message without letting ever-changing tags grow the maps).
const EMPTY_QUEUES_KEPT: usize = 64;

/// The outcome handed to a receive: its buffer back, and who sent or what failed.
pub(crate) struct RecvDone {
    pub(crate) buf: Tensor,
    pub(crate) result: Result<Rank>,
    /// The message's place in arrival order (see [`Matching::stash`]); 0
    /// for a failed receive.
    pub(crate) arrival: u64,
}

impl RecvDone {
    /// A failed receive's outcome: its buffer back, and why.
    pub(crate) fn failed(buf: Tensor, err: crate::error::Error) -> RecvDone {
        RecvDone {
            buf,
            result: Err(err),
            arrival: 0,
        }
    }
}

/// A posted receive: where a message may come from, the buffer it goes into,
/// and where to hand the outcome.
pub(crate) struct Posted {
    pub(crate) id: u64,
    pub(crate) src: Source,
    pub(crate) buf: Tensor,
    pub(crate) tx: oneshot::Sender<RecvDone>,
    /// The place in arrival order of the message it was handed (set when a
    /// message is matched to it).
    pub(crate) arrival: u64,
}

/// The payload of an early message.
pub(crate) enum StashData {
    /// A small message read ahead into a pooled buffer.
    Bytes(Vec<u8>),
    /// A message whose receive was cancelled while it was arriving.
    Tensor(Tensor),
}

impl StashData {
    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            StashData::Bytes(v) => v,
            StashData::Tensor(t) => t.as_bytes(),
        }
    }
}

/// An early message, in arrival order.
pub(crate) struct Stashed {
    pub(crate) arrival: u64,
    pub(crate) dtype: DType,
    pub(crate) data: StashData,
}

/// Where an arriving message's payload goes (see the module docs).
pub(crate) enum Route {
    /// Straight into this posted receive's buffer.
    Receive(Posted),
    /// Read ahead into this (pooled) buffer; its bytes are now held.
    ReadAhead(Vec<u8>),
    /// Leave it in the socket until a receive is posted or room is made.
    Hold,
}

/// Early messages taken out at abort: dropped by the caller outside the lock.
pub(crate) type Stash = HashMap<(Rank, Tag), VecDeque<Stashed>>;

/// Posted receives and early messages of one communicator. The communicator
/// guards it with a `std` mutex that is never held across `.await` (every
/// method is short and never blocks).
pub(crate) struct Matching {
    posted: HashMap<Tag, VecDeque<Posted>>,
    /// Receives posted for a specific source, per source rank.
    posted_for: Vec<usize>,
    /// Any-source receives posted.
    posted_any: usize,
    unexpected: Stash,
    /// Bytes held (or being read) for early messages, per source rank.
    held: Vec<usize>,
    pool: Vec<Vec<u8>>,
    next_id: u64,
    next_arrival: u64,
}

impl Matching {
    /// Matching for a world of `size` ranks.
    pub(crate) fn new(size: usize) -> Self {
        Matching {
            posted: HashMap::new(),
            posted_for: vec![0; size],
            posted_any: 0,
            unexpected: HashMap::new(),
            held: vec![0; size],
            pool: Vec::new(),
            next_id: 0,
            next_arrival: 0,
        }
    }

    fn count(&mut self, src: Source, up: bool) {
        let c = match src {
            Source::Any => &mut self.posted_any,
            Source::Rank(r) => match self.posted_for.get_mut(r.index()) {
                Some(c) => c,
                None => return,
            },
        };
        if up {
            *c += 1;
        } else {
            *c = c.saturating_sub(1);
        }
    }

    /// Posts a receive (after [`Matching::take_stash`] found nothing); returns
    /// its id, for [`Matching::take_posted_id`].
    pub(crate) fn post(&mut self, src: Source, tag: Tag, buf: Tensor, tx: oneshot::Sender<RecvDone>) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.posted.entry(tag).or_default().push_back(Posted {
            id,
            src,
            buf,
            tx,
            arrival: 0,
        });
        self.count(src, true);
        id
    }

    fn remove_posted(&mut self, tag: Tag, idx: usize) -> Option<Posted> {
        let q = self.posted.get_mut(&tag)?;
        let p = q.remove(idx)?;
        if q.is_empty() && self.posted.len() > EMPTY_QUEUES_KEPT {
            self.posted.remove(&tag);
        }
        self.count(p.src, false);
        Some(p)
    }

    /// The earliest posted receive that a message from `from` on `tag`
    /// satisfies, skipping (and dropping) receives whose caller went away.
    pub(crate) fn take_posted(&mut self, from: Rank, tag: Tag) -> Option<Posted> {
        self.take_posted_if(from, tag, |_| true)
    }

    /// Like [`Matching::take_posted`], but only if that receive's buffer
    /// fits the message (`dtype`, `len` bytes); a receive that does not fit
    /// stays posted (its mismatch is for the connection's reader to report).
    pub(crate) fn take_posted_fitting(
        &mut self,
        from: Rank,
        tag: Tag,
        dtype: DType,
        len: usize,
    ) -> Option<Posted> {
        self.take_posted_if(from, tag, |p| p.buf.dtype() == dtype && p.buf.nbytes() == len)
    }

    /// The earliest posted receive that a message from `from` on `tag`
    /// satisfies, skipping (and dropping) receives whose caller went away,
    /// if `take` accepts it; otherwise it stays posted.
    fn take_posted_if(&mut self, from: Rank, tag: Tag, take: impl Fn(&Posted) -> bool) -> Option<Posted> {
        loop {
            let q = self.posted.get(&tag)?;
            let idx = q.iter().position(|p| p.src.matches(from))?;
            let p = q.get(idx)?;
            if !p.tx.is_closed() && !take(p) {
                return None;
            }
            let mut p = self.remove_posted(tag, idx)?;
            if !p.tx.is_closed() {
                p.arrival = self.stamp();
                return Some(p);
            }
        }
    }

    /// Removes the posted receive `id` on `tag` (a cancel), if still posted.
    pub(crate) fn take_posted_id(&mut self, tag: Tag, id: u64) -> Option<Posted> {
        let idx = self.posted.get(&tag)?.iter().position(|p| p.id == id)?;
        self.remove_posted(tag, idx)
    }

    /// Removes every posted receive `pred` selects (abort, a lost peer).
    pub(crate) fn drain_posted(&mut self, pred: impl Fn(&Posted) -> bool) -> Vec<Posted> {
        let mut out = Vec::new();
        for q in self.posted.values_mut() {
            let mut i = 0;
            while i < q.len() {
                if pred(&q[i]) {
                    if let Some(p) = q.remove(i) {
                        out.push(p);
                    }
                } else {
                    i += 1;
                }
            }
        }
        for p in &out {
            let src = p.src;
            self.count(src, false);
        }
        out
    }

    /// The earliest buffered message for `src` on `tag` (any-source: earliest
    /// arrival over all ranks, so each sender's order is kept); its bytes are
    /// no longer held.
    pub(crate) fn take_stash(&mut self, src: Source, tag: Tag) -> Option<(Rank, Stashed)> {
        let from = match src {
            Source::Rank(r) => r,
            Source::Any => {
                let mut best: Option<(u64, Rank)> = None;
                for r in 0..self.held.len() {
                    let r = Rank(r as u32);
                    if let Some(s) = self.unexpected.get(&(r, tag)).and_then(|q| q.front()) {
                        if best.is_none_or(|(a, _)| s.arrival < a) {
                            best = Some((s.arrival, r));
                        }
                    }
                }
                best?.1
            }
        };
        let q = self.unexpected.get_mut(&(from, tag))?;
        let s = q.pop_front()?;
        if q.is_empty() && self.unexpected.len() > EMPTY_QUEUES_KEPT {
            self.unexpected.remove(&(from, tag));
        }
        self.release(from, s.data.bytes().len());
        Some((from, s))
    }

    /// The next place in arrival order: every message gets one when it is
    /// matched to a receive or kept, in the order its connection's frames
    /// come, so the places of one sender's messages follow its sending order.
    pub(crate) fn stamp(&mut self) -> u64 {
        let a = self.next_arrival;
        self.next_arrival += 1;
        a
    }

    /// Keeps an early message for a later receive. `reserved`: its bytes are
    /// already counted in `held` (read ahead). `arrival`: its place in
    /// arrival order if it has one (a message given back by a receive that
    /// was dropped before taking it: it goes back ahead of the messages from
    /// `from` on `tag` that arrived after it); `None` for a new message,
    /// which is the latest.
    pub(crate) fn stash(
        &mut self,
        from: Rank,
        tag: Tag,
        dtype: DType,
        data: StashData,
        reserved: bool,
        arrival: Option<u64>,
    ) {
        self.hold(from, &data, reserved);
        let arrival = match arrival {
            Some(a) => a,
            None => self.stamp(),
        };
        let q = self.unexpected.entry((from, tag)).or_default();
        let at = q.iter().rposition(|s| s.arrival < arrival).map_or(0, |i| i + 1);
        q.insert(at, Stashed { arrival, dtype, data });
    }

    fn hold(&mut self, from: Rank, data: &StashData, reserved: bool) {
        if !reserved {
            if let Some(h) = self.held.get_mut(from.index()) {
                *h = h.saturating_add(data.bytes().len());
            }
        }
    }

    /// Where the payload of a message of `len` bytes from `from` on `tag`
    /// goes (see the module docs). `ReadAhead` counts `len` as held.
    pub(crate) fn route(
        &mut self,
        from: Rank,
        tag: Tag,
        len: usize,
        eager_limit: usize,
        budget: usize,
        draining: bool,
    ) -> Route {
        if let Some(p) = self.take_posted(from, tag) {
            return Route::Receive(p);
        }
        if !(self.fits_ahead(from, len, eager_limit, budget) || draining) {
            return Route::Hold;
        }
        if let Some(h) = self.held.get_mut(from.index()) {
            *h = h.saturating_add(len);
        }
        Route::ReadAhead(self.pool.pop().unwrap_or_default())
    }

    /// Whether [`Matching::route`] would hold back a message from `from` on
    /// `tag` of `len` bytes now (no posted receive takes it and there is no
    /// room to read it ahead), without routing it. For a peer that is not
    /// closing. When it says so, routing holds back too; the converse can
    /// fail only while a cancelled receive is still posted (routing drops
    /// it first).
    pub(crate) fn holds_back(
        &self,
        from: Rank,
        tag: Tag,
        len: usize,
        eager_limit: usize,
        budget: usize,
    ) -> bool {
        let posted = self
            .posted
            .get(&tag)
            .is_some_and(|q| q.iter().any(|p| p.src.matches(from) && !p.tx.is_closed()));
        !posted && !self.fits_ahead(from, len, eager_limit, budget)
    }

    /// Whether a message from `from` of `len` bytes with no receive posted
    /// is read ahead (see the module docs).
    fn fits_ahead(&self, from: Rank, len: usize, eager_limit: usize, budget: usize) -> bool {
        // Someone waits for a message behind this one on this connection: read
        // this one ahead so that one is not blocked.
        let behind = self.posted_for.get(from.index()).copied().unwrap_or(0) > 0 || self.posted_any > 0;
        let held = self.held(from);
        if behind {
            return held.saturating_add(len) <= budget;
        }
        Self::room(len, eager_limit, budget).is_some_and(|room| held <= room)
    }

    /// The most bytes held for `from` under which a frame of `len` bytes
    /// with no receive posted is read ahead (`None`: never, it waits for its
    /// receive); see [`Matching::fits_ahead`].
    fn room(len: usize, eager_limit: usize, budget: usize) -> Option<usize> {
        if len > eager_limit {
            return None;
        }
        let limit = if len <= WINDOWED_FROM {
            budget
        } else {
            READ_AHEAD_WINDOW.min(budget)
        };
        limit.checked_sub(len)
    }

    /// Bytes held for early messages of `from`.
    pub(crate) fn held(&self, from: Rank) -> usize {
        self.held.get(from.index()).copied().unwrap_or(0)
    }

    /// Releases `len` held bytes of `from` (a read-ahead that failed, or a
    /// read-ahead message a receive took).
    pub(crate) fn release(&mut self, from: Rank, len: usize) {
        if let Some(h) = self.held.get_mut(from.index()) {
            *h = h.saturating_sub(len);
        }
    }

    /// Keeps a small buffer for the next read-ahead.
    pub(crate) fn recycle(&mut self, mut v: Vec<u8>, eager_limit: usize) {
        let pooled: usize = self.pool.iter().map(Vec::capacity).sum();
        if self.pool.len() < POOL_MAX
            && v.capacity() <= eager_limit.max(4096)
            && pooled.saturating_add(v.capacity()) <= POOL_BYTES
        {
            v.clear();
            self.pool.push(v);
        }
    }

    /// Takes every early message and spare buffer out (abort), releasing every
    /// held byte; the caller drops them outside the lock.
    pub(crate) fn take_all_stashed(&mut self) -> (Stash, Vec<Vec<u8>>) {
        self.held.iter_mut().for_each(|h| *h = 0);
        (
            std::mem::take(&mut self.unexpected),
            std::mem::take(&mut self.pool),
        )
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    const EAGER: usize = 64;
    const BUDGET: usize = 256;

    fn recv(m: &mut Matching, src: Source, tag: u32) -> (u64, oneshot::Receiver<RecvDone>) {
        let (tx, rx) = oneshot::channel();
        (m.post(src, Tag(tag), Tensor::from(vec![0u8; 4]), tx), rx)
    }

    fn bytes(n: usize, fill: u8) -> StashData {
        StashData::Bytes(vec![fill; n])
    }

    fn route(m: &mut Matching, from: u32, tag: u32, len: usize, draining: bool) -> Route {
        m.route(Rank(from), Tag(tag), len, EAGER, BUDGET, draining)
    }

    fn is_hold(r: &Route) -> bool {
        matches!(r, Route::Hold)
    }

    #[test]
    fn a_message_goes_to_the_earliest_receive_it_satisfies() {
        let mut m = Matching::new(3);
        let (a, _ra) = recv(&mut m, Source::Rank(Rank(2)), 7);
        let (b, _rb) = recv(&mut m, Source::Any, 7);
        let (c, _rc) = recv(&mut m, Source::Rank(Rank(1)), 7);
        // From rank 1: the any-source receive is the earliest it satisfies.
        assert_eq!(m.take_posted(Rank(1), Tag(7)).unwrap().id, b);
        assert_eq!(m.take_posted(Rank(1), Tag(7)).unwrap().id, c);
        assert!(m.take_posted(Rank(1), Tag(7)).is_none());
        // Another tag never matches.
        assert!(m.take_posted(Rank(2), Tag(8)).is_none());
        assert_eq!(m.take_posted(Rank(2), Tag(7)).unwrap().id, a);
    }

    #[test]
    fn holds_back_says_what_route_would_do_without_doing_it() {
        let mut m = Matching::new(3);
        let big = 4 * EAGER;
        // Nothing posted, too large to read ahead: held back, and routing agrees.
        assert!(m.holds_back(Rank(1), Tag(5), big, EAGER, BUDGET));
        assert!(is_hold(&route(&mut m, 1, 5, big, false)));
        // Small: read ahead.
        assert!(!m.holds_back(Rank(1), Tag(5), 16, EAGER, BUDGET));
        // A receive posted for it: not held back, and nothing was taken.
        let (_id, _rx) = recv(&mut m, Source::Rank(Rank(1)), 5);
        assert!(!m.holds_back(Rank(1), Tag(5), big, EAGER, BUDGET));
        assert!(m.take_posted(Rank(1), Tag(5)).is_some());
        // A receive posted behind it on the same connection (another tag):
        // read ahead, so that one is not blocked.
        let (_id, _rx) = recv(&mut m, Source::Rank(Rank(1)), 6);
        assert!(!m.holds_back(Rank(1), Tag(5), big, EAGER, BUDGET));
        assert!(m.holds_back(Rank(2), Tag(5), big, EAGER, BUDGET));
        // A receive whose caller went away takes nothing, but still counts
        // as waiting behind until routing drops it: `holds_back` errs
        // towards "not held back" (the reader is woken to route it), never
        // the other way.
        let (_id, rx) = recv(&mut m, Source::Rank(Rank(2)), 5);
        drop(rx);
        assert!(!m.holds_back(Rank(2), Tag(5), big, EAGER, BUDGET));
        assert!(is_hold(&route(&mut m, 2, 5, big, false)));
        assert!(m.holds_back(Rank(2), Tag(5), big, EAGER, BUDGET));
    }

    #[test]
    fn only_a_receive_that_fits_is_taken_for_a_frame_read_by_its_poster() {
        let mut m = Matching::new(3);
        let buf = |n: usize| Tensor::zeros(DType::F32, [n]).unwrap();
        let (tx0, rx0) = oneshot::channel();
        let a = m.post(Source::Rank(Rank(1)), Tag(5), buf(4), tx0);
        let (tx1, _rx1) = oneshot::channel();
        let b = m.post(Source::Rank(Rank(1)), Tag(5), buf(8), tx1);
        // The earliest receive (16 bytes) does not fit 32 bytes: nothing is
        // taken, not even the later one that would.
        assert!(m.take_posted_fitting(Rank(1), Tag(5), DType::F32, 32).is_none());
        assert!(m.take_posted_fitting(Rank(1), Tag(5), DType::I32, 16).is_none());
        // Its caller gone, it is skipped and the next one is taken.
        drop(rx0);
        assert_eq!(
            m.take_posted_fitting(Rank(1), Tag(5), DType::F32, 32).unwrap().id,
            b
        );
        assert!(m.take_posted_id(Tag(5), a).is_none());
        // Another source or tag never matches.
        let (tx2, _rx2) = oneshot::channel();
        let c = m.post(Source::Any, Tag(5), buf(4), tx2);
        assert!(m.take_posted_fitting(Rank(2), Tag(6), DType::F32, 16).is_none());
        assert_eq!(
            m.take_posted_fitting(Rank(2), Tag(5), DType::F32, 16).unwrap().id,
            c
        );
    }

    #[test]
    fn cancelled_receives_are_skipped_and_cancel_by_id_removes_one() {
        let mut m = Matching::new(2);
        let (_a, ra) = recv(&mut m, Source::Rank(Rank(1)), 0);
        let (b, _rb) = recv(&mut m, Source::Rank(Rank(1)), 0);
        let (c, _rc) = recv(&mut m, Source::Rank(Rank(1)), 0);
        drop(ra); // the caller of the first receive went away
        assert_eq!(m.take_posted_id(Tag(0), c).unwrap().id, c);
        assert!(m.take_posted_id(Tag(0), c).is_none(), "taken once");
        assert_eq!(m.take_posted(Rank(1), Tag(0)).unwrap().id, b);
        assert!(m.take_posted(Rank(1), Tag(0)).is_none());
        // Nothing is counted as waiting any more: a large message is held.
        assert!(is_hold(&route(&mut m, 1, 0, EAGER + 1, false)));
    }

    #[test]
    fn routing_without_a_receive_follows_the_budget_and_the_eager_limit() {
        let mut m = Matching::new(2);
        // Small: read ahead, and its bytes are held.
        assert!(matches!(route(&mut m, 1, 0, EAGER, false), Route::ReadAhead(_)));
        assert_eq!(m.held(Rank(1)), EAGER);
        // Large with nobody waiting behind it: stays in the socket.
        assert!(is_hold(&route(&mut m, 1, 0, EAGER + 1, false)));
        // Small ones until the budget is spent, then held back.
        for _ in 0..(BUDGET / EAGER - 1) {
            assert!(matches!(route(&mut m, 1, 0, EAGER, false), Route::ReadAhead(_)));
        }
        assert_eq!(m.held(Rank(1)), BUDGET);
        assert!(is_hold(&route(&mut m, 1, 0, 1, false)));
        // The budget is per peer: rank 0 still has room.
        assert!(matches!(route(&mut m, 0, 0, 1, false), Route::ReadAhead(_)));
        // A closing peer is read whatever the budget.
        assert!(matches!(
            route(&mut m, 1, 0, 10 * BUDGET, true),
            Route::ReadAhead(_)
        ));
        // Releasing makes room again.
        m.release(Rank(1), 10 * BUDGET + BUDGET);
        assert_eq!(m.held(Rank(1)), 0);
        assert!(matches!(route(&mut m, 1, 0, EAGER, false), Route::ReadAhead(_)));
    }

    #[test]
    fn messages_above_16_kib_are_read_ahead_only_within_the_window() {
        let mut m = Matching::new(2);
        let (eager, msg) = (256 << 10, 64 << 10);
        let route = |m: &mut Matching, len: usize| m.route(Rank(1), Tag(0), len, eager, 64 << 20, false);
        for _ in 0..READ_AHEAD_WINDOW / msg {
            assert!(matches!(route(&mut m, msg), Route::ReadAhead(_)));
        }
        assert_eq!(m.held(Rank(1)), READ_AHEAD_WINDOW);
        // The window is full: the next 64 KiB message waits in the socket...
        assert!(is_hold(&route(&mut m, msg)));
        // ...a small one is still read ahead (the budget is far)...
        assert!(matches!(route(&mut m, WINDOWED_FROM), Route::ReadAhead(_)));
        // ...and once a receive took one, there is room again.
        m.release(Rank(1), msg + WINDOWED_FROM);
        assert!(matches!(route(&mut m, msg), Route::ReadAhead(_)));
    }

    #[test]
    fn taking_read_ahead_messages_reopens_a_held_back_reader_once_per_fall() {
        let (eager, budget, msg) = (256 << 10, 64 << 20, 64 << 10);
        // A window full of 64 KiB messages, the next one held back: taking
        // them one by one wakes the reader once, when half the window is
        // left, and not at each take.
        let mut m = Matching::new(2);
        while !is_hold(&m.route(Rank(1), Tag(0), msg, eager, budget, false)) {
            m.stash(Rank(1), Tag(0), DType::U8, bytes(msg, 1), true, None);
        }
        let mut wakes = Vec::new();
        while let Some((_, st)) = m.take_stash(Source::Rank(Rank(1)), Tag(0)) {
            if reopens(m.held(Rank(1)), st.data.bytes().len(), msg, eager, budget) {
                // Woken then, the held-back frame fits.
                let fits = !m.holds_back(Rank(1), Tag(0), msg, eager, budget);
                wakes.push((m.held(Rank(1)), fits));
            }
        }
        assert_eq!(wakes, [(READ_AHEAD_WINDOW / 2, true)]);
        // A frame that needs more than half the window: woken once it fits.
        let big = 600 << 10;
        let eager_big = 1 << 20;
        assert!(!reopens(READ_AHEAD_WINDOW - big + 1, msg, big, eager_big, budget));
        assert!(reopens(READ_AHEAD_WINDOW - big, msg, big, eager_big, budget));
        // Small messages: half the budget.
        assert!(reopens(budget / 2, 16, 16, eager, budget));
        assert!(!reopens(budget / 2 - 16, 16, 16, eager, budget));
        // Never for a frame that is never read ahead (it waits for its
        // receive, whose posting wakes the reader).
        assert!(!reopens(0, READ_AHEAD_WINDOW, eager + 1, eager, budget));
    }

    #[test]
    fn a_receive_waiting_behind_a_large_message_lets_it_be_read_ahead() {
        let mut m = Matching::new(3);
        let (_id, _rx) = recv(&mut m, Source::Rank(Rank(1)), 9);
        // A large message on another tag blocks the connection the receive on
        // tag 9 waits on: read it ahead, within the budget.
        assert!(matches!(route(&mut m, 1, 3, BUDGET, false), Route::ReadAhead(_)));
        // Over the budget it is held even so.
        assert!(is_hold(&route(&mut m, 1, 3, 1, false)));
        // A receive for another rank does not count for rank 2's connection...
        assert!(is_hold(&route(&mut m, 2, 3, EAGER + 1, false)));
        // ...but an any-source receive waits behind every connection.
        let (_id, _rx2) = recv(&mut m, Source::Any, 9);
        assert!(matches!(
            route(&mut m, 2, 3, EAGER + 1, false),
            Route::ReadAhead(_)
        ));
    }

    #[test]
    fn a_posted_receive_takes_the_payload_directly() {
        let mut m = Matching::new(2);
        let (id, _rx) = recv(&mut m, Source::Any, 5);
        match route(&mut m, 1, 5, 10 * BUDGET, false) {
            Route::Receive(p) => assert_eq!(p.id, id),
            _ => panic!("expected the posted receive"),
        }
        assert_eq!(m.held(Rank(1)), 0, "nothing held for a direct receive");
    }

    #[test]
    fn any_source_takes_the_earliest_arrival_and_keeps_each_senders_order() {
        let mut m = Matching::new(3);
        m.stash(Rank(2), Tag(1), DType::U8, bytes(1, 20), false, None);
        m.stash(Rank(1), Tag(1), DType::U8, bytes(1, 10), false, None);
        m.stash(Rank(2), Tag(1), DType::U8, bytes(1, 21), false, None);
        m.stash(Rank(1), Tag(2), DType::U8, bytes(1, 99), false, None);
        let order: Vec<(u32, u8)> = std::iter::from_fn(|| m.take_stash(Source::Any, Tag(1)))
            .map(|(r, s)| (r.0, s.data.bytes()[0]))
            .collect();
        assert_eq!(order, [(2, 20), (1, 10), (2, 21)]);
        // A specific source sees only its own messages, on its own tag.
        assert!(m.take_stash(Source::Rank(Rank(2)), Tag(2)).is_none());
        let (r, s) = m.take_stash(Source::Rank(Rank(1)), Tag(2)).unwrap();
        assert_eq!((r, s.data.bytes()[0]), (Rank(1), 99));
    }

    #[test]
    fn held_bytes_follow_stash_and_take() {
        let mut m = Matching::new(2);
        // Stashed without a read-ahead reservation: counted now.
        m.stash(Rank(1), Tag(0), DType::U8, bytes(30, 1), false, None);
        assert_eq!(m.held(Rank(1)), 30);
        // Read ahead (reserved by route), then stashed: not counted twice.
        let Route::ReadAhead(mut v) = route(&mut m, 1, 0, 20, false) else {
            panic!("expected a read-ahead");
        };
        assert_eq!(m.held(Rank(1)), 50);
        v.resize(20, 2);
        m.stash(Rank(1), Tag(0), DType::U8, StashData::Bytes(v), true, None);
        assert_eq!(m.held(Rank(1)), 50);
        m.take_stash(Source::Rank(Rank(1)), Tag(0)).unwrap();
        assert_eq!(m.held(Rank(1)), 20);
        m.take_stash(Source::Rank(Rank(1)), Tag(0)).unwrap();
        assert_eq!(m.held(Rank(1)), 0);
    }

    #[test]
    fn a_receive_cancelled_while_arriving_gives_the_message_to_the_next_one() {
        let mut m = Matching::new(2);
        let (_id, rx) = recv(&mut m, Source::Rank(Rank(1)), 4);
        let Route::Receive(p) = route(&mut m, 1, 4, 4, false) else {
            panic!("expected the posted receive");
        };
        // The payload is read into its buffer, but the caller has gone.
        drop(rx);
        let done =
            p.tx.send(RecvDone {
                buf: p.buf,
                result: Ok(Rank(1)),
                arrival: p.arrival,
            })
            .err()
            .unwrap();
        m.stash(
            Rank(1),
            Tag(4),
            DType::U8,
            StashData::Tensor(done.buf),
            false,
            Some(done.arrival),
        );
        // The next receive finds it.
        let (from, s) = m.take_stash(Source::Any, Tag(4)).unwrap();
        assert_eq!(from, Rank(1));
        assert_eq!(s.data.bytes().len(), 4);
        assert_eq!(m.held(Rank(1)), 0);
    }

    #[test]
    fn messages_given_back_in_any_order_go_back_in_arrival_order() {
        let mut m = Matching::new(3);
        // Three receives get the first three messages from rank 1...
        let mut handed = Vec::new();
        for fill in 0..3u8 {
            let (_id, rx) = recv(&mut m, Source::Rank(Rank(1)), 5);
            let Route::Receive(p) = route(&mut m, 1, 5, 4, false) else {
                panic!("expected the posted receive");
            };
            handed.push((fill, p.arrival, rx));
        }
        // ... the next two are kept, and one from rank 2 after them.
        m.stash(Rank(1), Tag(5), DType::U8, bytes(4, 3), false, None);
        m.stash(Rank(1), Tag(5), DType::U8, bytes(4, 4), false, None);
        m.stash(Rank(2), Tag(5), DType::U8, bytes(4, 9), false, None);
        // The three receives are dropped unread, the last first.
        for (fill, arrival, _rx) in handed.into_iter().rev() {
            m.stash(Rank(1), Tag(5), DType::U8, bytes(4, fill), false, Some(arrival));
        }
        let order: Vec<(u32, u8)> = std::iter::from_fn(|| m.take_stash(Source::Any, Tag(5)))
            .map(|(r, s)| (r.0, s.data.bytes()[0]))
            .collect();
        assert_eq!(order, [(1, 0), (1, 1), (1, 2), (1, 3), (1, 4), (2, 9)]);
    }

    #[test]
    fn abort_takes_everything_and_releases_every_held_byte() {
        let mut m = Matching::new(2);
        m.stash(Rank(0), Tag(0), DType::U8, bytes(10, 0), false, None);
        m.stash(Rank(1), Tag(3), DType::U8, bytes(10, 0), false, None);
        m.recycle(Vec::with_capacity(16), EAGER);
        let (_a, _ra) = recv(&mut m, Source::Any, 1);
        let (_b, _rb) = recv(&mut m, Source::Rank(Rank(1)), 2);
        let posted = m.drain_posted(|_| true);
        assert_eq!(posted.len(), 2);
        let (stash, pool) = m.take_all_stashed();
        assert_eq!(stash.values().map(VecDeque::len).sum::<usize>(), 2);
        assert_eq!(pool.len(), 1);
        assert_eq!((m.held(Rank(0)), m.held(Rank(1))), (0, 0));
        assert!(m.take_stash(Source::Any, Tag(0)).is_none());
        // Nothing waits any more: a large message is held back.
        assert!(is_hold(&route(&mut m, 1, 0, EAGER + 1, false)));
    }

    #[test]
    fn the_pool_keeps_only_a_few_small_buffers() {
        let mut m = Matching::new(1);
        m.recycle(Vec::with_capacity(1 << 20), EAGER);
        for _ in 0..(POOL_MAX + 10) {
            m.recycle(Vec::with_capacity(8), EAGER);
        }
        let (_, pool) = m.take_all_stashed();
        assert_eq!(pool.len(), POOL_MAX);
        assert!(pool.iter().all(|v| v.capacity() < 1 << 20));
        // 1 MiB buffers under a 1 MiB eager limit: no more than POOL_BYTES
        // in all.
        for _ in 0..POOL_MAX {
            m.recycle(Vec::with_capacity(1 << 20), 1 << 20);
        }
        let (_, pool) = m.take_all_stashed();
        assert_eq!(pool.len(), POOL_BYTES >> 20);
    }
}
