//! The tensor collectives of [`Group`], each as a blocking-style `async fn` and a
//! `*_handle` form. Every call follows the life cycle described in `group.rs`:
//! turn, local validation (an invalid call fails before any tensor data is sent),
//! agreement, then the algorithm from `algo.rs` under the member-loss guard.

use crate::algo::{self, to_peers};
use crate::desc::{Algo, Kind};
use crate::group::{Group, Ticket, finish_sends};
use crate::handle::CollectiveHandle;
use crate::shm;
use crate::util::{even_segments, segments_of, view_range};
use multiworld_tcp::{Error, Result};
use multiworld_types::Rank;
use multiworld_types::{DType, Tensor, TensorView};
use multiworld_types::{ReduceOp, with_type};

/// A tensor's dtype and shape, to put back if a failed call left it emptied (a
/// receive cancelled while its message was arriving takes the buffer).
struct Shape(DType, Vec<usize>);

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

    fn of_all(ts: &[Tensor]) -> Vec<Shape> {
        ts.iter().map(Shape::of).collect()
    }

    fn restore_all(shapes: &[Shape], ts: &mut [Tensor]) {
        for (s, t) in shapes.iter().zip(ts) {
            s.restore(t);
        }
    }
}

/// The op must be defined for the dtype.
fn check_op(op: ReduceOp, dtype: DType) -> Result<()> {
    if op.supports(dtype) {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "reduce op {op} is not defined for {dtype} (avg: floating-point dtypes only; band/bor/bxor: integer and bool dtypes only)"
        )))
    }
}

fn check_dtype(what: &str, got: DType, want: DType) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(Error::invalid(format!("{what} holds {got}, expected {want}")))
    }
}

fn check_len(what: &str, got: usize, want: usize) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "{what} has {got} elements, expected {want}"
        )))
    }
}

impl Group {
    /// The member index of world rank `root`.
    pub(crate) fn root_index(&self, root: Rank) -> Result<usize> {
        self.index_of(root).ok_or_else(|| {
            Error::invalid(format!(
                "root rank {root} is not a member of group {} ({:?})",
                self.id(),
                self.ranks()
            ))
        })
    }

    // ---------------------------------------------------------------- barrier

    /// Waits until every member has called `barrier` (one round of small messages).
    pub async fn barrier(&self) -> Result<()> {
        self.barrier_in(self.ticket()).await
    }

    /// Handle form of [`Group::barrier`].
    pub fn barrier_handle(&self) -> CollectiveHandle<()> {
        let (ticket, g) = (self.ticket(), self.clone());
        Group::spawn(async move { g.barrier_in(ticket).await })
    }

    async fn barrier_in(&self, ticket: Ticket) -> Result<()> {
        let call = self.begin(ticket, Kind::Barrier).await?;
        let mut d = call.desc();
        call.plan(&mut d, 0, 0);
        let cx = call.ctx();
        call.guard(async {
            let (_, sends) = cx.exchange(&d, &[]).await?;
            finish_sends(sends).await
        })
        .await
    }

    // -------------------------------------------------------------- broadcast

    /// Copies `root`'s `tensor` into every member's `tensor` (same dtype and
    /// element count everywhere).
    pub async fn broadcast(&self, tensor: &mut Tensor, root: Rank) -> Result<()> {
        self.broadcast_in(self.ticket(), tensor, root).await
    }

    /// Handle form of [`Group::broadcast`]; yields the tensor.
    pub fn broadcast_handle(&self, mut tensor: Tensor, root: Rank) -> CollectiveHandle<Tensor> {
        let (ticket, g) = (self.ticket(), self.clone());
        Group::spawn(async move { g.broadcast_in(ticket, &mut tensor, root).await.map(|()| tensor) })
    }

    async fn broadcast_in(&self, ticket: Ticket, t: &mut Tensor, root: Rank) -> Result<()> {
        let kind = Kind::Broadcast;
        let mut call = self.begin(ticket, kind).await?;
        let mut d = call.desc();
        d.dtype = Some(t.dtype());
        d.root = Some(root);
        d.count = t.numel() as u64;
        let root_i = match self.root_index(root) {
            Ok(i) => i,
            Err(e) => return Err(call.abstain(e.in_op(kind))),
        };
        let cx = call.ctx();
        let bytes = t.nbytes() as u64;
        let peers = (cx.n() - 1) as u64;
        call.plan(&mut d, bytes, if cx.me == root_i { bytes * peers } else { 0 });
        let mut sc = call.take_scratch();
        let shape = Shape::of(t);
        let r = call
            .guard(async {
                let payloads = if cx.me == root_i {
                    to_peers(cx, t.view())
                } else {
                    Vec::new()
                };
                let (_, sends) = cx.exchange(&d, &payloads).await?;
                drop(payloads);
                algo::broadcast(cx, &mut sc, t, root_i, &d).await?;
                finish_sends(sends).await
            })
            .await;
        call.put_scratch(sc);
        if r.is_err() {
            shape.restore(t);
        }
        r
    }

    // ------------------------------------------------------ reduce/all_reduce

    /// Reduces every member's `tensor` with `op` into `root`'s `tensor`; the other
    /// members' tensors are not modified.
    pub async fn reduce(&self, tensor: &mut Tensor, root: Rank, op: ReduceOp) -> Result<()> {
        self.reduce_in(self.ticket(), tensor, Some(root), op).await
    }

    /// Handle form of [`Group::reduce`]; yields the tensor.
    pub fn reduce_handle(&self, mut tensor: Tensor, root: Rank, op: ReduceOp) -> CollectiveHandle<Tensor> {
        let (ticket, g) = (self.ticket(), self.clone());
        Group::spawn(async move {
            g.reduce_in(ticket, &mut tensor, Some(root), op)
                .await
                .map(|()| tensor)
        })
    }

    /// Reduces every member's `tensor` with `op`; every member gets the result in
    /// `tensor`.
    pub async fn all_reduce(&self, tensor: &mut Tensor, op: ReduceOp) -> Result<()> {
        self.reduce_in(self.ticket(), tensor, None, op).await
    }

    /// Handle form of [`Group::all_reduce`]; yields the tensor.
    pub fn all_reduce_handle(&self, mut tensor: Tensor, op: ReduceOp) -> CollectiveHandle<Tensor> {
        let (ticket, g) = (self.ticket(), self.clone());
        Group::spawn(async move { g.reduce_in(ticket, &mut tensor, None, op).await.map(|()| tensor) })
    }

    /// Reduce (`root: Some`) or all-reduce (`None`).
    async fn reduce_in(
        &self,
        ticket: Ticket,
        t: &mut Tensor,
        root: Option<Rank>,
        op: ReduceOp,
    ) -> Result<()> {
        let kind = if root.is_some() {
            Kind::Reduce
        } else {
            Kind::AllReduce
        };
        let mut call = self.begin(ticket, kind).await?;
        let mut d = call.desc();
        d.dtype = Some(t.dtype());
        d.root = root;
        d.op = Some(op);
        d.count = t.numel() as u64;
        let root_i = match root.map(|r| self.root_index(r)).transpose() {
            Ok(i) => i,
            Err(e) => return Err(call.abstain(e.in_op(kind))),
        };
        if let Err(e) = check_op(op, t.dtype()) {
            return Err(call.abstain(e.in_op(kind)));
        }
        let cx = call.ctx();
        let bytes = t.nbytes() as u64;
        let send_bytes = match root_i {
            None => bytes * (cx.n() as u64 - 1),
            Some(r) if r == cx.me => 0,
            Some(_) => bytes,
        };
        call.plan(&mut d, bytes, send_bytes);
        let mut sc = call.take_scratch();
        // Only a call that may use the segment takes the group's state (see
        // `take_shm`). Not bool: a byte another process wrote is only read as a
        // number type, for which every bit pattern is valid.
        let mut shm =
            (root_i.is_none() && d.algo == Algo::Shm && t.dtype() != DType::Bool).then(|| call.take_shm());
        let shape = Shape::of(t);
        let r = call
            .guard(async {
                let payloads = match root_i {
                    None => to_peers(cx, t.view()),
                    Some(r) if r != cx.me => vec![(r, t.view())],
                    Some(_) => Vec::new(),
                };
                let (_, sends) = cx.exchange(&d, &payloads).await?;
                drop(payloads);
                // The segment, when this call uses one (set up on first use);
                // without it a shared-memory call runs the ring.
                let seg = match shm.as_mut() {
                    Some(state) => shm::ensure(cx, state).await?,
                    None => None,
                };
                match (root_i, seg) {
                    (None, Some(seg)) => with_type!(t.dtype(), T => {
                        shm::all_reduce::<T>(cx, seg, &mut sc, t.as_mut_slice::<T>()?, op).await?
                    }),
                    (None, None) => algo::all_reduce(cx, &mut sc, t, op, &d).await?,
                    (Some(r), _) => algo::reduce(cx, &mut sc, t, r, op, &d).await?,
                }
                finish_sends(sends).await
            })
            .await;
        call.put_scratch(sc);
        if let Some(shm) = shm {
            call.put_shm(shm);
        }
        if r.is_err() {
            shape.restore(t);
        }
        r
    }

    // ------------------------------------------------------------- all_gather

    /// Gathers every member's `input` into every member's `outputs` (one tensor per
    /// member, in [`Group::ranks`] order; `outputs[p]` must have member p's element
    /// count, so uneven sizes are allowed, and the input's dtype).
    pub async fn all_gather(&self, outputs: &mut [Tensor], input: &Tensor) -> Result<()> {
        self.all_gather_in(self.ticket(), outputs, input).await
    }

    /// Handle form of [`Group::all_gather`]; yields the outputs.
    pub fn all_gather_handle(
        &self,
        mut outputs: Vec<Tensor>,
        input: Tensor,
    ) -> CollectiveHandle<Vec<Tensor>> {
        let (ticket, g) = (self.ticket(), self.clone());
        Group::spawn(async move {
            g.all_gather_in(ticket, &mut outputs, &input)
                .await
                .map(|()| outputs)
        })
    }

    async fn all_gather_in(&self, ticket: Ticket, outputs: &mut [Tensor], input: &Tensor) -> Result<()> {
        let kind = Kind::AllGather;
        let call = self.begin(ticket, kind).await?;
        let cx = call.ctx();
        let n = cx.n();
        let mut d = call.desc();
        d.dtype = Some(input.dtype());
        d.count = input.numel() as u64;
        let valid = (|| {
            check_len("the output list", outputs.len(), n)?;
            for (p, o) in outputs.iter().enumerate() {
                check_dtype(&format!("output {p}"), o.dtype(), input.dtype())?;
            }
            check_len("this rank's output", outputs[cx.me].numel(), input.numel())
        })();
        if let Err(e) = valid {
            return Err(call.abstain(e.in_op(kind)));
        }
        for (p, o) in outputs.iter().enumerate() {
            d.a[p] = o.numel() as u64;
        }
        let es = input.dtype().size() as u64;
        let total: u64 = d.a.iter().sum::<u64>() * es;
        call.plan(&mut d, total / n as u64, input.nbytes() as u64 * (n as u64 - 1));
        let shapes = Shape::of_all(outputs);
        let r = call
            .guard(async {
                let (_, sends) = cx.exchange(&d, &to_peers(cx, input.view())).await?;
                algo::all_gather(cx, outputs, input, &d).await?;
                finish_sends(sends).await
            })
            .await;
        if r.is_err() {
            Shape::restore_all(&shapes, outputs);
        }
        r
    }

    /// Gathers every member's `input` into `output`, concatenated in
    /// [`Group::ranks`] order (`output` has `size() × input.numel()` elements).
    pub async fn all_gather_into_tensor(&self, output: &mut Tensor, input: &Tensor) -> Result<()> {
        self.all_gather_into_in(self.ticket(), output, input).await
    }

    /// Handle form of [`Group::all_gather_into_tensor`]; yields the output.
    pub fn all_gather_into_tensor_handle(
        &self,
        mut output: Tensor,
        input: Tensor,
    ) -> CollectiveHandle<Tensor> {
        let (ticket, g) = (self.ticket(), self.clone());
        Group::spawn(async move {
            g.all_gather_into_in(ticket, &mut output, &input)
                .await
                .map(|()| output)
        })
    }

    async fn all_gather_into_in(&self, ticket: Ticket, output: &mut Tensor, input: &Tensor) -> Result<()> {
        let kind = Kind::AllGatherInto;
        let mut call = self.begin(ticket, kind).await?;
        let cx = call.ctx();
        let n = cx.n();
        let mut d = call.desc();
        d.dtype = Some(input.dtype());
        d.count = input.numel() as u64;
        let valid = check_dtype("the output", output.dtype(), input.dtype()).and_then(|()| {
            let want = input.numel().saturating_mul(n);
            check_len("the output", output.numel(), want)
        });
        if let Err(e) = valid {
            return Err(call.abstain(e.in_op(kind)));
        }
        let bytes = input.nbytes() as u64;
        call.plan(&mut d, bytes, bytes * (n as u64 - 1));
        let mut sc = call.take_scratch();
        let shape = Shape::of(output);
        let r = call
            .guard(async {
                let (_, sends) = cx.exchange(&d, &to_peers(cx, input.view())).await?;
                algo::all_gather_into(cx, &mut sc, output, input, &d).await?;
                finish_sends(sends).await
            })
            .await;
        call.put_scratch(sc);
        if r.is_err() {
            shape.restore(output);
        }
        r
    }

    // ---------------------------------------------------------- gather/scatter

    /// Gathers every member's `input` into `root`'s `outputs` (one tensor per
    /// member, in [`Group::ranks`] order, each with that member's element count).
    /// `outputs` must be `Some` on the root and is ignored elsewhere.
    pub async fn gather(&self, input: &Tensor, outputs: Option<&mut [Tensor]>, root: Rank) -> Result<()> {
        self.gather_in(self.ticket(), input, outputs, root).await
    }

    /// Handle form of [`Group::gather`]; yields the outputs (on the root).
    pub fn gather_handle(
        &self,
        input: Tensor,
        mut outputs: Option<Vec<Tensor>>,
        root: Rank,
    ) -> CollectiveHandle<Option<Vec<Tensor>>> {
        let (ticket, g) = (self.ticket(), self.clone());
        Group::spawn(async move {
            g.gather_in(ticket, &input, outputs.as_deref_mut(), root)
                .await
                .map(|()| outputs)
        })
    }

    async fn gather_in(
        &self,
        ticket: Ticket,
        input: &Tensor,
        mut outputs: Option<&mut [Tensor]>,
        root: Rank,
    ) -> Result<()> {
        let kind = Kind::Gather;
        let call = self.begin(ticket, kind).await?;
        let cx = call.ctx();
        let n = cx.n();
        let mut d = call.desc();
        d.dtype = Some(input.dtype());
        d.root = Some(root);
        d.count = input.numel() as u64;
        let valid = self.root_index(root).and_then(|r| {
            if r != cx.me {
                return Ok(r);
            }
            let outs = outputs
                .as_deref()
                .ok_or_else(|| Error::invalid("the root must pass an output list"))?;
            check_len("the output list", outs.len(), n)?;
            for (p, o) in outs.iter().enumerate() {
                check_dtype(&format!("output {p}"), o.dtype(), input.dtype())?;
            }
            check_len("the root's output", outs[cx.me].numel(), input.numel())?;
            Ok(r)
        });
        let root_i = match valid {
            Ok(r) => r,
            Err(e) => return Err(call.abstain(e.in_op(kind))),
        };
        let is_root = root_i == cx.me;
        if is_root {
            for (p, o) in outputs.as_deref().unwrap_or_default().iter().enumerate() {
                d.a[p] = o.numel() as u64;
            }
        }
        call.plan(&mut d, 0, if is_root { 0 } else { input.nbytes() as u64 });
        let shapes = outputs.as_deref().map(Shape::of_all);
        let r = call
            .guard(async {
                let payloads = if is_root {
                    Vec::new()
                } else {
                    vec![(root_i, input.view())]
                };
                let (_, sends) = cx.exchange(&d, &payloads).await?;
                algo::gather(cx, input, outputs.as_deref_mut(), root_i, &d).await?;
                finish_sends(sends).await
            })
            .await;
        if let (Err(_), Some(s), Some(o)) = (&r, &shapes, outputs) {
            Shape::restore_all(s, o);
        }
        r
    }

    /// Sends `inputs[p]` of `root` to member p's `output` (in [`Group::ranks`]
    /// order, each with that member's element count). `inputs` must be `Some` on
    /// the root and is ignored elsewhere.
    pub async fn scatter(&self, output: &mut Tensor, inputs: Option<&[Tensor]>, root: Rank) -> Result<()> {
        self.scatter_in(self.ticket(), output, inputs, root).await
    }

    /// Handle form of [`Group::scatter`]; yields the output.
    pub fn scatter_handle(
        &self,
        mut output: Tensor,
        inputs: Option<Vec<Tensor>>,
        root: Rank,
    ) -> CollectiveHandle<Tensor> {
        let (ticket, g) = (self.ticket(), self.clone());
        Group::spawn(async move {
            g.scatter_in(ticket, &mut output, inputs.as_deref(), root)
                .await
                .map(|()| output)
        })
    }

    async fn scatter_in(
        &self,
        ticket: Ticket,
        output: &mut Tensor,
        inputs: Option<&[Tensor]>,
        root: Rank,
    ) -> Result<()> {
        let kind = Kind::Scatter;
        let call = self.begin(ticket, kind).await?;
        let cx = call.ctx();
        let n = cx.n();
        let mut d = call.desc();
        d.dtype = Some(output.dtype());
        d.root = Some(root);
        d.count = output.numel() as u64;
        let valid = self.root_index(root).and_then(|r| {
            if r != cx.me {
                return Ok(r);
            }
            let ins = inputs.ok_or_else(|| Error::invalid("the root must pass an input list"))?;
            check_len("the input list", ins.len(), n)?;
            for (p, t) in ins.iter().enumerate() {
                check_dtype(&format!("input {p}"), t.dtype(), output.dtype())?;
            }
            check_len("the root's own input", ins[cx.me].numel(), output.numel())?;
            Ok(r)
        });
        let root_i = match valid {
            Ok(r) => r,
            Err(e) => return Err(call.abstain(e.in_op(kind))),
        };
        let is_root = root_i == cx.me;
        let ins = if is_root { inputs.unwrap_or_default() } else { &[] };
        let mut send_bytes = 0;
        for (p, t) in ins.iter().enumerate() {
            d.a[p] = t.numel() as u64;
            if p != cx.me {
                send_bytes += t.nbytes() as u64;
            }
        }
        call.plan(&mut d, 0, send_bytes);
        let shape = Shape::of(output);
        let r = call
            .guard(async {
                let payloads: Vec<(usize, TensorView<'_>)> =
                    cx.peers().filter_map(|q| Some((q, ins.get(q)?.view()))).collect();
                let (_, sends) = cx.exchange(&d, &payloads).await?;
                algo::scatter(cx, output, is_root.then_some(ins), root_i, &d).await?;
                finish_sends(sends).await
            })
            .await;
        if r.is_err() {
            shape.restore(output);
        }
        r
    }

    // ---------------------------------------------------------- reduce_scatter

    /// Reduces `inputs[p]` over all members with `op` into member p's `output` (one
    /// input per member in [`Group::ranks`] order; `inputs[p]` must have member p's
    /// output element count, the same list of sizes on every member).
    pub async fn reduce_scatter(&self, output: &mut Tensor, inputs: &[Tensor], op: ReduceOp) -> Result<()> {
        self.reduce_scatter_in(self.ticket(), output, Inputs::List(inputs), op)
            .await
    }

    /// Handle form of [`Group::reduce_scatter`]; yields the output.
    pub fn reduce_scatter_handle(
        &self,
        mut output: Tensor,
        inputs: Vec<Tensor>,
        op: ReduceOp,
    ) -> CollectiveHandle<Tensor> {
        let (ticket, g) = (self.ticket(), self.clone());
        Group::spawn(async move {
            g.reduce_scatter_in(ticket, &mut output, Inputs::List(&inputs), op)
                .await
                .map(|()| output)
        })
    }

    /// Reduces `input` (`size() × output.numel()` elements, segment p for member p)
    /// over all members with `op`; member p gets segment p in `output`.
    pub async fn reduce_scatter_tensor(
        &self,
        output: &mut Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> Result<()> {
        self.reduce_scatter_in(self.ticket(), output, Inputs::Tensor(input), op)
            .await
    }

    /// Handle form of [`Group::reduce_scatter_tensor`]; yields the output.
    pub fn reduce_scatter_tensor_handle(
        &self,
        mut output: Tensor,
        input: Tensor,
        op: ReduceOp,
    ) -> CollectiveHandle<Tensor> {
        let (ticket, g) = (self.ticket(), self.clone());
        Group::spawn(async move {
            g.reduce_scatter_in(ticket, &mut output, Inputs::Tensor(&input), op)
                .await
                .map(|()| output)
        })
    }

    async fn reduce_scatter_in(
        &self,
        ticket: Ticket,
        output: &mut Tensor,
        inputs: Inputs<'_>,
        op: ReduceOp,
    ) -> Result<()> {
        let kind = match inputs {
            Inputs::List(_) => Kind::ReduceScatter,
            Inputs::Tensor(_) => Kind::ReduceScatterTensor,
        };
        let mut call = self.begin(ticket, kind).await?;
        let cx = call.ctx();
        let n = cx.n();
        let dtype = output.dtype();
        let mut d = call.desc();
        d.dtype = Some(dtype);
        d.op = Some(op);
        d.count = output.numel() as u64;
        let valid = check_op(op, dtype).and_then(|()| match inputs {
            Inputs::List(ins) => {
                check_len("the input list", ins.len(), n)?;
                for (p, t) in ins.iter().enumerate() {
                    check_dtype(&format!("input {p}"), t.dtype(), dtype)?;
                }
                check_len("this rank's own input", ins[cx.me].numel(), output.numel())
            }
            Inputs::Tensor(t) => {
                check_dtype("the input", t.dtype(), dtype)?;
                check_len("the input", t.numel(), output.numel().saturating_mul(n))
            }
        });
        if let Err(e) = valid {
            return Err(call.abstain(e.in_op(kind)));
        }
        let segs = match inputs {
            Inputs::List(ins) => segments_of(ins.iter().map(Tensor::numel)),
            Inputs::Tensor(t) => even_segments(t.numel(), n),
        };
        if let Inputs::List(_) = inputs {
            for (p, s) in segs.iter().enumerate() {
                d.a[p] = s.len() as u64;
            }
        }
        let es = dtype.size() as u64;
        let total = segs.last().map_or(0, |s| s.end) as u64 * es;
        let own = segs[cx.me].len() as u64 * es;
        call.plan(&mut d, total / n as u64, total - own);
        let mut sc = call.take_scratch();
        let shape = Shape::of(output);
        let r = call
            .guard(async {
                let payloads: Vec<(usize, TensorView<'_>)> = match inputs {
                    Inputs::List(ins) => cx.peers().map(|q| (q, ins[q].view())).collect(),
                    Inputs::Tensor(t) => cx
                        .peers()
                        .map(|q| Ok((q, view_range(t, segs[q].clone())?)))
                        .collect::<Result<_>>()?,
                };
                let (_, sends) = cx.exchange(&d, &payloads).await?;
                drop(payloads);
                with_type!(dtype, T => {
                    let ins: Vec<&[T]> = match inputs {
                        Inputs::List(ins) => ins.iter().map(|t| t.as_slice::<T>().map_err(Error::from)).collect::<Result<_>>()?,
                        Inputs::Tensor(t) => {
                            let all = t.as_slice::<T>()?;
                            segs.iter().map(|s| &all[s.clone()]).collect()
                        }
                    };
                    algo::reduce_scatter::<T>(cx, &mut sc, output.as_mut_slice::<T>()?, &ins, op, &d).await?;
                });
                finish_sends(sends).await
            })
            .await;
        call.put_scratch(sc);
        if r.is_err() {
            shape.restore(output);
        }
        r
    }

    // -------------------------------------------------------------- all_to_all

    /// Sends `inputs[p]` to member p, which receives it in its `outputs[me]` (lists
    /// in [`Group::ranks`] order; uneven sizes allowed: `outputs[p]` must have the
    /// element count of member p's `inputs[me]`; one dtype throughout).
    pub async fn all_to_all(&self, outputs: &mut [Tensor], inputs: &[Tensor]) -> Result<()> {
        self.all_to_all_in(self.ticket(), outputs, inputs).await
    }

    /// Handle form of [`Group::all_to_all`]; yields the outputs.
    pub fn all_to_all_handle(
        &self,
        mut outputs: Vec<Tensor>,
        inputs: Vec<Tensor>,
    ) -> CollectiveHandle<Vec<Tensor>> {
        let (ticket, g) = (self.ticket(), self.clone());
        Group::spawn(async move {
            g.all_to_all_in(ticket, &mut outputs, &inputs)
                .await
                .map(|()| outputs)
        })
    }

    async fn all_to_all_in(&self, ticket: Ticket, outputs: &mut [Tensor], inputs: &[Tensor]) -> Result<()> {
        let kind = Kind::AllToAll;
        let call = self.begin(ticket, kind).await?;
        let cx = call.ctx();
        let n = cx.n();
        let dtype = inputs.first().map_or(DType::U8, Tensor::dtype);
        let mut d = call.desc();
        d.dtype = Some(dtype);
        let valid = (|| {
            check_len("the input list", inputs.len(), n)?;
            check_len("the output list", outputs.len(), n)?;
            for (p, t) in inputs.iter().enumerate() {
                check_dtype(&format!("input {p}"), t.dtype(), dtype)?;
            }
            for (p, t) in outputs.iter().enumerate() {
                check_dtype(&format!("output {p}"), t.dtype(), dtype)?;
            }
            check_len(
                "this rank's own output",
                outputs[cx.me].numel(),
                inputs[cx.me].numel(),
            )
        })();
        if let Err(e) = valid {
            return Err(call.abstain(e.in_op(kind)));
        }
        let mut send_bytes = 0;
        for p in 0..n {
            d.a[p] = inputs[p].numel() as u64;
            d.b[p] = outputs[p].numel() as u64;
            if p != cx.me {
                send_bytes += inputs[p].nbytes() as u64;
            }
        }
        call.plan(&mut d, 0, send_bytes);
        let shapes = Shape::of_all(outputs);
        let r = call
            .guard(async {
                let payloads: Vec<(usize, TensorView<'_>)> =
                    cx.peers().map(|q| (q, inputs[q].view())).collect();
                let (_, sends) = cx.exchange(&d, &payloads).await?;
                algo::all_to_all(cx, outputs, inputs, &d).await?;
                finish_sends(sends).await
            })
            .await;
        if r.is_err() {
            Shape::restore_all(&shapes, outputs);
        }
        r
    }

    /// All-to-all of one tensor: `input` is split into `input_splits[p]` elements
    /// for member p (in [`Group::ranks`] order), and `output` receives
    /// `output_splits[p]` elements from member p, concatenated. `None` splits the
    /// tensor evenly (its element count must then divide by the group size).
    pub async fn all_to_all_single(
        &self,
        output: &mut Tensor,
        input: &Tensor,
        output_splits: Option<&[usize]>,
        input_splits: Option<&[usize]>,
    ) -> Result<()> {
        self.all_to_all_single_in(self.ticket(), output, input, output_splits, input_splits)
            .await
    }

    /// Handle form of [`Group::all_to_all_single`]; yields the output.
    pub fn all_to_all_single_handle(
        &self,
        mut output: Tensor,
        input: Tensor,
        output_splits: Option<Vec<usize>>,
        input_splits: Option<Vec<usize>>,
    ) -> CollectiveHandle<Tensor> {
        let (ticket, g) = (self.ticket(), self.clone());
        Group::spawn(async move {
            g.all_to_all_single_in(
                ticket,
                &mut output,
                &input,
                output_splits.as_deref(),
                input_splits.as_deref(),
            )
            .await
            .map(|()| output)
        })
    }

    async fn all_to_all_single_in(
        &self,
        ticket: Ticket,
        output: &mut Tensor,
        input: &Tensor,
        output_splits: Option<&[usize]>,
        input_splits: Option<&[usize]>,
    ) -> Result<()> {
        let kind = Kind::AllToAllSingle;
        let mut call = self.begin(ticket, kind).await?;
        let cx = call.ctx();
        let n = cx.n();
        let mut d = call.desc();
        d.dtype = Some(input.dtype());
        d.count = input.numel() as u64;
        let splits = |given: Option<&[usize]>, what: &str, numel: usize| -> Result<Vec<usize>> {
            match given {
                Some(s) => {
                    check_len(&format!("{what} splits"), s.len(), n)?;
                    let sum = s
                        .iter()
                        .try_fold(0usize, |a, &b| a.checked_add(b))
                        .unwrap_or(usize::MAX);
                    check_len(&format!("the {what} (sum of its splits)"), numel, sum)?;
                    Ok(s.to_vec())
                }
                None if numel % n == 0 => Ok(vec![numel / n; n]),
                None => Err(Error::invalid(format!(
                    "the {what} has {numel} elements, not divisible by the group size {n}; pass splits"
                ))),
            }
        };
        let valid = check_dtype("the output", output.dtype(), input.dtype()).and_then(|()| {
            let ins = splits(input_splits, "input", input.numel())?;
            let outs = splits(output_splits, "output", output.numel())?;
            check_len("this rank's own output split", outs[cx.me], ins[cx.me])?;
            Ok((ins, outs))
        });
        let (ins, outs) = match valid {
            Ok(v) => v,
            Err(e) => return Err(call.abstain(e.in_op(kind))),
        };
        for p in 0..n {
            d.a[p] = ins[p] as u64;
            d.b[p] = outs[p] as u64;
        }
        let es = input.dtype().size() as u64;
        let send_bytes = (input.numel() - ins[cx.me]) as u64 * es;
        call.plan(&mut d, 0, send_bytes);
        let mut sc = call.take_scratch();
        let shape = Shape::of(output);
        let r = call
            .guard(async {
                let in_segs = segments_of(ins.iter().copied());
                let payloads = algo::a2a_payloads(cx, input, &in_segs)?;
                let (_, sends) = cx.exchange(&d, &payloads).await?;
                drop(payloads);
                algo::all_to_all_single(cx, &mut sc, output, input, &ins, &outs, &d).await?;
                finish_sends(sends).await
            })
            .await;
        call.put_scratch(sc);
        if r.is_err() {
            shape.restore(output);
        }
        r
    }
}

/// Inputs of a reduce-scatter.
#[derive(Clone, Copy)]
enum Inputs<'a> {
    List(&'a [Tensor]),
    Tensor(&'a Tensor),
}

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
