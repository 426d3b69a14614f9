//! An operation whose handle needs no task: its future only waits for the
//! runtime to act (a posted receive, which the connection's reader fills)
//! and is polled by whoever waits on the handle — a blocking `wait` on its
//! own thread, or the asyncio bridge with a waker that pushes the handle's
//! token to the event loop's notifier. Compared with running the future as
//! a task, that saves waking a runtime thread to start the task and the
//! hand-off from the task to the waiter when it ends.

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll, ready},
};

use multiworld::WorldError;

use crate::{notify::CompletionGuard, world::Done};

/// The operation's future.
pub type Op = Pin<Box<dyn Future<Output = Result<Done, WorldError>> + Send>>;

/// How an operation behind a handle ended.
pub enum Ended {
    /// It ran to its end (successfully or with the world's error).
    Done(Result<Done, WorldError>),
    /// It was cancelled before its end.
    Cancelled,
    /// Its task failed (panicked).
    Failed(String),
}

/// The state of a polled operation: running (its future), or ended (its
/// outcome, until taken). Its [`CompletionGuard`] fires when it ends.
pub struct Polled {
    fut: Option<Op>,
    out: Option<Ended>,
    guard: Option<CompletionGuard>,
}

impl Polled {
    /// A running operation; `guard` fires when it ends.
    pub fn new(fut: Op, guard: CompletionGuard) -> Polled {
        Polled {
            fut: Some(fut),
            out: None,
            guard: Some(guard),
        }
    }

    /// Polls the operation: ready once it has ended (at once after that).
    /// Polled on threads that run no runtime tasks, so a receive whose
    /// message is here never yields its turn (`multiworld::without_pacing`).
    pub fn poll_end(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.out.is_none() {
            let Some(f) = self.fut.as_mut() else {
                // Unreachable: the future goes only when the outcome comes.
                return Poll::Ready(());
            };
            let r = ready!(multiworld::without_pacing(|| f.as_mut().poll(cx)));
            self.end(Ended::Done(r));
        }
        Poll::Ready(())
    }

    /// Ends an operation that has not ended by dropping its future (which
    /// withdraws a receive); no effect on one that has.
    pub fn cancel(&mut self) {
        if self.out.is_none() {
            self.end(Ended::Cancelled);
        }
    }

    /// The outcome, once [`Polled::poll_end`] was ready or after
    /// [`Polled::cancel`].
    pub fn take(&mut self) -> Ended {
        self.out
            .take()
            .unwrap_or_else(|| Ended::Failed("internal: the outcome was taken twice".into()))
    }

    fn end(&mut self, how: Ended) {
        self.out = Some(how);
        self.fut = None;
        self.guard = None; // fires the completion
    }
}
