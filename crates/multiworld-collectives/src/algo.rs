//! The data movement of each collective, once the members agree (see `group.rs`
//! for the call life cycle). Two families:
//!
//! * **direct** (latency-optimal, one round): every member sends what each other
//!   member needs straight to it, all transfers at once; reductions are then done
//!   locally **in rank order** (`((x0 op x1) op x2) ...`), so the result is exactly
//!   the sequential reference and identical on every member;
//! * **ring / chain** (bandwidth-optimal): all-reduce is a ring reduce-scatter
//!   followed by a ring all-gather (each rank sends and receives `2(n-1)/n` of the
//!   buffer), split into pipelined chunks so that reducing one chunk overlaps the
//!   transfer of the next; reduce is a ring reduce-scatter then a gather of the
//!   reduced segments at the root; broadcast is a pipelined chain from the root.
//!   Ring reductions combine in ring order, so float results may differ from the
//!   rank-order reference in rounding (see `COLLECTIVES.md` for the bound); every
//!   member still gets bit-identical results.
//!
//! Gather, scatter and all-to-all are direct at every size (the root's link, or
//! every link, carries the minimum anyway). Any group size works, including 1 and
//! non-powers of two; segments differ by at most one element.
//!
//! Receives need an owned tensor of the message's exact size: messages that land
//! in a part of a caller's buffer go through a (reused, cache-sized) scratch chunk
//! and one copy; messages that fill a whole caller tensor are received into it
//! directly.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;

use crate::desc::{Algo, Desc};
use crate::group::Ctx;
use crate::shm::{self, Moves, Segment};
use crate::util::{
    Scratch, even_segments, segments_of, split_bytes, split2, try_join_all, try_join2, view_range,
};
use multiworld_tcp::{Error, Result};
use multiworld_types::{DType, Element, Tensor, TensorView};
use multiworld_types::{Kernel, ReduceOp, with_type};

/// `(member, view)` for every other member.
pub(crate) fn to_peers<'a>(cx: Ctx<'_>, v: TensorView<'a>) -> Vec<(usize, TensorView<'a>)> {
    cx.peers().map(|q| (q, v)).collect()
}

fn internal(what: &str) -> Error {
    Error::invalid(format!("internal: {what}"))
}

/// Copies `src` into `dst`'s bytes at byte offset `at`.
pub(crate) fn copy_bytes(dst: &mut Tensor, at: usize, src: &[u8]) -> Result<()> {
    let d = dst
        .bytes_mut()
        .get_mut(at..at + src.len())
        .ok_or_else(|| internal("copy outside the destination"))?;
    // Both sides hold valid values of the same dtype, so a bool tensor stays
    // valid. A large copy bypasses the caches (`shm::copy_large`).
    crate::shm::copy_large(d, src);
    Ok(())
}

/// Receives one message from each of `from` into fresh scratch tensors of
/// `numel(p)` elements, concurrently.
async fn recv_parts(
    cx: Ctx<'_>,
    sc: &mut Scratch,
    dtype: DType,
    from: impl Iterator<Item = usize>,
    numel: impl Fn(usize) -> usize,
) -> Result<Vec<(usize, Tensor)>> {
    let bufs: Vec<(usize, Tensor)> = from
        .map(|p| Ok((p, sc.take(dtype, numel(p))?)))
        .collect::<Result<_>>()?;
    try_join_all(
        bufs.into_iter()
            .map(|(p, t)| async move { Ok((p, cx.recv_new(p, t).await?)) }),
    )
    .await
}

/// Sends `payloads` unless they already went eagerly with the descriptor.
async fn send_unless_eager(cx: Ctx<'_>, d: &Desc, payloads: &[(usize, TensorView<'_>)]) -> Result<()> {
    if d.eager {
        Ok(())
    } else {
        cx.send_all(payloads).await
    }
}

/// `data` holds `x_me`; `parts[p]` holds `x_p` for the other members. Leaves the
/// rank-order fold `((x_0 op x_1) op x_2) ... op x_{n-1}` in `data`. Every binary
/// op here is commutative bit for bit, so folding `x_me` in from the other side
/// gives exactly the rank-order result.
fn fold_in_order<T: Kernel>(
    me: usize,
    data: &mut [T],
    parts: &mut [Option<Tensor>],
    op: ReduceOp,
) -> Result<()> {
    let n = parts.len();
    let eop = op.elem();
    if me == 1 {
        let x0 = parts
            .first()
            .and_then(Option::as_ref)
            .ok_or_else(|| internal("missing part 0"))?;
        T::combine_assign(eop, data, x0.as_slice::<T>()?);
    } else if me >= 2 {
        // acc = x0 op x1 op ... op x_{me-1}, built in part 0's scratch buffer.
        let mut acc = parts
            .get_mut(0)
            .and_then(Option::take)
            .ok_or_else(|| internal("missing part 0"))?;
        for p in 1..me {
            let xp = parts
                .get(p)
                .and_then(Option::as_ref)
                .ok_or_else(|| internal("missing part"))?;
            T::combine_assign(eop, acc.as_mut_slice::<T>()?, xp.as_slice::<T>()?);
        }
        T::combine_assign(eop, data, acc.as_slice::<T>()?);
        if let Some(slot) = parts.get_mut(0) {
            *slot = Some(acc);
        }
    }
    for p in me + 1..n {
        let xp = parts
            .get(p)
            .and_then(Option::as_ref)
            .ok_or_else(|| internal("missing part"))?;
        T::combine_assign(eop, data, xp.as_slice::<T>()?);
    }
    if op == ReduceOp::Avg {
        T::divide(data, n);
    }
    Ok(())
}

fn indexed(n: usize, parts: Vec<(usize, Tensor)>) -> Vec<Option<Tensor>> {
    let mut v: Vec<Option<Tensor>> = (0..n).map(|_| None).collect();
    for (p, t) in parts {
        if let Some(slot) = v.get_mut(p) {
            *slot = Some(t);
        }
    }
    v
}

fn give_all(sc: &mut Scratch, parts: Vec<Option<Tensor>>) {
    for t in parts.into_iter().flatten() {
        sc.give(t);
    }
}

// ---------------------------------------------------------------------------
// Ring building blocks

/// One ring step: sends `send` to the next member in chunks and receives
/// `recv_len` elements from the previous one in chunks (receives posted
/// `pipeline_depth` ahead, so data lands straight in them), handing each received
/// chunk and its offset to `sink`. Both sides chunk with the same agreed size.
async fn ring_step<T: Element>(
    cx: Ctx<'_>,
    sc: &mut Scratch,
    send: &[T],
    recv_len: usize,
    mut sink: impl FnMut(usize, &[T]) -> Result<()>,
) -> Result<()> {
    let chunk = cx.chunk_elems(T::DTYPE);
    let (next, prev) = (cx.next(), cx.prev());
    let sending = async {
        for c in send.chunks(chunk) {
            cx.send(next, c).await?;
        }
        Ok::<(), Error>(())
    };
    let receiving = async {
        let count = recv_len.div_ceil(chunk);
        let depth = cx.cfg.pipeline_depth.max(1);
        let mut posted = VecDeque::with_capacity(depth);
        let mut next_post = 0;
        for i in 0..count {
            while next_post < count && posted.len() < depth {
                let len = chunk.min(recv_len - next_post * chunk);
                posted.push_back(cx.irecv(prev, sc.take(T::DTYPE, len)?));
                next_post += 1;
            }
            let h = posted.pop_front().ok_or_else(|| internal("pipeline empty"))?;
            let got = h.wait().await?.tensor;
            sink(i * chunk, got.as_slice::<T>()?)?;
            sc.give(got);
        }
        Ok::<(), Error>(())
    };
    try_join2(sending, receiving).await.map(|_| ())
}

fn sub<T>(s: &mut [T], off: usize, len: usize) -> Result<&mut [T]> {
    s.get_mut(off..off + len)
        .ok_or_else(|| internal("chunk outside its segment"))
}

/// Ring reduce-scatter in place: afterwards `data[segs[me]]` holds the reduction
/// of that segment over all members (other segments hold partial results).
async fn ring_reduce_scatter_inplace<T: Kernel>(
    cx: Ctx<'_>,
    sc: &mut Scratch,
    data: &mut [T],
    segs: &[Range<usize>],
    op: ReduceOp,
) -> Result<()> {
    let (n, r) = (cx.n(), cx.me);
    let eop = op.elem();
    for s in 0..n - 1 {
        // Step s: send segment r-s-1, receive and reduce segment r-s-2; after n-1
        // steps segment r has passed through every member.
        let (si, ri) = ((r + 2 * n - s - 1) % n, (r + 2 * n - s - 2) % n);
        let (send, recv) = split2(data, segs[si].clone(), segs[ri].clone())?;
        ring_step(cx, sc, send, recv.len(), |off, c| {
            T::combine_assign(eop, sub(recv, off, c.len())?, c);
            Ok(())
        })
        .await?;
    }
    Ok(())
}

/// Ring all-gather in place: member p's segment `segs[p]` is valid on p; afterwards
/// every segment is valid everywhere.
async fn ring_all_gather_inplace<T: Element>(
    cx: Ctx<'_>,
    sc: &mut Scratch,
    data: &mut [T],
    segs: &[Range<usize>],
) -> Result<()> {
    let (n, r) = (cx.n(), cx.me);
    for s in 0..n - 1 {
        let (si, ri) = ((r + n - s) % n, (r + 2 * n - s - 1) % n);
        let (send, recv) = split2(data, segs[si].clone(), segs[ri].clone())?;
        ring_step(cx, sc, send, recv.len(), |off, c| {
            sub(recv, off, c.len())?.copy_from_slice(c);
            Ok(())
        })
        .await?;
    }
    Ok(())
}

/// Ring reduce-scatter out of place: `input[k]` is this member's segment k (never
/// modified); afterwards `fin` holds the reduction of segment `me`. Partial sums
/// travel in two scratch accumulators.
async fn ring_reduce_scatter_out<T: Kernel>(
    cx: Ctx<'_>,
    sc: &mut Scratch,
    input: &[&[T]],
    fin: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let (n, r) = (cx.n(), cx.me);
    if n == 1 {
        let own = input.first().ok_or_else(|| internal("no input"))?;
        if own.len() != fin.len() {
            return Err(internal("segment size"));
        }
        fin.copy_from_slice(own);
        return Ok(());
    }
    let eop = op.elem();
    let max = input.iter().map(|s| s.len()).max().unwrap_or(0);
    let mut prev_acc = sc.take(T::DTYPE, max)?;
    let mut cur_acc = sc.take(T::DTYPE, max)?;
    for s in 0..n - 1 {
        let (si, ri) = ((r + 2 * n - s - 1) % n, (r + 2 * n - s - 2) % n);
        let mine = input[ri];
        let send: &[T] = if s == 0 {
            input[si]
        } else {
            prev_acc
                .as_slice::<T>()?
                .get(..input[si].len())
                .ok_or_else(|| internal("accumulator size"))?
        };
        let out: &mut [T] = if s == n - 2 {
            &mut *fin
        } else {
            cur_acc
                .as_mut_slice::<T>()?
                .get_mut(..mine.len())
                .ok_or_else(|| internal("accumulator size"))?
        };
        if out.len() != mine.len() {
            return Err(internal("segment size"));
        }
        ring_step(cx, sc, send, mine.len(), |off, c| {
            let own = mine.get(off..off + c.len()).ok_or_else(|| internal("chunk"))?;
            T::combine(eop, sub(out, off, c.len())?, own, c);
            Ok(())
        })
        .await?;
        std::mem::swap(&mut prev_acc, &mut cur_acc);
    }
    sc.give(prev_acc);
    sc.give(cur_acc);
    Ok(())
}

// ---------------------------------------------------------------------------
// Operations

/// All-reduce of `t` in place.
pub(crate) async fn all_reduce(
    cx: Ctx<'_>,
    sc: &mut Scratch,
    t: &mut Tensor,
    op: ReduceOp,
    d: &Desc,
) -> Result<()> {
    let n = cx.n();
    if n == 1 {
        return Ok(());
    }
    match d.algo {
        // Shared memory that turned out unavailable falls back to the ring.
        Algo::Ring | Algo::Shm => with_type!(t.dtype(), T => {
            let data = t.as_mut_slice::<T>()?;
            let segs = even_segments(data.len(), n);
            ring_reduce_scatter_inplace(cx, sc, data, &segs, op).await?;
            if op == ReduceOp::Avg {
                T::divide(&mut data[segs[cx.me].clone()], n);
            }
            ring_all_gather_inplace(cx, sc, data, &segs).await
        }),
        Algo::Direct => {
            let (dtype, numel) = (t.dtype(), t.numel());
            let parts = {
                let payloads = to_peers(cx, t.view());
                let sending = send_unless_eager(cx, d, &payloads);
                let receiving = recv_parts(cx, sc, dtype, cx.peers(), |_| numel);
                try_join2(sending, receiving).await?.1
            };
            let mut parts = indexed(n, parts);
            with_type!(dtype, T => fold_in_order::<T>(cx.me, t.as_mut_slice::<T>()?, &mut parts, op))?;
            give_all(sc, parts);
            Ok(())
        }
    }
}

/// Reduce of `t` to member `root` (other members' `t` are not modified).
pub(crate) async fn reduce(
    cx: Ctx<'_>,
    sc: &mut Scratch,
    t: &mut Tensor,
    root: usize,
    op: ReduceOp,
    d: &Desc,
) -> Result<()> {
    let n = cx.n();
    if n == 1 {
        return Ok(());
    }
    // A reduce planned on shared memory that runs over TCP (bool tensors, or
    // a group that cannot share memory) takes the direct reduce with 2
    // members, as Auto would have: every member sees the same plan.
    if d.algo == Algo::Ring || (d.algo == Algo::Shm && n > 2) {
        return with_type!(t.dtype(), T => reduce_ring::<T>(cx, sc, t, root, op).await);
    }
    if cx.me != root {
        return send_unless_eager(cx, d, &[(root, t.view())]).await;
    }
    let (dtype, numel) = (t.dtype(), t.numel());
    let parts = recv_parts(cx, sc, dtype, cx.peers(), |_| numel).await?;
    let mut parts = indexed(n, parts);
    with_type!(dtype, T => fold_in_order::<T>(cx.me, t.as_mut_slice::<T>()?, &mut parts, op))?;
    give_all(sc, parts);
    Ok(())
}

async fn reduce_ring<T: Kernel>(
    cx: Ctx<'_>,
    sc: &mut Scratch,
    t: &mut Tensor,
    root: usize,
    op: ReduceOp,
) -> Result<()> {
    let (n, me) = (cx.n(), cx.me);
    let segs = even_segments(t.numel(), n);
    let mut fin = sc.take(T::DTYPE, segs[me].len())?;
    {
        let input = t.as_slice::<T>()?;
        let inputs: Vec<&[T]> = segs.iter().map(|s| &input[s.clone()]).collect();
        ring_reduce_scatter_out(cx, sc, &inputs, fin.as_mut_slice::<T>()?, op).await?;
    }
    if op == ReduceOp::Avg {
        T::divide(fin.as_mut_slice::<T>()?, n);
    }
    if me == root {
        let others = recv_parts(cx, sc, T::DTYPE, cx.peers(), |p| segs[p].len()).await?;
        let data = t.as_mut_slice::<T>()?;
        data[segs[me].clone()].copy_from_slice(fin.as_slice::<T>()?);
        for (p, part) in others {
            data[segs[p].clone()].copy_from_slice(part.as_slice::<T>()?);
            sc.give(part);
        }
    } else {
        cx.send(root, fin.as_slice::<T>()?).await?;
    }
    sc.give(fin);
    Ok(())
}

/// Broadcast of `t` from member `root`.
pub(crate) async fn broadcast(
    cx: Ctx<'_>,
    sc: &mut Scratch,
    t: &mut Tensor,
    root: usize,
    d: &Desc,
) -> Result<()> {
    let n = cx.n();
    if n == 1 {
        return Ok(());
    }
    // With two members the chain is the direct send, received in place.
    if d.algo == Algo::Direct || n == 2 {
        if cx.me == root {
            return send_unless_eager(cx, d, &to_peers(cx, t.view())).await;
        }
        return cx.recv(root, t).await;
    }
    with_type!(t.dtype(), T => chain_broadcast::<T>(cx, sc, t, root).await)
}

/// Pipelined chain root → root+1 → ... → root-1: each member forwards chunk i while
/// chunks i+1.. are already arriving into posted receives.
async fn chain_broadcast<T: Element>(
    cx: Ctx<'_>,
    sc: &mut Scratch,
    t: &mut Tensor,
    root: usize,
) -> Result<()> {
    let n = cx.n();
    let pos = (cx.me + n - root) % n;
    let chunk = cx.chunk_elems(T::DTYPE);
    let next = cx.next();
    if pos == 0 {
        for c in t.as_slice::<T>()?.chunks(chunk) {
            cx.send(next, c).await?;
        }
        return Ok(());
    }
    let forward = pos < n - 1;
    let data = t.as_mut_slice::<T>()?;
    let total = data.len();
    let count = total.div_ceil(chunk);
    let depth = cx.cfg.pipeline_depth.max(1);
    let mut posted = VecDeque::with_capacity(depth);
    let mut next_post = 0;
    for i in 0..count {
        while next_post < count && posted.len() < depth {
            let len = chunk.min(total - next_post * chunk);
            posted.push_back(cx.irecv(cx.prev(), sc.take(T::DTYPE, len)?));
            next_post += 1;
        }
        let h = posted.pop_front().ok_or_else(|| internal("pipeline empty"))?;
        let got = h.wait().await?.tensor;
        let src = got.as_slice::<T>()?;
        if forward {
            cx.send(next, src).await?;
        }
        sub(data, i * chunk, src.len())?.copy_from_slice(src);
        sc.give(got);
    }
    Ok(())
}

/// All-gather into a list: `outputs[p]` gets member p's `input`.
pub(crate) async fn all_gather(cx: Ctx<'_>, outputs: &mut [Tensor], input: &Tensor, d: &Desc) -> Result<()> {
    let (n, me) = (cx.n(), cx.me);
    copy_bytes(
        outputs.get_mut(me).ok_or_else(|| internal("outputs"))?,
        0,
        input.as_bytes(),
    )?;
    if n == 1 {
        return Ok(());
    }
    match d.algo {
        Algo::Direct => {
            let payloads = to_peers(cx, input.view());
            let sending = send_unless_eager(cx, d, &payloads);
            let receiving = try_join_all(
                outputs
                    .iter_mut()
                    .enumerate()
                    .filter(|(p, _)| *p != me)
                    .map(|(p, o)| cx.recv(p, o)),
            );
            try_join2(sending, receiving).await.map(|_| ())
        }
        Algo::Ring | Algo::Shm => {
            // Whole tensors travel around the ring, received in place.
            for s in 0..n - 1 {
                let (si, ri) = ((me + n - s) % n, (me + 2 * n - s - 1) % n);
                let (send, recv) = pick2(outputs, si, ri)?;
                try_join2(cx.send(cx.next(), send), cx.recv(cx.prev(), recv)).await?;
            }
            Ok(())
        }
    }
}

/// A shared reference to `v[a]` and a mutable one to `v[b]` (`a != b`).
fn pick2<T>(v: &mut [T], a: usize, b: usize) -> Result<(&T, &mut T)> {
    if a == b || a >= v.len() || b >= v.len() {
        return Err(internal("list indices"));
    }
    if a < b {
        let (lo, hi) = v.split_at_mut(b);
        Ok((&lo[a], &mut hi[0]))
    } else {
        let (lo, hi) = v.split_at_mut(a);
        Ok((&hi[0], &mut lo[b]))
    }
}

/// All-gather into one tensor of `n × input.numel()` elements, in member order.
pub(crate) async fn all_gather_into(
    cx: Ctx<'_>,
    sc: &mut Scratch,
    output: &mut Tensor,
    input: &Tensor,
    d: &Desc,
) -> Result<()> {
    let (n, me) = (cx.n(), cx.me);
    let (count, cb) = (input.numel(), input.nbytes());
    copy_bytes(output, me * cb, input.as_bytes())?;
    if n == 1 {
        return Ok(());
    }
    match d.algo {
        Algo::Direct => {
            let parts = {
                let payloads = to_peers(cx, input.view());
                let sending = send_unless_eager(cx, d, &payloads);
                let receiving = recv_parts(cx, sc, input.dtype(), cx.peers(), |_| count);
                try_join2(sending, receiving).await?.1
            };
            for (p, t) in parts {
                copy_bytes(output, p * cb, t.as_bytes())?;
                sc.give(t);
            }
            Ok(())
        }
        Algo::Ring | Algo::Shm => with_type!(output.dtype(), T => {
            let segs = segments_of((0..n).map(|_| count));
            ring_all_gather_inplace(cx, sc, output.as_mut_slice::<T>()?, &segs).await
        }),
    }
}

/// Where a gather, scatter or all-to-all moves the data between members: over
/// TCP (each payload one message), or through the group's segment as planned
/// after the agreement (see `shm::plan_after_agreement`).
pub(crate) enum Path<'a> {
    Tcp,
    Shm(&'a Arc<Segment>, Moves),
}

impl Path<'_> {
    /// Moves `sends` (what this member sends each other member) and fills
    /// `recvs` (from each other member) on this path; `payloads` are the same
    /// sends as messages, for TCP.
    async fn run(
        &self,
        cx: Ctx<'_>,
        d: &Desc,
        payloads: &[(usize, TensorView<'_>)],
        recvs: Vec<(usize, &mut Tensor)>,
    ) -> Result<()> {
        match self {
            Path::Tcp => {
                let sending = send_unless_eager(cx, d, payloads);
                let receiving = try_join_all(recvs.into_iter().map(|(p, o)| cx.recv(p, o)));
                try_join2(sending, receiving).await.map(|_| ())
            }
            Path::Shm(seg, m) => {
                let sends: Vec<(usize, &[u8])> = payloads.iter().map(|(q, v)| (*q, v.as_bytes())).collect();
                let mut recvs: Vec<(usize, &mut [u8])> =
                    recvs.into_iter().map(|(p, o)| (p, o.bytes_mut())).collect();
                shm::route(cx, seg, m, &sends, &mut recvs).await
            }
        }
    }
}

/// Gather to member `root` into `outputs` (root only).
pub(crate) async fn gather(
    cx: Ctx<'_>,
    input: &Tensor,
    outputs: Option<&mut [Tensor]>,
    root: usize,
    d: &Desc,
    path: &Path<'_>,
) -> Result<()> {
    let me = cx.me;
    if me != root {
        return path.run(cx, d, &[(root, input.view())], Vec::new()).await;
    }
    let outs = outputs.ok_or_else(|| internal("root without outputs"))?;
    copy_bytes(
        outs.get_mut(me).ok_or_else(|| internal("outputs"))?,
        0,
        input.as_bytes(),
    )?;
    let recvs = outs.iter_mut().enumerate().filter(|(p, _)| *p != me).collect();
    path.run(cx, d, &[], recvs).await
}

/// Scatter from member `root`'s `inputs` (root only) into `output`.
pub(crate) async fn scatter(
    cx: Ctx<'_>,
    output: &mut Tensor,
    inputs: Option<&[Tensor]>,
    root: usize,
    d: &Desc,
    path: &Path<'_>,
) -> Result<()> {
    let me = cx.me;
    if me != root {
        return path.run(cx, d, &[], vec![(root, output)]).await;
    }
    let ins = inputs.ok_or_else(|| internal("root without inputs"))?;
    copy_bytes(
        output,
        0,
        ins.get(me).ok_or_else(|| internal("inputs"))?.as_bytes(),
    )?;
    let payloads: Vec<(usize, TensorView<'_>)> = cx.peers().map(|q| (q, ins[q].view())).collect();
    path.run(cx, d, &payloads, Vec::new()).await
}

/// Reduce-scatter: `inputs[k]` is this member's contribution to segment k;
/// `output` gets the reduction of segment `me`.
pub(crate) async fn reduce_scatter<T: Kernel>(
    cx: Ctx<'_>,
    sc: &mut Scratch,
    output: &mut [T],
    inputs: &[&[T]],
    op: ReduceOp,
    d: &Desc,
) -> Result<()> {
    let (n, me) = (cx.n(), cx.me);
    match d.algo {
        Algo::Direct if n > 1 => {
            let parts = {
                let payloads: Vec<(usize, TensorView<'_>)> =
                    cx.peers().map(|q| (q, TensorView::from(inputs[q]))).collect();
                let sending = send_unless_eager(cx, d, &payloads);
                let len = output.len();
                let receiving = recv_parts(cx, sc, T::DTYPE, cx.peers(), |_| len);
                try_join2(sending, receiving).await?.1
            };
            let own = inputs.get(me).ok_or_else(|| internal("inputs"))?;
            if own.len() != output.len() {
                return Err(internal("segment size"));
            }
            output.copy_from_slice(own);
            let mut parts = indexed(n, parts);
            fold_in_order::<T>(me, output, &mut parts, op)?;
            give_all(sc, parts);
            Ok(())
        }
        _ => {
            ring_reduce_scatter_out(cx, sc, inputs, output, op).await?;
            if op == ReduceOp::Avg {
                T::divide(output, n);
            }
            Ok(())
        }
    }
}

/// All-to-all of lists: `outputs[p]` gets member p's `inputs[me]`.
pub(crate) async fn all_to_all(
    cx: Ctx<'_>,
    outputs: &mut [Tensor],
    inputs: &[Tensor],
    d: &Desc,
    path: &Path<'_>,
) -> Result<()> {
    let me = cx.me;
    let own = inputs.get(me).ok_or_else(|| internal("inputs"))?;
    copy_bytes(
        outputs.get_mut(me).ok_or_else(|| internal("outputs"))?,
        0,
        own.as_bytes(),
    )?;
    let payloads: Vec<(usize, TensorView<'_>)> = cx.peers().map(|q| (q, inputs[q].view())).collect();
    let recvs = outputs.iter_mut().enumerate().filter(|(p, _)| *p != me).collect();
    path.run(cx, d, &payloads, recvs).await
}

/// The direct payloads of an all-to-all-single: `input[in_segs[q]]` to each q.
pub(crate) fn a2a_payloads<'a>(
    cx: Ctx<'_>,
    input: &'a Tensor,
    in_segs: &[Range<usize>],
) -> Result<Vec<(usize, TensorView<'a>)>> {
    cx.peers()
        .map(|q| Ok((q, view_range(input, in_segs[q].clone())?)))
        .collect()
}

/// All-to-all of one tensor with split sizes (element counts per member).
#[allow(clippy::too_many_arguments)] // the splits come validated from the preparation
pub(crate) async fn all_to_all_single(
    cx: Ctx<'_>,
    sc: &mut Scratch,
    output: &mut Tensor,
    input: &Tensor,
    in_splits: &[usize],
    out_splits: &[usize],
    d: &Desc,
    path: &Path<'_>,
) -> Result<()> {
    let me = cx.me;
    let es = input.dtype().size();
    let (in_segs, out_segs) = (
        segments_of(in_splits.iter().copied()),
        segments_of(out_splits.iter().copied()),
    );
    let own = input
        .as_bytes()
        .get(in_segs[me].start * es..in_segs[me].end * es)
        .ok_or_else(|| internal("splits"))?;
    copy_bytes(output, out_segs[me].start * es, own)?;
    let payloads = a2a_payloads(cx, input, &in_segs)?;
    if let Path::Shm(seg, m) = path {
        // Straight into the output's ranges, which are disjoint and in member
        // order.
        let sends: Vec<(usize, &[u8])> = payloads.iter().map(|(q, v)| (*q, v.as_bytes())).collect();
        let lens: Vec<usize> = out_segs.iter().map(|s| s.len() * es).collect();
        let parts = split_bytes(output.bytes_mut(), &lens)?;
        let mut recvs: Vec<(usize, &mut [u8])> =
            parts.into_iter().enumerate().filter(|(p, _)| *p != me).collect();
        return shm::route(cx, seg, m, &sends, &mut recvs).await;
    }
    let parts = {
        let sending = send_unless_eager(cx, d, &payloads);
        let receiving = recv_parts(cx, sc, input.dtype(), cx.peers(), |p| out_splits[p]);
        try_join2(sending, receiving).await?.1
    };
    for (p, t) in parts {
        copy_bytes(output, out_segs[p].start * es, t.as_bytes())?;
        sc.give(t);
    }
    Ok(())
}
