//! The operations of a world's communicator: each validates its buffers
//! (same world, dtypes, lengths, ranks), maps dtype and reduce op to NCCL,
//! and issues through [`NcclComm::issue`], which enqueues on the world's
//! stream and returns an [`OpHandle`]. Gather, scatter and all-to-all are
//! grouped `ncclSend`/`ncclRecv` (self included); barrier is a one-element
//! all-reduce.

#![allow(unsafe_code)]

use std::ffi::{c_int, c_void};
use std::sync::Arc;
use std::time::Instant;

use crate::buffer::DeviceBuffer;
use crate::comm::{NcclComm, lock, to_int};
use multiworld_types::{DType, ReduceOp};

use crate::dtype::{NcclDataType, NcclRedOp, nccl_reduction, wire_type};
use crate::error::NcclError;
use crate::ffi::{CuDevicePtr, CuStream, RawComm};
use crate::handle::OpHandle;
use crate::runtime::NcclRuntime;

impl NcclComm {
    /// Issues one operation: checks the state, enqueues under the gate,
    /// polls the non-blocking communicator until the enqueue completes
    /// (`op_timeout`), then records a completion event.
    pub(crate) fn issue(
        &self,
        op: &'static str,
        call: &'static str,
        enqueue: impl FnOnce(&NcclRuntime, RawComm, CuStream) -> Result<(), NcclError>,
    ) -> Result<OpHandle, NcclError> {
        let sh = &self.shared;
        let _issue = lock(&sh.issue);
        sh.ensure_live(op)?;
        let budget = sh.config.op_timeout;
        let issued_at = Instant::now();
        let deadline = issued_at + budget;
        sh.dev.bind()?;
        let stream = sh.dev.stream();
        sh.with_comm(op, |comm| enqueue(&sh.rt, comm, stream))?
            .map_err(|e| sh.fail(e))?;
        sh.wait_ready(call, deadline, budget)?;
        // The operation is enqueued: any failure from here on leaves it in
        // flight with no handle, and the members' sequences of operations
        // out of step, so it fails the communicator whatever its kind.
        let event = sh.dev.record_event().map_err(|e| sh.fail_async(e))?;
        Ok(OpHandle::new(Arc::clone(sh), event, op, issued_at, budget))
    }

    fn check_owned(&self, what: &str, b: &DeviceBuffer) -> Result<(), NcclError> {
        if b.world_id() != self.shared.dev.id() {
            return Err(NcclError::invalid(format!(
                "{what} buffer was allocated by another communicator (buffers belong to one world)"
            )));
        }
        Ok(())
    }

    fn check_pair(
        &self,
        op: &str,
        send: &DeviceBuffer,
        recv: &DeviceBuffer,
        recv_len: usize,
    ) -> Result<(), NcclError> {
        self.check_owned("send", send)?;
        self.check_owned("recv", recv)?;
        if send.dtype() != recv.dtype() {
            return Err(NcclError::invalid(format!(
                "{op}: send is {} but recv is {}",
                send.dtype(),
                recv.dtype()
            )));
        }
        if recv.len() != recv_len {
            return Err(NcclError::invalid(format!(
                "{op}: recv holds {} elements, expected {recv_len}",
                recv.len()
            )));
        }
        Ok(())
    }

    fn check_rank(&self, what: &str, r: usize) -> Result<c_int, NcclError> {
        if r >= self.size() {
            return Err(NcclError::invalid(format!(
                "{what} {r} is out of range for size {}",
                self.size()
            )));
        }
        to_int(what, r)
    }

    fn len_times_size(&self, op: &str, len: usize) -> Result<usize, NcclError> {
        len.checked_mul(self.size())
            .ok_or_else(|| NcclError::invalid(format!("{op}: {len} x {} overflows", self.size())))
    }

    /// `recv = reduce(op, send over all ranks)` (`ncclAllReduce`). `send` and
    /// `recv` have the same dtype and length.
    pub fn all_reduce(
        &self,
        send: &DeviceBuffer,
        recv: &mut DeviceBuffer,
        op: ReduceOp,
    ) -> Result<OpHandle, NcclError> {
        self.check_pair("all_reduce", send, recv, send.len())?;
        let (t, red) = nccl_reduction(send.dtype(), op, self.version())?;
        self.enqueue_all_reduce(send.ptr(), recv.ptr(), send.len(), t.code(), red)
    }

    /// In-place [`all_reduce`](Self::all_reduce).
    pub fn all_reduce_in_place(&self, buf: &mut DeviceBuffer, op: ReduceOp) -> Result<OpHandle, NcclError> {
        self.check_owned("buf", buf)?;
        let (t, red) = nccl_reduction(buf.dtype(), op, self.version())?;
        self.enqueue_all_reduce(buf.ptr(), buf.ptr(), buf.len(), t.code(), red)
    }

    fn enqueue_all_reduce(
        &self,
        s: CuDevicePtr,
        r: CuDevicePtr,
        n: usize,
        t: c_int,
        red: NcclRedOp,
    ) -> Result<OpHandle, NcclError> {
        self.issue("all_reduce", "ncclAllReduce", move |rt, comm, stream| {
            if n == 0 {
                return Ok(());
            }
            // SAFETY: both pointers address `n` elements of this world's
            // memory (checked by the callers); the kernel is ordered on the
            // world's stream, before any later access or free of the buffers.
            let rc = unsafe { (rt.nccl().all_reduce)(cptr(s), mptr(r), n, t, red.code(), comm, stream) };
            rt.nccl_check("ncclAllReduce", rc, Some(comm))
        })
    }

    /// Broadcasts `buf` from `root` to every rank, in place (`ncclBroadcast`).
    pub fn broadcast(&self, buf: &mut DeviceBuffer, root: usize) -> Result<OpHandle, NcclError> {
        self.check_owned("buf", buf)?;
        let root = self.check_rank("root", root)?;
        let (t, n) = wire_type(buf.dtype(), buf.len(), self.version())?;
        self.enqueue_broadcast(buf.ptr(), buf.ptr(), t, n, root)
    }

    /// Out-of-place broadcast (`ncclBroadcast`): every rank's `recv` (the
    /// root's included) gets the root's `send`. `send` is required on
    /// `root`, with `recv`'s dtype and length, and ignored elsewhere.
    pub fn broadcast_into(
        &self,
        send: Option<&DeviceBuffer>,
        recv: &mut DeviceBuffer,
        root: usize,
    ) -> Result<OpHandle, NcclError> {
        self.check_owned("recv", recv)?;
        let root_int = self.check_rank("root", root)?;
        let s = if self.rank() == root {
            let Some(send) = send else {
                return Err(NcclError::invalid("broadcast: the root must pass a send buffer"));
            };
            self.check_pair("broadcast", send, recv, send.len())?;
            send.ptr()
        } else {
            // NCCL reads the send buffer on the root only.
            recv.ptr()
        };
        let (t, n) = wire_type(recv.dtype(), recv.len(), self.version())?;
        self.enqueue_broadcast(s, recv.ptr(), t, n, root_int)
    }

    fn enqueue_broadcast(
        &self,
        s: CuDevicePtr,
        r: CuDevicePtr,
        t: NcclDataType,
        n: usize,
        root: c_int,
    ) -> Result<OpHandle, NcclError> {
        self.issue("broadcast", "ncclBroadcast", move |rt, comm, stream| {
            if n == 0 {
                return Ok(());
            }
            // SAFETY: as in all_reduce; `n` is the wire count of both
            // buffers (checked by the callers).
            let rc = unsafe { (rt.nccl().broadcast)(cptr(s), mptr(r), n, t.code(), root, comm, stream) };
            rt.nccl_check("ncclBroadcast", rc, Some(comm))
        })
    }

    /// Reduces `send` over all ranks into `recv` on `root` (`ncclReduce`);
    /// `recv` is left untouched on other ranks. Same dtype and length.
    pub fn reduce(
        &self,
        send: &DeviceBuffer,
        recv: &mut DeviceBuffer,
        op: ReduceOp,
        root: usize,
    ) -> Result<OpHandle, NcclError> {
        self.check_pair("reduce", send, recv, send.len())?;
        let root = self.check_rank("root", root)?;
        let (t, red) = nccl_reduction(send.dtype(), op, self.version())?;
        self.enqueue_reduce(send.ptr(), recv.ptr(), send.len(), t.code(), red, root)
    }

    /// In-place [`reduce`](Self::reduce): the result lands in `buf` on `root`.
    pub fn reduce_in_place(
        &self,
        buf: &mut DeviceBuffer,
        op: ReduceOp,
        root: usize,
    ) -> Result<OpHandle, NcclError> {
        self.check_owned("buf", buf)?;
        let root = self.check_rank("root", root)?;
        let (t, red) = nccl_reduction(buf.dtype(), op, self.version())?;
        self.enqueue_reduce(buf.ptr(), buf.ptr(), buf.len(), t.code(), red, root)
    }

    fn enqueue_reduce(
        &self,
        s: CuDevicePtr,
        r: CuDevicePtr,
        n: usize,
        t: c_int,
        red: NcclRedOp,
        root: c_int,
    ) -> Result<OpHandle, NcclError> {
        self.issue("reduce", "ncclReduce", move |rt, comm, stream| {
            if n == 0 {
                return Ok(());
            }
            // SAFETY: as in all_reduce.
            let rc = unsafe { (rt.nccl().reduce)(cptr(s), mptr(r), n, t, red.code(), root, comm, stream) };
            rt.nccl_check("ncclReduce", rc, Some(comm))
        })
    }

    /// Gathers every rank's `send` into `recv`, rank `i`'s block at
    /// `i * send.len()` (`ncclAllGather`). `recv.len() == send.len() * size`.
    pub fn all_gather(&self, send: &DeviceBuffer, recv: &mut DeviceBuffer) -> Result<OpHandle, NcclError> {
        let want = self.len_times_size("all_gather", send.len())?;
        self.check_pair("all_gather", send, recv, want)?;
        let (t, n) = wire_type(send.dtype(), send.len(), self.version())?;
        let (s, r) = (send.ptr(), recv.ptr());
        self.issue("all_gather", "ncclAllGather", move |rt, comm, stream| {
            if n == 0 {
                return Ok(());
            }
            // SAFETY: `send` holds `n` wire elements and `recv` `n * size`
            // (checked); ordering as in all_reduce.
            let rc = unsafe { (rt.nccl().all_gather)(cptr(s), mptr(r), n, t.code(), comm, stream) };
            rt.nccl_check("ncclAllGather", rc, Some(comm))
        })
    }

    /// Reduces `send` over all ranks and leaves block `rank` of the result in
    /// `recv` (`ncclReduceScatter`). `send.len() == recv.len() * size`.
    pub fn reduce_scatter(
        &self,
        send: &DeviceBuffer,
        recv: &mut DeviceBuffer,
        op: ReduceOp,
    ) -> Result<OpHandle, NcclError> {
        self.check_owned("send", send)?;
        let want = self.len_times_size("reduce_scatter", recv.len())?;
        if send.len() != want {
            return Err(NcclError::invalid(format!(
                "reduce_scatter: send holds {} elements, expected recv.len() * size = {want}",
                send.len()
            )));
        }
        self.check_pair("reduce_scatter", send, recv, recv.len())?;
        let (t, red) = nccl_reduction(send.dtype(), op, self.version())?;
        let (s, r, n) = (send.ptr(), recv.ptr(), recv.len());
        self.issue("reduce_scatter", "ncclReduceScatter", move |rt, comm, stream| {
            if n == 0 {
                return Ok(());
            }
            // SAFETY: `recv` holds `n` elements and `send` `n * size`
            // (checked); ordering as in all_reduce.
            let rc = unsafe {
                (rt.nccl().reduce_scatter)(cptr(s), mptr(r), n, t.code(), red.code(), comm, stream)
            };
            rt.nccl_check("ncclReduceScatter", rc, Some(comm))
        })
    }

    /// The checks [`NcclComm::send`] and [`NcclComm::recv`] make before
    /// anything is enqueued (the buffer is this communicator's, the peer a
    /// rank, the dtype one NCCL carries), made alone: a caller that tells
    /// the peer about a message before enqueueing it learns here whether
    /// the enqueue would refuse its arguments.
    pub fn check_p2p(&self, buf: &DeviceBuffer, peer: usize) -> Result<(), NcclError> {
        self.p2p_args(buf, peer).map(drop)
    }

    fn p2p_args(&self, buf: &DeviceBuffer, peer: usize) -> Result<(c_int, NcclDataType, usize), NcclError> {
        self.check_owned("buf", buf)?;
        let peer = self.check_rank("peer", peer)?;
        let (t, n) = wire_type(buf.dtype(), buf.len(), self.version())?;
        Ok((peer, t, n))
    }

    /// Sends `buf` to `peer` (`ncclSend`); `peer` must post a matching
    /// [`recv`](Self::recv).
    pub fn send(&self, buf: &DeviceBuffer, peer: usize) -> Result<OpHandle, NcclError> {
        let (peer, t, n) = self.p2p_args(buf, peer)?;
        let p = buf.ptr();
        self.issue("send", "ncclSend", move |rt, comm, stream| {
            if n == 0 {
                return Ok(());
            }
            // SAFETY: `buf` holds `n` wire elements; ordering as in
            // all_reduce.
            let rc = unsafe { (rt.nccl().send)(cptr(p), n, t.code(), peer, comm, stream) };
            rt.nccl_check("ncclSend", rc, Some(comm))
        })
    }

    /// Receives into `buf` from `peer` (`ncclRecv`).
    pub fn recv(&self, buf: &mut DeviceBuffer, peer: usize) -> Result<OpHandle, NcclError> {
        let (peer, t, n) = self.p2p_args(buf, peer)?;
        let p = buf.ptr();
        self.issue("recv", "ncclRecv", move |rt, comm, stream| {
            if n == 0 {
                return Ok(());
            }
            // SAFETY: `buf` holds `n` wire elements; ordering as in
            // all_reduce.
            let rc = unsafe { (rt.nccl().recv)(mptr(p), n, t.code(), peer, comm, stream) };
            rt.nccl_check("ncclRecv", rc, Some(comm))
        })
    }

    /// All-to-all with equal splits: block `j` of `send` goes to rank `j`,
    /// block `i` of `recv` comes from rank `i`. Same dtype and length, a
    /// multiple of `size`. Grouped `ncclSend`/`ncclRecv` (self included).
    pub fn all_to_all(&self, send: &DeviceBuffer, recv: &mut DeviceBuffer) -> Result<OpHandle, NcclError> {
        self.check_pair("all_to_all", send, recv, send.len())?;
        if send.len() % self.size() != 0 {
            return Err(NcclError::invalid(format!(
                "all_to_all: length {} is not a multiple of size {}",
                send.len(),
                self.size()
            )));
        }
        let counts = vec![send.len() / self.size(); self.size()];
        self.all_to_all_uneven(send, &counts, recv, &counts)
    }

    /// All-to-all with uneven splits: `send_counts[j]` elements (consecutive
    /// in `send`) go to rank `j`; `recv_counts[i]` elements arrive from rank
    /// `i`, consecutive in `recv`. Counts must add up to the buffer lengths
    /// and match the peers' counts.
    pub fn all_to_all_uneven(
        &self,
        send: &DeviceBuffer,
        send_counts: &[usize],
        recv: &mut DeviceBuffer,
        recv_counts: &[usize],
    ) -> Result<OpHandle, NcclError> {
        self.check_owned("send", send)?;
        self.check_owned("recv", recv)?;
        if send.dtype() != recv.dtype() {
            return Err(NcclError::invalid(format!(
                "all_to_all: send is {} but recv is {}",
                send.dtype(),
                recv.dtype()
            )));
        }
        let sends = self.split("all_to_all send", send, send_counts)?;
        let recvs = self.split("all_to_all recv", recv, recv_counts)?;
        let plan: Vec<P2p> = sends
            .into_iter()
            .enumerate()
            .map(|(peer, (ptr, n))| P2p::Send { ptr, n, peer })
            .chain(
                recvs
                    .into_iter()
                    .enumerate()
                    .map(|(peer, (ptr, n))| P2p::Recv { ptr, n, peer }),
            )
            .collect();
        self.grouped("all_to_all", plan)
    }

    /// Gathers every rank's `send` on `root`: block `i` of `recv` comes from
    /// rank `i` (`recv.len() == send.len() * size`). `recv` is required on
    /// `root` and ignored elsewhere. Grouped send/recv.
    pub fn gather(
        &self,
        send: &DeviceBuffer,
        recv: Option<&mut DeviceBuffer>,
        root: usize,
    ) -> Result<OpHandle, NcclError> {
        self.check_owned("send", send)?;
        self.check_rank("root", root)?;
        let (t, n) = wire_type(send.dtype(), send.len(), self.version())?;
        let mut plan = vec![P2p::Send {
            ptr: send.ptr(),
            n: (t, n),
            peer: root,
        }];
        if self.rank() == root {
            let Some(recv) = recv else {
                return Err(NcclError::invalid("gather: the root must pass a recv buffer"));
            };
            let want = self.len_times_size("gather", send.len())?;
            self.check_pair("gather", send, recv, want)?;
            let counts = vec![send.len(); self.size()];
            for (peer, (ptr, n)) in self.split("gather recv", recv, &counts)?.into_iter().enumerate() {
                plan.push(P2p::Recv { ptr, n, peer });
            }
        }
        self.grouped("gather", plan)
    }

    /// Scatters block `i` of `send` (on `root`) to rank `i`'s `recv`
    /// (`send.len() == recv.len() * size`). `send` is required on `root` and
    /// ignored elsewhere. Grouped send/recv.
    pub fn scatter(
        &self,
        send: Option<&DeviceBuffer>,
        recv: &mut DeviceBuffer,
        root: usize,
    ) -> Result<OpHandle, NcclError> {
        self.check_owned("recv", recv)?;
        self.check_rank("root", root)?;
        let mut plan = Vec::new();
        if self.rank() == root {
            let Some(send) = send else {
                return Err(NcclError::invalid("scatter: the root must pass a send buffer"));
            };
            self.check_owned("send", send)?;
            let want = self.len_times_size("scatter", recv.len())?;
            if send.len() != want || send.dtype() != recv.dtype() {
                return Err(NcclError::invalid(format!(
                    "scatter: send is {} x {} but recv.len() * size = {want} x {} is needed",
                    send.len(),
                    send.dtype(),
                    recv.dtype()
                )));
            }
            let counts = vec![recv.len(); self.size()];
            for (peer, (ptr, n)) in self.split("scatter send", send, &counts)?.into_iter().enumerate() {
                plan.push(P2p::Send { ptr, n, peer });
            }
        }
        let wire = wire_type(recv.dtype(), recv.len(), self.version())?;
        plan.push(P2p::Recv {
            ptr: recv.ptr(),
            n: wire,
            peer: root,
        });
        self.grouped("scatter", plan)
    }

    /// Completes once every rank has reached it: an all-reduce of one `i32`
    /// on a scratch buffer (NCCL has no barrier). Wait on the handle.
    pub fn barrier(&self) -> Result<OpHandle, NcclError> {
        let p = self.shared.scratch.ptr();
        let (t, red) = nccl_reduction(DType::I32, ReduceOp::Sum, self.version())?;
        self.issue("barrier", "ncclAllReduce", move |rt, comm, stream| {
            // SAFETY: the scratch buffer holds one i32 of this world and
            // lives as long as the communicator.
            let rc =
                unsafe { (rt.nccl().all_reduce)(cptr(p), mptr(p), 1, t.code(), red.code(), comm, stream) };
            rt.nccl_check("ncclAllReduce", rc, Some(comm))
        })
    }

    /// Splits `buf` into consecutive blocks of `counts` elements: the device
    /// address and wire type/count of each.
    fn split(
        &self,
        what: &str,
        buf: &DeviceBuffer,
        counts: &[usize],
    ) -> Result<Vec<(CuDevicePtr, Wire)>, NcclError> {
        if counts.len() != self.size() {
            return Err(NcclError::invalid(format!(
                "{what}: {} counts for a world of {}",
                counts.len(),
                self.size()
            )));
        }
        let total = counts
            .iter()
            .try_fold(0usize, |acc, c| acc.checked_add(*c))
            .ok_or_else(|| NcclError::invalid(format!("{what}: counts overflow")))?;
        if total != buf.len() {
            return Err(NcclError::invalid(format!(
                "{what}: counts add up to {total} but the buffer holds {}",
                buf.len()
            )));
        }
        let elem = buf.dtype().size();
        let mut offset = 0usize;
        let mut out = Vec::with_capacity(counts.len());
        for &c in counts {
            let wire = wire_type(buf.dtype(), c, self.version())?;
            // `offset * elem <= byte_len`, which fits (the buffer exists).
            out.push((buf.ptr() + (offset * elem) as u64, wire));
            offset += c;
        }
        Ok(out)
    }

    /// Runs a plan of sends and receives as one NCCL group. Zero-length
    /// transfers are skipped (peers skip them too, since counts must match).
    fn grouped(&self, op: &'static str, plan: Vec<P2p>) -> Result<OpHandle, NcclError> {
        for p in &plan {
            self.check_rank("peer", p.peer())?;
        }
        self.issue(op, "ncclGroupEnd", move |rt, comm, stream| {
            let api = rt.nccl();
            // SAFETY: group calls only record state for this thread.
            rt.nccl_check("ncclGroupStart", unsafe { (api.group_start)() }, Some(comm))?;
            let mut first_err = None;
            for p in plan {
                let r = match p {
                    P2p::Send { ptr, n: (t, n), peer } if n > 0 => {
                        // SAFETY: `ptr` addresses `n` wire elements inside a
                        // buffer of this world (from `split`); ordering as in
                        // all_reduce. `peer` fits an int (checked).
                        let rc = unsafe { (api.send)(cptr(ptr), n, t.code(), peer as c_int, comm, stream) };
                        rt.nccl_check("ncclSend", rc, Some(comm))
                    }
                    P2p::Recv { ptr, n: (t, n), peer } if n > 0 => {
                        // SAFETY: as for the send.
                        let rc = unsafe { (api.recv)(mptr(ptr), n, t.code(), peer as c_int, comm, stream) };
                        rt.nccl_check("ncclRecv", rc, Some(comm))
                    }
                    _ => Ok(()),
                };
                if let Err(e) = r {
                    first_err = Some(e);
                    break;
                }
            }
            // Always close the group (NCCL discards a group whose calls
            // failed), then report the first error.
            // SAFETY: closes the group opened above on this thread.
            let end = rt.nccl_check("ncclGroupEnd", unsafe { (api.group_end)() }, Some(comm));
            match first_err {
                Some(e) => Err(e),
                None => end,
            }
        })
    }
}

/// An NCCL type and element count on the wire.
type Wire = (NcclDataType, usize);

/// One point-to-point transfer of a grouped operation.
enum P2p {
    Send { ptr: CuDevicePtr, n: Wire, peer: usize },
    Recv { ptr: CuDevicePtr, n: Wire, peer: usize },
}

impl P2p {
    fn peer(&self) -> usize {
        match self {
            P2p::Send { peer, .. } | P2p::Recv { peer, .. } => *peer,
        }
    }
}

fn cptr(p: CuDevicePtr) -> *const c_void {
    p as usize as *const c_void
}

fn mptr(p: CuDevicePtr) -> *mut c_void {
    p as usize as *mut c_void
}
