//! The tensor collectives of [`Group`], each as a blocking-style `async fn` and a
//! `*_handle` form. Every call runs the life cycle of `group.rs` through one
//! template, [`Group::run_collective`] (`collective.rs`): turn, description and
//! local validation (an invalid call abstains and fails before any tensor data is
//! sent), plan, then agreement and the algorithm from `algo.rs` under the
//! member-loss guard, with the group's scratch pool lent and output shapes put
//! back on failure. Each operation here supplies only its preparation (what it
//! writes into the descriptor, its validation, its byte counts) and its body.

use crate::algo::{self, to_peers};
use crate::collective::{Lent, Prep};
use crate::desc::{Desc, Kind};
use crate::group::{Ctx, Group, Ticket, finish_sends};
use crate::handle::CollectiveHandle;
use crate::shm;
use crate::util::{even_segments, segments_of, split_bytes, view_range};
use multiworld_tcp::{Error, Result};
use multiworld_types::Rank;
use multiworld_types::{DType, Tensor, TensorView};
use multiworld_types::{ReduceOp, with_type};

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
        self.run_collective(
            ticket,
            Kind::Barrier,
            &mut (),
            |_, _, _| Ok(Prep::new((), 0, 0)),
            async |_, cx, d, (), _| {
                let (_, sends) = cx.exchange(d, &[]).await?;
                finish_sends(sends).await
            },
        )
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
        let prepare = |t: &Tensor, cx: Ctx<'_>, d: &mut Desc| {
            d.dtype = Some(t.dtype());
            d.root = Some(root);
            d.count = t.numel() as u64;
            let root_i = self.root_index(root)?;
            let bytes = t.nbytes() as u64;
            let peers = (cx.n() - 1) as u64;
            let send_bytes = if cx.me == root_i { bytes * peers } else { 0 };
            Ok(Prep::new(root_i, bytes, send_bytes)
                .with_scratch()
                .with_shm_for(t.dtype()))
        };
        self.run_collective(
            ticket,
            Kind::Broadcast,
            t,
            prepare,
            async |t, cx, d, root_i, lent| {
                let payloads = if cx.me == root_i {
                    to_peers(cx, t.view())
                } else {
                    Vec::new()
                };
                let (_, sends) = cx.exchange(d, &payloads).await?;
                drop(payloads);
                match shm::ensure(cx, lent.shm.as_mut()).await? {
                    Some(seg) => shm::broadcast(cx, seg, t.bytes_mut(), root_i).await?,
                    None => algo::broadcast(cx, &mut lent.scratch, t, root_i, d).await?,
                }
                finish_sends(sends).await
            },
        )
        .await
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
        let prepare = |t: &Tensor, cx: Ctx<'_>, d: &mut Desc| {
            d.dtype = Some(t.dtype());
            d.root = root;
            d.op = Some(op);
            d.count = t.numel() as u64;
            let root_i = root.map(|r| self.root_index(r)).transpose()?;
            check_op(op, t.dtype())?;
            let bytes = t.nbytes() as u64;
            let send_bytes = match root_i {
                None => bytes * (cx.n() as u64 - 1),
                Some(r) if r == cx.me => 0,
                Some(_) => bytes,
            };
            Ok(Prep::new(root_i, bytes, send_bytes)
                .with_scratch()
                .with_shm_for(t.dtype()))
        };
        self.run_collective(ticket, kind, t, prepare, async |t, cx, d, root_i, lent| {
            let payloads = match root_i {
                None => to_peers(cx, t.view()),
                Some(r) if r != cx.me => vec![(r, t.view())],
                Some(_) => Vec::new(),
            };
            let (_, sends) = cx.exchange(d, &payloads).await?;
            drop(payloads);
            // The segment, when this call uses one (set up on first use);
            // without it a shared-memory call runs the ring.
            let seg = shm::ensure(cx, lent.shm.as_mut()).await?;
            let sc = &mut lent.scratch;
            match (root_i, seg) {
                (None, Some(seg)) => with_type!(t.dtype(), T => {
                    shm::all_reduce::<T>(cx, seg, sc, t.as_mut_slice::<T>()?, op).await?
                }),
                (Some(r), Some(seg)) if r == cx.me => with_type!(t.dtype(), T => {
                    shm::reduce_root::<T>(cx, seg, sc, t.as_mut_slice::<T>()?, op).await?
                }),
                // The others' tensors are only read (a reduce leaves them as
                // they were).
                (Some(r), Some(seg)) => shm::reduce_send(cx, seg, t.as_bytes(), r).await?,
                (None, None) => algo::all_reduce(cx, sc, t, op, d).await?,
                (Some(r), None) => algo::reduce(cx, sc, t, r, op, d).await?,
            }
            finish_sends(sends).await
        })
        .await
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
        let prepare = |outputs: &[Tensor], cx: Ctx<'_>, d: &mut Desc| {
            let n = cx.n();
            d.dtype = Some(input.dtype());
            d.count = input.numel() as u64;
            check_len("the output list", outputs.len(), n)?;
            for (p, o) in outputs.iter().enumerate() {
                check_dtype(&format!("output {p}"), o.dtype(), input.dtype())?;
            }
            check_len("this rank's output", outputs[cx.me].numel(), input.numel())?;
            for (p, o) in outputs.iter().enumerate() {
                d.a[p] = o.numel() as u64;
            }
            let es = input.dtype().size() as u64;
            let total: u64 = d.a.iter().sum::<u64>() * es;
            let send_bytes = input.nbytes() as u64 * (n as u64 - 1);
            Ok(Prep::new((), total / n as u64, send_bytes).with_shm_for(input.dtype()))
        };
        self.run_collective(
            ticket,
            Kind::AllGather,
            outputs,
            prepare,
            async |outputs, cx, d, (), lent| {
                let (_, sends) = cx.exchange(d, &to_peers(cx, input.view())).await?;
                match shm::ensure(cx, lent.shm.as_mut()).await? {
                    Some(seg) => {
                        let mut parts: Vec<&mut [u8]> = outputs.iter_mut().map(Tensor::bytes_mut).collect();
                        shm::all_gather(cx, seg, input.as_bytes(), &mut parts).await?
                    }
                    None => algo::all_gather(cx, outputs, input, d).await?,
                }
                finish_sends(sends).await
            },
        )
        .await
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
        let prepare = |output: &Tensor, cx: Ctx<'_>, d: &mut Desc| {
            let n = cx.n();
            d.dtype = Some(input.dtype());
            d.count = input.numel() as u64;
            check_dtype("the output", output.dtype(), input.dtype())?;
            check_len("the output", output.numel(), input.numel().saturating_mul(n))?;
            let bytes = input.nbytes() as u64;
            Ok(Prep::new((), bytes, bytes * (n as u64 - 1))
                .with_scratch()
                .with_shm_for(input.dtype()))
        };
        self.run_collective(
            ticket,
            Kind::AllGatherInto,
            output,
            prepare,
            async |output, cx, d, (), lent| {
                let (_, sends) = cx.exchange(d, &to_peers(cx, input.view())).await?;
                match shm::ensure(cx, lent.shm.as_mut()).await? {
                    Some(seg) => {
                        let lens = vec![input.nbytes(); cx.n()];
                        let mut parts = split_bytes(output.bytes_mut(), &lens)?;
                        shm::all_gather(cx, seg, input.as_bytes(), &mut parts).await?
                    }
                    None => algo::all_gather_into(cx, &mut lent.scratch, output, input, d).await?,
                }
                finish_sends(sends).await
            },
        )
        .await
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
        outputs: Option<&mut [Tensor]>,
        root: Rank,
    ) -> Result<()> {
        // The template sees a missing list (allowed off the root) as an empty one;
        // `given` keeps the root's own error for it. Off the root the list is
        // ignored.
        let given = outputs.is_some();
        let outputs = outputs.unwrap_or_default();
        let prepare = |outputs: &[Tensor], cx: Ctx<'_>, d: &mut Desc| {
            let n = cx.n();
            d.dtype = Some(input.dtype());
            d.root = Some(root);
            d.count = input.numel() as u64;
            let root_i = self.root_index(root)?;
            let is_root = root_i == cx.me;
            if is_root {
                if !given {
                    return Err(Error::invalid("the root must pass an output list"));
                }
                check_len("the output list", outputs.len(), n)?;
                for (p, o) in outputs.iter().enumerate() {
                    check_dtype(&format!("output {p}"), o.dtype(), input.dtype())?;
                }
                check_len("the root's output", outputs[cx.me].numel(), input.numel())?;
                for (p, o) in outputs.iter().enumerate() {
                    d.a[p] = o.numel() as u64;
                }
            }
            let send_bytes = if is_root { 0 } else { input.nbytes() as u64 };
            Ok(Prep::new(root_i, 0, send_bytes).with_shm_for(input.dtype()))
        };
        self.run_collective(
            ticket,
            Kind::Gather,
            outputs,
            prepare,
            async |outputs, cx, d, root_i, lent| {
                let payloads = if root_i == cx.me {
                    Vec::new()
                } else {
                    vec![(root_i, input.view())]
                };
                let (descs, sends) = cx.exchange(d, &payloads).await?;
                let path = path_after_agreement(cx, &descs, lent).await?;
                algo::gather(cx, input, Some(outputs), root_i, d, &path).await?;
                finish_sends(sends).await
            },
        )
        .await
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
        let prepare = |output: &Tensor, cx: Ctx<'_>, d: &mut Desc| {
            let n = cx.n();
            d.dtype = Some(output.dtype());
            d.root = Some(root);
            d.count = output.numel() as u64;
            let root_i = self.root_index(root)?;
            let mut send_bytes = 0;
            if root_i == cx.me {
                let ins = inputs.ok_or_else(|| Error::invalid("the root must pass an input list"))?;
                check_len("the input list", ins.len(), n)?;
                for (p, t) in ins.iter().enumerate() {
                    check_dtype(&format!("input {p}"), t.dtype(), output.dtype())?;
                }
                check_len("the root's own input", ins[cx.me].numel(), output.numel())?;
                for (p, t) in ins.iter().enumerate() {
                    d.a[p] = t.numel() as u64;
                    if p != cx.me {
                        send_bytes += t.nbytes() as u64;
                    }
                }
            }
            Ok(Prep::new(root_i, 0, send_bytes).with_shm_for(output.dtype()))
        };
        self.run_collective(
            ticket,
            Kind::Scatter,
            output,
            prepare,
            async |output, cx, d, root_i, lent| {
                // The root's list, checked by the preparation; nothing elsewhere.
                let ins = inputs.filter(|_| root_i == cx.me).unwrap_or_default();
                let payloads: Vec<(usize, TensorView<'_>)> =
                    cx.peers().filter_map(|q| Some((q, ins.get(q)?.view()))).collect();
                let (descs, sends) = cx.exchange(d, &payloads).await?;
                let path = path_after_agreement(cx, &descs, lent).await?;
                let is_root = root_i == cx.me;
                algo::scatter(cx, output, is_root.then_some(ins), root_i, d, &path).await?;
                finish_sends(sends).await
            },
        )
        .await
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
        let prepare = |output: &Tensor, cx: Ctx<'_>, d: &mut Desc| {
            let n = cx.n();
            let dtype = output.dtype();
            d.dtype = Some(dtype);
            d.op = Some(op);
            d.count = output.numel() as u64;
            check_op(op, dtype)?;
            let segs = match inputs {
                Inputs::List(ins) => {
                    check_len("the input list", ins.len(), n)?;
                    for (p, t) in ins.iter().enumerate() {
                        check_dtype(&format!("input {p}"), t.dtype(), dtype)?;
                    }
                    check_len("this rank's own input", ins[cx.me].numel(), output.numel())?;
                    let segs = segments_of(ins.iter().map(Tensor::numel));
                    for (p, s) in segs.iter().enumerate() {
                        d.a[p] = s.len() as u64;
                    }
                    segs
                }
                Inputs::Tensor(t) => {
                    check_dtype("the input", t.dtype(), dtype)?;
                    check_len("the input", t.numel(), output.numel().saturating_mul(n))?;
                    even_segments(t.numel(), n)
                }
            };
            let es = dtype.size() as u64;
            let total = segs.last().map_or(0, |s| s.end) as u64 * es;
            let own = segs[cx.me].len() as u64 * es;
            Ok(Prep::new(segs, total / n as u64, total - own)
                .with_scratch()
                .with_shm_for(dtype))
        };
        self.run_collective(ticket, kind, output, prepare, async |output, cx, d, segs, lent| {
            let payloads: Vec<(usize, TensorView<'_>)> = match inputs {
                Inputs::List(ins) => cx.peers().map(|q| (q, ins[q].view())).collect(),
                Inputs::Tensor(t) => cx
                    .peers()
                    .map(|q| Ok((q, view_range(t, segs[q].clone())?)))
                    .collect::<Result<_>>()?,
            };
            let (_, sends) = cx.exchange(d, &payloads).await?;
            drop(payloads);
            with_type!(output.dtype(), T => {
                let ins: Vec<&[T]> = match inputs {
                    Inputs::List(ins) => ins.iter().map(|t| t.as_slice::<T>().map_err(Error::from)).collect::<Result<_>>()?,
                    Inputs::Tensor(t) => {
                        let all = t.as_slice::<T>()?;
                        segs.iter().map(|s| &all[s.clone()]).collect()
                    }
                };
                match shm::ensure(cx, lent.shm.as_mut()).await? {
                    Some(seg) => shm::reduce_scatter::<T>(cx, seg, &mut lent.scratch, output.as_mut_slice::<T>()?, &ins, op).await?,
                    None => algo::reduce_scatter::<T>(cx, &mut lent.scratch, output.as_mut_slice::<T>()?, &ins, op, d).await?,
                }
            });
            finish_sends(sends).await
        })
        .await
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
        let prepare = |outputs: &[Tensor], cx: Ctx<'_>, d: &mut Desc| {
            let n = cx.n();
            let dtype = inputs.first().map_or(DType::U8, Tensor::dtype);
            d.dtype = Some(dtype);
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
            )?;
            let mut send_bytes = 0;
            for p in 0..n {
                d.a[p] = inputs[p].numel() as u64;
                d.b[p] = outputs[p].numel() as u64;
                if p != cx.me {
                    send_bytes += inputs[p].nbytes() as u64;
                }
            }
            Ok(Prep::new((), 0, send_bytes).with_shm_for(dtype))
        };
        self.run_collective(
            ticket,
            Kind::AllToAll,
            outputs,
            prepare,
            async |outputs, cx, d, (), lent| {
                let payloads: Vec<(usize, TensorView<'_>)> =
                    cx.peers().map(|q| (q, inputs[q].view())).collect();
                let (descs, sends) = cx.exchange(d, &payloads).await?;
                drop(payloads);
                let path = path_after_agreement(cx, &descs, lent).await?;
                algo::all_to_all(cx, outputs, inputs, d, &path).await?;
                finish_sends(sends).await
            },
        )
        .await
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
        let prepare = |output: &Tensor, cx: Ctx<'_>, d: &mut Desc| {
            let n = cx.n();
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
            check_dtype("the output", output.dtype(), input.dtype())?;
            let ins = splits(input_splits, "input", input.numel())?;
            let outs = splits(output_splits, "output", output.numel())?;
            check_len("this rank's own output split", outs[cx.me], ins[cx.me])?;
            for p in 0..n {
                d.a[p] = ins[p] as u64;
                d.b[p] = outs[p] as u64;
            }
            let es = input.dtype().size() as u64;
            let send_bytes = (input.numel() - ins[cx.me]) as u64 * es;
            Ok(Prep::new((ins, outs), 0, send_bytes)
                .with_scratch()
                .with_shm_for(input.dtype()))
        };
        self.run_collective(
            ticket,
            Kind::AllToAllSingle,
            output,
            prepare,
            async |output, cx, d, (ins, outs), lent| {
                let in_segs = segments_of(ins.iter().copied());
                let payloads = algo::a2a_payloads(cx, input, &in_segs)?;
                let (descs, sends) = cx.exchange(d, &payloads).await?;
                drop(payloads);
                let mut scratch = std::mem::take(&mut lent.scratch);
                let path = path_after_agreement(cx, &descs, lent).await;
                let r = match path {
                    Ok(path) => {
                        algo::all_to_all_single(cx, &mut scratch, output, input, &ins, &outs, d, &path).await
                    }
                    Err(e) => Err(e),
                };
                lent.scratch = scratch;
                r?;
                finish_sends(sends).await
            },
        )
        .await
    }
}

/// Where a gather, scatter or all-to-all whose descriptors `descs` were agreed
/// moves its data: through the group's segment (set up now if this is the
/// group's first call to use it) when [`shm::plan_after_agreement`] says so
/// and the members can share memory, else over TCP. The same on every member.
async fn path_after_agreement<'l>(cx: Ctx<'_>, descs: &[Desc], lent: &'l mut Lent) -> Result<algo::Path<'l>> {
    let Some(m) = shm::plan_after_agreement(cx, descs, lent.shm.is_some()) else {
        return Ok(algo::Path::Tcp);
    };
    Ok(match shm::ensure(cx, lent.shm.as_mut()).await? {
        Some(seg) => algo::Path::Shm(seg, m),
        None => algo::Path::Tcp,
    })
}

/// Inputs of a reduce-scatter.
#[derive(Clone, Copy)]
enum Inputs<'a> {
    List(&'a [Tensor]),
    Tensor(&'a Tensor),
}
