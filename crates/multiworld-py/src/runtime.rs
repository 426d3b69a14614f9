//! The one Tokio runtime of the process, and how Python threads wait on it.
//!
//! Every blocking call of the package goes through [`wait`] (or
//! [`wait_moving`]): a first poll with the GIL held when the operation moves
//! at most [`held_poll_max`] bytes (a result already there costs no release
//! of the GIL), then, with the GIL released, the future polled on the
//! calling thread (inside the runtime's context, parked between polls) in
//! slices of [`SLICE`], and between slices Python's signal
//! handlers, so Ctrl-C interrupts a waiting call on the main thread within
//! one slice (the future is then dropped; see `docs/python.md` for what that
//! means for each operation). Before it parks, a call may poll its operation
//! for a short while ([`set_spin`], off by default), which saves the wake-up
//! of a parked thread when the result is close. How much an asyncio receive
//! copies on the event loop's thread is [`loop_copy_max`], and whether it
//! reads a small held-back message itself is [`loop_leaves_held`]. Rust
//! tasks never call into Python.
//!
//! The runtime remembers the pid that created it. A child made by `fork()`
//! inherits the memory of the runtime but none of its threads, so any use of
//! it there would hang: such a child gets [`ForkedProcessError`] instead, and
//! objects it inherited are leaked, never dropped, in the child (dropping them
//! would touch the dead runtime).

use std::{
    future::Future,
    pin::Pin,
    sync::{
        Arc, OnceLock,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    },
    task::{Context, Poll, Wake, Waker},
    time::{Duration, Instant},
};

use pyo3::prelude::*;

use crate::errors;

/// How long a blocking call runs without the GIL before Python's signal
/// handlers get a chance (the bound on Ctrl-C latency).
pub const SLICE: Duration = Duration::from_millis(50);

struct Shared {
    rt: tokio::runtime::Runtime,
    pid: u32,
    /// Whether [`FORKED`] is kept up to date (its fork handler registered);
    /// if not, every check asks the kernel for the pid.
    fork_watched: bool,
}

/// Set in a child process by `fork()` (a `pthread_atfork` handler), so that
/// the check on every call is a load, not a `getpid` system call. Every fork
/// that runs the handlers is seen (`os.fork`, multiprocessing's fork start
/// method, C code calling `fork`); a child made without them (raw `clone`,
/// `vfork` or `_Fork`) and calling into the package before it execs is not.
static FORKED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_fork_child() {
    FORKED.store(true, Ordering::Relaxed);
}

/// Registers [`on_fork_child`]; false if that failed.
#[allow(unsafe_code)]
fn watch_forks() -> bool {
    // SAFETY: the handler only stores to an atomic (async-signal-safe, as a
    // handler run in a forked child must be), and it lives for the whole
    // program (a plain function, never unloaded: the extension module is
    // never unloaded by CPython).
    unsafe { libc::pthread_atfork(None, None, Some(on_fork_child)) == 0 }
}

impl Shared {
    fn in_forked_child(&self) -> bool {
        if self.fork_watched {
            FORKED.load(Ordering::Relaxed)
        } else {
            self.pid != std::process::id()
        }
    }
}

static RUNTIME: OnceLock<Result<Shared, String>> = OnceLock::new();

fn build() -> Result<Shared, String> {
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 8));
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name("multiworld-rt")
        .enable_all()
        .build()
        .map(|rt| Shared {
            rt,
            pid: std::process::id(),
            fork_watched: watch_forks(),
        })
        .map_err(|e| format!("cannot start the multiworld runtime: {e}"))
}

/// True when this process is not the one that started the runtime (a forked
/// child); false when the runtime is not started yet.
pub fn is_forked_child() -> bool {
    matches!(RUNTIME.get(), Some(Ok(s)) if s.in_forked_child())
}

/// The runtime, started on first use; an error in a forked child.
pub fn runtime() -> PyResult<&'static tokio::runtime::Runtime> {
    match RUNTIME.get_or_init(build) {
        Ok(s) if !s.in_forked_child() => Ok(&s.rt),
        Ok(s) => Err(errors::forked(s.pid)),
        Err(e) => Err(pyo3::exceptions::PyRuntimeError::new_err(e.clone())),
    }
}

/// Runs `fut` to completion on the calling thread, inside the runtime's
/// context, with the GIL released, checking for signals (KeyboardInterrupt)
/// every [`SLICE`]. On an exception from a signal handler, `fut` is dropped
/// (cancelled) and the exception returned.
///
/// A future that is ready at once (a send that fits the socket's buffer, a
/// receive whose message is already here) completes in a first poll, with
/// the GIL held, without releasing the GIL: that poll does no more than any
/// other (Rust tasks never call into Python, so holding the GIL cannot
/// block them).
/// For operations that move more than [`held_poll_max`] bytes, use
/// [`wait_moving`].
pub fn wait<F>(py: Python<'_>, fut: F) -> PyResult<F::Output>
where
    F: Future + Send,
    F::Output: Send,
{
    wait_moving(py, 0, fut)
}

/// The most bytes an operation may move for [`wait_moving`] to make its
/// first poll with the GIL held (`MULTIWORLD_PY_HELD_COPY_MAX` sets it;
/// 16 KiB by default). That poll copies whatever is already there (a
/// message read ahead, or waiting whole in the socket, into the receive's
/// array; a send's bytes into the socket), and while it copies every other
/// Python thread of the process waits for the GIL.
pub fn held_poll_max() -> usize {
    static MAX: OnceLock<usize> = OnceLock::new();
    *MAX.get_or_init(|| bytes_from_env("MULTIWORLD_PY_HELD_COPY_MAX").unwrap_or(16 << 10))
}

/// The most bytes an asyncio receive copies on the event loop's thread
/// ([`set_loop_copy_max`], or `MULTIWORLD_PY_LOOP_COPY_MAX` in the
/// environment): a larger message is received by a task of the runtime, on
/// one of its threads, and the loop only learns that it is in. By default
/// 256 KiB on a machine with more than two CPUs, where the runtime's
/// threads copy beside the loop (on a 16-core machine, an asyncio leader
/// of 1 MiB messages from four workers went from 0.42–0.44x to
/// 0.80–0.94x the Rust API's rate), and no limit on one with two or fewer,
/// where a copy off the loop's thread waits for a core and costs two
/// hand-offs (on two cores, reading such messages in the call took the
/// asyncio leaders of 1 MiB messages from 0.59–0.73x to 0.79–0.98x).
/// Below about 256 KiB, a round through the loop costs the loop more than
/// the copy it saves (64 KiB messages off the loop: 0.27–0.31x, against
/// 0.42–0.87x on it, on the 16 cores).
pub fn loop_copy_max() -> usize {
    loop_copy_setting().load(Ordering::Relaxed)
}

/// Sets [`loop_copy_max`] for every asyncio receive of the process started
/// from now on.
pub fn set_loop_copy_max(bytes: usize) {
    loop_copy_setting().store(bytes, Ordering::Relaxed);
}

fn loop_copy_setting() -> &'static AtomicUsize {
    static MAX: OnceLock<AtomicUsize> = OnceLock::new();
    MAX.get_or_init(|| {
        AtomicUsize::new(bytes_from_env("MULTIWORLD_PY_LOOP_COPY_MAX").unwrap_or_else(|| {
            if more_than_two_cpus() {
                256 << 10
            } else {
                usize::MAX
            }
        }))
    })
}

/// Whether an asyncio receive posted on the event loop's thread leaves a
/// message small enough to be read ahead, which its connection's reader
/// holds back for the moment, to that reader (woken to read it) rather
/// than reading it from the socket in the call ([`set_loop_leaves_held`],
/// or `MULTIWORLD_PY_LOOP_LEAVES_HELD=0|1` in the environment). By default
/// on a machine with more than two CPUs, where the loop's one thread is
/// what a leader runs short of; not on one with two or fewer, where what
/// counts is the CPU a message costs in all, and the reader's wake-up and
/// hand-off back to the loop cost more than the read: on 2 cores, reading
/// in the call took an asyncio leader of 64 KiB messages from 32–35 to
/// 29–33 µs of CPU per message over all processes, and its rate up by
/// 5–7 % in the medians (docs/benchmarks.md, "Reading held-back messages
/// in the call on two cores").
pub fn loop_leaves_held() -> bool {
    loop_leaves_setting().load(Ordering::Relaxed)
}

/// Sets [`loop_leaves_held`] for every asyncio receive of the process
/// posted from now on.
pub fn set_loop_leaves_held(on: bool) {
    loop_leaves_setting().store(on, Ordering::Relaxed);
}

fn loop_leaves_setting() -> &'static AtomicBool {
    static ON: OnceLock<AtomicBool> = OnceLock::new();
    ON.get_or_init(|| {
        let from_env = std::env::var("MULTIWORLD_PY_LOOP_LEAVES_HELD").ok();
        AtomicBool::new(match from_env.as_deref().map(str::trim) {
            Some("1") => true,
            Some("0") => false,
            _ => more_than_two_cpus(),
        })
    })
}

/// Whether this machine has more than two CPUs (the defaults that trade
/// the event loop's time against the CPU a message costs in all).
fn more_than_two_cpus() -> bool {
    std::thread::available_parallelism().is_ok_and(|n| n.get() > 2)
}

/// A byte count from the environment variable `name` (`None` if unset or
/// not a whole number).
fn bytes_from_env(name: &str) -> Option<usize> {
    std::env::var(name).ok()?.trim().parse().ok()
}

/// [`wait`] for an operation that moves `bytes` bytes through the calling
/// thread: above [`held_poll_max`], even its first poll runs with the GIL
/// released, so that its copy runs beside the other Python threads of the
/// process instead of holding them up (releasing and taking back the GIL
/// costs a single thread about 0.25 µs per call).
pub fn wait_moving<F>(py: Python<'_>, bytes: usize, fut: F) -> PyResult<F::Output>
where
    F: Future + Send,
    F::Output: Send,
{
    // Pinned once, here: an operation's future can be tens of KiB (a
    // collective's is), and each move on the way down copied all of it
    // (a call on a world of one spent about half its time in such copies).
    let fut = std::pin::pin!(fut);
    // This thread runs no runtime tasks: a receive whose message is here
    // need not yield its turn to any (see `multiworld::without_pacing`).
    multiworld::without_pacing(|| wait_on_runtime(py, fut, bytes <= held_poll_max()))
}

fn wait_on_runtime<F>(py: Python<'_>, mut fut: Pin<&mut F>, poll_held: bool) -> PyResult<F::Output>
where
    F: Future + Send,
    F::Output: Send,
{
    let rt = runtime()?;
    // A poll outside `drive_for`, inside the runtime's context (for the
    // sockets and timers the poll touches); the no-op waker is replaced by
    // this thread's at the next poll.
    let poll_now = |fut: Pin<&mut F>| {
        let _guard = rt.enter();
        fut.poll(&mut Context::from_waker(Waker::noop()))
    };
    if poll_held {
        if let Poll::Ready(out) = poll_now(fut.as_mut()) {
            return Ok(out);
        }
    }
    let spin = spin();
    let mut first = true;
    loop {
        // With the GIL released this thread only waits for `fut`: waits that
        // would sleep on a blocking-pool thread sleep here instead (a device
        // wait would otherwise spend its eager polls here and then hand
        // itself to the pool).
        let slice = py.detach(|| {
            multiworld::as_blocking_caller(|| {
                if std::mem::take(&mut first) && !spin.is_zero() {
                    let until = Instant::now() + spin;
                    loop {
                        if let Poll::Ready(out) = poll_now(fut.as_mut()) {
                            return Some(out);
                        }
                        if Instant::now() >= until {
                            break;
                        }
                        std::thread::yield_now();
                    }
                }
                drive_for(rt, fut.as_mut(), SLICE)
            })
        });
        match slice {
            Some(out) => return Ok(out),
            None => py.check_signals()?,
        }
    }
}

/// Wakes the thread it was made on (the waker [`drive_for`] polls with):
/// sets `woken`, then unparks it. The flag, not the thread's park token
/// alone, says whether to poll again, so a wake whose token other code on
/// the thread consumed during a poll (anything that parks the thread, as a
/// blocking channel does) is still seen.
struct Unpark {
    thread: std::thread::Thread,
    woken: AtomicBool,
}

impl Unpark {
    fn for_this_thread() -> Arc<Unpark> {
        Arc::new(Unpark {
            thread: std::thread::current(),
            woken: AtomicBool::new(false),
        })
    }
}

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.thread.unpark();
    }
}

thread_local! {
    /// This thread's [`Unpark`], made once per thread.
    static UNPARK: Arc<Unpark> = Unpark::for_this_thread();
}

/// Polls `fut` on this thread, inside the runtime's context, until it is
/// ready (`Some`) or `slice` has passed (`None`), the thread parked between
/// polls until `fut`'s waker wakes it. Unlike the runtime's `block_on` with
/// a timer for the slice, the wait adds no timer of its own: a timer due
/// before every other one the runtime holds makes the runtime wake a parked
/// worker thread to rearm its clock, which a wait should not cost. A stray
/// wake (a waker that fires after its future is done) only makes one extra
/// poll. Polls run outside any task, so Tokio's cooperative budget does
/// not split a run of ready operations (as with the first poll of
/// [`wait`]); the slice is checked between polls.
fn drive_for<F: Future>(
    rt: &tokio::runtime::Runtime,
    mut fut: Pin<&mut F>,
    slice: Duration,
) -> Option<F::Output> {
    // A thread whose locals are being torn down gets a waker of its own.
    let me = UNPARK
        .try_with(Arc::clone)
        .unwrap_or_else(|_| Unpark::for_this_thread());
    let waker = Waker::from(Arc::clone(&me));
    let mut cx = Context::from_waker(&waker);
    let until = Instant::now() + slice;
    loop {
        // Any wake from here on, during the poll too, means: poll again.
        me.woken.store(false, Ordering::Relaxed);
        let polled = {
            let _guard = rt.enter();
            fut.as_mut().poll(&mut cx)
        };
        if let Poll::Ready(out) = polled {
            return Some(out);
        }
        // The slice is checked after every poll, woken or not: a future
        // that wakes itself as it returns (a yield) is polled again and
        // again, and must still let the caller check for signals.
        loop {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            if me.woken.swap(false, Ordering::Acquire) {
                break;
            }
            std::thread::park_timeout(left);
        }
    }
}

/// Nanoseconds a blocking call polls before it parks (see [`set_spin`]);
/// `u64::MAX`: not read from the environment yet.
static SPIN_NS: AtomicU64 = AtomicU64::new(u64::MAX);

/// How long a blocking call polls its operation, with the GIL released,
/// before its thread parks: `MULTIWORLD_PY_SPIN_US` (microseconds) until
/// [`set_spin`] says otherwise; zero by default.
pub fn spin() -> Duration {
    let ns = SPIN_NS.load(Ordering::Relaxed);
    if ns != u64::MAX {
        return Duration::from_nanos(ns);
    }
    let from_env = std::env::var("MULTIWORLD_PY_SPIN_US")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(Duration::ZERO, Duration::from_micros)
        .min(SLICE);
    set_spin(from_env);
    from_env
}

/// Sets how long every blocking call of the process polls its operation
/// before parking its thread. A result that arrives meanwhile is taken
/// without the wake-up of a parked thread (a few microseconds each on a
/// busy machine), at the price of that much CPU per blocking wait (the
/// polling thread yields to runnable threads between polls).
pub fn set_spin(spin: Duration) {
    let ns = u64::try_from(spin.as_nanos())
        .unwrap_or(u64::MAX - 1)
        .min(u64::MAX - 1);
    SPIN_NS.store(ns, Ordering::Relaxed);
}

/// Like [`wait`], but gives up after `timeout` (`None`: never), returning
/// `Ok(None)`.
pub fn wait_for<F>(py: Python<'_>, fut: F, timeout: Option<Duration>) -> PyResult<Option<F::Output>>
where
    F: Future + Send,
    F::Output: Send,
{
    match timeout {
        None => wait(py, fut).map(Some),
        Some(after) => wait(py, async move { tokio::time::timeout(after, fut).await.ok() }),
    }
}

/// Runs `f` inside the runtime's context (for constructors and drops of
/// runtime objects that need one).
pub fn enter<R>(f: impl FnOnce() -> R) -> PyResult<R> {
    let rt = runtime()?;
    let _guard = rt.enter();
    Ok(f())
}

/// Drops a runtime object: inside the runtime's context normally, leaked in a
/// forked child (where dropping would touch a runtime without threads).
pub fn release<T>(value: T) {
    if is_forked_child() {
        std::mem::forget(value);
        return;
    }
    match RUNTIME.get() {
        Some(Ok(s)) => {
            let _guard = s.rt.enter();
            drop(value);
        }
        _ => drop(value),
    }
}

/// Converts a Python timeout in seconds (`None`: no timeout) to a duration,
/// refusing negative, NaN or absurd values with a `ValueError` naming them.
pub fn seconds(what: &str, value: Option<f64>) -> PyResult<Option<Duration>> {
    match value {
        None => Ok(None),
        Some(s) => Duration::try_from_secs_f64(s).map(Some).map_err(|_| {
            pyo3::exceptions::PyValueError::new_err(format!(
                "{what} must be a non-negative number of seconds, got {s}"
            ))
        }),
    }
}
