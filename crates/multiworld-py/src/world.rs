//! `World` (the native half of `multiworld_rs.World`): point-to-point
//! operations, their handles, collectives (blocking and handle forms),
//! object collectives and sub-groups.
//!
//! Every method takes arrays as the Python layer prepares them (see
//! `tensor.rs`) and returns flat numpy arrays that the Python layer reshapes
//! and, for in-place operations, copies into the caller's arrays; the
//! blocking `recv_into`, `all_reduce_into` and `broadcast_into` instead work
//! on the caller's array itself, lent for the call (`lent.rs`).

use std::{
    future::Future,
    pin::Pin,
    sync::{
        Mutex, MutexGuard,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll, Waker},
    time::Duration,
};

use multiworld::{
    CollectiveHandle, CommError, Group, Rank, ReduceOp, SharedMemory, Tag, Tensor, TensorView, WorldError,
    WorldState,
};
use pyo3::{
    exceptions::{PyBaseException, PyRuntimeError, PyValueError},
    prelude::*,
    pyclass::{PyTraverseError, PyVisit},
    types::PyBytes,
};
use tokio::task::JoinHandle;

use crate::{
    errors,
    lent::{self, Loan, Readable, Released, Writable},
    notify::{Completion, Notifier},
    polled::{Ended, Polled},
    runtime,
    tensor::{self, CallInput, Input, Output},
};

/// One membership of a world (see `multiworld_rs.World`), or a sub-group of
/// one: the same membership whose collectives run on `group`.
#[pyclass(module = "multiworld_rs._native", frozen)]
pub struct World {
    inner: Option<multiworld::World>,
    /// A sub-group's collectives (`None`: the whole world's).
    group: Option<Group>,
}

impl Drop for World {
    fn drop(&mut self) {
        if let Some(w) = self.inner.take() {
            runtime::release(w);
        }
    }
}

/// A rank or tag given from Python as a plain `int` in `0..2**32`; `None`
/// for anything else (a `bool`, a numpy integer, an out-of-range value),
/// which the general path takes and, where wrong, words the error.
fn index(v: &Bound<'_, PyAny>) -> Option<u32> {
    if !v.is_exact_instance_of::<pyo3::types::PyInt>() {
        return None;
    }
    v.extract::<u32>().ok()
}

/// `all_to_all_single`'s split sizes for `array` in elements: `Some(None)`
/// for `None` (even splits), `Some(Some(..))` for a list or tuple of Python
/// ints, each a count of rows of `array`'s first dimension; `None` for
/// anything else (a negative or huge count, another type), which the
/// general path words.
fn split_elements(splits: &Bound<'_, PyAny>, array: &lent::Plain<'_>) -> Option<Option<Vec<usize>>> {
    if splits.is_none() {
        return Some(None);
    }
    let items = if let Ok(l) = splits.cast::<pyo3::types::PyList>() {
        l.iter().collect::<Vec<_>>()
    } else {
        splits.cast::<pyo3::types::PyTuple>().ok()?.iter().collect()
    };
    let shape = array.shape();
    let row = shape.get(1..).map_or(1, |rest| rest.iter().product::<usize>());
    let elements = items
        .iter()
        .map(|s| usize::try_from(index(s)?).ok()?.checked_mul(row))
        .collect::<Option<Vec<usize>>>()?;
    Some(Some(elements))
}

/// The arguments of a receive's fast path: the source (`None`: any), the
/// tag and the plain array; `None` if any of them needs the general path.
fn plain_recv<'a>(
    obj: &'a Bound<'a, PyAny>,
    src: Option<&Bound<'_, PyAny>>,
    tag: &Bound<'_, PyAny>,
) -> Option<(Option<u32>, u32, lent::Plain<'a>)> {
    let src = match src {
        Some(s) if !s.is_none() => Some(index(s)?),
        _ => None,
    };
    Some((src, index(tag)?, lent::plain(obj)?))
}

/// [`plain_recv`] with the array lent for one blocking receive.
fn plain_loan(
    obj: &Bound<'_, PyAny>,
    src: Option<&Bound<'_, PyAny>>,
    tag: &Bound<'_, PyAny>,
) -> PyResult<Option<(Option<u32>, u32, Loan)>> {
    let Some((src, tag, a)) = plain_recv(obj, src, tag) else {
        return Ok(None);
    };
    Ok(a.lend("recv_into")?.map(|loan| (src, tag, loan)))
}

/// A reduce op by its torch name (`"sum"`, `"avg"`, `"band"`, ...).
pub(crate) fn reduce_op(name: &str) -> PyResult<ReduceOp> {
    let name = name.to_ascii_lowercase();
    let name = match name.as_str() {
        "prod" => "product",
        other => other,
    };
    ReduceOp::ALL
        .into_iter()
        .find(|op| op.name() == name)
        .ok_or_else(|| {
            PyValueError::new_err(format!(
                "unknown reduce op '{name}' (expected one of sum, product, min, max, avg, band, bor, bxor)"
            ))
        })
}

impl World {
    pub(crate) fn new(inner: multiworld::World) -> World {
        World {
            inner: Some(inner),
            group: None,
        }
    }

    /// Receives from `src` (`None`: any member) on `tag` into `t`; returns
    /// the sender.
    fn receive(&self, py: Python<'_>, src: Option<u32>, tag: u32, t: &mut Tensor) -> PyResult<u32> {
        let w = self.w()?;
        let bytes = t.nbytes();
        match src {
            Some(r) => self.op_moving(py, bytes, async {
                w.recv(Rank(r), Tag(tag), t).await.map(|()| r)
            }),
            None => self.op_moving(py, bytes, async { w.recv_any(Tag(tag), t).await.map(|r| r.0) }),
        }
    }

    /// The group the collectives run on (cheap: shared state).
    fn g(&self) -> PyResult<Group> {
        match &self.group {
            Some(g) => Ok(g.clone()),
            None => Ok(self.w()?.collectives().clone()),
        }
    }

    /// The world, for a method of this handle; in a forked child
    /// `ForkedProcessError`, also for the methods that only read state (the
    /// parent's worlds are not the child's).
    pub(crate) fn w(&self) -> PyResult<&multiworld::World> {
        runtime::runtime()?;
        self.inner
            .as_ref()
            .ok_or_else(|| PyRuntimeError::new_err("the world handle was released"))
    }

    /// Whether this is a sub-group's handle (its collectives run on the
    /// group, over the world's TCP mesh).
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    pub(crate) fn is_group(&self) -> bool {
        self.group.is_some()
    }

    pub(crate) fn generation_of(&self) -> Option<u64> {
        self.inner.as_ref().map(|w| w.generation().0)
    }

    /// Waits for a world operation; maps its error.
    fn op<T: Send>(
        &self,
        py: Python<'_>,
        fut: impl Future<Output = Result<T, WorldError>> + Send,
    ) -> PyResult<T> {
        self.op_moving(py, 0, fut)
    }

    /// [`Self::op`] for an operation that moves `bytes` through the calling
    /// thread (`runtime::wait_moving`: a large copy runs without the GIL).
    fn op_moving<T: Send>(
        &self,
        py: Python<'_>,
        bytes: usize,
        fut: impl Future<Output = Result<T, WorldError>> + Send,
    ) -> PyResult<T> {
        runtime::wait_moving(py, bytes, fut)?.map_err(|e| errors::world(py, e, self.generation_of()))
    }

    /// Waits for a collective; maps its (transport) error.
    fn coll<T: Send>(
        &self,
        py: Python<'_>,
        fut: impl Future<Output = Result<T, CommError>> + Send,
    ) -> PyResult<T> {
        let w = self.w()?;
        // Pinned here, so that the block below holds a reference to it, not
        // a second copy of a future of several KiB.
        let fut = std::pin::pin!(fut);
        // A collective's first poll may already copy its whole tensor (into
        // a shared-memory segment, or out of messages that are here): never
        // with the GIL held.
        self.op_moving(py, usize::MAX, async move {
            match fut.await {
                Ok(v) => Ok(v),
                Err(e) => Err(w.collective_error(e)),
            }
        })
    }

    /// Starts `fut` as a task and returns its handle.
    fn work(
        &self,
        fut: impl Future<Output = Result<Done, WorldError>> + Send + 'static,
        cancel_on_drop: bool,
    ) -> PyResult<Work> {
        spawn_work(
            self.w()?.name().to_string(),
            self.generation_of(),
            fut,
            cancel_on_drop,
        )
    }

    /// The handle of an operation that finished in its [`first_poll`].
    fn finished(&self, py: Python<'_>, r: Result<Done, WorldError>) -> PyResult<Work> {
        Ok(finished_work(
            py,
            self.w()?.name().to_string(),
            self.generation_of(),
            r,
        ))
    }

    /// [`World::work`] for an operation over an array lent to it: the task
    /// ends, and `Work.cancel` returns, only once the loan has (`released`),
    /// after `op` (which drops the lent tensor) has finished.
    fn lent_work(
        &self,
        op: impl Future<Output = Result<Done, WorldError>> + Send + 'static,
        released: Released,
        cancel_on_drop: bool,
    ) -> PyResult<Work> {
        let mut work = self.work(until_released(op, released.clone()), cancel_on_drop)?;
        work.lent = Some(released);
        Ok(work)
    }

    /// A receive's handle: a [`polled_work`] (no task) when the world has no
    /// operation deadline; otherwise a task, which ends the operation (and
    /// its deadline) when the message is in, even if no one polls the
    /// handle until later.
    fn receive_work(
        &self,
        op: impl Future<Output = Result<Done, WorldError>> + Send + 'static,
    ) -> PyResult<Work> {
        let w = self.w()?;
        if w.op_timeout().is_some() {
            return self.work(op, true);
        }
        Ok(polled_work(
            w.name().to_string(),
            self.generation_of(),
            Box::pin(op),
        ))
    }

    /// [`World::receive_work`] for a receive into a lent array: it ends
    /// once the loan has too.
    fn lent_receive(
        &self,
        op: impl Future<Output = Result<Done, WorldError>> + Send + 'static,
        released: Released,
    ) -> PyResult<Work> {
        let mut work = self.receive_work(until_released(op, released.clone()))?;
        work.lent = Some(released);
        Ok(work)
    }
}

/// An output array given with its dtype and shape: a flat `uint8` view of
/// a C-contiguous array, lent to the runtime for one call.
type LentArray<'py> = (Writable<'py>, String, Vec<usize>);

/// Lends every array of `list` for one call: their tensors, and the ends of
/// their loans for [`settle_all`] once the tensors are dropped. The arrays
/// must share no memory (the Python layer checks); an array that cannot be
/// lent is an error naming its place in the list.
fn lend_list(list: &mut [LentArray<'_>], what: &str) -> PyResult<(Vec<Tensor>, Vec<lent::LoanEnd>)> {
    let (mut tensors, mut ends) = (Vec::with_capacity(list.len()), Vec::with_capacity(list.len()));
    for (i, (array, dtype, shape)) in list.iter_mut().enumerate() {
        let loan = Loan::new(
            array,
            tensor::dtype(dtype)?,
            shape.clone(),
            &format!("{what} output {i}"),
        )?;
        let (t, end) = loan.into_parts();
        tensors.push(t);
        ends.push(end);
    }
    Ok((tensors, ends))
}

/// Every input of a list for one blocking call that only reads them:
/// lent where they can be (see [`Input::for_call`]), with the ends of
/// their loans for [`settle_all`] once the tensors are dropped.
fn lend_inputs(list: &[Input<'_>], what: &str) -> PyResult<(Vec<Tensor>, Vec<lent::LoanEnd>)> {
    let (mut tensors, mut ends) = (Vec::with_capacity(list.len()), Vec::new());
    for input in list {
        let (t, end) = input.for_call(what)?.into_parts();
        tensors.push(t);
        ends.extend(end);
    }
    Ok((tensors, ends))
}

/// Ends every loan of a list (see [`lent::LoanEnd::settle`]).
fn settle_all(py: Python<'_>, ends: Vec<lent::LoanEnd>) {
    for end in ends {
        end.settle(py);
    }
}

/// `op`, ending only once the loan `released` watches has ended too.
async fn until_released(
    op: impl Future<Output = Result<Done, WorldError>>,
    released: Released,
) -> Result<Done, WorldError> {
    let r = op.await;
    released.wait().await;
    r
}

/// A receive into `t` made whole by a task (the asyncio API's receives
/// above `runtime::loop_copy_max`): posted, read and completed on the
/// runtime's threads. Yields the sender and the tensor.
async fn receive_in_task(
    w: multiworld::World,
    src: Option<u32>,
    tag: u32,
    mut t: Tensor,
) -> Result<(u32, Tensor), WorldError> {
    let from = match src {
        Some(r) => {
            w.recv(Rank(r), Tag(tag), &mut t).await?;
            r
        }
        None => w.recv_any(Tag(tag), &mut t).await?.0,
    };
    Ok((from, t))
}

/// Posts a receive on `w` (`World::irecv`), without the GIL for a large one.
/// `from_loop` (an asyncio receive, posted on the event loop's thread), when
/// `runtime::loop_leaves_held` (by default with more than two CPUs): a
/// message small enough to be read ahead that its connection's reader holds
/// back for the moment is left to the reader (`World::irecv_leaving_small`),
/// not read from the socket here. The loop serves every world alone, and
/// reading such a message from the socket cost it 40–60 µs against 5 µs for
/// copying one read ahead (fifteenth session; an asyncio leader of 64 KiB
/// messages from four workers spent most of its time there once it began,
/// since each read in the call left the next frame held back too). With two
/// CPUs or fewer the read is made here: there the reader's wake-up and its
/// hand-off back to the loop cost the machine more than the read saves the
/// loop.
fn post_receive(
    py: Python<'_>,
    w: &multiworld::World,
    src: Option<u32>,
    tag: u32,
    t: Tensor,
    from_loop: bool,
) -> PyResult<multiworld::PendingRecv> {
    // A message held back whole in the socket is read into the buffer in
    // the posting call (`Communicator::irecv`): a large one without the GIL.
    let large = t.nbytes() > runtime::held_poll_max();
    let post = move || {
        runtime::enter(move || {
            if from_loop && runtime::loop_leaves_held() {
                w.irecv_leaving_small(src.map(Rank), Tag(tag), t)
            } else {
                w.irecv(src.map(Rank), Tag(tag), t)
            }
        })
    };
    if large { py.detach(post) } else { post() }
}

/// Polls `fut` once on the calling thread (inside the runtime's context, as
/// the blocking calls' first poll does): its outcome if that finished it,
/// else the future, to go on in a task (the task's first poll registers the
/// task's waker in place of the no-op one).
fn first_poll<F: Future + Send + 'static>(fut: F) -> PyResult<Result<F::Output, Pin<Box<F>>>> {
    let mut fut = Box::pin(fut);
    let polled = runtime::enter(|| fut.as_mut().poll(&mut Context::from_waker(Waker::noop())))?;
    Ok(match polled {
        Poll::Ready(out) => Ok(out),
        Poll::Pending => Err(fut),
    })
}

/// Starts `fut` as a task of the runtime and returns its handle, a `Work`
/// of world `world` (generation `generation`, for the errors it raises).
pub(crate) fn spawn_work(
    world: String,
    generation: Option<u64>,
    fut: impl Future<Output = Result<Done, WorldError>> + Send + 'static,
    cancel_on_drop: bool,
) -> PyResult<Work> {
    spawn_work_probed(world, generation, fut, cancel_on_drop, None)
}

/// [`spawn_work`] for a task that waits for a device operation, with a
/// view of its completion (`probe`) that a thread in `Work.wait` polls
/// itself instead of waiting for the task to notice (see [`task_end`]).
pub(crate) fn spawn_work_probed(
    world: String,
    generation: Option<u64>,
    fut: impl Future<Output = Result<Done, WorldError>> + Send + 'static,
    cancel_on_drop: bool,
    probe: Option<DeviceProbe>,
) -> PyResult<Work> {
    let completion = Completion::default();
    let guard = completion.guard();
    let task = runtime::runtime()?.spawn(async move {
        let _fire_when_done = guard;
        fut.await
    });
    Ok(Work::new(
        completion,
        Some(Pending::Task(task, probe)),
        cancel_on_drop,
        None,
        generation,
        world,
    ))
}

/// A `Work` for an operation that needs no task of its own (`crate::polled`):
/// its future only waits for the runtime to act (a posted receive, which the
/// connection's reader fills) and is polled by whoever waits on the handle.
/// Dropping the handle drops the future, which withdraws a receive.
fn polled_work(world: String, generation: Option<u64>, op: crate::polled::Op) -> Work {
    let completion = Completion::default();
    let polled = Polled::new(op, completion.guard());
    Work::new(
        completion,
        Some(Pending::Polled(polled)),
        true,
        None,
        generation,
        world,
    )
}

/// A `Work` whose operation finished before it was handed out (no task).
pub(crate) fn finished_work(
    py: Python<'_>,
    world: String,
    generation: Option<u64>,
    r: Result<Done, WorldError>,
) -> Work {
    let outcome = match r {
        Ok(done) => done.into_py(py),
        Err(e) => Err(errors::world(py, e, generation)),
    };
    let completion = Completion::default();
    drop(completion.guard()); // marks it finished: a later `notify` fires at once
    let outcome = keep_outcome(py, &outcome);
    Work::new(completion, None, false, Some(outcome), generation, world)
}

/// A collective that works on one tensor in place.
enum InPlace {
    AllReduce(ReduceOp),
    Broadcast(Rank),
    /// The root's tensor gets the result; the others' are left as they were.
    Reduce(Rank, ReduceOp),
    /// Every member's input (this one's given), gathered into the tensor.
    AllGatherFrom(CallInput),
    /// Every member's input reduced, this member's segment into the tensor.
    ReduceScatterFrom(CallInput, ReduceOp),
    /// Parts of every member's input exchanged into the tensor (splits in
    /// elements: the output's, then the input's; `None`: even).
    AllToAllFrom(CallInput, Option<Vec<usize>>, Option<Vec<usize>>),
}

impl World {
    /// A blocking in-place collective's fast path on `obj` (`what`): false,
    /// doing nothing, unless it is a plain, writeable numpy array that can
    /// be lent and `call` (made once the array is known to be plain, so
    /// that the general path words the errors of anything else) says which
    /// collective (`None`: an argument the general path must take).
    fn in_place_plain(
        &self,
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
        what: &str,
        call: impl FnOnce() -> PyResult<Option<InPlace>>,
    ) -> PyResult<bool> {
        let Some(a) = lent::plain(obj) else {
            return Ok(false);
        };
        let Some(call) = call()? else {
            return Ok(false);
        };
        let Some(loan) = a.lend(what)? else {
            return Ok(false);
        };
        self.in_place(py, loan, call)?;
        Ok(true)
    }

    /// [`World::in_place_plain`] for a collective of an output and a
    /// separate input: both plain numpy arrays of one dtype that share no
    /// memory, the output lent for writing and the input for reading;
    /// `call` (made once both are known to qualify, from the output and
    /// the input) makes the collective from the input (`None`: an argument
    /// the general path must take).
    fn pair_in_place_plain<F: FnOnce(CallInput) -> InPlace>(
        &self,
        py: Python<'_>,
        out: &Bound<'_, PyAny>,
        input: &Bound<'_, PyAny>,
        what: &str,
        call: impl FnOnce(&lent::Plain<'_>, &lent::Plain<'_>) -> PyResult<Option<F>>,
    ) -> PyResult<bool> {
        let (Some(o), Some(i)) = (lent::plain(out), lent::plain(input)) else {
            return Ok(false);
        };
        if o.dtype != i.dtype || o.overlaps(&i) {
            return Ok(false);
        }
        let Some(call) = call(&o, &i)? else {
            return Ok(false);
        };
        let Some(loan) = o.lend(&format!("{what} output"))? else {
            return Ok(false);
        };
        let input = match i.lend_to_read(&format!("{what} input")) {
            Ok(Some(input)) => input,
            other => {
                loan.settle(py);
                return other.map(|_| false);
            }
        };
        self.in_place(py, loan, call(CallInput::Lent(input)))?;
        Ok(true)
    }

    /// Runs an in-place collective on a lent array and settles the loan.
    /// The call's future is polled on this thread (measured: faster here
    /// than as a task of the runtime, for 1 and 64 MiB over 2 and 4
    /// processes).
    fn in_place(&self, py: Python<'_>, mut loan: Loan, what: InPlace) -> PyResult<()> {
        let g = self.g()?;
        let out = &mut loan.tensor;
        let (r, input) = match what {
            InPlace::AllReduce(op) => (self.coll(py, g.all_reduce(out, op)), None),
            InPlace::Broadcast(root) => (self.coll(py, g.broadcast(out, root)), None),
            InPlace::Reduce(root, op) => (self.coll(py, g.reduce(out, root, op)), None),
            InPlace::AllGatherFrom(input) => {
                let r = self.coll(py, g.all_gather_into_tensor(out, input.tensor()));
                (r, Some(input))
            }
            InPlace::ReduceScatterFrom(input, op) => {
                let r = self.coll(py, g.reduce_scatter_tensor(out, input.tensor(), op));
                (r, Some(input))
            }
            InPlace::AllToAllFrom(input, out_splits, in_splits) => {
                let call =
                    g.all_to_all_single(out, input.tensor(), out_splits.as_deref(), in_splits.as_deref());
                (self.coll(py, call), Some(input))
            }
        };
        loan.settle(py);
        if let Some(input) = input {
            input.settle(py);
        }
        r
    }

    /// An in-place collective in the background on a plain, writeable numpy
    /// array (`lent::plain`): the collective works on the array itself,
    /// lent to its task (no copy in, none out). The handle yields `None`,
    /// and only once the runtime has let go of the array (also after a
    /// failure; dropping the handle does not cancel a collective). `None`
    /// (nothing started, `input` not called) for any other argument: the
    /// Python layer then takes the copying path. `input` makes what else
    /// `start` takes (a copy of a separate input) once the array is known to
    /// be lendable and before it is lent, since that input may lie in it.
    fn in_place_lent<I, T: Send + 'static>(
        &self,
        obj: &Bound<'_, PyAny>,
        what: &str,
        input: impl FnOnce() -> PyResult<I>,
        start: impl FnOnce(&Group, Tensor, I) -> CollectiveHandle<T>,
    ) -> PyResult<Option<Work>> {
        let Some(a) = lent::plain(obj).filter(lent::Plain::lendable_to_task) else {
            return Ok(None);
        };
        self.background_lent(|| a.lend_to_task(what), input, start)
    }

    /// [`World::in_place_lent`] for a collective whose outputs are a list:
    /// every array of `objs` (plain and writeable, sharing no memory: the
    /// Python layer checks) is lent to the collective's task; `None` if any
    /// of them cannot be.
    fn list_lent<I, T: Send + 'static>(
        &self,
        objs: &[Bound<'_, PyAny>],
        what: &str,
        input: impl FnOnce() -> PyResult<I>,
        start: impl FnOnce(&Group, Vec<Tensor>, I) -> CollectiveHandle<T>,
    ) -> PyResult<Option<Work>> {
        let Some(arrays) = objs
            .iter()
            .map(|o| lent::plain(o).filter(lent::Plain::lendable_to_task))
            .collect::<Option<Vec<_>>>()
        else {
            return Ok(None);
        };
        let lend = || {
            let (mut tensors, mut released) = (Vec::with_capacity(arrays.len()), Vec::new());
            for (i, a) in arrays.iter().enumerate() {
                // Those lent before a refusal end their loans when dropped.
                let Some((t, r)) = a.lend_to_task(&format!("{what} output {i}"))? else {
                    return Ok(None);
                };
                tensors.push(t);
                released.push(r);
            }
            Ok(Some((tensors, Released::all(released))))
        };
        self.background_lent(lend, input, start)
    }

    /// Makes `input`, then lends (`lend`: what is lent and the end of its
    /// loans, `None` if it cannot be) and starts the collective on it; the
    /// handle ends once the collective has and the loans have too.
    fn background_lent<L, I, T: Send + 'static>(
        &self,
        lend: impl FnOnce() -> PyResult<Option<(L, Released)>>,
        input: impl FnOnce() -> PyResult<I>,
        start: impl FnOnce(&Group, L, I) -> CollectiveHandle<T>,
    ) -> PyResult<Option<Work>> {
        let (w, g, input) = (self.w()?.clone(), self.g()?, input()?);
        let Some((lent, released)) = lend()? else {
            return Ok(None);
        };
        let h = runtime::enter(|| start(&g, lent, input))?;
        let op = async move {
            match h.wait().await {
                // Dropping the tensors ends the loans.
                Ok(t) => {
                    drop(t);
                    Ok(Done::Unit)
                }
                Err(e) => Err(w.collective_error(e)),
            }
        };
        self.lent_work(op, released, false).map(Some)
    }

    /// Starts a collective's handle form on this world's group as a `Work`.
    fn start<T: Send + 'static>(
        &self,
        start: impl FnOnce(&Group) -> CollectiveHandle<T>,
        done: fn(T) -> Done,
    ) -> PyResult<Work> {
        let (w, g) = (self.w()?.clone(), self.g()?);
        let h = runtime::enter(|| start(&g))?;
        self.work(background(w, h, done), false)
    }
}

/// A collective's handle as a `Work` future: its error mapped as for the
/// blocking form.
async fn background<T>(
    w: multiworld::World,
    h: multiworld::CollectiveHandle<T>,
    done: fn(T) -> Done,
) -> Result<Done, WorldError> {
    match h.wait().await {
        Ok(v) => Ok(done(v)),
        Err(e) => Err(w.collective_error(e)),
    }
}

/// What a background operation yields, converted to Python by `Work.wait`.
pub enum Done {
    /// Nothing (a send, a barrier).
    Unit,
    /// A receive: the sender and the message.
    Received(u32, Tensor),
    /// A receive into a lent array: the sender.
    Source(u32),
    /// One tensor (a collective's output).
    Tensor(Tensor),
    /// One tensor per member (all_gather, all_to_all).
    Tensors(Vec<Tensor>),
    /// One tensor per member on the root, nothing elsewhere (gather).
    MaybeTensors(Option<Vec<Tensor>>),
    /// One object's bytes (broadcast_object, scatter_object).
    Bytes(Vec<u8>),
    /// One object's bytes per member (all_gather_object).
    BytesList(Vec<Vec<u8>>),
    /// One object's bytes per member on the root, nothing elsewhere.
    MaybeBytesList(Option<Vec<Vec<u8>>>),
}

impl Done {
    fn into_py(self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        Ok(match self {
            Done::Unit => py.None(),
            Done::Source(src) => src.into_pyobject(py)?.into_any().unbind(),
            Done::Received(src, t) => (src, tensor::to_numpy(py, t)?)
                .into_pyobject(py)?
                .into_any()
                .unbind(),
            Done::Tensor(t) => tensor::to_numpy(py, t)?.unbind(),
            Done::Tensors(ts) | Done::MaybeTensors(Some(ts)) => tensor::list_to_numpy(py, ts)?
                .into_pyobject(py)?
                .into_any()
                .unbind(),
            Done::MaybeTensors(None) | Done::MaybeBytesList(None) => py.None(),
            Done::Bytes(b) => PyBytes::new(py, &b).into_any().unbind(),
            Done::BytesList(bs) | Done::MaybeBytesList(Some(bs)) => bs
                .iter()
                .map(|b| PyBytes::new(py, b))
                .collect::<Vec<_>>()
                .into_pyobject(py)?
                .into_any()
                .unbind(),
        })
    }
}

/// Locks a mutex held only briefly and never across a wait (a panic while
/// holding one leaves plain data behind, still usable).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Longest `cancel` waits for a brief check (`is_completed`, `settled`)
/// holding a handle to let go of it.
const BRIEF_HOLD: Duration = Duration::from_secs(1);

/// A handle on an operation running in the background (`isend`, `irecv`, a
/// collective with `async_op=True`).
#[pyclass(module = "multiworld_rs._native", frozen)]
pub struct Work {
    /// Fires when the operation ends (the asyncio bridge's wake-up).
    completion: Completion,
    /// What runs the operation; `None` once its outcome was taken (or for
    /// an operation that ended before the handle existed).
    pending: tokio::sync::Mutex<Option<Pending>>,
    /// The task's (`None`: no task).
    abort: Option<tokio::task::AbortHandle>,
    /// For an operation over a lent array (a receive into it, a send from
    /// it): resolves once the runtime has let go of it (`cancel` waits for it).
    lent: Option<Released>,
    cancel_on_drop: bool,
    /// The outcome once waited for (returned again by later waits). Locked
    /// only with the GIL held and never across a wait. Seen by Python's
    /// garbage collector (`__traverse__`): a raised error's traceback holds
    /// the frames that hold this handle, a cycle through it.
    outcome: Mutex<Option<Outcome>>,
    /// A polled operation's waker when no one waits in `wait`: the event
    /// loop's, once `notify` gave it (every other poll passes it on, so the
    /// loop's wake-up stays registered).
    loop_waker: Mutex<Option<Waker>>,
    /// `cancel` of a polled operation while a thread waits on it in `wait`
    /// (which holds it): the flag, and that thread's waker.
    cancel_asked: AtomicBool,
    waiter: Mutex<Option<Waker>>,
    /// The threads inside `wait` on this handle now (a `cancel` from one of
    /// them runs in a signal handler, inside that wait).
    waiting: Mutex<Vec<std::thread::ThreadId>>,
    /// Whether the operation is polled (`Pending::Polled`), not a task's.
    polled: bool,
    generation: Option<u64>,
    world: String,
}

/// A device operation's completion as a `Work` sees it (`multiworld`'s,
/// in the `nccl` build; there are none without it).
#[cfg(feature = "nccl")]
pub(crate) type DeviceProbe = multiworld::DeviceProbe;
#[cfg(not(feature = "nccl"))]
pub(crate) enum DeviceProbe {}

/// How a task's operation ended: what the task returned; for a device
/// operation's task (`probe`), success as soon as this thread's own polls
/// see the device complete it, unless the handle was cancelled meanwhile
/// (`cancelled`). Anything but that success is the task's to say (the
/// task, which owns the operation's memory, ends on its own).
async fn task_end(
    j: &mut JoinHandle<Result<Done, WorldError>>,
    probe: Option<&DeviceProbe>,
    cancelled: &AtomicBool,
) -> Ended {
    let joined = async {
        match j.await {
            Ok(r) => Ended::Done(r),
            Err(e) if e.is_cancelled() => Ended::Cancelled,
            Err(e) => Ended::Failed(e.to_string()),
        }
    };
    let Some(probe) = probe else {
        return joined.await;
    };
    #[cfg(feature = "nccl")]
    {
        let mut joined = std::pin::pin!(joined);
        let probed = tokio::select! {
            biased;
            ended = &mut joined => return ended,
            done = probe.completed() => done,
        };
        if probed.is_ok() && !cancelled.load(Ordering::SeqCst) {
            return Ended::Done(Ok(Done::Unit));
        }
        joined.await
    }
    #[cfg(not(feature = "nccl"))]
    {
        let _ = cancelled;
        match *probe {}
    }
}

/// A `Work`'s outcome as kept: the result, or the exception raised for it.
type Outcome = Result<Py<PyAny>, Py<PyBaseException>>;

/// `r` as kept in a `Work` (the same objects: a later wait returns them).
fn keep_outcome(py: Python<'_>, r: &PyResult<Py<PyAny>>) -> Outcome {
    match r {
        Ok(v) => Ok(v.clone_ref(py)),
        Err(e) => Err(e.value(py).clone().unbind()),
    }
}

/// What runs a `Work`'s operation.
enum Pending {
    /// A task of the runtime; for a device operation's task, a view of
    /// its completion (see [`task_end`]).
    Task(JoinHandle<Result<Done, WorldError>>, Option<DeviceProbe>),
    /// Whoever waits on the handle (`crate::polled`).
    Polled(Polled),
}

impl Drop for Work {
    fn drop(&mut self) {
        if self.cancel_on_drop
            && !runtime::is_forked_child()
            && let Some(a) = &self.abort
        {
            a.abort();
        }
        // A polled operation's future is dropped here: a receive is withdrawn.
        if let Some(p) = self.pending.get_mut().take() {
            runtime::release(p);
        }
    }
}

impl Work {
    fn new(
        completion: Completion,
        pending: Option<Pending>,
        cancel_on_drop: bool,
        outcome: Option<Outcome>,
        generation: Option<u64>,
        world: String,
    ) -> Work {
        let abort = match &pending {
            Some(Pending::Task(j, _)) => Some(j.abort_handle()),
            _ => None,
        };
        let polled = matches!(pending, Some(Pending::Polled(_)));
        Work {
            completion,
            pending: tokio::sync::Mutex::new(pending),
            abort,
            lent: None,
            cancel_on_drop,
            outcome: Mutex::new(outcome),
            loop_waker: Mutex::new(None),
            cancel_asked: AtomicBool::new(false),
            waiter: Mutex::new(None),
            waiting: Mutex::new(Vec::new()),
            polled,
            generation,
            world,
        }
    }

    /// Polls a polled operation once without waiting, with the event loop's
    /// waker if it gave one: whether it has ended.
    fn poll_now(&self, p: &mut Polled) -> bool {
        let waker = lock(&self.loop_waker)
            .clone()
            .unwrap_or_else(|| Waker::noop().clone());
        runtime::enter(|| p.poll_end(&mut Context::from_waker(&waker)).is_ready()).unwrap_or(false)
    }

    /// A polled operation asked to cancel (`cancel_asked`), not held by a
    /// waiter: ended now, unless it has ended already (an outcome already
    /// in stays: the cancellation lost the race). Dropping the future
    /// withdraws the receive.
    /// Returns false when a thread's `wait` holds the handle: that thread
    /// applies the cancel (and settles the loan) itself.
    fn apply_cancel(&self) -> PyResult<bool> {
        if !self.cancel_asked.load(Ordering::SeqCst) {
            return Ok(true);
        }
        let Ok(mut g) = self.pending.try_lock() else {
            return Ok(false);
        };
        if let Some(Pending::Polled(p)) = g.as_mut()
            && !self.poll_now(p)
        {
            runtime::enter(|| p.cancel())?;
        }
        Ok(true)
    }

    /// [`Work::apply_cancel`] for `cancel`: false only when this very thread
    /// is inside `wait` on the handle (`cancel` then runs in a signal
    /// handler there, and that wait applies the cancel and settles the loan
    /// when it resumes). When another thread waits, that thread applies the
    /// cancel (its wait was woken for it, and a wait that ends otherwise
    /// applies it as it leaves); when only a brief check holds the handle
    /// (`is_completed`, `settled`), this tries again once it lets go.
    /// A brief holder that keeps the handle past [`BRIEF_HOLD`] (it should
    /// never) is treated as a waiter: the cancel stays asked, and the loan is
    /// not waited for here.
    fn apply_cancel_or_leave_it(&self, py: Python<'_>) -> PyResult<bool> {
        let me = std::thread::current().id();
        let until = std::time::Instant::now() + BRIEF_HOLD;
        loop {
            if self.apply_cancel()? {
                return Ok(true);
            }
            let waiting = lock(&self.waiting);
            if waiting.contains(&me) {
                return Ok(false);
            }
            if !waiting.is_empty() {
                return Ok(true);
            }
            drop(waiting);
            if std::time::Instant::now() >= until {
                return Ok(false);
            }
            // Without the GIL, in case the holder needs it to let go.
            py.detach(std::thread::yield_now);
        }
    }

    /// After a `wait` on a polled operation (which polled it with its own
    /// waker, replacing the event loop's): if the loop awaits this handle
    /// too, its waker is registered again, and woken if the operation has
    /// ended meanwhile.
    fn hand_back_to_loop(&self) {
        if !self.polled {
            return;
        }
        let Some(waker) = lock(&self.loop_waker).clone() else {
            return;
        };
        // Locked: another thread waits on it, and hands back in turn.
        if let Ok(mut g) = self.pending.try_lock() {
            match g.as_mut() {
                Some(Pending::Polled(p)) => {
                    if self.poll_now(p) {
                        waker.wake();
                    }
                }
                // Ended, and its outcome taken by the wait just done.
                None => waker.wake(),
                Some(Pending::Task(..)) => {}
            }
        }
    }

    /// [`Work::cached`] for a `wait` that did not take the outcome itself
    /// (another wait kept it, maybe before Ctrl-C interrupted that wait
    /// while the runtime still held the array): it returns only once the
    /// runtime has let go of the array (at once when it already has).
    fn cached_once_let_go(&self, py: Python<'_>) -> Option<PyResult<Py<PyAny>>> {
        let r = self.cached(py)?;
        if let Err(e) = self.wait_let_go(py) {
            return Some(Err(e));
        }
        Some(r)
    }

    /// Waits (interruptibly, without the GIL) until the runtime has let go
    /// of the caller's array this handle lent it, if any: at once when it
    /// already has.
    fn wait_let_go(&self, py: Python<'_>) -> PyResult<()> {
        match &self.lent {
            Some(l) => runtime::wait(py, l.clone().wait()),
            None => Ok(()),
        }
    }

    fn cached(&self, py: Python<'_>) -> Option<PyResult<Py<PyAny>>> {
        let g = self.outcome.lock().unwrap_or_else(|e| e.into_inner());
        g.as_ref().map(|r| match r {
            Ok(v) => Ok(v.clone_ref(py)),
            Err(e) => Err(PyErr::from_value(e.bind(py).clone().into_any())),
        })
    }
}

#[pymethods]
impl Work {
    /// What this handle holds of Python's, for the garbage collector: the
    /// kept outcome (a raised error's traceback leads back to this handle
    /// through the frames of its `wait`). Skipped while another thread
    /// holds the lock (it never waits with it held).
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        if let Ok(g) = self.outcome.try_lock()
            && let Some(r) = g.as_ref()
        {
            match r {
                Ok(v) => visit.call(v)?,
                Err(e) => visit.call(e)?,
            }
        }
        Ok(())
    }

    /// Breaks a reference cycle through the kept outcome (the collector
    /// calls it on a handle that nothing outside the cycle reaches, so no
    /// one waits on it again).
    fn __clear__(&self) {
        lock(&self.outcome).take();
    }

    /// Whether the operation has finished (successfully or not). In a
    /// forked child it raises `ForkedProcessError`, as every call that
    /// needs the runtime does (the parent's operations are not the child's).
    fn is_completed(&self) -> PyResult<bool> {
        runtime::runtime()?;
        Ok(match self.pending.try_lock() {
            Ok(mut g) => match g.as_mut() {
                None => true,
                Some(Pending::Task(j, _)) => j.is_finished(),
                Some(Pending::Polled(p)) => self.poll_now(p),
            },
            // Someone is waiting on it right now.
            Err(_) => false,
        })
    }

    /// Cancels the operation if it is still running (a later `wait` raises
    /// `RuntimeError`). A send cut off mid-frame breaks its world. For a
    /// receive into a lent array, returns once the runtime has let go of the
    /// array (at once, unless its message was arriving: then once it has).
    fn cancel(&self, py: Python<'_>) -> PyResult<()> {
        // In a forked child, before anything touches the runtime's state (an
        // abort would push onto the dead scheduler's queue, under its lock).
        runtime::runtime()?;
        // Whether a thread's `wait` holds this (polled) handle: that thread
        // ends it and waits for the loan to end before it returns.
        let mut held_by_a_waiter = false;
        if let Some(a) = &self.abort {
            // A thread in `wait` that sees a device complete meanwhile
            // leaves the outcome to the task (see `task_end`).
            self.cancel_asked.store(true, Ordering::SeqCst);
            a.abort();
        } else if self.polled {
            // Ended here, or, if a thread holds it in `wait`, by that thread:
            // it sees the flag while it waits, or when it leaves (a timeout,
            // Ctrl-C). Not waiting for it here: this may run in a signal
            // handler on that very thread.
            self.cancel_asked.store(true, Ordering::SeqCst);
            if let Some(w) = lock(&self.waiter).take() {
                w.wake();
            }
            held_by_a_waiter = !self.apply_cancel_or_leave_it(py)?;
            // An event loop awaiting the handle learns of the end.
            self.hand_back_to_loop();
        }
        // Not when a waiter holds the handle: the lent array is inside its
        // suspended wait, and this may run in a signal handler on that very
        // thread (waiting here would never end).
        if held_by_a_waiter {
            return Ok(());
        }
        self.wait_let_go(py)
    }

    /// Asks for `token` to reach `notifier` when the operation ends (at once
    /// if it has ended): the asyncio bridge's wake-up.
    fn notify(&self, notifier: &Notifier, token: u64) {
        if self.polled {
            // The loop's waker brings the token (one push per wake-up; the
            // completion would push it a second time), woken now if the
            // operation has ended.
            *lock(&self.loop_waker) = Some(notifier.waker(token));
            self.hand_back_to_loop();
            return;
        }
        self.completion.notify(notifier, token);
    }

    /// The event loop stopped awaiting this handle (its task was
    /// cancelled): no wake-up for it any more.
    fn unwatch(&self) {
        lock(&self.loop_waker).take();
    }

    /// After the notifier pushed this handle's token: whether `wait` now
    /// returns without waiting. Always for a task (its token comes only when
    /// it ends); a polled operation is polled now, and its token may also
    /// come from a wake-up before its end (the loop then keeps waiting; the
    /// wake-up stays registered).
    fn settled(&self) -> bool {
        let settled = match self.pending.try_lock() {
            Ok(mut g) => match g.as_mut() {
                Some(Pending::Polled(p)) => self.poll_now(p),
                // Taken by a thread's `wait`: settled once it has cached the
                // outcome (it wakes the loop then).
                None if self.polled => lock(&self.outcome).is_some(),
                _ => true,
            },
            // A thread waits on it in `wait`: a task's has ended (its token
            // came), it only hands the outcome over; a polled one's waiter
            // wakes the loop again when it returns.
            Err(_) => !self.polled,
        };
        if settled {
            // The loop takes the outcome now: no wake-up for it any more.
            lock(&self.loop_waker).take();
        }
        settled
    }

    /// Waits for the outcome, at most `timeout` seconds (`None`: no limit);
    /// raises `WorldTimeoutError` if it is not done by then (the operation
    /// goes on). Returns `None`, an array, `(src, array)` or a list of arrays.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Py<PyAny>> {
        if let Some(r) = self.cached_once_let_go(py) {
            return r;
        }
        let after = runtime::seconds("timeout", timeout)?;
        let me = std::thread::current().id();
        lock(&self.waiting).push(me);
        let fut = async {
            let mut g = self.pending.lock().await;
            let ended = match g.as_mut()? {
                Pending::Task(j, probe) => task_end(j, probe.as_ref(), &self.cancel_asked).await,
                Pending::Polled(p) => {
                    std::future::poll_fn(|cx| {
                        *lock(&self.waiter) = Some(cx.waker().clone());
                        if p.poll_end(cx).is_ready() {
                            return Poll::Ready(());
                        }
                        if self.cancel_asked.load(Ordering::SeqCst) {
                            p.cancel();
                            return Poll::Ready(());
                        }
                        Poll::Pending
                    })
                    .await;
                    p.take()
                }
            };
            *g = None;
            Some(ended)
        };
        let waited = runtime::wait_for(py, fut, after);
        {
            let mut waiting = lock(&self.waiting);
            if let Some(i) = waiting.iter().position(|t| *t == me) {
                waiting.swap_remove(i);
            }
        }
        if self.polled && !matches!(waited, Ok(Some(Some(_)))) {
            // Not ended by this wait (a timeout, Ctrl-C): a cancel that came
            // while it held the handle applies now, and the loop, if it
            // awaits this handle too, keeps watching it.
            // Interrupted by a signal handler that cancelled and then
            // raised: the cancel is applied (past a brief check that holds
            // the handle, or by another thread waiting on it), and the
            // caller's handler gets the array back only once the runtime
            // has let go of it.
            let cancelled_here = waited.is_err() && self.cancel_asked.load(Ordering::SeqCst);
            let applied = if cancelled_here {
                self.apply_cancel_or_leave_it(py)?
            } else {
                self.apply_cancel()?
            };
            self.hand_back_to_loop();
            if cancelled_here && applied {
                self.wait_let_go(py)?;
            }
        }
        let r = match waited? {
            None => {
                return Err(errors::world(
                    py,
                    WorldError::Timeout {
                        world: multiworld::WorldName::new(&self.world)
                            .map_err(|e| PyRuntimeError::new_err(e.to_string()))?,
                        op: "wait".into(),
                        after: after.unwrap_or(Duration::ZERO),
                    },
                    self.generation,
                ));
            }
            // Another thread took the outcome: it caches it once it holds
            // the GIL again, which this thread lets it take.
            Some(None) => {
                let until = std::time::Instant::now() + Duration::from_secs(1);
                loop {
                    if let Some(r) = self.cached_once_let_go(py) {
                        return r;
                    }
                    if std::time::Instant::now() >= until {
                        return Err(PyRuntimeError::new_err(
                            "another thread took this handle's outcome and did not hand it over",
                        ));
                    }
                    py.detach(|| std::thread::sleep(Duration::from_micros(50)));
                }
            }
            Some(Some(r)) => r,
        };
        // An operation that did not complete may still hold the caller's
        // array (a message arriving into it when it was cancelled): the
        // runtime lets go of it before this returns, after the outcome is
        // kept (Ctrl-C during that wait must not lose it).
        let completed = matches!(r, Ended::Done(Ok(_)));
        let out = match r {
            Ended::Done(Ok(done)) => done.into_py(py),
            Ended::Done(Err(e)) => Err(errors::world(py, e, self.generation)),
            Ended::Cancelled => Err(PyRuntimeError::new_err("the operation was cancelled")),
            Ended::Failed(why) => Err(PyRuntimeError::new_err(format!(
                "the operation's task failed: {why}"
            ))),
        };
        *lock(&self.outcome) = Some(keep_outcome(py, &out));
        let released = if completed { Ok(()) } else { self.wait_let_go(py) };
        // Cached first: a loop woken now takes it from the cache.
        self.hand_back_to_loop();
        released?;
        out
    }
}

#[pymethods]
impl World {
    /// The world's name.
    #[getter]
    fn name(&self) -> PyResult<String> {
        Ok(self.w()?.name().to_string())
    }

    /// This process's rank.
    #[getter]
    fn rank(&self) -> PyResult<u32> {
        Ok(self.w()?.rank().0)
    }

    /// Number of members.
    #[getter]
    fn size(&self) -> PyResult<u32> {
        Ok(self.w()?.size())
    }

    /// This membership's generation.
    #[getter]
    fn generation(&self) -> PyResult<u64> {
        Ok(self.w()?.generation().0)
    }

    /// Whether its device calls are first checked against the other
    /// members, waiting on the calling thread (`check_device_calls` on an
    /// NCCL world): a collective for every member's description of it, a
    /// receive for its sender's description of the message.
    #[getter]
    fn checks_device_calls(&self) -> PyResult<bool> {
        Ok(self.w()?.checks_device_calls())
    }

    /// The store's address.
    #[getter]
    fn store_addr(&self) -> PyResult<String> {
        Ok(self.w()?.store_addr().to_string())
    }

    /// `(state, cause)`: state is "joining", "ready", "broken" or "removed";
    /// cause the break cause's kind when broken.
    fn state(&self) -> PyResult<(&'static str, Option<&'static str>)> {
        let s = self.w()?.state();
        let cause = match &s {
            WorldState::Broken(c) => Some(c.kind()),
            _ => None,
        };
        Ok((s.label(), cause))
    }

    /// `(state, detail)` of the shared memory this world's (or sub-group's)
    /// collectives use between members on one host: `("untried", None)`
    /// until the first call that would use it, then `("active", None)` or
    /// `("unavailable", reason)` for good, the same on every member. Waits
    /// for the group's turn (a collective running now ends first).
    fn shared_memory(&self, py: Python<'_>) -> PyResult<(&'static str, Option<String>)> {
        let g = self.g()?;
        Ok(match runtime::wait(py, async move { g.shared_memory().await })? {
            SharedMemory::Untried => ("untried", None),
            SharedMemory::Active { .. } => ("active", None),
            SharedMemory::Unavailable { reason } => ("unavailable", Some(reason)),
            // A state added later: named by its description.
            other => ("unknown", Some(other.to_string())),
        })
    }

    /// `World.send`'s fast path: a plain numpy array (`lent::plain`) sent
    /// from its own memory, every argument checked here. Returns false,
    /// sending nothing, for any other argument (the Python layer then takes
    /// its general path, which also words the errors).
    fn send_plain(
        &self,
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
        dst: &Bound<'_, PyAny>,
        tag: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let (Some(dst), Some(tag), Some(a)) = (index(dst), index(tag), lent::plain(obj)) else {
            return Ok(false);
        };
        let Ok(view) = TensorView::from_bytes(a.dtype, a.bytes()) else {
            return Ok(false);
        };
        let _reading = lent::reading(view.as_bytes(), "send")?;
        let w = self.w()?;
        self.op_moving(py, view.as_bytes().len(), w.send(Rank(dst), Tag(tag), view))?;
        Ok(true)
    }

    /// `World.recv_into`'s fast path: a plain, writeable numpy array
    /// (`lent::plain`) lent for the receive. Returns the sender, or `None`
    /// (nothing received) for any other argument, which the Python layer
    /// takes its general way.
    fn recv_into_plain(
        &self,
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
        src: Option<&Bound<'_, PyAny>>,
        tag: &Bound<'_, PyAny>,
    ) -> PyResult<Option<u32>> {
        let Some((src, tag, mut loan)) = plain_loan(obj, src, tag)? else {
            return Ok(None);
        };
        let got = self.receive(py, src, tag, &mut loan.tensor);
        loan.settle(py);
        got.map(Some)
    }

    /// `World.all_reduce`'s fast path (blocking): a plain, writeable numpy
    /// array (`lent::plain`) lent for the call and reduced in place with
    /// `op` (a name, as `all_reduce_into` takes). Returns false, doing
    /// nothing, for any other array (the Python layer then takes its
    /// general path); a call that fails raises as the general path's does.
    fn all_reduce_plain(&self, py: Python<'_>, obj: &Bound<'_, PyAny>, op: &str) -> PyResult<bool> {
        self.in_place_plain(py, obj, "all_reduce", || {
            reduce_op(op).map(|op| Some(InPlace::AllReduce(op)))
        })
    }

    /// `World.broadcast`'s fast path (blocking), as
    /// [`World::all_reduce_plain`]: `root` must be a Python int (anything
    /// else returns false, for the general path to word the error).
    fn broadcast_plain(
        &self,
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
        root: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        self.in_place_plain(py, obj, "broadcast", || {
            Ok(index(root).map(|r| InPlace::Broadcast(Rank(r))))
        })
    }

    /// `World.reduce`'s fast path (blocking), as
    /// [`World::all_reduce_plain`]: `root` must be a Python int (anything
    /// else returns false, for the general path to word the error); the
    /// root's array gets the result, the others' are left as they were.
    fn reduce_plain(
        &self,
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
        root: &Bound<'_, PyAny>,
        op: &str,
    ) -> PyResult<bool> {
        self.in_place_plain(py, obj, "reduce", || match index(root) {
            Some(r) => reduce_op(op).map(|op| Some(InPlace::Reduce(Rank(r), op))),
            None => Ok(None),
        })
    }

    /// `World.all_gather_into_tensor`'s fast path (blocking): plain numpy
    /// arrays of one dtype that share no memory, the output writeable
    /// (see [`World::pair_in_place_plain`]). Returns false, doing nothing,
    /// otherwise (the Python layer then takes its general path, which also
    /// copies an input lying in the output).
    fn all_gather_into_tensor_plain(
        &self,
        py: Python<'_>,
        out: &Bound<'_, PyAny>,
        input: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        self.pair_in_place_plain(py, out, input, "all_gather_into_tensor", |_, _| {
            Ok(Some(InPlace::AllGatherFrom))
        })
    }

    /// `World.reduce_scatter_tensor`'s fast path (blocking), as
    /// [`World::all_gather_into_tensor_plain`], reducing with `op`.
    fn reduce_scatter_tensor_plain(
        &self,
        py: Python<'_>,
        out: &Bound<'_, PyAny>,
        input: &Bound<'_, PyAny>,
        op: &str,
    ) -> PyResult<bool> {
        self.pair_in_place_plain(py, out, input, "reduce_scatter_tensor", |_, _| {
            let op = reduce_op(op)?;
            Ok(Some(move |input| InPlace::ReduceScatterFrom(input, op)))
        })
    }

    /// `World.all_to_all_single`'s fast path (blocking), as
    /// [`World::all_gather_into_tensor_plain`]: each split list is `None`
    /// (even splits) or a list or tuple of Python ints, in rows of its
    /// array's first dimension (anything else returns false, for the
    /// general path to word the error).
    fn all_to_all_single_plain(
        &self,
        py: Python<'_>,
        out: &Bound<'_, PyAny>,
        input: &Bound<'_, PyAny>,
        output_split_sizes: &Bound<'_, PyAny>,
        input_split_sizes: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        self.pair_in_place_plain(py, out, input, "all_to_all_single", |o, i| {
            let (Some(out_splits), Some(in_splits)) = (
                split_elements(output_split_sizes, o),
                split_elements(input_split_sizes, i),
            ) else {
                return Ok(None);
            };
            Ok(Some(move |input| {
                InPlace::AllToAllFrom(input, out_splits, in_splits)
            }))
        })
    }

    /// Sends a flat byte view of `dtype` elements to `dst` (no copy).
    fn send(&self, py: Python<'_>, data: Readable<'_>, dtype: &str, dst: u32, tag: u32) -> PyResult<()> {
        let bytes = data
            .0
            .as_slice()
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let _reading = lent::reading(bytes, "send")?;
        let view = tensor::view(bytes, tensor::dtype(dtype)?)?;
        let w = self.w()?;
        self.op_moving(py, bytes.len(), w.send(Rank(dst), Tag(tag), view))
    }

    /// Receives a message of `dtype` and `shape` from `src` (`None`: any);
    /// returns `(src, flat array)`.
    fn recv(
        &self,
        py: Python<'_>,
        src: Option<u32>,
        tag: u32,
        dtype: &str,
        shape: Vec<usize>,
    ) -> PyResult<(u32, Py<PyAny>)> {
        let mut t = Output(dtype.to_string(), shape).tensor()?;
        let from = self.receive(py, src, tag, &mut t)?;
        Ok((from, tensor::to_numpy(py, t)?.unbind()))
    }

    /// Receives a message of `dtype` and `shape` from `src` (`None`: any)
    /// straight into the caller's C-contiguous array `out` (its bytes, as
    /// `uint8`), which is lent to the runtime for the call (no copy; see
    /// `lent.rs`). On a mismatch `out` is untouched; on other failures it may
    /// hold part of the message. Returns the sender.
    fn recv_into(
        &self,
        py: Python<'_>,
        mut out: Writable<'_>,
        dtype: &str,
        shape: Vec<usize>,
        src: Option<u32>,
        tag: u32,
    ) -> PyResult<u32> {
        let mut loan = Loan::new(&mut out, tensor::dtype(dtype)?, shape, "recv_into")?;
        let got = self.receive(py, src, tag, &mut loan.tensor);
        loan.settle(py);
        got
    }

    /// All-reduce of the caller's C-contiguous array `out` (its bytes, as
    /// `uint8`) in place, the array lent to the runtime for the call (no
    /// copy). On failure `out` may hold partial results.
    fn all_reduce_into(
        &self,
        py: Python<'_>,
        mut out: Writable<'_>,
        dtype: &str,
        shape: Vec<usize>,
        op: &str,
    ) -> PyResult<()> {
        let op = reduce_op(op)?;
        let loan = Loan::new(&mut out, tensor::dtype(dtype)?, shape, "all_reduce")?;
        self.in_place(py, loan, InPlace::AllReduce(op))
    }

    /// Broadcast from `root` into the caller's C-contiguous array `out` (its
    /// bytes, as `uint8`) in place, the array lent to the runtime for the
    /// call (no copy). On failure `out` may hold part of the root's data.
    fn broadcast_into(
        &self,
        py: Python<'_>,
        mut out: Writable<'_>,
        dtype: &str,
        shape: Vec<usize>,
        root: u32,
    ) -> PyResult<()> {
        let loan = Loan::new(&mut out, tensor::dtype(dtype)?, shape, "broadcast")?;
        self.in_place(py, loan, InPlace::Broadcast(Rank(root)))
    }

    /// All-gather into the caller's C-contiguous array `out` (its bytes, as
    /// `uint8`), lent to the runtime for the call, from `input`, lent too
    /// where it can be (no copy either way; the Python layer copies an
    /// input that lies in the output first). On failure `out` may hold part
    /// of the result.
    fn all_gather_into_tensor_into(
        &self,
        py: Python<'_>,
        mut out: Writable<'_>,
        dtype: &str,
        shape: Vec<usize>,
        input: Input<'_>,
    ) -> PyResult<()> {
        let what = "all_gather_into_tensor";
        let input = input.for_call(what)?;
        let loan = Loan::new(&mut out, tensor::dtype(dtype)?, shape, &format!("{what} output"))?;
        self.in_place(py, loan, InPlace::AllGatherFrom(input))
    }

    /// Reduce-scatter of `input` into the caller's C-contiguous array `out`
    /// (its bytes, as `uint8`), both lent to the runtime for the call where
    /// they can be (no copy; the Python layer copies an input that shares
    /// memory with the output first). On failure `out` may hold part of the
    /// result.
    fn reduce_scatter_tensor_into(
        &self,
        py: Python<'_>,
        mut out: Writable<'_>,
        dtype: &str,
        shape: Vec<usize>,
        input: Input<'_>,
        op: &str,
    ) -> PyResult<()> {
        let what = "reduce_scatter_tensor";
        let (op, input) = (reduce_op(op)?, input.for_call(what)?);
        let loan = Loan::new(&mut out, tensor::dtype(dtype)?, shape, &format!("{what} output"))?;
        self.in_place(py, loan, InPlace::ReduceScatterFrom(input, op))
    }

    /// All-to-all of `input`'s parts into the caller's C-contiguous array
    /// `out` (its bytes, as `uint8`), both lent to the runtime for the call
    /// where they can be (no copy; the Python layer copies an input that
    /// shares memory with the output first); `splits` in elements, the
    /// output's then the input's, as for `all_to_all_single`. On failure
    /// `out` may hold part of the result.
    fn all_to_all_single_into(
        &self,
        py: Python<'_>,
        mut out: Writable<'_>,
        dtype: &str,
        shape: Vec<usize>,
        input: Input<'_>,
        splits: (Option<Vec<usize>>, Option<Vec<usize>>),
    ) -> PyResult<()> {
        let what = "all_to_all_single";
        let input = input.for_call(what)?;
        let loan = Loan::new(&mut out, tensor::dtype(dtype)?, shape, &format!("{what} output"))?;
        self.in_place(py, loan, InPlace::AllToAllFrom(input, splits.0, splits.1))
    }

    /// All-gather into the caller's C-contiguous arrays (each as its bytes,
    /// `uint8`, with its dtype and shape), lent to the runtime for the call,
    /// from `input`, lent too where it can be (no copy; the Python layer
    /// passes arrays that share no memory). On failure the outputs may hold
    /// part of the result.
    fn all_gather_into_list(
        &self,
        py: Python<'_>,
        mut outputs: Vec<LentArray<'_>>,
        input: Input<'_>,
    ) -> PyResult<()> {
        let what = "all_gather";
        let input = input.for_call(what)?;
        let (mut outs, ends) = lend_list(&mut outputs, what)?;
        let g = self.g()?;
        let r = self.coll(py, g.all_gather(&mut outs, input.tensor()));
        drop(outs);
        settle_all(py, ends);
        input.settle(py);
        r
    }

    /// Gather to `root` of `input` (lent where it can be) into the root's
    /// C-contiguous arrays `outputs` (as for `all_gather_into_list`; `None`
    /// on the other members), lent for the call (no copy). On failure the
    /// outputs may hold part of the result.
    #[pyo3(signature = (input, outputs, root))]
    fn gather_into_list(
        &self,
        py: Python<'_>,
        input: Input<'_>,
        mut outputs: Option<Vec<LentArray<'_>>>,
        root: u32,
    ) -> PyResult<()> {
        let what = "gather";
        let input = input.for_call(what)?;
        let (mut outs, ends) = match outputs.as_mut() {
            Some(list) => {
                let (outs, ends) = lend_list(list, what)?;
                (Some(outs), ends)
            }
            None => (None, Vec::new()),
        };
        let g = self.g()?;
        let r = self.coll(py, g.gather(input.tensor(), outs.as_deref_mut(), Rank(root)));
        drop(outs);
        settle_all(py, ends);
        input.settle(py);
        r
    }

    /// Scatter from `root` of its `inputs` (lent where they can be; `None`
    /// on the other members) into the caller's C-contiguous array `out`
    /// (its bytes, as `uint8`), lent for the call (no copy). On failure
    /// `out` may hold part of its part.
    #[pyo3(signature = (out, dtype, shape, inputs, root))]
    fn scatter_into(
        &self,
        py: Python<'_>,
        mut out: Writable<'_>,
        dtype: &str,
        shape: Vec<usize>,
        inputs: Option<Vec<Input<'_>>>,
        root: u32,
    ) -> PyResult<()> {
        let what = "scatter";
        let (ins, mut ends) = match &inputs {
            Some(list) => {
                let (ins, ends) = lend_inputs(list, what)?;
                (Some(ins), ends)
            }
            None => (None, Vec::new()),
        };
        let loan = Loan::new(&mut out, tensor::dtype(dtype)?, shape, &format!("{what} output"))?;
        let (mut t, end) = loan.into_parts();
        ends.push(end);
        let g = self.g()?;
        let r = self.coll(py, g.scatter(&mut t, ins.as_deref(), Rank(root)));
        drop((t, ins));
        settle_all(py, ends);
        r
    }

    /// Reduce-scatter of `inputs` (one per member, lent where they can be)
    /// into the caller's C-contiguous array `out` (its bytes, as `uint8`),
    /// lent for the call (no copy; the Python layer passes arrays that share
    /// no memory). On failure `out` may hold part of the result.
    fn reduce_scatter_into(
        &self,
        py: Python<'_>,
        mut out: Writable<'_>,
        dtype: &str,
        shape: Vec<usize>,
        inputs: Vec<Input<'_>>,
        op: &str,
    ) -> PyResult<()> {
        let (what, op) = ("reduce_scatter", reduce_op(op)?);
        let (ins, mut ends) = lend_inputs(&inputs, what)?;
        let loan = Loan::new(&mut out, tensor::dtype(dtype)?, shape, &format!("{what} output"))?;
        let (mut t, end) = loan.into_parts();
        ends.push(end);
        let g = self.g()?;
        let r = self.coll(py, g.reduce_scatter(&mut t, &ins, op));
        drop((t, ins));
        settle_all(py, ends);
        r
    }

    /// All-to-all of lists: `inputs` (one per member, lent where they can
    /// be) into the caller's C-contiguous arrays `outputs` (as for
    /// `all_gather_into_list`), lent for the call (no copy). On failure the
    /// outputs may hold part of the result.
    fn all_to_all_into_list(
        &self,
        py: Python<'_>,
        mut outputs: Vec<LentArray<'_>>,
        inputs: Vec<Input<'_>>,
    ) -> PyResult<()> {
        let what = "all_to_all";
        let (ins, mut ends) = lend_inputs(&inputs, what)?;
        let (mut outs, out_ends) = lend_list(&mut outputs, what)?;
        ends.extend(out_ends);
        let g = self.g()?;
        let r = self.coll(py, g.all_to_all(&mut outs, &ins));
        drop((outs, ins));
        settle_all(py, ends);
        r
    }

    /// Reduce to `root` of the caller's C-contiguous array `out` (its bytes,
    /// as `uint8`) in place, the array lent to the runtime for the call (no
    /// copy): the root's gets the result, the others' are left as they
    /// were. On failure the root's may hold partial results.
    fn reduce_into(
        &self,
        py: Python<'_>,
        mut out: Writable<'_>,
        dtype: &str,
        shape: Vec<usize>,
        root: u32,
        op: &str,
    ) -> PyResult<()> {
        let op = reduce_op(op)?;
        let loan = Loan::new(&mut out, tensor::dtype(dtype)?, shape, "reduce")?;
        self.in_place(py, loan, InPlace::Reduce(Rank(root), op))
    }

    /// The asyncio API's send of a plain numpy array (`lent::plain`) from
    /// its own memory, lent to the send's task: the handle yields `None`,
    /// and only once the runtime has let go of the array (also after a
    /// failure). `None` (nothing sent) when the array cannot be lent (not
    /// plain, read-only): the caller then sends a copy; `ValueError` while
    /// a call that writes it (a receive, an in-place collective) holds it.
    /// Other sends of the same array may run at the same time. As with
    /// `isend`, a send that fits the socket's buffer ends in this call (the
    /// handle is finished, the loan over).
    fn isend_plain(
        &self,
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
        dst: &Bound<'_, PyAny>,
        tag: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Work>> {
        let (Some(dst), Some(tag), Some(a)) = (index(dst), index(tag), lent::plain(obj)) else {
            return Ok(None);
        };
        let Some((t, released)) = a.lend_to_send()? else {
            return Ok(None);
        };
        let w = self.w()?.clone();
        // The future owns the lent tensor and drops it when the send ends:
        // that ends the loan.
        let op = async move {
            let r = w.send(Rank(dst), Tag(tag), &t).await;
            drop(t);
            r.map(|()| Done::Unit)
        };
        match first_poll(op)? {
            Ok(r) => Ok(Some(self.finished(py, r)?)),
            Err(rest) => self.lent_work(rest, released, false).map(Some),
        }
    }

    /// Starts a send of a copy of `data`; the handle yields `None`. A send
    /// that fits the socket's buffer ends here, before the handle exists
    /// (no task, no wake-up); the rest of a larger one goes on in a task.
    fn isend(&self, py: Python<'_>, data: Input<'_>, dst: u32, tag: u32) -> PyResult<Work> {
        let t = data.tensor()?;
        let w = self.w()?.clone();
        let op = async move { w.send(Rank(dst), Tag(tag), &t).await.map(|()| Done::Unit) };
        match first_poll(op)? {
            Ok(r) => self.finished(py, r),
            Err(rest) => self.work(rest, false),
        }
    }

    /// The asyncio API's shortcut: a receive into a plain, writeable numpy
    /// array of a message that has already arrived (nothing is posted and
    /// nothing waits). Returns the sender; `None` if no such message is here
    /// or the argument is not a plain array, and without looking when the
    /// array is larger than `runtime::loop_copy_max` (such a receive is
    /// left to a task: `irecv_plain` with `off_loop`). Errors (a broken
    /// world, a mismatch) raise as from `recv_into`.
    fn recv_into_now(
        &self,
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
        src: Option<&Bound<'_, PyAny>>,
        tag: &Bound<'_, PyAny>,
    ) -> PyResult<Option<u32>> {
        let Some((src, tag, a)) = plain_recv(obj, src, tag) else {
            return Ok(None);
        };
        let bytes = a.bytes().len();
        if bytes > runtime::loop_copy_max() {
            return Ok(None);
        }
        let Some(mut loan) = a.lend("recv_into")? else {
            return Ok(None);
        };
        let w = self.w()?;
        let mut take = || runtime::enter(|| w.try_recv(src.map(Rank), Tag(tag), &mut loan.tensor));
        let got = if bytes > runtime::held_poll_max() {
            py.detach(take)
        } else {
            take()
        }?;
        loan.settle(py);
        match got {
            None => Ok(None),
            Some(r) => r
                .map(|r| Some(r.0))
                .map_err(|e| errors::world(py, e, self.generation_of())),
        }
    }

    /// `World.irecv`'s fast path for a plain, writeable numpy array
    /// (`lent::plain`): the receive writes the array itself (no buffer, no
    /// copy); the handle yields the sender, and only once the runtime has
    /// let go of the array (also after a failure). `None` (nothing posted)
    /// for any other argument, which the Python layer takes its general way.
    /// Dropping the handle withdraws the receive; `cancel` also waits until
    /// the array is let go. With `off_loop` (the asyncio API's receives), an
    /// array larger than `runtime::loop_copy_max` is received by a task, so
    /// the copy of a message already here runs on a thread of the runtime,
    /// not on the event loop's; a smaller one small enough to be read ahead
    /// is left to its connection's reader if held back, when
    /// `runtime::loop_leaves_held` (see [`post_receive`]).
    #[pyo3(signature = (obj, src, tag, off_loop = false))]
    fn irecv_plain(
        &self,
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
        src: Option<&Bound<'_, PyAny>>,
        tag: &Bound<'_, PyAny>,
        off_loop: bool,
    ) -> PyResult<Option<Work>> {
        let Some((src, tag, a)) = plain_recv(obj, src, tag) else {
            return Ok(None);
        };
        let Some((t, released)) = a.lend_to_task("irecv")? else {
            return Ok(None);
        };
        let w = self.w()?;
        if off_loop && t.nbytes() > runtime::loop_copy_max() {
            let op = receive_in_task(w.clone(), src, tag, t);
            // The lent tensor is dropped with the result: the loan ends.
            let op = async move { op.await.map(|(from, _)| Done::Source(from)) };
            return self.lent_work(op, released, true).map(Some);
        }
        let pending = post_receive(py, w, src, tag, t, off_loop)?;
        let op = async move { pending.wait().await.map(|r| Done::Source(r.src.0)) };
        self.lent_receive(op, released).map(Some)
    }

    /// Starts a receive; the handle yields `(src, flat array)`. Dropping the
    /// handle before it completes cancels the receive. With `off_loop` (the
    /// asyncio API's receives), a message larger than
    /// `runtime::loop_copy_max` is received by a task, on a thread of the
    /// runtime, and a smaller one as by `irecv_plain`.
    #[pyo3(signature = (src, tag, out, off_loop = false))]
    fn irecv(
        &self,
        py: Python<'_>,
        src: Option<u32>,
        tag: u32,
        out: Output,
        off_loop: bool,
    ) -> PyResult<Work> {
        let t = out.tensor()?;
        let w = self.w()?;
        if off_loop && t.nbytes() > runtime::loop_copy_max() {
            let op = receive_in_task(w.clone(), src, tag, t);
            return self.work(
                async move { op.await.map(|(from, t)| Done::Received(from, t)) },
                true,
            );
        }
        let pending = post_receive(py, w, src, tag, t, off_loop)?;
        self.receive_work(async move { pending.wait().await.map(|r| Done::Received(r.src.0, r.tensor)) })
    }

    /// Broadcast from `root`; returns the result.
    fn broadcast(&self, py: Python<'_>, t: Input<'_>, root: u32) -> PyResult<Py<PyAny>> {
        let mut t = t.tensor()?;
        let g = self.g()?;
        self.coll(py, g.broadcast(&mut t, Rank(root)))?;
        Ok(tensor::to_numpy(py, t)?.unbind())
    }

    /// All-reduce with `op`; returns the result.
    fn all_reduce(&self, py: Python<'_>, t: Input<'_>, op: &str) -> PyResult<Py<PyAny>> {
        let (mut t, op) = (t.tensor()?, reduce_op(op)?);
        let g = self.g()?;
        self.coll(py, g.all_reduce(&mut t, op))?;
        Ok(tensor::to_numpy(py, t)?.unbind())
    }

    /// Reduce to `root` with `op`; returns the tensor (the result on the root).
    fn reduce(&self, py: Python<'_>, t: Input<'_>, root: u32, op: &str) -> PyResult<Py<PyAny>> {
        let (mut t, op) = (t.tensor()?, reduce_op(op)?);
        let g = self.g()?;
        self.coll(py, g.reduce(&mut t, Rank(root), op))?;
        Ok(tensor::to_numpy(py, t)?.unbind())
    }

    /// All-gather into one output per member; returns them.
    fn all_gather(&self, py: Python<'_>, outputs: Vec<Output>, input: Input<'_>) -> PyResult<Py<PyAny>> {
        let (mut outs, input) = (tensor::outputs(&outputs)?, input.tensor()?);
        let g = self.g()?;
        self.coll(py, g.all_gather(&mut outs, &input))?;
        Ok(tensor::list_to_numpy(py, outs)?
            .into_pyobject(py)?
            .into_any()
            .unbind())
    }

    /// All-gather into one tensor; returns it.
    fn all_gather_into_tensor(
        &self,
        py: Python<'_>,
        output: Output,
        input: Input<'_>,
    ) -> PyResult<Py<PyAny>> {
        let (mut out, input) = (output.tensor()?, input.tensor()?);
        let g = self.g()?;
        self.coll(py, g.all_gather_into_tensor(&mut out, &input))?;
        Ok(tensor::to_numpy(py, out)?.unbind())
    }

    /// Gather to `root`; returns the outputs there, `None` elsewhere.
    #[pyo3(signature = (input, outputs, root))]
    fn gather(
        &self,
        py: Python<'_>,
        input: Input<'_>,
        outputs: Option<Vec<Output>>,
        root: u32,
    ) -> PyResult<Option<Py<PyAny>>> {
        let input = input.tensor()?;
        let mut outs = outputs.as_deref().map(tensor::outputs).transpose()?;
        let g = self.g()?;
        self.coll(py, g.gather(&input, outs.as_deref_mut(), Rank(root)))?;
        outs.map(|o| {
            Ok(tensor::list_to_numpy(py, o)?
                .into_pyobject(py)?
                .into_any()
                .unbind())
        })
        .transpose()
    }

    /// Scatter from `root`; returns this member's part.
    #[pyo3(signature = (output, inputs, root))]
    fn scatter(
        &self,
        py: Python<'_>,
        output: Output,
        inputs: Option<Vec<Input<'_>>>,
        root: u32,
    ) -> PyResult<Py<PyAny>> {
        let mut out = output.tensor()?;
        let ins = inputs.as_deref().map(tensor::inputs).transpose()?;
        let g = self.g()?;
        self.coll(py, g.scatter(&mut out, ins.as_deref(), Rank(root)))?;
        Ok(tensor::to_numpy(py, out)?.unbind())
    }

    /// Reduce-scatter of a list (one input per member); returns this member's part.
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        output: Output,
        inputs: Vec<Input<'_>>,
        op: &str,
    ) -> PyResult<Py<PyAny>> {
        let (mut out, ins, op) = (output.tensor()?, tensor::inputs(&inputs)?, reduce_op(op)?);
        let g = self.g()?;
        self.coll(py, g.reduce_scatter(&mut out, &ins, op))?;
        Ok(tensor::to_numpy(py, out)?.unbind())
    }

    /// Reduce-scatter of one tensor; returns this member's part.
    fn reduce_scatter_tensor(
        &self,
        py: Python<'_>,
        output: Output,
        input: Input<'_>,
        op: &str,
    ) -> PyResult<Py<PyAny>> {
        let (mut out, input, op) = (output.tensor()?, input.tensor()?, reduce_op(op)?);
        let g = self.g()?;
        self.coll(py, g.reduce_scatter_tensor(&mut out, &input, op))?;
        Ok(tensor::to_numpy(py, out)?.unbind())
    }

    /// All-to-all of lists; returns the outputs.
    fn all_to_all(
        &self,
        py: Python<'_>,
        outputs: Vec<Output>,
        inputs: Vec<Input<'_>>,
    ) -> PyResult<Py<PyAny>> {
        let (mut outs, ins) = (tensor::outputs(&outputs)?, tensor::inputs(&inputs)?);
        let g = self.g()?;
        self.coll(py, g.all_to_all(&mut outs, &ins))?;
        Ok(tensor::list_to_numpy(py, outs)?
            .into_pyobject(py)?
            .into_any()
            .unbind())
    }

    /// All-to-all of one tensor with optional uneven splits; returns the output.
    #[pyo3(signature = (output, input, output_splits=None, input_splits=None))]
    fn all_to_all_single(
        &self,
        py: Python<'_>,
        output: Output,
        input: Input<'_>,
        output_splits: Option<Vec<usize>>,
        input_splits: Option<Vec<usize>>,
    ) -> PyResult<Py<PyAny>> {
        let (mut out, input) = (output.tensor()?, input.tensor()?);
        let g = self.g()?;
        self.coll(
            py,
            g.all_to_all_single(
                &mut out,
                &input,
                output_splits.as_deref(),
                input_splits.as_deref(),
            ),
        )?;
        Ok(tensor::to_numpy(py, out)?.unbind())
    }

    // -- handle forms (async_op=True and the asyncio API) -------------------

    /// Starts an all-reduce in the background; the handle yields the result.
    fn all_reduce_async(&self, t: Input<'_>, op: &str) -> PyResult<Work> {
        let (t, op) = (t.tensor()?, reduce_op(op)?);
        self.start(|g| g.all_reduce_handle(t, op), Done::Tensor)
    }

    /// `all_reduce(async_op=True)` on a plain numpy array, in place and
    /// without a copy (see `in_place_lent`); `None` for anything else.
    fn all_reduce_lent(&self, obj: &Bound<'_, PyAny>, op: &str) -> PyResult<Option<Work>> {
        let op = reduce_op(op)?;
        self.in_place_lent(
            obj,
            "all_reduce",
            || Ok(()),
            |g, t, ()| g.all_reduce_handle(t, op),
        )
    }

    /// `broadcast(async_op=True)` on a plain numpy array, in place and
    /// without a copy (see `in_place_lent`); `None` for anything else.
    fn broadcast_lent(&self, obj: &Bound<'_, PyAny>, root: u32) -> PyResult<Option<Work>> {
        self.in_place_lent(
            obj,
            "broadcast",
            || Ok(()),
            |g, t, ()| g.broadcast_handle(t, Rank(root)),
        )
    }

    /// `reduce(async_op=True)` on a plain numpy array, in place (the root's
    /// array gets the result) and without a copy (see `in_place_lent`);
    /// `None` for anything else.
    fn reduce_lent(&self, obj: &Bound<'_, PyAny>, root: u32, op: &str) -> PyResult<Option<Work>> {
        let op = reduce_op(op)?;
        self.in_place_lent(
            obj,
            "reduce",
            || Ok(()),
            |g, t, ()| g.reduce_handle(t, Rank(root), op),
        )
    }

    /// Starts a broadcast in the background; the handle yields the result.
    fn broadcast_async(&self, t: Input<'_>, root: u32) -> PyResult<Work> {
        let t = t.tensor()?;
        self.start(|g| g.broadcast_handle(t, Rank(root)), Done::Tensor)
    }

    /// Starts a reduce in the background; the handle yields the tensor.
    fn reduce_async(&self, t: Input<'_>, root: u32, op: &str) -> PyResult<Work> {
        let (t, op) = (t.tensor()?, reduce_op(op)?);
        self.start(|g| g.reduce_handle(t, Rank(root), op), Done::Tensor)
    }

    /// Starts an all-gather into a list in the background.
    fn all_gather_async(&self, outputs: Vec<Output>, input: Input<'_>) -> PyResult<Work> {
        let (outs, input) = (tensor::outputs(&outputs)?, input.tensor()?);
        self.start(|g| g.all_gather_handle(outs, input), Done::Tensors)
    }

    /// `all_gather_into_tensor(async_op=True)` into a plain numpy array,
    /// written in place without a copy (see `in_place_lent`); the input is
    /// copied first (it may lie in the output). `None` for anything else.
    fn all_gather_into_tensor_lent(
        &self,
        obj: &Bound<'_, PyAny>,
        input: Input<'_>,
    ) -> PyResult<Option<Work>> {
        self.in_place_lent(
            obj,
            "all_gather_into_tensor",
            || input.tensor(),
            |g, out, input| g.all_gather_into_tensor_handle(out, input),
        )
    }

    /// Starts an all-gather into one tensor in the background; the handle
    /// yields the output.
    fn all_gather_into_tensor_async(&self, output: Output, input: Input<'_>) -> PyResult<Work> {
        let (out, input) = (output.tensor()?, input.tensor()?);
        self.start(|g| g.all_gather_into_tensor_handle(out, input), Done::Tensor)
    }

    /// Starts a gather in the background; the handle yields the outputs on
    /// the root, `None` elsewhere.
    #[pyo3(signature = (input, outputs, root))]
    fn gather_async(&self, input: Input<'_>, outputs: Option<Vec<Output>>, root: u32) -> PyResult<Work> {
        let input = input.tensor()?;
        let outs = outputs.as_deref().map(tensor::outputs).transpose()?;
        self.start(|g| g.gather_handle(input, outs, Rank(root)), Done::MaybeTensors)
    }

    /// Starts a scatter in the background; the handle yields this member's part.
    #[pyo3(signature = (output, inputs, root))]
    fn scatter_async(&self, output: Output, inputs: Option<Vec<Input<'_>>>, root: u32) -> PyResult<Work> {
        let out = output.tensor()?;
        let ins = inputs.as_deref().map(tensor::inputs).transpose()?;
        self.start(|g| g.scatter_handle(out, ins, Rank(root)), Done::Tensor)
    }

    /// Starts a reduce-scatter of a list in the background.
    fn reduce_scatter_async(&self, output: Output, inputs: Vec<Input<'_>>, op: &str) -> PyResult<Work> {
        let (out, ins, op) = (output.tensor()?, tensor::inputs(&inputs)?, reduce_op(op)?);
        self.start(|g| g.reduce_scatter_handle(out, ins, op), Done::Tensor)
    }

    /// Starts a reduce-scatter of one tensor in the background.
    fn reduce_scatter_tensor_async(&self, output: Output, input: Input<'_>, op: &str) -> PyResult<Work> {
        let (out, input, op) = (output.tensor()?, input.tensor()?, reduce_op(op)?);
        self.start(|g| g.reduce_scatter_tensor_handle(out, input, op), Done::Tensor)
    }

    /// `all_gather(async_op=True)` into a list of plain numpy arrays, each
    /// written in place without a copy (see `list_lent`); the input is
    /// copied first (it may be one of the outputs). `None` for anything else.
    fn all_gather_lent(&self, outputs: Vec<Bound<'_, PyAny>>, input: Input<'_>) -> PyResult<Option<Work>> {
        self.list_lent(
            &outputs,
            "all_gather",
            || input.tensor(),
            |g, outs, input| g.all_gather_handle(outs, input),
        )
    }

    /// `gather(async_op=True)` on the root into a list of plain numpy
    /// arrays (as for `all_gather_lent`). `None` for anything else.
    fn gather_lent(
        &self,
        input: Input<'_>,
        outputs: Vec<Bound<'_, PyAny>>,
        root: u32,
    ) -> PyResult<Option<Work>> {
        self.list_lent(
            &outputs,
            "gather",
            || input.tensor(),
            |g, outs, input| g.gather_handle(input, Some(outs), Rank(root)),
        )
    }

    /// `scatter(async_op=True)` into a plain numpy array, written in place
    /// without a copy (see `in_place_lent`); the root's inputs are copied
    /// first. `None` for anything else.
    #[pyo3(signature = (obj, inputs, root))]
    fn scatter_lent(
        &self,
        obj: &Bound<'_, PyAny>,
        inputs: Option<Vec<Input<'_>>>,
        root: u32,
    ) -> PyResult<Option<Work>> {
        self.in_place_lent(
            obj,
            "scatter",
            || inputs.as_deref().map(tensor::inputs).transpose(),
            |g, out, ins| g.scatter_handle(out, ins, Rank(root)),
        )
    }

    /// `reduce_scatter(async_op=True)` of a list into a plain numpy array,
    /// written in place without a copy (see `in_place_lent`); the inputs
    /// are copied first. `None` for anything else.
    fn reduce_scatter_lent(
        &self,
        obj: &Bound<'_, PyAny>,
        inputs: Vec<Input<'_>>,
        op: &str,
    ) -> PyResult<Option<Work>> {
        let op = reduce_op(op)?;
        self.in_place_lent(
            obj,
            "reduce_scatter",
            || tensor::inputs(&inputs),
            |g, out, ins| g.reduce_scatter_handle(out, ins, op),
        )
    }

    /// `all_to_all(async_op=True)` into a list of plain numpy arrays (as
    /// for `all_gather_lent`); the inputs are copied first. `None` for
    /// anything else.
    fn all_to_all_lent(
        &self,
        outputs: Vec<Bound<'_, PyAny>>,
        inputs: Vec<Input<'_>>,
    ) -> PyResult<Option<Work>> {
        self.list_lent(
            &outputs,
            "all_to_all",
            || tensor::inputs(&inputs),
            |g, outs, ins| g.all_to_all_handle(outs, ins),
        )
    }

    /// Starts an all-to-all of lists in the background.
    fn all_to_all_async(&self, outputs: Vec<Output>, inputs: Vec<Input<'_>>) -> PyResult<Work> {
        let (outs, ins) = (tensor::outputs(&outputs)?, tensor::inputs(&inputs)?);
        self.start(|g| g.all_to_all_handle(outs, ins), Done::Tensors)
    }

    /// `all_to_all_single(async_op=True)` into a plain numpy array, written
    /// in place without a copy (see `in_place_lent`); the input is copied
    /// first (the caller may change it once the call returns). `splits` as
    /// for `all_to_all_single_into`. `None` for anything else.
    fn all_to_all_single_lent(
        &self,
        obj: &Bound<'_, PyAny>,
        input: Input<'_>,
        splits: (Option<Vec<usize>>, Option<Vec<usize>>),
    ) -> PyResult<Option<Work>> {
        self.in_place_lent(
            obj,
            "all_to_all_single",
            || input.tensor(),
            |g, out, input| g.all_to_all_single_handle(out, input, splits.0, splits.1),
        )
    }

    /// `reduce_scatter_tensor(async_op=True)` into a plain numpy array,
    /// written in place without a copy (see `in_place_lent`); the input is
    /// copied first. `None` for anything else.
    fn reduce_scatter_tensor_lent(
        &self,
        obj: &Bound<'_, PyAny>,
        input: Input<'_>,
        op: &str,
    ) -> PyResult<Option<Work>> {
        let op = reduce_op(op)?;
        self.in_place_lent(
            obj,
            "reduce_scatter_tensor",
            || input.tensor(),
            |g, out, input| g.reduce_scatter_tensor_handle(out, input, op),
        )
    }

    /// Starts an all-to-all of one tensor in the background.
    #[pyo3(signature = (output, input, output_splits=None, input_splits=None))]
    fn all_to_all_single_async(
        &self,
        output: Output,
        input: Input<'_>,
        output_splits: Option<Vec<usize>>,
        input_splits: Option<Vec<usize>>,
    ) -> PyResult<Work> {
        let (out, input) = (output.tensor()?, input.tensor()?);
        self.start(
            |g| g.all_to_all_single_handle(out, input, output_splits, input_splits),
            Done::Tensor,
        )
    }

    /// Starts a barrier in the background; the handle yields `None`.
    fn barrier_async(&self) -> PyResult<Work> {
        self.start(Group::barrier_handle, |()| Done::Unit)
    }

    /// Starts an object broadcast in the background (bytes of a pickle).
    #[pyo3(signature = (data, root))]
    fn broadcast_object_async(&self, data: Option<Bound<'_, PyBytes>>, root: u32) -> PyResult<Work> {
        let data = data.map(|b| b.as_bytes().to_vec());
        self.start(|g| g.broadcast_object_handle(data, Rank(root)), Done::Bytes)
    }

    /// Starts an object all-gather in the background.
    fn all_gather_object_async(&self, data: Bound<'_, PyBytes>) -> PyResult<Work> {
        let data = data.as_bytes().to_vec();
        self.start(|g| g.all_gather_object_handle(data), Done::BytesList)
    }

    /// Starts an object gather in the background.
    fn gather_object_async(&self, data: Bound<'_, PyBytes>, root: u32) -> PyResult<Work> {
        let data = data.as_bytes().to_vec();
        self.start(|g| g.gather_object_handle(data, Rank(root)), Done::MaybeBytesList)
    }

    /// Starts an object scatter in the background.
    #[pyo3(signature = (data, root))]
    fn scatter_object_async(&self, data: Option<Vec<Bound<'_, PyBytes>>>, root: u32) -> PyResult<Work> {
        let data: Option<Vec<Vec<u8>>> = data.map(|v| v.iter().map(|b| b.as_bytes().to_vec()).collect());
        self.start(|g| g.scatter_object_handle(data, Rank(root)), Done::Bytes)
    }

    // -- sub-groups ----------------------------------------------------------

    /// Creates a sub-group of world ranks `ranks` (a collective call on this
    /// world or group: every member calls it, members of the new group or
    /// not). Returns the same membership with its collectives on the sub-group.
    fn new_group(&self, py: Python<'_>, ranks: Vec<u32>) -> PyResult<World> {
        let g = self.g()?;
        let ranks: Vec<Rank> = ranks.into_iter().map(Rank).collect();
        let sub = self.coll(py, g.new_group(&ranks))?;
        Ok(World {
            inner: Some(self.w()?.clone()),
            group: Some(sub),
        })
    }

    /// The world ranks of the group the collectives run on (every rank for
    /// a world).
    #[getter]
    fn group_ranks(&self) -> PyResult<Vec<u32>> {
        Ok(self.g()?.ranks().iter().map(|r| r.0).collect())
    }

    /// This member's position in `group_ranks` (`None`: not a member).
    #[getter]
    fn group_rank(&self) -> PyResult<Option<usize>> {
        Ok(self.g()?.group_rank())
    }

    /// Waits until every member has called it.
    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        let g = self.g()?;
        self.coll(py, g.barrier())
    }

    /// Broadcasts `root`'s bytes (a pickle); returns them everywhere.
    #[pyo3(signature = (data, root))]
    fn broadcast_object<'py>(
        &self,
        py: Python<'py>,
        data: Option<Bound<'py, PyBytes>>,
        root: u32,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let data = data.map(|b| b.as_bytes().to_vec());
        let g = self.g()?;
        let out: Vec<u8> = self.coll(py, g.broadcast_object(data.as_ref(), Rank(root)))?;
        Ok(PyBytes::new(py, &out))
    }

    /// Gathers every member's bytes everywhere.
    fn all_gather_object<'py>(
        &self,
        py: Python<'py>,
        data: Bound<'py, PyBytes>,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let data = data.as_bytes().to_vec();
        let g = self.g()?;
        let out: Vec<Vec<u8>> = self.coll(py, g.all_gather_object(&data))?;
        Ok(out.iter().map(|b| PyBytes::new(py, b)).collect())
    }

    /// Gathers every member's bytes at `root` (`None` elsewhere).
    fn gather_object<'py>(
        &self,
        py: Python<'py>,
        data: Bound<'py, PyBytes>,
        root: u32,
    ) -> PyResult<Option<Vec<Bound<'py, PyBytes>>>> {
        let data = data.as_bytes().to_vec();
        let g = self.g()?;
        let out: Option<Vec<Vec<u8>>> = self.coll(py, g.gather_object(&data, Rank(root)))?;
        Ok(out.map(|v| v.iter().map(|b| PyBytes::new(py, b)).collect()))
    }

    /// Scatters `root`'s list of bytes; returns this member's.
    #[pyo3(signature = (data, root))]
    fn scatter_object<'py>(
        &self,
        py: Python<'py>,
        data: Option<Vec<Bound<'py, PyBytes>>>,
        root: u32,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let data: Option<Vec<Vec<u8>>> = data.map(|v| v.iter().map(|b| b.as_bytes().to_vec()).collect());
        let g = self.g()?;
        let out: Vec<u8> = self.coll(py, g.scatter_object(data.as_deref(), Rank(root)))?;
        Ok(PyBytes::new(py, &out))
    }

    /// Ends the world for every member (each must call it), then leaves.
    fn finish(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let after = runtime::seconds("timeout", Some(timeout))?.unwrap_or(Duration::ZERO);
        let w = self.w()?;
        self.op(py, w.finish(after))
    }

    /// Breaks the world now (cause "aborted").
    fn abort(&self) -> PyResult<()> {
        let w = self.w()?;
        runtime::enter(|| w.abort())
    }

    /// Waits (at most `timeout` seconds) until the world is torn down;
    /// returns whether it was.
    #[pyo3(signature = (timeout=None))]
    fn wait_removed(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let after = runtime::seconds("timeout", timeout)?;
        let w = self.w()?;
        Ok(runtime::wait_for(py, w.removed(), after)?.is_some())
    }

    fn __repr__(&self) -> PyResult<String> {
        let w = self.w()?;
        Ok(format!(
            "World(name={:?}, rank={}, size={}, generation={}, state={:?})",
            w.name().as_str(),
            w.rank().0,
            w.size(),
            w.generation().0,
            w.state().label()
        ))
    }
}
