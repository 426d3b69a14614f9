//! `Nccl` (the `nccl` feature): the device operations of an NCCL world on
//! the caller's own device memory — torch CUDA tensors, passed from Python
//! as `(data_ptr, dtype name, element count)` — without a copy.
//!
//! Each tensor becomes a [`DeviceBuffer::borrowed`] of the world's
//! communicator: the runtime's NCCL operations read and write the tensor's
//! memory in place and never free it. What makes that sound:
//! - **Alive**: every method takes `keep`, the Python objects that own the
//!   memory (the tensors); `InFlight` holds them until the operation has
//!   completed: in a detached task for a `Work` (cancelling or dropping the
//!   `Work` does not end that task early), or on a blocking caller's own
//!   thread (`wait=True`), which hands them to such a task if it is
//!   interrupted by Ctrl-C. If the operation fails (the world broke, its
//!   deadline passed), a kernel may still touch the memory until the
//!   communicator's abort has returned — or forever, if it is quarantined —
//!   so `keep` is leaked on purpose: those tensors are never freed.
//! - **Ordered**: the Python side orders the world's stream after torch's
//!   current stream before calling (`Nccl.after_stream`: an event recorded
//!   on torch's stream that the world's stream waits for, so the tensors'
//!   producers are done before NCCL reads them), and the operation's `Work`
//!   completes only when the operation has completed on the world's stream,
//!   so torch's later kernels (issued after `wait()`) see the result.
//! - **Right device and size**: the Python side passes only contiguous
//!   tensors on the world's device; lengths and dtypes are checked by the
//!   communicator like those of owned buffers.

#![allow(unsafe_code)]

use multiworld::nccl::DeviceBuffer;
use multiworld::{DeviceOp, NcclWorld, Rank, WorldError, WorldName};
use pyo3::prelude::*;

use crate::{
    errors, runtime, tensor,
    world::{Done, Work, World, finished_work, reduce_op, spawn_work_probed},
};

/// A tensor's device memory as Python describes it: device address, dtype
/// name (`"float32"`, ...) and number of elements.
type Mem = (u64, String, usize);

/// The NCCL side of an NCCL world (see the module docs). Made by
/// `nccl_world`.
#[pyclass(module = "multiworld_rs._native", frozen)]
pub struct Nccl {
    inner: Option<NcclWorld>,
    name: WorldName,
    generation: u64,
}

impl Drop for Nccl {
    fn drop(&mut self) {
        if let Some(n) = self.inner.take() {
            runtime::release(n);
        }
    }
}

/// The NCCL side of `world`: `None` for a world joined with the TCP backend
/// and for a sub-group (whose collectives run over the world's TCP mesh).
/// Raises the world's error if it is broken or gone.
#[pyfunction]
pub fn nccl_world(py: Python<'_>, world: PyRef<'_, World>) -> PyResult<Option<Nccl>> {
    if world.is_group() {
        return Ok(None);
    }
    let w = world.w()?;
    match w.nccl() {
        Ok(n) => Ok(Some(Nccl {
            inner: Some(n),
            name: w.name().clone(),
            generation: w.generation().0,
        })),
        Err(WorldError::InvalidArgument { .. }) => Ok(None),
        Err(e) => Err(errors::world(py, e, world.generation_of())),
    }
}

impl Nccl {
    fn n(&self) -> PyResult<&NcclWorld> {
        self.inner
            .as_ref()
            .ok_or_else(|| pyo3::exceptions::PyRuntimeError::new_err("the NCCL world handle was released"))
    }

    /// Borrows `mems` as buffers of this world, issues `issue` on them (the
    /// GIL released: the enqueue may wait for NCCL) and returns a `Work`
    /// that completes with the operation; `keep` stays alive until then.
    /// With `wait` (a blocking call), this thread waits for the operation
    /// itself, GIL released (polled here: no task, no hand-off between
    /// threads), and the `Work` returned has finished.
    fn run(
        &self,
        py: Python<'_>,
        keep: Vec<Py<PyAny>>,
        mems: Vec<Mem>,
        wait: bool,
        issue: impl FnOnce(&NcclWorld, &mut [DeviceBuffer]) -> Result<DeviceOp, WorldError> + Send,
    ) -> PyResult<Work> {
        let n = self.n()?;
        let mut bufs = Vec::with_capacity(mems.len());
        for (ptr, dtype, len) in mems {
            let dtype = tensor::dtype(&dtype)?;
            // SAFETY: the Python side passes the `data_ptr()` of a contiguous
            // CUDA tensor of `len` elements of `dtype` on this world's device
            // (torch allocates in the device's primary context, which the
            // world's communicator uses), and that tensor is in `keep`, which
            // `InFlight` holds until the operation has completed (or leaks if
            // it failed). The world's stream was ordered after torch's before
            // this call (`after_stream`), and nothing else runs on these
            // tensors until the returned Work has completed (documented
            // caller rule).
            let buf = unsafe { DeviceBuffer::borrowed(n.comm(), ptr, dtype, len) }
                .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
            bufs.push(buf);
        }
        // Ctrl-C stops a check that waits for the other members
        // (`check_device_calls`); the enqueue itself is bounded.
        let issued =
            py.detach(|| runtime::enter(|| multiworld::interruptible(interrupted, || issue(n, &mut bufs))))?;
        if let Some(signal) = PENDING_SIGNAL.with(|s| s.borrow_mut().take()) {
            // A check that the hook interrupted stopped before anything was
            // enqueued: the call failed, and the handler's exception is
            // what it raises.
            if issued.is_err() {
                return Err(signal);
            }
            // Not reached (an interrupted check always fails its call); an
            // enqueued operation keeps its tensors, and Python is asked to
            // raise KeyboardInterrupt at its next check instead.
            // SAFETY: callable from any thread, with or without the GIL.
            unsafe { pyo3::ffi::PyErr_SetInterrupt() };
        }
        let op = match issued {
            Ok(op) => op,
            Err(e) => {
                if may_have_been_enqueued(&e) {
                    // NCCL may have taken the operation before it failed
                    // (its enqueue outlived the deadline, or its completion
                    // event could not be recorded): a kernel may still use
                    // the memory, and there is no handle to wait on, so the
                    // owners are kept for the rest of the process, as for an
                    // operation that failed after its start.
                    std::mem::forget((bufs, keep));
                }
                return Err(errors::world(py, e, Some(self.generation)));
            }
        };
        let in_flight = InFlight(Some((op, bufs, keep)));
        if wait {
            let done = runtime::wait(py, in_flight.wait())?.map(|()| Done::Unit);
            return Ok(finished_work(
                py,
                self.name.to_string(),
                Some(self.generation),
                done,
            ));
        }
        // Cancelling the Work drops its task's `InFlight`, which hands the
        // operation on to a task of its own: `keep` outlives it. A thread in
        // `Work.wait` sees the end itself through the probe.
        let probe = in_flight.0.as_ref().map(|(op, _, _)| op.probe());
        spawn_work_probed(
            self.name.to_string(),
            Some(self.generation),
            async move { in_flight.wait().await.map(|()| Done::Unit) },
            false,
            probe,
        )
    }
}

/// An issued operation on borrowed device memory, the buffers over that
/// memory, and the Python objects that own it (see the module docs):
/// dropped before the operation has completed (a blocking caller
/// interrupted by Ctrl-C), it hands all three to a detached task that
/// waits for the operation, so the memory outlives it.
struct InFlight(Option<(DeviceOp, Vec<DeviceBuffer>, Vec<Py<PyAny>>)>);

impl InFlight {
    /// Waits for the operation, then lets go of the memory (or leaks the
    /// owners, if the operation failed).
    async fn wait(mut self) -> Result<(), WorldError> {
        let done = match self.0.as_mut() {
            Some((op, _, _)) => op.completed().await,
            // Only `Drop` takes the parts out.
            None => Ok(()),
        };
        if let Some((op, bufs, keep)) = self.0.take() {
            let_go(op, bufs, keep, &done);
        }
        done
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let Some((mut op, bufs, keep)) = self.0.take() else {
            return;
        };
        match runtime::runtime() {
            Ok(rt) => {
                rt.spawn(async move {
                    let done = op.completed().await;
                    let_go(op, bufs, keep, &done);
                });
            }
            // No runtime to wait on: the device may use the memory forever.
            Err(_) => std::mem::forget((op, bufs, keep)),
        }
    }
}

thread_local! {
    /// The exception a signal handler raised while a device call's check
    /// waited on this thread ([`interrupted`]), to raise when it returns.
    static PENDING_SIGNAL: std::cell::RefCell<Option<PyErr>> = const { std::cell::RefCell::new(None) };
}

/// The interruption hook of device calls (`multiworld::interruptible`):
/// runs Python's signal handlers (on the main thread) and keeps the
/// exception one raised.
fn interrupted() -> bool {
    Python::attach(|py| match py.check_signals() {
        Ok(()) => false,
        Err(e) => {
            PENDING_SIGNAL.with(|s| *s.borrow_mut() = Some(e));
            true
        }
    })
}

/// Whether an operation whose start failed with `e` may nevertheless be on
/// the device: the errors of a device call that can come after NCCL took the
/// operation (a deadline, a device failure, the world broken by either).
/// Invalid arguments and mismatches are found before anything is enqueued,
/// and so is a transport error, which only the agreement check before the
/// enqueue (`check_device_calls`) can give (a member that left in an
/// orderly way meanwhile).
fn may_have_been_enqueued(e: &WorldError) -> bool {
    !matches!(
        e,
        WorldError::InvalidArgument { .. }
            | WorldError::Mismatch { .. }
            | WorldError::NotJoined { .. }
            | WorldError::Transport { .. }
    )
}

/// The end of an operation's hold on its memory: the buffers and the
/// owners are dropped once it has completed; if it failed, a kernel may
/// still touch the memory until the communicator's abort has returned (or
/// forever, if the world is quarantined), so the owners are leaked on
/// purpose and those tensors are never freed.
fn let_go(op: DeviceOp, bufs: Vec<DeviceBuffer>, keep: Vec<Py<PyAny>>, done: &Result<(), WorldError>) {
    drop(op);
    drop(bufs);
    match done {
        Ok(()) => drop(keep),
        Err(_) => std::mem::forget(keep),
    }
}

/// The buffers an operation was given did not match what it takes (not
/// reachable from the methods below, which pass their own; an error rather
/// than a panic all the same).
fn buffers(world: &WorldName, want: usize, got: usize) -> WorldError {
    WorldError::InvalidArgument {
        world: world.clone(),
        detail: format!("expected {want} device buffers, got {got}"),
    }
}

impl Nccl {
    /// [`run`](Self::run) on one buffer.
    fn run1(
        &self,
        py: Python<'_>,
        keep: Vec<Py<PyAny>>,
        buf: Mem,
        wait: bool,
        issue: impl FnOnce(&NcclWorld, &mut DeviceBuffer) -> Result<DeviceOp, WorldError> + Send,
    ) -> PyResult<Work> {
        let name = self.name.clone();
        self.run(py, keep, vec![buf], wait, move |n, b| match b {
            [b] => issue(n, b),
            _ => Err(buffers(&name, 1, b.len())),
        })
    }

    /// [`run`](Self::run) on a send and a receive buffer.
    fn run2(
        &self,
        py: Python<'_>,
        keep: Vec<Py<PyAny>>,
        send: Mem,
        recv: Mem,
        wait: bool,
        issue: impl FnOnce(&NcclWorld, &DeviceBuffer, &mut DeviceBuffer) -> Result<DeviceOp, WorldError> + Send,
    ) -> PyResult<Work> {
        let name = self.name.clone();
        self.run(py, keep, vec![send, recv], wait, move |n, b| match b {
            [s, r] => issue(n, s, r),
            _ => Err(buffers(&name, 2, b.len())),
        })
    }
}

#[pymethods]
impl Nccl {
    /// The CUDA device ordinal of the world's communicator.
    #[getter]
    fn device(&self) -> PyResult<usize> {
        Ok(self.n()?.comm().device())
    }

    /// Orders this world's next operations behind everything enqueued so
    /// far on `stream`, on the device (an event recorded there that the
    /// world's stream waits for): the host does not wait. `stream` is a raw
    /// CUDA stream handle; the package passes torch's current stream on the
    /// world's device (`cuda_stream`, 0 for the legacy default stream).
    fn after_stream(&self, py: Python<'_>, stream: usize) -> PyResult<()> {
        let n = self.n()?;
        // SAFETY: the package passes `torch.cuda.current_stream(d).cuda_stream`
        // for this world's device `d` (the tensors were checked to be on it):
        // a live stream of that device's primary context, where the world's
        // communicator lives too, or 0, the legacy default stream.
        py.detach(|| unsafe { n.comm().order_after_stream(stream) })
            .map_err(|e| pyo3::exceptions::PyRuntimeError::new_err(e.to_string()))
    }

    /// In-place all-reduce of `buf`.
    #[pyo3(signature = (buf, op, keep, wait=false))]
    fn all_reduce(
        &self,
        py: Python<'_>,
        buf: Mem,
        op: &str,
        keep: Vec<Py<PyAny>>,
        wait: bool,
    ) -> PyResult<Work> {
        let op = reduce_op(op)?;
        self.run1(py, keep, buf, wait, move |n, b| n.all_reduce(b, op))
    }

    /// In-place broadcast of `root`'s `buf`.
    #[pyo3(signature = (buf, root, keep, wait=false))]
    fn broadcast(
        &self,
        py: Python<'_>,
        buf: Mem,
        root: u32,
        keep: Vec<Py<PyAny>>,
        wait: bool,
    ) -> PyResult<Work> {
        self.run1(py, keep, buf, wait, move |n, b| n.broadcast(b, Rank(root)))
    }

    /// In-place reduce into `root`'s `buf`.
    #[pyo3(signature = (buf, root, op, keep, wait=false))]
    fn reduce(
        &self,
        py: Python<'_>,
        buf: Mem,
        root: u32,
        op: &str,
        keep: Vec<Py<PyAny>>,
        wait: bool,
    ) -> PyResult<Work> {
        let op = reduce_op(op)?;
        self.run1(py, keep, buf, wait, move |n, b| n.reduce(b, op, Rank(root)))
    }

    /// All-gather of every rank's `send` into `recv` (rank order).
    #[pyo3(signature = (send, recv, keep, wait=false))]
    fn all_gather(
        &self,
        py: Python<'_>,
        send: Mem,
        recv: Mem,
        keep: Vec<Py<PyAny>>,
        wait: bool,
    ) -> PyResult<Work> {
        self.run2(py, keep, send, recv, wait, |n, s, r| n.all_gather(s, r))
    }

    /// Reduce-scatter of every rank's `send`; this rank's slice into `recv`.
    #[pyo3(signature = (send, recv, op, keep, wait=false))]
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        send: Mem,
        recv: Mem,
        op: &str,
        keep: Vec<Py<PyAny>>,
        wait: bool,
    ) -> PyResult<Work> {
        let op = reduce_op(op)?;
        self.run2(py, keep, send, recv, wait, move |n, s, r| {
            n.reduce_scatter(s, r, op)
        })
    }

    /// All-to-all with equal slices of `send` and `recv`.
    #[pyo3(signature = (send, recv, keep, wait=false))]
    fn all_to_all(
        &self,
        py: Python<'_>,
        send: Mem,
        recv: Mem,
        keep: Vec<Py<PyAny>>,
        wait: bool,
    ) -> PyResult<Work> {
        self.run2(py, keep, send, recv, wait, |n, s, r| n.all_to_all(s, r))
    }

    /// Gather of every rank's `send` into `recv` on `root` (rank order;
    /// `recv` is `None` on the other ranks, and ignored there).
    #[pyo3(signature = (send, recv, root, keep, wait=false))]
    fn gather(
        &self,
        py: Python<'_>,
        send: Mem,
        recv: Option<Mem>,
        root: u32,
        keep: Vec<Py<PyAny>>,
        wait: bool,
    ) -> PyResult<Work> {
        match recv {
            Some(recv) => self.run2(py, keep, send, recv, wait, move |n, s, r| {
                n.gather(s, Some(r), Rank(root))
            }),
            None => self.run1(py, keep, send, wait, move |n, s| n.gather(s, None, Rank(root))),
        }
    }

    /// Scatter of `root`'s `send` (one equal slice per rank, in rank order;
    /// `None` on the other ranks) into every rank's `recv`.
    #[pyo3(signature = (send, recv, root, keep, wait=false))]
    fn scatter(
        &self,
        py: Python<'_>,
        send: Option<Mem>,
        recv: Mem,
        root: u32,
        keep: Vec<Py<PyAny>>,
        wait: bool,
    ) -> PyResult<Work> {
        match send {
            Some(send) => self.run2(py, keep, send, recv, wait, move |n, s, r| {
                n.scatter(Some(s), r, Rank(root))
            }),
            None => self.run1(py, keep, recv, wait, move |n, r| n.scatter(None, r, Rank(root))),
        }
    }

    /// Sends `buf` to `peer`.
    #[pyo3(signature = (buf, peer, keep, wait=false))]
    fn send(&self, py: Python<'_>, buf: Mem, peer: u32, keep: Vec<Py<PyAny>>, wait: bool) -> PyResult<Work> {
        self.run1(py, keep, buf, wait, move |n, b| n.send(b, Rank(peer)))
    }

    /// Receives into `buf` from `peer`.
    #[pyo3(signature = (buf, peer, keep, wait=false))]
    fn recv(&self, py: Python<'_>, buf: Mem, peer: u32, keep: Vec<Py<PyAny>>, wait: bool) -> PyResult<Work> {
        self.run1(py, keep, buf, wait, move |n, b| n.recv(b, Rank(peer)))
    }

    /// A barrier on the device (an all-reduce of one element).
    #[pyo3(signature = (wait=false))]
    fn barrier(&self, py: Python<'_>, wait: bool) -> PyResult<Work> {
        self.run(py, Vec::new(), Vec::new(), wait, |n, _| n.barrier())
    }
}
