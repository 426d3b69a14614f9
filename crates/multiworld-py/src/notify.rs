//! `Notifier`: how background operations tell an asyncio event loop that they
//! finished, without Rust ever calling into Python.
//!
//! A notifier is a socket pair and a list of finished tokens. When an
//! operation registered with [`Completion::notify`] finishes (or is cancelled),
//! its task pushes the token and, if the list was empty, writes one byte to the
//! socket. The event loop watches the other end (`loop.add_reader(fileno)`)
//! and, when it is readable, calls `drain()` to get every finished token at
//! once. One wake-up of the loop covers any number of operations that finished
//! together, and no thread waits per operation. An operation that has no task
//! (`crate::polled`) is polled by the loop with [`Notifier::waker`], which
//! pushes the token each time it is woken.

use std::{
    io::{ErrorKind, Read, Write},
    os::{fd::AsRawFd, unix::net::UnixStream},
    sync::{Arc, Mutex, PoisonError},
    task::{Wake, Waker},
};

use pyo3::{exceptions::PyOSError, prelude::*};

struct Inner {
    /// The loop's end (non-blocking): readable while tokens wait.
    rx: UnixStream,
    /// The tasks' end (non-blocking).
    tx: UnixStream,
    ready: Mutex<Vec<u64>>,
}

impl Inner {
    fn fire(&self, token: u64) {
        let was_empty = {
            let mut ready = self.ready.lock().unwrap_or_else(PoisonError::into_inner);
            ready.push(token);
            ready.len() == 1
        };
        if was_empty {
            // A full socket buffer means the loop has a wake-up pending
            // already; any other error means the loop's end is gone.
            let _ = (&self.tx).write(&[1]);
        }
    }
}

/// Pushes one token each time it is woken: the waker of an operation polled
/// by the event loop (`crate::polled`). A wake-up before the operation's end
/// only makes the loop poll it again.
struct TokenWake {
    inner: Arc<Inner>,
    token: u64,
}

impl Wake for TokenWake {
    fn wake(self: Arc<Self>) {
        self.inner.fire(self.token);
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.inner.fire(self.token);
    }
}

/// A wake-up channel from the runtime's tasks to one asyncio event loop.
#[pyclass(module = "multiworld_rs._native", frozen)]
pub struct Notifier {
    inner: Arc<Inner>,
}

impl Notifier {
    /// A waker that pushes `token` to this notifier.
    pub fn waker(&self, token: u64) -> Waker {
        Waker::from(Arc::new(TokenWake {
            inner: Arc::clone(&self.inner),
            token,
        }))
    }
}

#[pymethods]
impl Notifier {
    #[new]
    fn new() -> PyResult<Notifier> {
        let (rx, tx) = UnixStream::pair().map_err(|e| PyOSError::new_err(e.to_string()))?;
        rx.set_nonblocking(true)
            .and_then(|()| tx.set_nonblocking(true))
            .map_err(|e| PyOSError::new_err(e.to_string()))?;
        Ok(Notifier {
            inner: Arc::new(Inner {
                rx,
                tx,
                ready: Mutex::new(Vec::new()),
            }),
        })
    }

    /// The file descriptor to watch for readability.
    fn fileno(&self) -> i32 {
        self.inner.rx.as_raw_fd()
    }

    /// Empties the socket and returns the tokens of every operation that
    /// finished since the last call (possibly none).
    fn drain(&self) -> Vec<u64> {
        let mut buf = [0u8; 256];
        loop {
            match (&self.inner.rx).read(&mut buf) {
                Ok(n) if n == buf.len() => continue,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                // Emptied (short read or WouldBlock), or the other end is
                // gone (it never is while `inner` lives).
                _ => break,
            }
        }
        std::mem::take(&mut *self.inner.ready.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

#[derive(Default)]
struct Registration {
    finished: bool,
    target: Option<(Arc<Inner>, u64)>,
}

/// The finishing side of one background operation: dropped by its task when
/// the operation ends, however it ends (done, failed, or cancelled: the task's
/// future is dropped then too).
#[derive(Clone, Default)]
pub struct Completion {
    reg: Arc<Mutex<Registration>>,
}

impl Completion {
    /// A guard to move into the operation's task; dropping it fires.
    pub fn guard(&self) -> CompletionGuard {
        CompletionGuard(self.clone())
    }

    /// Asks for `token` to be pushed to `notifier` when the operation ends
    /// (at once if it has ended). A later call replaces an earlier one.
    pub fn notify(&self, notifier: &Notifier, token: u64) {
        let fire_now = {
            let mut reg = self.reg.lock().unwrap_or_else(PoisonError::into_inner);
            if reg.finished {
                true
            } else {
                reg.target = Some((Arc::clone(&notifier.inner), token));
                false
            }
        };
        if fire_now {
            notifier.inner.fire(token);
        }
    }
}

/// Fires its operation's notification when dropped.
pub struct CompletionGuard(Completion);

impl Drop for CompletionGuard {
    fn drop(&mut self) {
        let target = {
            let mut reg = self.0.reg.lock().unwrap_or_else(PoisonError::into_inner);
            reg.finished = true;
            reg.target.take()
        };
        if let Some((inner, token)) = target {
            inner.fire(token);
        }
    }
}
