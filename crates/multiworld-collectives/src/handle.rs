//! [`CollectiveHandle`]: the handle form of a collective call, like torch's
//! `async_op=True` work object. The call runs on its own Tokio task; its place in
//! the group's order was taken when the handle was created.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::task::JoinHandle;

use multiworld_tcp::{Error, Result};

/// A collective call in progress. Await it (it is a `Future`) or call
/// [`CollectiveHandle::wait`] to get the outcome (the output buffers, which the
/// call owned meanwhile). Dropping the handle does **not** cancel the call: a
/// collective must run to its end on every member to keep the group in step, so
/// it finishes in the background and its buffers are then dropped.
#[must_use = "dropping a CollectiveHandle lets the call finish in the background; await it to see errors"]
pub struct CollectiveHandle<T> {
    state: State<T>,
}

enum State<T> {
    Ready(Option<Result<T>>),
    Running(JoinHandle<Result<T>>),
}

// No pinned data is projected: the join handle is `Unpin` and the ready value is
// only moved out.
impl<T> Unpin for CollectiveHandle<T> {}

impl<T> std::fmt::Debug for CollectiveHandle<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CollectiveHandle")
            .field("completed", &self.is_completed())
            .finish()
    }
}

impl<T> CollectiveHandle<T> {
    pub(crate) fn ready(r: Result<T>) -> Self {
        CollectiveHandle {
            state: State::Ready(Some(r)),
        }
    }

    pub(crate) fn running(j: JoinHandle<Result<T>>) -> Self {
        CollectiveHandle {
            state: State::Running(j),
        }
    }

    /// True once the call finished (successfully or not).
    pub fn is_completed(&self) -> bool {
        match &self.state {
            State::Ready(_) => true,
            State::Running(j) => j.is_finished(),
        }
    }

    /// Waits for the outcome. The call's own deadline applies
    /// (`CollectiveConfig::timeout` or the communicator's `op_timeout`).
    pub async fn wait(self) -> Result<T> {
        self.await
    }
}

impl<T> Future for CollectiveHandle<T> {
    type Output = Result<T>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        match &mut this.state {
            State::Ready(r) => Poll::Ready(
                r.take()
                    .unwrap_or_else(|| Err(Error::invalid("CollectiveHandle polled after completion"))),
            ),
            State::Running(j) => match Pin::new(j).poll(cx) {
                Poll::Pending => Poll::Pending,
                Poll::Ready(Ok(r)) => {
                    this.state = State::Ready(None);
                    Poll::Ready(r)
                }
                Poll::Ready(Err(e)) => {
                    this.state = State::Ready(None);
                    if e.is_panic() {
                        std::panic::resume_unwind(e.into_panic());
                    }
                    Poll::Ready(Err(Error::Aborted {
                        reason: Arc::from("collective task cancelled (runtime shutting down)"),
                    }))
                }
            },
        }
    }
}
