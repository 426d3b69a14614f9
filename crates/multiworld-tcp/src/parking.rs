//! Where a connection's reader leaves its link while it holds back a frame,
//! so that the thread that posts the frame's receive can read the payload
//! itself. Pure state, no I/O: `comm.rs` moves the link in and out.
//!
//! A reader that decoded a frame header and found no receive posted for it
//! (and no room to read it ahead) stops reading and waits to be woken
//! (TCP backpressure). Without this module, the receive posted next wakes the
//! reader, the reader reads the payload into the receive's buffer on its
//! runtime thread, and then wakes the receiver: two hand-offs between threads
//! for a message whose bytes were already in the socket. With it, the reader
//! *parks* its link here with the frame's header; the posting thread may
//! *lend* it, read what the socket holds straight into its buffer without
//! waiting, and *give it back* with the outcome (delivered, or read part-way
//! into that receive); the reader, woken, *unparks* it and goes on from there.
//!
//! The states, each transition under one mutex:
//!
//! | state | meaning | next |
//! |---|---|---|
//! | `Reading` | the reader task has its link | `Parked` (park), `Ended` (end) |
//! | `Parked` | the reader holds back this frame | `Reading` (unpark), `Lent` (lend), `Ended` (end: the link is handed to the reader's end) |
//! | `Lent` | a posting thread reads the frame's payload (noting whether anyone asked for the link meanwhile) | `Parked` (give back), `Ended` (end) |
//! | `Ended` | the reader task ended | — (a link given back is handed to the lender to drop) |
//!
//! The link moves with the state, so it is read by one thread at a time and
//! each byte once; the lender's predicate ([`Parking::lend`]) decides which
//! parked frames it takes.

use std::sync::{Mutex, MutexGuard, PoisonError};

use multiworld_types::{DType, Tag};

use crate::matching::Posted;

/// A data frame whose header was read and whose payload was not, or only
/// part of it.
pub(crate) struct Frame {
    pub(crate) tag: Tag,
    pub(crate) dtype: DType,
    /// Payload bytes.
    pub(crate) len: usize,
    /// When its header was read, in the communicator's order of arrivals
    /// over all its connections (an any-source receive takes the earliest).
    pub(crate) arrived: u64,
    /// The receive whose buffer the payload is going into, and how many of
    /// its bytes are there already (read by a lender); `None`: not routed.
    pub(crate) into: Option<(Posted, usize)>,
}

/// A parked link, with the frame its reader holds back.
pub(crate) struct Held<L> {
    /// The connection's read side, positioned right after `frame`'s header
    /// (and the payload bytes already read), or at a frame boundary.
    pub(crate) link: L,
    /// The frame held back; `None` once a lender has read it whole and found
    /// no whole header behind it (the link is at a frame boundary).
    pub(crate) frame: Option<Frame>,
    /// A read error the lender met (a reset is reported once, so the
    /// reader must hear of it from the lender).
    pub(crate) failed: Option<std::io::Error>,
}

impl<L> Held<L> {
    /// Takes the receive the held frame's payload is being read into, if
    /// any (to fail it with the connection).
    pub(crate) fn take_receive(&mut self) -> Option<Posted> {
        self.frame.as_mut()?.into.take().map(|(posted, _)| posted)
    }
}

enum State<L> {
    Reading,
    Parked(Held<L>),
    /// `wanted`: a poster was refused the link, or the reader tried to
    /// take it back, meanwhile: the lender must wake the reader.
    Lent {
        wanted: bool,
    },
    Ended,
}

/// What became of a link given back ([`Parking::give_back`]).
pub(crate) enum GivenBack<L> {
    /// Parked again; `wanted`: someone asked for it while it was lent, so
    /// the reader must be woken.
    Parked { wanted: bool },
    /// The reader had ended: the lender drops the link (and fails a receive
    /// left part-way).
    Ended(Held<L>),
}

/// One connection's parking place (see the module docs).
pub(crate) struct Parking<L> {
    state: Mutex<State<L>>,
}

impl<L> Parking<L> {
    /// A parking place whose reader has its link.
    pub(crate) fn new() -> Self {
        Parking {
            state: Mutex::new(State::Reading),
        }
    }

    fn state(&self) -> MutexGuard<'_, State<L>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The reader parks its link with the frame it holds back. Returns the
    /// frame if the reader has ended meanwhile (its end came first), which
    /// cannot happen to a live reader.
    pub(crate) fn park(&self, held: Held<L>) -> Option<Held<L>> {
        let mut s = self.state();
        match *s {
            State::Ended => Some(held),
            _ => {
                *s = State::Parked(held);
                None
            }
        }
    }

    /// The reader takes its link back: `None` while it is lent (the lender
    /// then wakes the reader when it gives it back).
    pub(crate) fn unpark(&self) -> Option<Held<L>> {
        let mut s = self.state();
        match std::mem::replace(&mut *s, State::Reading) {
            State::Parked(h) => Some(h),
            State::Lent { .. } => {
                *s = State::Lent { wanted: true };
                None
            }
            other => {
                *s = other;
                None
            }
        }
    }

    /// `look` applied to the parked link, if it is parked (the reader checking
    /// on it without taking it back); `None` otherwise.
    pub(crate) fn inspect<R>(&self, look: impl FnOnce(&Held<L>) -> Option<R>) -> Option<R> {
        match &*self.state() {
            State::Parked(h) => look(h),
            _ => None,
        }
    }

    /// The parked frame's arrival, if the link is parked and `fits` accepts
    /// it (a poster choosing among connections; the link stays parked).
    pub(crate) fn peek(&self, fits: impl FnOnce(&Held<L>) -> bool) -> Option<u64> {
        match &*self.state() {
            State::Parked(h) if fits(h) => h.frame.as_ref().map(|f| f.arrived),
            _ => None,
        }
    }

    /// A posting thread borrows the parked link if `fits` accepts it;
    /// `None` otherwise (the reader has it, or it is lent: then the lender
    /// wakes the reader when it gives it back, to see to what this poster
    /// posted).
    pub(crate) fn lend(&self, fits: impl FnOnce(&Held<L>) -> bool) -> Option<Held<L>> {
        let mut s = self.state();
        match &mut *s {
            State::Parked(h) if fits(h) => {}
            State::Lent { wanted } => {
                *wanted = true;
                return None;
            }
            _ => return None,
        }
        match std::mem::replace(&mut *s, State::Lent { wanted: false }) {
            State::Parked(h) => Some(h),
            // Not reached: matched as `Parked` above, under the same lock.
            other => {
                *s = other;
                None
            }
        }
    }

    /// The lender gives the link back, with where it stopped.
    pub(crate) fn give_back(&self, held: Held<L>) -> GivenBack<L> {
        let mut s = self.state();
        match *s {
            State::Lent { wanted } => {
                *s = State::Parked(held);
                GivenBack::Parked { wanted }
            }
            State::Ended => GivenBack::Ended(held),
            // Not reached: only the lender leaves `Lent` other than by the
            // reader's end. Were it reached, the link is dropped rather
            // than a second one parked.
            State::Reading | State::Parked(_) => {
                debug_assert!(false, "a link was given back that was not lent");
                GivenBack::Ended(held)
            }
        }
    }

    /// The reader task ends: from now on a link given back is the lender's
    /// to drop. Returns the parked frame, if the link was parked.
    pub(crate) fn end(&self) -> Option<Held<L>> {
        match std::mem::replace(&mut *self.state(), State::Ended) {
            State::Parked(h) => Some(h),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matching::Matching;
    use multiworld_types::{Rank, Source, Tensor};
    use tokio::sync::oneshot;

    fn held(link: u32) -> Held<u32> {
        Held {
            link,
            frame: Some(Frame {
                tag: Tag(3),
                dtype: DType::F32,
                len: 64,
                arrived: u64::from(link),
                into: None,
            }),
            failed: None,
        }
    }

    fn parked_again(g: GivenBack<u32>) -> bool {
        match g {
            GivenBack::Parked { wanted } => wanted,
            GivenBack::Ended(_) => panic!("the reader had not ended"),
        }
    }

    fn untouched(h: &Held<u32>) -> bool {
        h.frame.as_ref().is_some_and(|f| f.into.is_none())
    }

    fn posted() -> Posted {
        let mut m = Matching::new(2);
        let (tx, _rx) = oneshot::channel();
        m.post(
            Source::Rank(Rank(1)),
            Tag(3),
            Tensor::zeros(DType::F32, [16]).unwrap(),
            tx,
        );
        m.take_posted_id(Tag(3), 0).unwrap()
    }

    #[test]
    fn a_parked_link_is_lent_once_and_comes_back_where_the_lender_stopped() {
        let p: Parking<u32> = Parking::new();
        // Nothing to lend while the reader reads.
        assert!(p.lend(|_| true).is_none());
        assert!(p.peek(|_| true).is_none());
        assert!(p.park(held(7)).is_none());
        assert_eq!(p.peek(untouched), Some(7));
        assert_eq!(p.peek(|_| false), None);
        assert_eq!(p.inspect(|h| Some(h.link)), Some(7));
        // The predicate decides.
        assert!(p.lend(|h| h.frame.as_ref().is_some_and(|f| f.len > 64)).is_none());
        let mut h = p.lend(untouched).unwrap();
        // Lent: neither the reader nor a second lender gets it.
        assert!(p.peek(|_| true).is_none());
        assert!(p.inspect(|h| Some(h.link)).is_none());
        assert!(p.unpark().is_none());
        assert!(p.lend(|_| true).is_none());
        // Read whole, nothing behind it: at a frame boundary.
        h.frame = None;
        // The refused lend above asked for it: the reader is to be woken.
        assert!(parked_again(p.give_back(h)));
        assert!(p.lend(untouched).is_none());
        let back = p.unpark().unwrap();
        assert_eq!(back.link, 7);
        assert!(back.frame.is_none());
        // The reader has it again.
        assert!(p.unpark().is_none());
    }

    #[test]
    fn a_frame_read_part_way_carries_its_receive_back_to_the_reader() {
        let p: Parking<u32> = Parking::new();
        assert!(p.park(held(1)).is_none());
        let mut h = p.lend(untouched).unwrap();
        if let Some(f) = h.frame.as_mut() {
            f.into = Some((posted(), 40));
        }
        // Nobody asked for it meanwhile.
        assert!(!parked_again(p.give_back(h)));
        // A frame being filled is not lent again.
        assert!(p.lend(untouched).is_none());
        let f = p.unpark().unwrap().frame.unwrap();
        let (posted, filled) = f.into.unwrap();
        assert_eq!(filled, 40);
        assert_eq!(posted.buf.nbytes(), 64);
    }

    #[test]
    fn a_reader_that_asks_for_its_lent_link_is_woken_when_it_comes_back() {
        let p: Parking<u32> = Parking::new();
        assert!(p.park(held(4)).is_none());
        let h = p.lend(untouched).unwrap();
        assert!(p.unpark().is_none());
        assert!(parked_again(p.give_back(h)));
        assert_eq!(p.unpark().unwrap().link, 4);
    }

    #[test]
    fn a_reader_that_ends_takes_its_parked_link_or_leaves_a_lent_one_to_the_lender() {
        // Parked at the end: the end gets it.
        let p: Parking<u32> = Parking::new();
        assert!(p.park(held(1)).is_none());
        assert_eq!(p.end().unwrap().link, 1);
        assert!(p.lend(|_| true).is_none());
        // Lent at the end: the lender gets it back to drop.
        let p: Parking<u32> = Parking::new();
        assert!(p.park(held(2)).is_none());
        let h = p.lend(|_| true).unwrap();
        assert!(p.end().is_none());
        match p.give_back(h) {
            GivenBack::Ended(h) => assert_eq!(h.link, 2),
            GivenBack::Parked { .. } => panic!("parked after the reader ended"),
        }
        assert!(p.unpark().is_none());
        // Reading at the end: nothing to hand over, and a late park is refused.
        let p: Parking<u32> = Parking::new();
        assert!(p.end().is_none());
        assert_eq!(p.park(held(3)).unwrap().link, 3);
    }
}
