//! The life cycle of one tensor collective call, written once:
//! [`Group::run_collective`]. It runs the stages described in `group.rs` in
//! their order:
//!
//! 1. `begin`: membership check, the call's turn and sequence number;
//! 2. the operation's **preparation** fills the call's descriptor and validates
//!    the call locally; an invalid call abstains (its descriptor, marked so, goes
//!    to the other members, no tensor data) and fails with the error prefixed by
//!    the operation's name;
//! 3. `plan`: the algorithm and whether direct payloads go eagerly;
//! 4. the group's scratch pool (and, for a call that may use it, its
//!    shared-memory state) is lent to the call;
//! 5. the operation's **body** (agreement round, then the algorithm) runs under
//!    the member-loss guard;
//! 6. what was lent goes back to the group, and after a failure the output
//!    tensors get back the dtype and shape they had (a receive cancelled while
//!    its message was arriving takes the buffer).
//!
//! Each operation (`ops.rs`) supplies only its preparation (description,
//! validation, byte counts, as a [`Prep`]) and its body.

use crate::desc::{Algo, Desc, Kind};
use crate::group::{Ctx, Group, Ticket};
use crate::shm::ShmLoan;
use crate::util::Scratch;
use multiworld_tcp::{Error, Result};
use multiworld_types::{DType, Tensor};

/// What an operation's preparation established: the facts its validation found
/// (the root's member index, the splits, ...) for the body, the byte counts the
/// algorithm choice needs (see `Call::plan` in `group.rs`), and which of the
/// group's state the call borrows.
pub(crate) struct Prep<V> {
    /// Handed to the body.
    valid: V,
    /// The buffer size every member agrees on (for the crossover).
    size_bytes: u64,
    /// What this rank sends in the direct algorithm.
    send_bytes: u64,
    /// Whether the body uses the group's scratch pool.
    scratch: bool,
    /// Whether the body may use the shared-memory segment (when the plan
    /// picks it).
    shm: bool,
}

impl<V> Prep<V> {
    /// A prepared call that borrows neither the scratch pool nor the
    /// shared-memory state.
    pub(crate) fn new(valid: V, size_bytes: u64, send_bytes: u64) -> Prep<V> {
        Prep {
            valid,
            size_bytes,
            send_bytes,
            scratch: false,
            shm: false,
        }
    }

    /// The body uses the group's scratch pool ([`Lent::scratch`]).
    pub(crate) fn with_scratch(mut self) -> Prep<V> {
        self.scratch = true;
        self
    }

    /// The body may move tensors of `dtype` through the shared-memory segment
    /// ([`Lent::shm`]) if the plan picks [`Algo::Shm`]; never `bool` ones (a
    /// byte another process wrote is only ever read as a number type, for
    /// which every bit pattern is valid). Only such a call borrows the
    /// group's state (see `Call::lend_shm` in `group.rs` and
    /// [`ShmLoan`](crate::shm::ShmLoan)).
    pub(crate) fn with_shm_for(mut self, dtype: DType) -> Prep<V> {
        self.shm = dtype != DType::Bool;
        self
    }
}

/// The group's state lent to a call's body while it runs.
pub(crate) struct Lent {
    /// The group's scratch pool if the preparation asked for it
    /// ([`Prep::with_scratch`]), else an empty one.
    pub scratch: Scratch,
    /// The group's shared-memory state if the call may use the segment
    /// ([`Prep::with_shm_for`]).
    pub shm: Option<ShmLoan>,
}

/// The output buffers of a call, whose dtype and shape are put back when the
/// call fails.
pub(crate) trait Outputs {
    /// The dtypes and shapes, as they were before the call.
    type Saved;

    /// Notes the dtypes and shapes.
    fn save(&self) -> Self::Saved;

    /// Puts back the dtypes and shapes of buffers that differ from `saved`
    /// (their contents are then unspecified, see [`Group`]).
    fn restore(&mut self, saved: &Self::Saved);
}

/// No outputs (barrier).
impl Outputs for () {
    type Saved = ();

    fn save(&self) {}

    fn restore(&mut self, (): &()) {}
}

impl Outputs for Tensor {
    type Saved = Shape;

    fn save(&self) -> Shape {
        Shape::of(self)
    }

    fn restore(&mut self, saved: &Shape) {
        saved.restore(self);
    }
}

impl Outputs for [Tensor] {
    type Saved = Vec<Shape>;

    fn save(&self) -> Vec<Shape> {
        self.iter().map(Shape::of).collect()
    }

    fn restore(&mut self, saved: &Vec<Shape>) {
        for (s, t) in saved.iter().zip(self) {
            s.restore(t);
        }
    }
}

/// A tensor's dtype and shape, to put back if a failed call left it emptied (a
/// receive cancelled while its message was arriving takes the buffer).
pub(crate) struct Shape(DType, Vec<usize>);

impl Shape {
    fn of(t: &Tensor) -> Shape {
        Shape(t.dtype(), t.shape().to_vec())
    }

    fn restore(&self, t: &mut Tensor) {
        if t.dtype() != self.0 || t.shape() != self.1.as_slice() {
            if let Ok(z) = Tensor::zeros(self.0, self.1.clone()) {
                *t = z;
            }
        }
    }
}

impl Group {
    /// Runs one tensor collective call of `kind` that writes `out` (see the
    /// module doc for the stages).
    ///
    /// `prepare` gets the outputs, the call's context and its descriptor (common
    /// fields filled in): it fills in the operation's fields and validates the
    /// call, returning an error (the call then abstains and fails with it,
    /// prefixed by the operation's name) or the [`Prep`]. `body` gets the
    /// outputs, the context, the planned descriptor, the validated facts and
    /// the lent state: it runs the agreement round and the algorithm, under the
    /// guard.
    ///
    /// `O` and `V` must not hold a borrow of their own (`Option<&mut [Tensor]>`,
    /// `&[Tensor]`): the handle forms' futures must be `Send`, and rustc cannot
    /// prove that for an async closure whose arguments carry such a lifetime
    /// ("implementation of `AsyncFnOnce` is not general enough"). So `gather`
    /// passes a missing list as an empty slice, and `scatter`'s body takes its
    /// input list from its own capture.
    pub(crate) async fn run_collective<O, V>(
        &self,
        ticket: Ticket,
        kind: Kind,
        out: &mut O,
        prepare: impl FnOnce(&O, Ctx<'_>, &mut Desc) -> Result<Prep<V>>,
        body: impl AsyncFnOnce(&mut O, Ctx<'_>, &Desc, V, &mut Lent) -> Result<()>,
    ) -> Result<()>
    where
        O: Outputs + ?Sized,
    {
        let mut call = self.begin(ticket, kind).await?;
        let cx = call.ctx();
        let mut d = call.desc();
        let prep = match prepare(out, cx, &mut d) {
            Ok(p) => p,
            Err(e) => return Err(call.abstain(e.in_op(kind)).await),
        };
        call.plan(&mut d, prep.size_bytes, prep.send_bytes);
        let mut lent = Lent {
            scratch: if prep.scratch {
                call.take_scratch()
            } else {
                Scratch::default()
            },
            shm: (prep.shm && d.algo == Algo::Shm).then(|| call.lend_shm()),
        };
        let saved = out.save();
        let r = call.guard(body(out, cx, &d, prep.valid, &mut lent)).await;
        if prep.scratch {
            call.put_scratch(lent.scratch);
        }
        if let Some(shm) = lent.shm {
            call.put_shm(shm);
        }
        if r.is_err() {
            out.restore(&saved);
        }
        r
    }
}

/// Names the operation in an invalid-argument error.
trait InOp {
    /// Prefixes an invalid-argument message with the operation's name.
    fn in_op(self, kind: Kind) -> Error;
}

impl InOp for Error {
    fn in_op(self, kind: Kind) -> Error {
        match self {
            Error::InvalidArgument(m) => Error::invalid(format!("{}: {m}", kind.name())),
            other => other,
        }
    }
}
