//! Small helpers for the algorithms: a pool of scratch tensors reused between calls
//! (receives need an owned tensor of the exact size, and fresh large allocations
//! cost page faults on every call), segment arithmetic, and a `try_join_all` for a
//! variable number of futures (this crate does not depend on `futures`).

use std::future::{Future, poll_fn};
use std::ops::Range;
use std::pin::Pin;
use std::task::Poll;

use multiworld_tcp::{Error, Result};
use multiworld_types::{DType, Tensor, TensorView};

/// Most tensors the pool keeps, whatever their size.
const POOL_MAX_TENSORS: usize = 64;

/// Scratch tensors kept between collective calls of one group, keyed by dtype and
/// element count, within a byte budget.
#[derive(Debug, Default)]
pub(crate) struct Scratch {
    free: Vec<Tensor>,
    bytes: usize,
    budget: usize,
}

impl Scratch {
    pub(crate) fn new(budget: usize) -> Scratch {
        Scratch {
            free: Vec::new(),
            bytes: 0,
            budget,
        }
    }

    /// A one-dimensional tensor of `numel` elements of `dtype`, from the pool or
    /// freshly zeroed. Its contents are unspecified.
    pub(crate) fn take(&mut self, dtype: DType, numel: usize) -> Result<Tensor> {
        if let Some(i) = self
            .free
            .iter()
            .rposition(|t| t.dtype() == dtype && t.numel() == numel)
        {
            let mut t = self.free.swap_remove(i);
            self.bytes -= t.nbytes();
            t.reshape([numel])?;
            return Ok(t);
        }
        Ok(Tensor::zeros(dtype, [numel])?)
    }

    /// Returns a tensor to the pool (dropped if it does not fit the budget; the
    /// oldest tensors are dropped to make room).
    pub(crate) fn give(&mut self, t: Tensor) {
        let b = t.nbytes();
        if b == 0 || b > self.budget {
            return;
        }
        while !self.free.is_empty() && (self.bytes + b > self.budget || self.free.len() >= POOL_MAX_TENSORS) {
            let old = self.free.remove(0);
            self.bytes -= old.nbytes();
        }
        self.bytes += b;
        self.free.push(t);
    }

    /// Changes the byte budget (applies to later [`Scratch::give`] calls).
    pub(crate) fn set_budget(&mut self, budget: usize) {
        self.budget = budget;
    }

    /// Bytes currently held.
    pub(crate) fn held(&self) -> usize {
        self.bytes
    }

    /// Drops every pooled tensor.
    pub(crate) fn clear(&mut self) {
        self.free.clear();
        self.bytes = 0;
    }
}

/// `total` elements split into `n` contiguous segments whose sizes differ by at
/// most one (the first `total % n` are one larger).
pub(crate) fn even_segments(total: usize, n: usize) -> Vec<Range<usize>> {
    let n = n.max(1);
    let (q, r) = (total / n, total % n);
    (0..n)
        .map(|k| {
            let start = k * q + k.min(r);
            start..start + q + usize::from(k < r)
        })
        .collect()
}

/// Contiguous segments of the given sizes.
pub(crate) fn segments_of(sizes: impl IntoIterator<Item = usize>) -> Vec<Range<usize>> {
    let mut at = 0;
    sizes
        .into_iter()
        .map(|s| {
            let r = at..at + s;
            at += s;
            r
        })
        .collect()
}

/// A shared view of segment `a` and a mutable view of segment `b` of `data`; the
/// two ranges must not overlap (empty ranges never do).
pub(crate) fn split2<T>(data: &mut [T], a: Range<usize>, b: Range<usize>) -> Result<(&[T], &mut [T])> {
    let len = data.len();
    if a.start > a.end || b.start > b.end || a.end > len || b.end > len {
        return Err(Error::invalid(format!(
            "internal: segments {a:?} and {b:?} outside {len} elements"
        )));
    }
    if a.is_empty() {
        return Ok((&[], &mut data[b]));
    }
    if b.is_empty() {
        return Ok((&data[a], &mut []));
    }
    if a.end <= b.start {
        let (lo, hi) = data.split_at_mut(b.start);
        Ok((&lo[a], &mut hi[..b.len()]))
    } else if b.end <= a.start {
        let (lo, hi) = data.split_at_mut(a.start);
        Ok((&hi[..a.len()], &mut lo[b]))
    } else {
        Err(Error::invalid(format!(
            "internal: overlapping segments {a:?} and {b:?}"
        )))
    }
}

/// A typed view of elements `range` of `t` (no copy).
pub(crate) fn view_range(t: &Tensor, range: Range<usize>) -> Result<TensorView<'_>> {
    multiworld_types::with_type!(t.dtype(), T => {
        let s = t.as_slice::<T>()?;
        let part = s.get(range.clone()).ok_or_else(|| {
            Error::invalid(format!("range {range:?} outside a tensor of {} elements", s.len()))
        })?;
        Ok(TensorView::from(part))
    })
}

/// Whether `e` is this communicator's own abort. After an abort every pending
/// operation fails within microseconds, and a send must be left to see that for
/// itself: a send future dropped while it holds a peer's writer leaves that
/// connection open, and the peer would never learn of the abort. So on this error
/// the joins below let their other futures run to their (quick) end.
fn is_abort(e: &Error) -> bool {
    matches!(e, Error::Aborted { .. })
}

/// Runs all futures concurrently. The first error ends it (dropping the rest),
/// except an abort, after which the rest are driven to their end first.
pub(crate) async fn try_join_all<F, T>(futs: impl IntoIterator<Item = F>) -> Result<Vec<T>>
where
    F: Future<Output = Result<T>>,
{
    let mut futs: Vec<Pin<Box<F>>> = futs.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<Result<T>>> = futs.iter().map(|_| None).collect();
    let mut left = futs.len();
    let mut failed: Option<Error> = None;
    poll_fn(|cx| {
        for (f, slot) in futs.iter_mut().zip(out.iter_mut()) {
            if slot.is_some() {
                continue;
            }
            if let Poll::Ready(r) = f.as_mut().poll(cx) {
                left -= 1;
                if let Err(e) = &r {
                    if !is_abort(e) {
                        // The first real failure is the answer, whatever the
                        // others were doing.
                        failed = Some(e.clone());
                        return Poll::Ready(());
                    }
                    failed.get_or_insert_with(|| e.clone());
                }
                *slot = Some(r);
            }
        }
        if left == 0 { Poll::Ready(()) } else { Poll::Pending }
    })
    .await;
    if let Some(e) = failed {
        return Err(e);
    }
    let mut vals = Vec::with_capacity(out.len());
    for r in out {
        match r {
            Some(Ok(v)) => vals.push(v),
            Some(Err(e)) => return Err(e),
            // Only left out when another future failed (returned above).
            None => return Err(Error::invalid("internal: join ended early")),
        }
    }
    Ok(vals)
}

/// Runs two futures concurrently, with the error rule of [`try_join_all`].
pub(crate) async fn try_join2<A, B, T, U>(a: A, b: B) -> Result<(T, U)>
where
    A: Future<Output = Result<T>>,
    B: Future<Output = Result<U>>,
{
    let (mut a, mut b) = (std::pin::pin!(a), std::pin::pin!(b));
    let (mut ra, mut rb): (Option<Result<T>>, Option<Result<U>>) = (None, None);
    poll_fn(|cx| {
        if ra.is_none() {
            if let Poll::Ready(r) = a.as_mut().poll(cx) {
                ra = Some(r);
            }
        }
        if rb.is_none() {
            if let Poll::Ready(r) = b.as_mut().poll(cx) {
                rb = Some(r);
            }
        }
        let fatal_a = matches!(&ra, Some(Err(e)) if !is_abort(e));
        let fatal_b = matches!(&rb, Some(Err(e)) if !is_abort(e));
        if fatal_a || fatal_b || (ra.is_some() && rb.is_some()) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
    .await;
    match (ra, rb) {
        (Some(Ok(x)), Some(Ok(y))) => Ok((x, y)),
        (Some(Err(e)), _) | (_, Some(Err(e))) => Err(e),
        _ => Err(Error::invalid("internal: join ended early")),
    }
}

/// `bytes` cut into consecutive parts of `lens` bytes.
pub(crate) fn split_bytes<'b>(mut bytes: &'b mut [u8], lens: &[usize]) -> Result<Vec<&'b mut [u8]>> {
    let mut parts = Vec::with_capacity(lens.len());
    for &len in lens {
        let (part, rest) = std::mem::take(&mut bytes)
            .split_at_mut_checked(len)
            .ok_or_else(|| Error::invalid("internal: parts longer than the buffer"))?;
        parts.push(part);
        bytes = rest;
    }
    Ok(parts)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[tokio::test]
    async fn a_real_failure_is_reported_even_with_others_pending() {
        let lost = || Error::PeerLost {
            rank: multiworld_types::Rank(2),
            cause: std::sync::Arc::from("connection closed by peer"),
        };
        let futs: Vec<std::pin::Pin<Box<dyn Future<Output = Result<u32>> + Send>>> = vec![
            Box::pin(std::future::pending()),
            Box::pin(async move { Err(lost()) }),
            Box::pin(async { Ok(1) }),
        ];
        match try_join_all(futs).await {
            Err(Error::PeerLost { rank, .. }) => assert_eq!(rank, multiworld_types::Rank(2)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn split_bytes_cuts_consecutive_parts() {
        let mut v: Vec<u8> = (0..10).collect();
        let parts = split_bytes(&mut v, &[3, 0, 5]).unwrap();
        assert_eq!(
            parts.iter().map(|p| p.to_vec()).collect::<Vec<_>>(),
            vec![vec![0, 1, 2], vec![], vec![3, 4, 5, 6, 7]]
        );
        assert!(split_bytes(&mut v, &[6, 5]).is_err(), "longer than the buffer");
    }

    #[test]
    fn segments() {
        let s = even_segments(10, 4);
        assert_eq!(s, vec![0..3, 3..6, 6..8, 8..10]);
        let s = even_segments(2, 4);
        assert_eq!(s, vec![0..1, 1..2, 2..2, 2..2]);
        assert_eq!(even_segments(0, 3), vec![0..0, 0..0, 0..0]);
        assert_eq!(segments_of([2, 0, 3]), vec![0..2, 2..2, 2..5]);
    }

    #[test]
    fn split_two_segments() {
        let mut d = [0, 1, 2, 3, 4, 5];
        let (a, b) = split2(&mut d, 0..2, 4..6).unwrap();
        assert_eq!(a, &[0, 1]);
        b[0] = 40;
        let (a, b) = split2(&mut d, 4..6, 1..3).unwrap();
        assert_eq!(a, &[40, 5]);
        assert_eq!(b, &mut [1, 2]);
        let (a, b) = split2(&mut d, 2..2, 2..2).unwrap();
        assert!(a.is_empty() && b.is_empty());
        let (a, b) = split2(&mut d, 3..3, 0..6).unwrap();
        assert!(a.is_empty() && b.len() == 6);
        let (a, b) = split2(&mut d, 0..6, 6..6).unwrap();
        assert!(a.len() == 6 && b.is_empty());
        assert!(split2(&mut d, 0..3, 2..4).is_err());
    }

    #[test]
    fn pool_reuses_and_bounds() {
        let mut p = Scratch::new(100);
        let t = p.take(DType::F32, 10).unwrap();
        let ptr = t.as_bytes().as_ptr();
        p.give(t);
        assert_eq!(p.held(), 40);
        let t = p.take(DType::F32, 10).unwrap();
        assert_eq!(t.as_bytes().as_ptr(), ptr);
        assert_eq!(p.held(), 0);
        p.give(t);
        p.give(Tensor::zeros(DType::U8, [50]).unwrap());
        p.give(Tensor::zeros(DType::U8, [30]).unwrap());
        assert!(p.held() <= 100);
        p.give(Tensor::zeros(DType::U8, [500]).unwrap());
        assert!(p.held() <= 100);
        p.clear();
        assert_eq!(p.held(), 0);
    }

    #[test]
    fn views_and_join() {
        let t = Tensor::from(vec![1u16, 2, 3, 4]);
        let v = view_range(&t, 1..3).unwrap();
        assert_eq!(v.numel(), 2);
        assert!(view_range(&t, 3..5).is_err());
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let r = rt.block_on(try_join_all((0..3).map(|i| async move { Ok::<_, Error>(i * 2) })));
        assert_eq!(r.unwrap(), vec![0, 2, 4]);
        let r =
            rt.block_on(try_join_all((0..3).map(|i| async move {
                if i == 1 { Err(Error::invalid("x")) } else { Ok(i) }
            })));
        assert!(r.is_err());
        // An ordinary error ends the join at once; an abort lets the others finish.
        let pending = || std::future::pending::<Result<()>>();
        let r = rt.block_on(try_join2(async { Err::<(), _>(Error::invalid("x")) }, pending()));
        assert!(r.is_err());
        let done = std::cell::Cell::new(false);
        let aborted = async { Err::<(), _>(Error::Aborted { reason: "a".into() }) };
        let other = async {
            tokio::task::yield_now().await;
            done.set(true);
            Ok(())
        };
        assert!(matches!(
            rt.block_on(try_join2(aborted, other)),
            Err(Error::Aborted { .. })
        ));
        assert!(done.get());
    }
}
