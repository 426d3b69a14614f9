//! The [`Communicator`]: one world, one rank, its sockets and tasks, and the
//! point-to-point operations on them. Each peer connection has a reader task that
//! decodes frames and routes each message to the earliest posted receive that
//! matches `(source, tag)`: the payload is read straight from the socket into that
//! receive's buffer. A message whose receive is not posted yet is buffered only if
//! it is small (`eager_limit`) and the peer's budget (`unexpected_budget`) allows,
//! or if some other receive is waiting behind it on the same connection; otherwise
//! the reader stops reading that socket until a receive is posted (TCP
//! backpressure); meanwhile it parks its end of the connection
//! (`crate::parking`), and the call that posts the receive reads what the
//! socket holds itself (`Inner::read_parked`). Sends write the header and the caller's bytes straight to the
//! socket (one vectored write, no copy) under a per-peer FIFO writer lock, which is
//! what keeps messages to one peer in call order. A failed connection fails every
//! pending operation involving that peer at once and is reported as a
//! [`HealthEvent`]; [`Communicator::abort`] fails everything of this world and
//! releases its sockets, tasks and buffers. Nothing here is shared with any other
//! communicator.
//!
//! "Socket" here means the connection's link (`crate::link`): a TCP socket, or,
//! in a world built in memory (feature `memory`), an in-process pipe that
//! behaves like one.
//!
//! Lock order: a peer's writer lock (async, held across the socket write) may be
//! held while taking the matching lock (sync, never held across `.await`); never the
//! other way round.

use std::future::{Future, poll_fn};
use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::sync::{Notify, broadcast, futures::Notified, oneshot};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use crate::config::CommConfig;
use crate::error::{Error, MessageDesc, Result};
use crate::frame::{self, FrameHeader, FrameKind, HEADER_LEN, RxSequencer};
use crate::link::{ReadLink, WriteLink};
use crate::mesh;
use crate::rendezvous::Rendezvous;
use multiworld_types::{DType, Tensor, TensorView, valid_bool_bytes};

use crate::matching::{Matching, Posted, RecvDone, Route, StashData, Stashed, reopens};
use crate::parking::{Frame, GivenBack, Held, Parking};
use multiworld_types::{Generation, Identity, Rank, Source, Tag, WorldName};

/// Capacity of each connection's read buffer. Headers and small messages come in
/// with one read; larger payloads bypass it and land in the receive buffer.
const READ_BUF: usize = 16 << 10;
/// Most bytes a payload read of unknown length grows its buffer by at once (the
/// declared length of a frame is not trusted for allocation).
const GROW_STEP: usize = 64 << 10;
/// While a reader holds back (no receive posted, no room to buffer), how often it
/// checks whether the peer closed or reset the connection. Bounds failure
/// detection in that state.
const CLOSED_POLL: Duration = Duration::from_millis(10);
/// Largest payload that the thread posting its receive reads itself, from a
/// frame its connection's reader holds back (`Inner::read_parked`): what the
/// socket holds is copied in the posting call, which an event loop's thread
/// must not spend milliseconds on; larger payloads are the reader's.
const READ_IN_CALL_MAX: usize = 4 << 20;
/// How long [`Communicator::close`] waits for its peers to answer its goodbye
/// before it cuts the rest off with a reset. An answering peer takes well
/// under a millisecond on one host.
pub const CLOSE_LIMIT: Duration = Duration::from_secs(1);

/// Something that happened to the world's connections, for a watchdog.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum HealthEvent {
    /// The connection to `rank` failed or was closed; operations with it now fail.
    PeerLost {
        /// The peer.
        rank: Rank,
        /// Why.
        cause: Arc<str>,
    },
    /// The communicator was aborted.
    Aborted {
        /// Why.
        reason: Arc<str>,
    },
}

/// A snapshot of the communicator's health.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Health {
    /// Set once the communicator is aborted, or once [`Communicator::close`]
    /// has begun (`"closed"`: from then on every operation fails with
    /// [`Error::Aborted`], and peers that answered the goodbye show as lost).
    pub aborted: Option<Arc<str>>,
    /// Lost peers and why, in rank order.
    pub lost: Vec<(Rank, Arc<str>)>,
}

impl Health {
    /// Not aborted and no peer lost.
    pub fn is_healthy(&self) -> bool {
        self.aborted.is_none() && self.lost.is_empty()
    }
}

/// Traffic counters of one peer connection (monotonic; also a progress signal: a
/// large transfer moves `bytes_received`, and the peer's "last heard" time, with
/// every read that returns payload bytes, however slowly they arrive).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PeerStats {
    /// The peer.
    pub rank: Rank,
    /// Payload bytes written to the peer.
    pub bytes_sent: u64,
    /// Payload bytes read from the peer.
    pub bytes_received: u64,
    /// Messages fully written.
    pub messages_sent: u64,
    /// Messages fully read.
    pub messages_received: u64,
    /// Of those, messages whose payload the receiving call read itself: the
    /// connection's reader had held the message back for want of a receive,
    /// and the call that posted one found the payload in the socket (no
    /// hand-off between threads; see [`Communicator::irecv`]).
    pub messages_read_in_call: u64,
}

struct Counters {
    bytes_sent: AtomicU64,
    bytes_received: AtomicU64,
    messages_sent: AtomicU64,
    messages_received: AtomicU64,
    messages_read_in_call: AtomicU64,
    /// When the communicator was created; `heard_us` counts from here.
    epoch: Instant,
    /// Microseconds after `epoch` at which anything (a header, payload bytes,
    /// a heartbeat) last arrived from the peer.
    heard_us: AtomicU64,
    /// The last heartbeat sent to the peer (its sequence number, when), and
    /// the last one received from it: what a heartbeat's echo pairs up.
    heartbeats: Mutex<HeartbeatEcho>,
    /// The last heartbeat round trip, in microseconds (0: none measured yet).
    rtt_us: AtomicU64,
}

#[derive(Default)]
struct HeartbeatEcho {
    sent: Option<(u32, Instant)>,
    received: Option<(u32, Instant)>,
}

impl Counters {
    fn new(epoch: Instant) -> Counters {
        Counters {
            bytes_sent: AtomicU64::new(0),
            bytes_received: AtomicU64::new(0),
            messages_sent: AtomicU64::new(0),
            messages_received: AtomicU64::new(0),
            messages_read_in_call: AtomicU64::new(0),
            epoch,
            heard_us: AtomicU64::new(0),
            heartbeats: Mutex::new(HeartbeatEcho::default()),
            rtt_us: AtomicU64::new(0),
        }
    }

    fn heartbeats(&self) -> MutexGuard<'_, HeartbeatEcho> {
        self.heartbeats.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A heartbeat `seq` goes out at `now`: notes it, and returns the echo of
    /// the last one received.
    fn heartbeat_out(&self, seq: u32, now: Instant) -> Option<frame::Echo> {
        let mut hb = self.heartbeats();
        hb.sent = Some((seq, now));
        hb.received.map(|(their, at)| frame::Echo {
            seq: their,
            held_us: u32::try_from(now.saturating_duration_since(at).as_micros()).unwrap_or(u32::MAX),
        })
    }

    /// Heartbeat `seq` arrived at `now` with `echo`: notes it, and when the
    /// echo answers the last heartbeat sent, records the round trip.
    fn heartbeat_in(&self, seq: u32, echo: Option<frame::Echo>, now: Instant) {
        let mut hb = self.heartbeats();
        hb.received = Some((seq, now));
        if let (Some(e), Some((sent_seq, sent_at))) = (echo, hb.sent) {
            if e.seq == sent_seq {
                let rtt = now
                    .saturating_duration_since(sent_at)
                    .saturating_sub(Duration::from_micros(u64::from(e.held_us)));
                let us = u64::try_from(rtt.as_micros()).unwrap_or(u64::MAX).max(1);
                self.rtt_us.store(us, Ordering::Relaxed);
            }
        }
    }

    /// Notes that the peer showed signs of life now.
    fn heard(&self) {
        let us = self.epoch.elapsed().as_micros() as u64;
        self.heard_us.fetch_max(us, Ordering::Relaxed);
    }

    /// Counts payload bytes read (which are also signs of life).
    fn received(&self, n: usize) {
        self.bytes_received.fetch_add(n as u64, Ordering::Relaxed);
        self.heard();
    }

    fn last_heard(&self) -> Instant {
        self.epoch + Duration::from_micros(self.heard_us.load(Ordering::Relaxed))
    }
}

/// When a peer was last heard from, and whether its connection is lost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerLiveness {
    /// The peer.
    pub rank: Rank,
    /// When anything last arrived from it: a frame header, payload bytes or a
    /// heartbeat. While this side deliberately leaves the peer's data unread
    /// (no receive posted, buffer budget spent), the peer counts as heard: the
    /// stall is ours, not its. Starts at the join.
    pub last_heard: Instant,
    /// Why its connection was lost, if it was.
    pub lost: Option<Arc<str>>,
    /// Whether the peer left in an orderly way (it closed its communicator
    /// and said goodbye) rather than failing.
    pub departed: bool,
    /// The last heartbeat round trip to the peer (`None` until one was
    /// measured: heartbeats echo each other, see `frame::Echo`).
    pub heartbeat_rtt: Option<Duration>,
}

/// A completed receive: who sent it and the filled buffer.
#[derive(Debug)]
pub struct Received {
    /// The sender.
    pub src: Rank,
    /// The receive buffer, now holding the message.
    pub tensor: Tensor,
}

struct Writer {
    half: Option<WriteLink>,
    seq: u32,
}

/// The reader's side of one connection: the link, buffered, and the
/// sequence its frames must follow. Moved to the peer's parking while the
/// reader holds back a frame (`crate::parking`).
struct Link {
    rd: BufReader<ReadLink>,
    seq: RxSequencer,
}

struct Peer {
    rank: Rank,
    /// FIFO (tokio's mutex is fair), so sends to one peer go out in call order.
    writer: Arc<tokio::sync::Mutex<Writer>>,
    /// Child of the world token; cancelled when this connection is lost.
    token: CancellationToken,
    lost: OnceLock<Arc<str>>,
    /// Set when the peer said goodbye (an orderly close, not a failure).
    departed: AtomicBool,
    /// Wakes the reader when a receive is posted that it may have to see to
    /// (it may be holding back a frame for want of one), and when its parked
    /// link is given back and it is wanted.
    wake: Notify,
    /// The reader's link while it holds back a frame (see `crate::parking`).
    parking: Parking<Link>,
    counters: Counters,
}

/// Result of moving a buffered message into a receive buffer.
enum Filled {
    /// The buffer holds the message; a pooled vector may be recycled.
    Done { spare: Option<Vec<u8>> },
    /// Type or size mismatch; the data is untouched.
    Mismatch { err: Error, data: StashData },
}

fn fill(buf: &mut Tensor, from: Rank, tag: Tag, dtype: DType, data: StashData) -> Filled {
    let len = data.bytes().len();
    if buf.dtype() != dtype || buf.nbytes() != len {
        return Filled::Mismatch {
            err: mismatch(buf, from, tag, dtype, len as u64),
            data,
        };
    }
    match data {
        StashData::Bytes(v) => {
            // Validated when it arrived, so a bool buffer stays valid.
            buf.bytes_mut().copy_from_slice(&v);
            Filled::Done { spare: Some(v) }
        }
        StashData::Tensor(t) => match buf.take_storage_from(t) {
            Ok(()) => Filled::Done { spare: None },
            // Not reached: dtype and byte size were compared above.
            Err(t) => Filled::Mismatch {
                err: mismatch(buf, from, tag, dtype, len as u64),
                data: StashData::Tensor(t),
            },
        },
    }
}

fn mismatch(buf: &Tensor, from: Rank, tag: Tag, dtype: DType, len: u64) -> Error {
    Error::Mismatch {
        peer: from,
        tag,
        expected: MessageDesc {
            dtype: buf.dtype(),
            bytes: buf.nbytes() as u64,
        },
        got: MessageDesc { dtype, bytes: len },
    }
}

struct Inner {
    identity: Identity,
    cfg: CommConfig,
    local_addr: SocketAddr,
    token: CancellationToken,
    tracker: TaskTracker,
    runtime: tokio::runtime::Handle,
    peers: Vec<Option<Arc<Peer>>>,
    matching: Mutex<Matching>,
    health_tx: broadcast::Sender<HealthEvent>,
    aborted: OnceLock<Arc<str>>,
    /// Set by [`Communicator::close`] (and never cleared): operations fail
    /// with `Aborted("closed")`, connections ending are not reported, and
    /// sockets close with FIN, not RST, unless `cut_off`.
    closing: AtomicBool,
    /// Set when a close gave up waiting for its peers: the sockets still
    /// open close with RST, as in an abort.
    cut_off: AtomicBool,
    rejected: Arc<AtomicU64>,
    /// Receives in a row that found their message already here, counted
    /// when posted (see [`READY_BURST`]); reset by one that waits and when a
    /// receive yields its turn.
    ready_in_a_row: AtomicU32,
    /// Data frame headers read so far over all connections: the order in
    /// which held-back frames arrived (`parking::Frame::arrived`).
    arrivals: AtomicU64,
}

/// After this many receives in a row on one communicator whose messages had
/// already arrived, the next one yields to the runtime once before it takes
/// its message. Tokio's own budget (128 operations) bounds how long a task
/// keeps its thread in operations, not in time: a consumer that spends a
/// millisecond on each message would keep the heartbeats behind it waiting
/// for 128 ms or more. With 16, a few milliseconds of work per message still
/// leaves them their turn well within a heartbeat interval.
const READY_BURST: u32 = 16;

thread_local! {
    /// Set while [`without_pacing`] runs on this thread.
    static UNPACED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

fn paced_here() -> bool {
    !UNPACED.with(std::cell::Cell::get)
}

/// Runs `f` with the every-[`READY_BURST`] yield of receives whose messages
/// were already here turned off on this thread. For a thread that runs no
/// runtime tasks and drives its own receives (a foreign language's thread
/// polling them, or calling `block_on`): nothing shares its turn, so the
/// yield would only cost time. Tokio's cooperative budget still applies
/// where the thread polls inside `block_on`; a thread that polls outside
/// any task has none to spend.
pub fn without_pacing<T>(f: impl FnOnce() -> T) -> T {
    with_flag(&UNPACED, f)
}

/// Runs `f` with the thread-local `flag` set, then restores what it was
/// (also when `f` unwinds).
fn with_flag<T>(flag: &'static std::thread::LocalKey<std::cell::Cell<bool>>, f: impl FnOnce() -> T) -> T {
    struct Reset(&'static std::thread::LocalKey<std::cell::Cell<bool>>, bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            self.0.with(|v| v.set(self.1));
        }
    }
    let _reset = Reset(flag, flag.with(|v| v.replace(true)));
    f()
}

thread_local! {
    /// Set while [`as_blocking_caller`] runs on this thread.
    static BLOCKING_CALLER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` (and [`without_pacing`]) on a thread that does nothing but wait
/// for its own operations: it runs no runtime tasks and no event loop, and
/// holds no lock that other threads wait for (a foreign language's thread
/// inside a blocking call, its interpreter lock released, polling its
/// operation itself or through `block_on`). Waits that would otherwise hand their sleeping
/// to a blocking-pool thread, to keep a runtime thread free (a shared-memory
/// barrier of the collectives, a device operation's poller), sleep on this
/// thread instead: that saves waking the pool's thread and being woken by it,
/// two hand-offs between threads per wait. Such a sleep lasts a bounded slice
/// (milliseconds), after which the wait yields once, so whatever else the
/// same future watches (a lost member, a deadline) keeps its turn.
///
/// Never use it on a runtime's thread or an event loop's: a wait there would
/// hold up everything else that thread runs. (A task the thread runs, as a
/// current-thread runtime's `block_on` runs its tasks, is not the caller's
/// future: [`on_blocking_caller`] is false inside it.)
pub fn as_blocking_caller<T>(f: impl FnOnce() -> T) -> T {
    with_flag(&BLOCKING_CALLER, || without_pacing(f))
}

/// Whether this thread is inside [`as_blocking_caller`], outside any task
/// (in the future `block_on` drives): a wait may sleep on it for a bounded
/// slice instead of on a blocking-pool thread.
pub fn on_blocking_caller() -> bool {
    BLOCKING_CALLER.with(std::cell::Cell::get) && tokio::task::try_id().is_none()
}

/// One rank's communicator for one world: owns that world's listener, connections
/// and tasks, and nothing else. Dropping it aborts it (use [`Communicator::close`]
/// for an orderly goodbye). Share it between tasks with an `Arc`.
pub struct Communicator {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("identity", &self.inner.identity)
            .field("local_addr", &self.inner.local_addr)
            .field("aborted", &self.inner.aborted.get())
            .finish_non_exhaustive()
    }
}

/// What [`Communicator::start`] builds a communicator from.
pub(crate) struct Started {
    pub(crate) cfg: CommConfig,
    pub(crate) token: CancellationToken,
    /// Closed (no task of the join left to add).
    pub(crate) tracker: TaskTracker,
    pub(crate) rejected: Arc<AtomicU64>,
    pub(crate) local_addr: SocketAddr,
    /// Where its tasks run.
    pub(crate) runtime: tokio::runtime::Handle,
    /// One connected, authenticated link per peer, `None` at its own rank.
    pub(crate) links: Vec<Option<(ReadLink, WriteLink)>>,
}

impl Drop for Communicator {
    fn drop(&mut self) {
        self.inner.abort_with("communicator dropped");
    }
}

impl Communicator {
    /// Joins the world described by `cfg`: listens, publishes the address through
    /// `rdv`, connects to and authenticates every peer, and starts the reader
    /// tasks. Fails with [`Error::Timeout`] (op `"join"`) after `cfg.join_timeout`,
    /// or at once when a peer refuses the handshake.
    pub async fn join(cfg: CommConfig, rdv: &dyn Rendezvous) -> Result<Communicator> {
        Self::join_with_token(cfg, rdv, CancellationToken::new()).await
    }

    /// Like [`Communicator::join`], with `token` as the world's cancellation token
    /// (typically a child of a manager's root token): cancelling it aborts the
    /// communicator as [`Communicator::abort`] does (pending operations fail with
    /// [`Error::Aborted`] as soon as a reader task observes it).
    pub async fn join_with_token(
        cfg: CommConfig,
        rdv: &dyn Rendezvous,
        token: CancellationToken,
    ) -> Result<Communicator> {
        cfg.validate()?;
        let tracker = TaskTracker::new();
        let rejected = Arc::new(AtomicU64::new(0));
        // Stops the accept loop if the join fails or is dropped part-way.
        let guard = token.clone().drop_guard();
        let built = mesh::build(&cfg, rdv, &token, &tracker, Arc::clone(&rejected)).await?;
        guard.disarm();
        tracker.close();

        let links = built
            .streams
            .into_iter()
            .map(|s| {
                s.map(|stream| {
                    let (rd, wr) = stream.into_split();
                    (ReadLink::Tcp(rd), WriteLink::Tcp(wr))
                })
            })
            .collect();
        let comm = Self::start(Started {
            cfg,
            token,
            tracker,
            rejected,
            local_addr: built.local_addr,
            runtime: tokio::runtime::Handle::current(),
            links,
        });
        info!(local = %comm.inner.identity, addr = %comm.inner.local_addr, "joined world");
        Ok(comm)
    }

    /// Builds the communicator over connected, authenticated links (one per
    /// peer, `None` at its own rank) and starts its reader and heartbeat tasks.
    pub(crate) fn start(s: Started) -> Communicator {
        let Started {
            cfg,
            token,
            tracker,
            rejected,
            local_addr,
            runtime,
            links,
        } = s;
        let size = cfg.size as usize;
        let epoch = Instant::now();
        let mut peers = Vec::with_capacity(size);
        let mut reads = Vec::new();
        for (r, link) in links.into_iter().enumerate() {
            let Some((rd, wr)) = link else {
                peers.push(None);
                continue;
            };
            let peer = Arc::new(Peer {
                rank: Rank(r as u32),
                writer: Arc::new(tokio::sync::Mutex::new(Writer {
                    half: Some(wr),
                    seq: 0,
                })),
                token: token.child_token(),
                lost: OnceLock::new(),
                departed: AtomicBool::new(false),
                wake: Notify::new(),
                parking: Parking::new(),
                counters: Counters::new(epoch),
            });
            reads.push((Arc::clone(&peer), rd));
            peers.push(Some(peer));
        }
        let (health_tx, _) = broadcast::channel(size + 4);
        let inner = Arc::new(Inner {
            identity: cfg.identity(),
            matching: Mutex::new(Matching::new(size)),
            cfg,
            local_addr,
            token,
            tracker,
            runtime,
            peers,
            health_tx,
            aborted: OnceLock::new(),
            closing: AtomicBool::new(false),
            cut_off: AtomicBool::new(false),
            rejected,
            ready_in_a_row: AtomicU32::new(0),
            arrivals: AtomicU64::new(0),
        });
        for (peer, rd) in reads {
            inner
                .tracker
                .spawn_on(reader_task(Arc::clone(&inner), peer, rd), &inner.runtime);
        }
        if let Some(every) = inner.cfg.heartbeat_interval
            && size > 1
        {
            inner
                .tracker
                .spawn_on(heartbeat_task(Arc::clone(&inner), every), &inner.runtime);
        }
        Communicator { inner }
    }

    /// This member's identity.
    pub fn identity(&self) -> &Identity {
        &self.inner.identity
    }

    /// This member's rank.
    pub fn rank(&self) -> Rank {
        self.inner.identity.rank
    }

    /// Number of ranks in the world.
    pub fn size(&self) -> u32 {
        self.inner.identity.size
    }

    /// World name.
    pub fn world(&self) -> &WorldName {
        &self.inner.identity.world
    }

    /// World generation.
    pub fn generation(&self) -> Generation {
        self.inner.identity.generation
    }

    /// The configuration it was joined with.
    pub fn config(&self) -> &CommConfig {
        &self.inner.cfg
    }

    /// The listener's address (`0.0.0.0:0` for a member of a world built in
    /// memory, which has none).
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.local_addr
    }

    /// The world's cancellation token (cancelled on abort).
    pub fn cancellation_token(&self) -> &CancellationToken {
        &self.inner.token
    }

    /// Sends `data` to `dst` on `tag` and returns once it is written to the socket.
    /// The bytes go from `data` to the socket without a copy. Messages to one peer
    /// leave in the order their sends were called (first polled, for this `async`
    /// method). Uses the configured `op_timeout`. If this future is dropped (or
    /// times out) after part of the message was written, the connection cannot be
    /// resynchronised and the peer is reported lost; dropped before that, nothing
    /// was sent.
    pub async fn send<'a>(&self, dst: Rank, tag: Tag, data: impl Into<TensorView<'a>>) -> Result<()> {
        let view = data.into();
        let fut = self.inner.send_view(dst, tag, view);
        match self.inner.cfg.op_timeout {
            None => fut.await,
            Some(after) => tokio::time::timeout(after, fut)
                .await
                .unwrap_or(Err(Error::Timeout { op: "send", after })),
        }
    }

    /// Starts sending `data` (owned, not copied) to `dst` on `tag` and returns a
    /// handle. Its place in the peer's send order is taken now, at the call.
    /// Dropping the handle does not cancel the send: it completes in the background
    /// (or fails with the connection), and the tensor is then dropped.
    pub fn isend(&self, dst: Rank, tag: Tag, data: Tensor) -> SendHandle {
        let timeout = self.inner.cfg.op_timeout;
        let peer = match self.inner.check_send(dst, data.nbytes()) {
            Ok(p) => Arc::clone(p),
            Err(e) => return SendHandle::ready(Err(e), timeout),
        };
        // Poll the lock once now so this send is queued behind earlier ones and in
        // front of later ones, even though the task that writes runs later.
        let mut lock = Box::pin(Arc::clone(&peer.writer).lock_owned());
        let early = lock.as_mut().poll(&mut Context::from_waker(Waker::noop()));
        let inner = Arc::clone(&self.inner);
        let task = self.inner.tracker.spawn_on(
            async move {
                let mut w = match early {
                    Poll::Ready(w) => w,
                    Poll::Pending => tokio::select! {
                        biased;
                        _ = peer.token.cancelled() => return Err(inner.peer_error(&peer)),
                        w = lock => w,
                    },
                };
                inner
                    .write_locked(&peer, &mut w, tag, data.dtype(), data.as_bytes())
                    .await?;
                Ok(data)
            },
            &self.inner.runtime,
        );
        SendHandle {
            state: SendState::Running(task),
            timeout,
        }
    }

    /// Receives a message from `src` on `tag` into `buf`, which must have the
    /// message's dtype and byte size (the shape is the receiver's; only the element
    /// count must agree); otherwise the message is consumed and
    /// [`Error::Mismatch`] returned. Large messages are read straight into `buf`.
    /// Uses the configured `op_timeout`. On any error `buf` is given back with
    /// its dtype and shape; its contents are unchanged when the error came
    /// before its message began to arrive, and unspecified when it came while
    /// the message was being read into it (the peer lost mid-payload; a bool
    /// payload with a byte other than 0 or 1, which zeroes it). If the receive
    /// was cancelled or timed out while its message was being read into it,
    /// `buf` is left empty and the message goes to the next matching receive.
    pub async fn recv(&self, src: Rank, tag: Tag, buf: &mut Tensor) -> Result<()> {
        self.recv_into(Source::Rank(src), tag, buf, "recv")
            .await
            .map(|_| ())
    }

    /// Like [`Communicator::recv`] from any rank; returns the sender.
    pub async fn recv_any(&self, tag: Tag, buf: &mut Tensor) -> Result<Rank> {
        self.recv_into(Source::Any, tag, buf, "recv_any").await
    }

    /// Takes a message from `src` on `tag` that has already arrived (kept for
    /// a later receive) into `buf`, without waiting and without posting a
    /// receive: `None` when none is here. Otherwise the outcome of a receive
    /// (a mismatch consumes the message, as in [`Communicator::recv`]).
    pub fn try_recv(&self, src: impl Into<Source>, tag: Tag, buf: &mut Tensor) -> Option<Result<Rank>> {
        self.inner.try_take(src.into(), tag, buf)
    }

    /// Posts a receive into `buf` (owned) now and returns a handle. Receives match
    /// messages in the order they were posted. A message that has arrived
    /// completes the handle in this call: one read ahead is copied, and one
    /// a connection's reader held back (too large to read ahead, at most
    /// 4 MiB; for any source, the earliest of those held back, after any
    /// read ahead) is read here from the socket, as much of it as is there
    /// without waiting (the reader reads the rest). Dropping the handle cancels the
    /// receive: a message that arrives later goes to the next matching receive (if
    /// it was already arriving, it is kept for the next matching receive too).
    pub fn irecv(&self, src: impl Into<Source>, tag: Tag, buf: Tensor) -> RecvHandle {
        self.post(src.into(), tag, buf, None)
    }

    /// [`Communicator::irecv`], except that a held-back message of at most
    /// `leave_up_to` payload bytes is not read in this call: the
    /// connection's reader is woken and reads it into `buf`. For a thread
    /// whose time is worth more than the runtime's (an event loop's, which
    /// serves many connections alone): a message small enough to be read
    /// ahead is held back only until the reader runs again (the frame
    /// behind one read in a call, say), and reading it from the socket
    /// costs the caller several times what copying it once read ahead does.
    /// A message read ahead is still copied in this call. An any-source
    /// receive reads in the call as [`Communicator::irecv`] does, so that
    /// it still takes the earliest held-back message (woken readers would
    /// race for it).
    pub fn irecv_leaving(
        &self,
        src: impl Into<Source>,
        tag: Tag,
        buf: Tensor,
        leave_up_to: usize,
    ) -> RecvHandle {
        self.post(src.into(), tag, buf, Some(leave_up_to))
    }

    /// [`Communicator::irecv_leaving`], `None` leaving nothing to the reader.
    fn post(&self, src: Source, tag: Tag, buf: Tensor, leave_up_to: Option<usize>) -> RecvHandle {
        let leave_up_to = leave_up_to.filter(|_| src != Source::Any);
        let state = match self.inner.post_recv(src, tag, buf, leave_up_to) {
            Posting::Done(d) => {
                self.inner.ready_in_a_row.fetch_add(1, Ordering::Relaxed);
                RecvState::Ready(d)
            }
            Posting::Waiting { id, rx } => RecvState::Waiting { id, rx },
        };
        RecvHandle {
            inner: Arc::clone(&self.inner),
            tag,
            state,
            paced: false,
        }
    }

    async fn recv_into(&self, src: Source, tag: Tag, buf: &mut Tensor, op: &'static str) -> Result<Rank> {
        // Yield, when this task's turn is up, before anything is taken: a
        // receive dropped here (a select, a zero timeout) leaves `buf` as it
        // was and every message where it was.
        self.inner.pace().await;
        let mut handle = self.irecv(src, tag, std::mem::take(buf));
        handle.paced = true;
        let mut g = Restore { slot: buf, handle };
        let spin = self.inner.cfg.recv_spin;
        let done = match self.inner.cfg.op_timeout {
            None => g.handle.done_spinning(spin).await,
            Some(after) => {
                let r = tokio::time::timeout(after, g.handle.done_spinning(spin)).await;
                match r {
                    Ok(d) => d,
                    Err(_) => {
                        if let Some(t) = g.handle.cancel() {
                            *g.slot = t;
                        }
                        return Err(Error::Timeout { op, after });
                    }
                }
            }
        };
        *g.slot = done.buf;
        done.result
    }

    /// Fails every pending and future operation of this world with
    /// [`Error::Aborted`], stops its tasks and closes its sockets and listener.
    /// Synchronous and idempotent: pending receives are failed before it returns;
    /// tasks finish shortly after (await [`Communicator::wait_closed`]).
    pub fn abort(&self) {
        self.inner.abort_with("abort() called");
    }

    /// [`Communicator::abort`] with the reason every failed operation will
    /// carry in its [`Error::Aborted`] (for example, why the owner gave the
    /// world up). Only the first abort's reason is kept.
    pub fn abort_with_reason(&self, reason: &str) {
        self.inner.abort_with(reason);
    }

    /// Says goodbye to every peer, then aborts with reason "closed" and waits
    /// for the tasks to finish. Peers see [`HealthEvent::PeerLost`] with an
    /// "orderly close" cause.
    ///
    /// The goodbye is a handshake, so that no reset ever overtakes it: after
    /// its goodbye (a `Bye` frame, then the end of its write side) this side
    /// keeps reading (and dropping what arrives) until each peer has answered
    /// with its own goodbye or end of stream, and only then lets its sockets
    /// go. Closing a socket with unread bytes in it would send a reset, and a
    /// reset can reach the peer before it has read the goodbye, which then
    /// takes the close for a failure. Sends already queued go out before the
    /// goodbye; receives still pending, and every operation started once the
    /// close has begun, fail with [`Error::Aborted`].
    ///
    /// Bounded: a peer that does not answer within [`CLOSE_LIMIT`] (frozen,
    /// or a send of ours still stuck on its full socket) is cut off with a
    /// reset, as [`Communicator::abort`] does. A close whose future is dropped
    /// before it ends aborts at once (the goodbyes that did not finish
    /// become resets).
    pub async fn close(&self) {
        /// Aborts the communicator if the close is dropped part-way: its
        /// operations already fail as closed, and nothing else would end
        /// its tasks and sockets.
        struct AbortIfDropped<'a>(Option<&'a Inner>);
        impl Drop for AbortIfDropped<'_> {
            fn drop(&mut self) {
                if let Some(inner) = self.0.take() {
                    inner.cut_off.store(true, Ordering::Relaxed);
                    inner.abort_with("closed (the close was cancelled before it ended)");
                }
            }
        }
        let inner = &self.inner;
        let mut guard = AbortIfDropped(Some(inner));
        inner.closing.store(true, Ordering::Relaxed);
        let farewells = inner.peers.iter().flatten().map(|peer| inner.farewell(peer));
        if tokio::time::timeout(CLOSE_LIMIT, futures::future::join_all(farewells))
            .await
            .is_err()
        {
            // Whoever has not answered gets the abortive close.
            inner.cut_off.store(true, Ordering::Relaxed);
        }
        guard.0 = None;
        inner.abort_with("closed");
        inner.tracker.wait().await;
    }

    /// Waits until every task of this communicator has finished, which
    /// happens after an abort or a close (or a drop of the last handle).
    /// Losing every peer does not end them: the listener and the heartbeat
    /// task run until the communicator is aborted or closed.
    pub async fn wait_closed(&self) {
        self.inner.tracker.wait().await;
    }

    /// Whether the communicator was aborted.
    pub fn is_aborted(&self) -> bool {
        self.inner.aborted.get().is_some()
    }

    /// A snapshot of the world's health.
    pub fn health(&self) -> Health {
        Health {
            aborted: match self.inner.aborted_error() {
                Some(Error::Aborted { reason }) => Some(reason),
                _ => None,
            },
            lost: self
                .inner
                .peers
                .iter()
                .flatten()
                .filter_map(|p| p.lost.get().map(|c| (p.rank, Arc::clone(c))))
                .collect(),
        }
    }

    /// Subscribes to health events from now on (subscribe, then check
    /// [`Communicator::health`] for what happened before). The channel holds more
    /// events than one communicator can produce, so a receiver never lags.
    pub fn health_events(&self) -> broadcast::Receiver<HealthEvent> {
        self.inner.health_tx.subscribe()
    }

    /// When each peer was last heard from (see [`PeerLiveness`]), in rank
    /// order: what a watchdog compares against its heartbeat timeout to tell a
    /// frozen or cut-off member from a quiet one.
    pub fn liveness(&self) -> Vec<PeerLiveness> {
        self.inner
            .peers
            .iter()
            .flatten()
            .map(|p| PeerLiveness {
                rank: p.rank,
                last_heard: p.counters.last_heard(),
                lost: p.lost.get().cloned(),
                departed: p.departed.load(Ordering::Relaxed),
                heartbeat_rtt: match p.counters.rtt_us.load(Ordering::Relaxed) {
                    0 => None,
                    us => Some(Duration::from_micros(us)),
                },
            })
            .collect()
    }

    /// Traffic counters of the connection to `rank`.
    pub fn peer_stats(&self, rank: Rank) -> Option<PeerStats> {
        let p = self.inner.peer(rank)?;
        Some(PeerStats {
            rank,
            bytes_sent: p.counters.bytes_sent.load(Ordering::Relaxed),
            bytes_received: p.counters.bytes_received.load(Ordering::Relaxed),
            messages_sent: p.counters.messages_sent.load(Ordering::Relaxed),
            messages_received: p.counters.messages_received.load(Ordering::Relaxed),
            messages_read_in_call: p.counters.messages_read_in_call.load(Ordering::Relaxed),
        })
    }

    /// Inbound connections refused by the listener so far (strangers, wrong secret,
    /// wrong world, duplicates, timeouts).
    pub fn rejected_connections(&self) -> u64 {
        self.inner.rejected.load(Ordering::Relaxed)
    }
}

/// Puts the receive buffer back into the caller's slot if the receive is dropped
/// before it started.
struct Restore<'a> {
    slot: &'a mut Tensor,
    handle: RecvHandle,
}

impl Drop for Restore<'_> {
    fn drop(&mut self) {
        if let Some(t) = self.handle.cancel() {
            *self.slot = t;
        }
    }
}

enum Posting {
    Done(RecvDone),
    Waiting {
        id: u64,
        rx: oneshot::Receiver<RecvDone>,
    },
}

impl Inner {
    /// Whether the next receive yields first: [`READY_BURST`] receives in a
    /// row found their messages here (and this thread is paced). The streak
    /// then starts over.
    fn turn_is_up(&self) -> bool {
        if paced_here() && self.ready_in_a_row.load(Ordering::Relaxed) >= READY_BURST {
            self.ready_in_a_row.store(0, Ordering::Relaxed);
            return true;
        }
        false
    }

    /// A blocking receive's turn, taken before it takes anything: yields
    /// once if [`Inner::turn_is_up`], and takes one unit of the task's
    /// cooperative budget (yielding if it is spent).
    async fn pace(&self) {
        if self.turn_is_up() {
            tokio::task::yield_now().await;
        }
        tokio::task::coop::consume_budget().await;
    }

    fn lock(&self) -> MutexGuard<'_, Matching> {
        // Critical sections do not panic; if one did, the data is still consistent
        // enough to fail everything, so ignore poisoning.
        self.matching.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn peer(&self, rank: Rank) -> Option<&Arc<Peer>> {
        self.peers.get(rank.index())?.as_ref()
    }

    /// The error every operation gets once the communicator was aborted, or
    /// once [`Communicator::close`] has begun.
    fn aborted_error(&self) -> Option<Error> {
        match self.aborted.get() {
            Some(r) => Some(Error::Aborted {
                reason: Arc::clone(r),
            }),
            None if self.closing.load(Ordering::Relaxed) => Some(Error::Aborted {
                reason: Arc::from("closed"),
            }),
            None => None,
        }
    }

    /// Whether sockets close gracefully (FIN): during a close that has not
    /// given up; otherwise they close with a reset.
    fn graceful(&self) -> bool {
        self.closing.load(Ordering::Relaxed) && !self.cut_off.load(Ordering::Relaxed)
    }

    /// The error for an operation with `peer` that found the connection unusable.
    fn peer_error(&self, peer: &Peer) -> Error {
        if let Some(e) = self.aborted_error() {
            return e;
        }
        match peer.lost.get() {
            Some(c) => Error::peer_lost(peer.rank, c),
            None => Error::PeerLost {
                rank: peer.rank,
                cause: Arc::from("connection closed"),
            },
        }
    }

    fn check_rank(&self, rank: Rank, what: &str) -> Result<&Arc<Peer>> {
        if rank.0 >= self.identity.size {
            return Err(Error::invalid(format!(
                "{what} rank {rank} is outside a world of {}",
                self.identity.size
            )));
        }
        if rank == self.identity.rank {
            return Err(Error::invalid(format!(
                "{what} rank {rank} is this rank; point-to-point with oneself is not supported"
            )));
        }
        self.peer(rank)
            .ok_or_else(|| Error::invalid(format!("no connection to rank {rank}")))
    }

    fn check_send(&self, dst: Rank, bytes: usize) -> Result<&Arc<Peer>> {
        let peer = self.check_rank(dst, "destination")?;
        if bytes as u64 > self.cfg.limits.max_message_bytes {
            return Err(Error::invalid(format!(
                "message of {bytes} bytes exceeds max_message_bytes ({})",
                self.cfg.limits.max_message_bytes
            )));
        }
        if let Some(e) = self.aborted_error() {
            return Err(e);
        }
        if peer.lost.get().is_some() {
            return Err(self.peer_error(peer));
        }
        Ok(peer)
    }

    async fn send_view(&self, dst: Rank, tag: Tag, view: TensorView<'_>) -> Result<()> {
        let peer = self.check_send(dst, view.as_bytes().len())?;
        // Fast path without registering with the cancellation token. `try_lock`
        // fails while sends are queued (the mutex hands over to waiters), so it
        // does not jump the FIFO.
        let mut w = match peer.writer.try_lock() {
            Ok(w) => w,
            Err(_) => tokio::select! {
                biased;
                _ = peer.token.cancelled() => return Err(self.peer_error(peer)),
                w = peer.writer.lock() => w,
            },
        };
        self.write_locked(peer, &mut w, tag, view.dtype(), view.as_bytes())
            .await
    }

    /// Writes one data frame with the peer's writer lock held.
    async fn write_locked(
        &self,
        peer: &Peer,
        w: &mut Writer,
        tag: Tag,
        dtype: DType,
        bytes: &[u8],
    ) -> Result<()> {
        // Aborted or lost while this send waited for the writer: write nothing.
        if peer.token.is_cancelled() {
            self.drop_writer(w);
            return Err(self.peer_error(peer));
        }
        let seq = w.seq;
        let Some(half) = w.half.as_mut() else {
            return Err(self.peer_error(peer));
        };
        let header = FrameHeader {
            kind: FrameKind::Data {
                dtype,
                tag,
                len: bytes.len() as u64,
            },
            seq,
            generation: self.identity.generation,
        }
        .encode();
        let mut guard = MidFrame {
            inner: self,
            rank: peer.rank,
            written: 0,
            finished: false,
        };
        // Fast path: most frames go out in this one non-blocking vectored write.
        let r = match half.try_write_vectored(&[IoSlice::new(&header), IoSlice::new(bytes)]) {
            Ok(n) => {
                guard.written = n;
                None
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => None,
            Err(e) => Some(Some(Err(e))),
        };
        let r = match r {
            Some(r) => r,
            None if guard.written == header.len() + bytes.len() => Some(Ok(())),
            None => tokio::select! {
                biased;
                _ = peer.token.cancelled() => None,
                r = write_frame(half, &header, bytes, &mut guard.written) => Some(r),
            },
        };
        guard.finished = true;
        match r {
            Some(Ok(())) => {
                w.seq = seq.wrapping_add(1);
                let c = &peer.counters;
                c.bytes_sent.fetch_add(bytes.len() as u64, Ordering::Relaxed);
                c.messages_sent.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Some(Err(e)) => {
                self.drop_writer(w);
                self.peer_lost(peer.rank, format!("write failed: {}", describe_io(&e)));
                Err(self.peer_error(peer))
            }
            None => {
                self.drop_writer(w);
                Err(self.peer_error(peer))
            }
        }
    }

    fn try_take(&self, src: Source, tag: Tag, buf: &mut Tensor) -> Option<Result<Rank>> {
        if let Source::Rank(r) = src {
            if let Err(e) = self.check_rank(r, "source") {
                return Some(Err(e));
            }
        }
        let mut m = self.lock();
        if let Some(e) = self.aborted_error() {
            return Some(Err(e));
        }
        let (from, st) = m.take_stash(src, tag)?;
        let held = m.held(from);
        drop(m);
        self.reopen(from, held, st.data.bytes().len());
        Some(self.consume(buf, from, tag, st))
    }

    /// After a receive took `taken` read-ahead bytes of `from`, `held` left:
    /// wakes `from`'s reader if it holds back a frame for lack of room and
    /// this take reopened enough of it ([`reopens`]).
    fn reopen(&self, from: Rank, held: usize, taken: usize) {
        let budget = self.cfg.unexpected_budget;
        // The mark is never above half the budget.
        if held > budget / 2 {
            return;
        }
        let Some(peer) = self.peer(from) else {
            return;
        };
        let parked = peer
            .parking
            .inspect(|h| h.frame.as_ref().filter(|f| f.into.is_none()).map(|f| f.len));
        let eager = self.cfg.read_ahead_limit();
        if parked.is_some_and(|len| reopens(held, taken, len, eager, budget)) {
            peer.wake.notify_one();
        }
    }

    /// Fills `buf` with a message taken from the stash (the lock released),
    /// recycling its buffer. A mismatch consumes the message either way,
    /// like a mismatch on the wire.
    fn consume(&self, buf: &mut Tensor, from: Rank, tag: Tag, st: Stashed) -> Result<Rank> {
        match fill(buf, from, tag, st.dtype, st.data) {
            Filled::Done { spare } => {
                if let Some(v) = spare {
                    self.lock().recycle(v, self.cfg.eager_limit);
                }
                Ok(from)
            }
            Filled::Mismatch { err, .. } => Err(err),
        }
    }

    /// Posts a receive (see [`Communicator::irecv_leaving`] for
    /// `leave_up_to`; `None`: no frame is left to the reader).
    fn post_recv(&self, src: Source, tag: Tag, mut buf: Tensor, leave_up_to: Option<usize>) -> Posting {
        let fail = |buf, e| Posting::Done(RecvDone::failed(buf, e));
        if let Source::Rank(r) = src {
            if let Err(e) = self.check_rank(r, "source") {
                return fail(buf, e);
            }
        }
        let mut m = self.lock();
        // Checked under the lock: abort and peer loss set their flag before taking
        // it to fail posted receives, so a receive is either failed here or there.
        if let Some(e) = self.aborted_error() {
            return fail(buf, e);
        }
        if let Some((from, st)) = m.take_stash(src, tag) {
            let held = m.held(from);
            drop(m);
            self.reopen(from, held, st.data.bytes().len());
            let arrival = st.arrival;
            let result = self.consume(&mut buf, from, tag, st);
            return Posting::Done(RecvDone { buf, result, arrival });
        }
        let lost = match src {
            Source::Rank(r) => self.peer(r).and_then(|p| p.lost.get().map(|c| (r, c))),
            Source::Any => self
                .peers
                .iter()
                .flatten()
                .find_map(|p| p.lost.get().map(|c| (p.rank, c))),
        };
        if let Some((r, cause)) = lost {
            let e = Error::peer_lost(r, cause);
            drop(m);
            return fail(buf, e);
        }
        let (tx, mut rx) = oneshot::channel();
        let id = m.post(src, tag, buf, tx);
        drop(m);
        // The connection whose held-back frame this receive may read now: its
        // source's; for any source, the one whose frame for this tag arrived
        // first (a later one never is read here, so a mismatch of the
        // earliest is for its reader to report, as the matching rules have it).
        let candidate = match src {
            Source::Rank(r) => self.peer(r),
            Source::Any => {
                let fits =
                    |h: &Held<Link>| h.frame.as_ref().is_some_and(|f| f.tag == tag && f.into.is_none());
                self.peers
                    .iter()
                    .flatten()
                    .filter_map(|p| p.parking.peek(fits).map(|arrived| (arrived, p)))
                    .min_by_key(|&(arrived, _)| arrived)
                    .map(|(_, p)| p)
            }
        };
        if let Some(p) = candidate {
            if self.read_parked(p, leave_up_to) {
                p.wake.notify_one();
            }
            if let Ok(done) = rx.try_recv() {
                return Posting::Done(done);
            }
        }
        if src == Source::Any {
            for p in self.peers.iter().flatten() {
                p.wake.notify_one();
            }
        }
        Posting::Waiting { id, rx }
    }

    /// Reads the payload of the frame `peer`'s reader holds back, if a
    /// receive now posted fits it, in the calling thread: what the socket
    /// holds goes straight into the receive's buffer without waiting, and
    /// the receive is finished here when all of it was there. Then the same
    /// for the frames behind it while posted receives take them, up to
    /// [`READ_IN_CALL_MAX`] bytes in all; the next header found whole is
    /// held back in turn. Otherwise the reader reads on (the rest of a
    /// payload into the same receive). No thread then waits for another to
    /// move bytes that had arrived: the poster would otherwise wake the
    /// reader, and the reader then the receive's waiter. `bool` payloads
    /// (validated as they are read) are left to the reader.
    ///
    /// Returns whether the reader must be woken: not when the link is left
    /// holding back a frame that no posted receive takes, which is what the
    /// reader was doing (it wakes by itself within [`CLOSED_POLL`]).
    ///
    /// A frame of at most `leave_up_to` payload bytes is left to the
    /// reader, as one no posted receive fits is (see
    /// [`Communicator::irecv_leaving`]).
    fn read_parked(&self, peer: &Peer, leave_up_to: Option<usize>) -> bool {
        if self.closing.load(Ordering::Relaxed) {
            return true;
        }
        let untouched = |h: &Held<Link>| h.frame.as_ref().is_some_and(|f| f.into.is_none());
        let Some(mut held) = peer.parking.lend(untouched) else {
            return true;
        };
        let eager = self.cfg.read_ahead_limit();
        let budget = self.cfg.unexpected_budget;
        let mut left = READ_IN_CALL_MAX;
        // The frame left held back for lack of room, if the call stops at one.
        let mut held_back = None;
        let wake = loop {
            // At a frame boundary: the reader waits for what comes next.
            let Some(f) = held.frame.take() else {
                break true;
            };
            if peer.token.is_cancelled() || held.failed.is_some() {
                held.frame = Some(f);
                break true;
            }
            let left_to_reader = leave_up_to.is_some_and(|max| f.len <= max);
            let fits = f.len <= left && !left_to_reader && f.dtype != DType::Bool;
            let taken = if fits {
                self.lock().take_posted_fitting(peer.rank, f.tag, f.dtype, f.len)
            } else {
                None
            };
            let Some(mut p) = taken else {
                let hold = self.lock().holds_back(peer.rank, f.tag, f.len, eager, budget);
                if hold {
                    held_back = Some((f.tag, f.len));
                }
                held.frame = Some(f);
                break !hold;
            };
            let filled = read_available(&mut held, p.buf.bytes_mut(), &peer.counters);
            if filled < f.len {
                held.frame = Some(Frame {
                    into: Some((p, filled)),
                    ..f
                });
                break true;
            }
            left = left.saturating_sub(f.len);
            self.delivered(peer, f.tag, f.dtype, p);
            self.next_frame_here(&mut held, &peer.counters);
        };
        match peer.parking.give_back(held) {
            // A receive that took read-ahead messages while the link was lent
            // found it not parked, so its reopening woke no one: look again.
            GivenBack::Parked { wanted } => {
                wake || wanted
                    || held_back
                        .is_some_and(|(tag, len)| !self.lock().holds_back(peer.rank, tag, len, eager, budget))
            }
            GivenBack::Ended(mut left) => {
                // The reader ended meanwhile: close as it would have.
                if !self.graceful() {
                    left.link.rd.get_ref().reset_on_close();
                }
                if let Some(posted) = left.take_receive() {
                    let _ = posted.tx.send(RecvDone::failed(
                        posted.buf,
                        self.aborted_error().unwrap_or_else(|| self.peer_error(peer)),
                    ));
                }
                false
            }
        }
    }

    /// Hands over a payload read whole into `p`'s buffer by the call that
    /// posted a receive ([`Inner::read_parked`]). A receive cancelled
    /// meanwhile leaves the message for the next one (a copy if the buffer
    /// was lent).
    fn delivered(&self, peer: &Peer, tag: Tag, dtype: DType, p: Posted) {
        peer.counters.messages_received.fetch_add(1, Ordering::Relaxed);
        peer.counters
            .messages_read_in_call
            .fetch_add(1, Ordering::Relaxed);
        let done = RecvDone {
            buf: p.buf,
            result: Ok(peer.rank),
            arrival: p.arrival,
        };
        if let Err(done) = p.tx.send(done) {
            let buf = StashData::Tensor(done.buf.into_owned());
            self.deliver(peer.rank, tag, dtype, buf, false, Some(done.arrival));
        }
    }

    /// Sets `held.frame` to the next frame if its header is whole in the
    /// link now and a data frame that checks out (consumed, as the reader
    /// would), else to `None`: anything else (no whole header yet, another
    /// kind of frame, a bad one) is left for the reader, which then has to be
    /// woken. A read error is kept in `held.failed`.
    fn next_frame_here(&self, held: &mut Held<Link>, progress: &Counters) {
        held.frame = None;
        let mut cx = Context::from_waker(Waker::noop());
        match Pin::new(&mut held.link.rd).poll_fill_buf(&mut cx) {
            Poll::Ready(Ok(_)) => held.frame = self.take_header(&mut held.link, progress),
            Poll::Ready(Err(e))
                if e.kind() != io::ErrorKind::WouldBlock && e.kind() != io::ErrorKind::Interrupted =>
            {
                held.failed = Some(e);
            }
            _ => {}
        }
    }

    /// [`Inner::next_frame_here`]'s decoding of what the link has buffered.
    fn take_header(&self, link: &mut Link, progress: &Counters) -> Option<Frame> {
        let buffered = link.rd.buffer();
        let hb: &[u8; HEADER_LEN] = buffered.get(..HEADER_LEN)?.try_into().ok()?;
        let h = frame::decode(hb, &self.cfg.limits).ok()?;
        let FrameKind::Data { dtype, tag, len } = h.kind else {
            return None;
        };
        let len = usize::try_from(len).ok()?;
        link.seq.check(&h).ok()?;
        link.rd.consume(HEADER_LEN);
        progress.heard();
        Some(self.frame(tag, dtype, len))
    }

    /// A data frame whose header was just read, stamped with its arrival.
    fn frame(&self, tag: Tag, dtype: DType, len: usize) -> Frame {
        Frame {
            tag,
            dtype,
            len,
            arrived: self.arrivals.fetch_add(1, Ordering::Relaxed),
            into: None,
        }
    }

    /// One peer's part of [`Communicator::close`]: the goodbye (after the
    /// sends already queued for the connection), the end of the write side,
    /// then the wait for the peer's answer, which ends this side's reader
    /// (its goodbye, end of stream or reset). Nothing is written after the
    /// goodbye: the write half leaves the writer, so no heartbeat follows it.
    async fn farewell(&self, peer: &Peer) {
        let mut w = tokio::select! {
            biased;
            _ = peer.token.cancelled() => return,
            w = peer.writer.lock() => w,
        };
        let seq = w.seq;
        if let Some(half) = w.half.as_mut() {
            let bye = FrameHeader {
                kind: FrameKind::Bye,
                seq,
                generation: self.identity.generation,
            }
            .encode();
            if half.write_all(&bye).await.is_ok() {
                // Dropped with `closing` set: a FIN, after the goodbye.
                w.half = None;
            }
        }
        drop(w);
        // A reader holding back a message it has no room for goes on to drop it.
        peer.wake.notify_waiters();
        peer.token.cancelled().await;
    }

    /// Closes a connection's write half now, or, if a send holds the writer,
    /// as soon as that send lets go of it, whichever way it does (finishing,
    /// failing, or its future being dropped without being polled again), so
    /// the peer always learns of an abort or a loss. The waiting task is not
    /// tracked: a send future that is kept but never polled again must not
    /// hold up `wait_closed`.
    fn close_writer(&self, peer: &Arc<Peer>) {
        if let Ok(mut w) = peer.writer.try_lock() {
            self.drop_writer(&mut w);
            return;
        }
        let closing = self.graceful();
        let writer = Arc::clone(&peer.writer);
        self.runtime.spawn(async move {
            let mut w = writer.lock().await;
            if let Some(half) = w.half.take()
                && !closing
            {
                half.reset_on_close();
            }
        });
    }

    /// Drops a connection's write half; abortively unless this is an orderly close.
    fn drop_writer(&self, w: &mut Writer) {
        if let Some(half) = w.half.take() {
            if !self.graceful() {
                half.reset_on_close();
            }
        }
    }

    fn release_held(&self, from: Rank, len: usize) {
        self.lock().release(from, len);
    }

    fn cancel_posted(&self, tag: Tag, id: u64) -> Option<Tensor> {
        let p = self.lock().take_posted_id(tag, id)?;
        Some(p.buf)
    }

    /// Hands a fully read message to the earliest matching posted receive, or
    /// keeps it for a later one. `reserved`: its bytes are already counted in
    /// `held`.
    fn deliver_or_stash(&self, from: Rank, tag: Tag, dtype: DType, data: StashData, reserved: bool) {
        self.deliver(from, tag, dtype, data, reserved, None);
    }

    /// Puts back a message that was handed to a receive whose handle was
    /// dropped before it took the message (a cancellation that lost the race
    /// with the delivery): it goes to the earliest matching posted receive,
    /// or is kept ahead of the messages from `from` on `tag` that arrived
    /// after it (`arrival`: its place in arrival order).
    fn give_back(&self, from: Rank, tag: Tag, buf: Tensor, arrival: u64) {
        let dtype = buf.dtype();
        self.deliver(
            from,
            tag,
            dtype,
            StashData::Tensor(buf.into_owned()),
            false,
            Some(arrival),
        );
    }

    /// [`Inner::deliver_or_stash`] of a message that has a place in arrival
    /// order already (`arrival`), or a new one (`None`).
    fn deliver(
        &self,
        from: Rank,
        tag: Tag,
        dtype: DType,
        mut data: StashData,
        reserved: bool,
        mut arrival: Option<u64>,
    ) {
        let len = data.bytes().len();
        loop {
            let mut m = self.lock();
            if self.aborted.get().is_some() {
                // The abort emptied the stash and no receive can take a
                // message any more: one handed on afterwards (a cancelled
                // receive's, off the runtime) is dropped, not kept until the
                // last handle goes.
                if reserved {
                    m.release(from, len);
                }
                return;
            }
            let Some(mut p) = m.take_posted(from, tag) else {
                m.stash(from, tag, dtype, data, reserved, arrival);
                return;
            };
            // A new message's place is the one it got here; it keeps it if
            // this receive is cancelled meanwhile and it goes round again.
            match arrival {
                Some(a) => p.arrival = a,
                None => arrival = Some(p.arrival),
            }
            drop(m);
            match fill(&mut p.buf, from, tag, dtype, data) {
                Filled::Done { spare } => {
                    match p.tx.send(RecvDone {
                        buf: p.buf,
                        result: Ok(from),
                        arrival: p.arrival,
                    }) {
                        Ok(()) => {
                            let mut m = self.lock();
                            if reserved {
                                m.release(from, len);
                            }
                            if let Some(v) = spare {
                                m.recycle(v, self.cfg.eager_limit);
                            }
                            return;
                        }
                        // Cancelled meanwhile: take the data back and try again.
                        Err(done) => {
                            data = match spare {
                                Some(v) => StashData::Bytes(v),
                                // Kept past its receive: the data must not stay in
                                // memory its lender expects back.
                                None => StashData::Tensor(done.buf.into_owned()),
                            };
                        }
                    }
                }
                Filled::Mismatch { err, data: back } => match p.tx.send(RecvDone::failed(p.buf, err)) {
                    Ok(()) => {
                        if reserved {
                            self.lock().release(from, len);
                        }
                        return;
                    }
                    Err(_) => data = back,
                },
            }
        }
    }

    /// Marks `rank`'s connection lost (once), fails every posted receive that it
    /// could satisfy (its own and any-source ones), wakes its writers, and reports.
    fn peer_lost(&self, rank: Rank, cause: impl Into<Arc<str>>) {
        let Some(peer) = self.peer(rank) else {
            return;
        };
        let cause: Arc<str> = cause.into();
        if peer.lost.set(Arc::clone(&cause)).is_err() {
            return;
        }
        peer.token.cancel();
        self.close_writer(peer);
        let failed = self.lock().drain_posted(|p| p.src.matches(rank));
        let err = self
            .aborted_error()
            .unwrap_or_else(|| Error::peer_lost(rank, &cause));
        for p in failed {
            let _ = p.tx.send(RecvDone::failed(p.buf, err.clone()));
        }
        if self.closing.load(Ordering::Relaxed) {
            // The answer to our own goodbye (or the peer going meanwhile):
            // this side is leaving, nothing to report.
            debug!(local = %self.identity, peer = %rank, %cause, "connection ended while closing");
        } else if self.aborted.get().is_none() {
            // A goodbye is not a failure: the owner decides whether it breaks
            // anything (a world that is finishing expects it).
            if peer.departed.load(Ordering::Relaxed) {
                debug!(local = %self.identity, peer = %rank, "peer left");
            } else {
                warn!(local = %self.identity, peer = %rank, %cause, "peer lost");
            }
            let _ = self.health_tx.send(HealthEvent::PeerLost { rank, cause });
        }
    }

    fn abort_with(&self, reason: &str) {
        let reason: Arc<str> = Arc::from(reason);
        if self.aborted.set(Arc::clone(&reason)).is_err() {
            return;
        }
        self.token.cancel();
        let (posted, stash, pool) = {
            let mut m = self.lock();
            let posted = m.drain_posted(|_| true);
            let (stash, pool) = m.take_all_stashed();
            (posted, stash, pool)
        };
        let err = Error::Aborted {
            reason: Arc::clone(&reason),
        };
        for p in posted {
            let _ = p.tx.send(RecvDone::failed(p.buf, err.clone()));
        }
        drop((stash, pool));
        for peer in self.peers.iter().flatten() {
            self.close_writer(peer);
        }
        info!(local = %self.identity, %reason, "communicator aborted");
        let _ = self.health_tx.send(HealthEvent::Aborted { reason });
    }

    /// Reads frames from one peer until the connection ends.
    async fn read_loop(
        self: &Arc<Self>,
        peer: &Peer,
        reading: &mut Option<Link>,
        slot: &mut Option<Posted>,
    ) -> ReadEnd {
        let mut hb = [0u8; HEADER_LEN];
        loop {
            let Some(link) = reading.as_mut() else {
                return ReadEnd::Failed("internal: the reader lost its link".into());
            };
            match link.rd.fill_buf().await {
                Ok([]) => return ReadEnd::Failed("connection closed by peer".into()),
                Ok(_) => {}
                Err(e) => return ReadEnd::Failed(describe_io(&e)),
            }
            if let Err(e) = link.rd.read_exact(&mut hb).await {
                return ReadEnd::Failed(format!("reading a frame header: {}", describe_io(&e)));
            }
            let h = match frame::decode(&hb, &self.cfg.limits).and_then(|h| link.seq.check(&h).map(|()| h)) {
                Ok(h) => h,
                Err(e) => return ReadEnd::Failed(format!("protocol violation: {e}")),
            };
            peer.counters.heard();
            match h.kind {
                FrameKind::Bye => return ReadEnd::Bye,
                FrameKind::Heartbeat { echo } => peer.counters.heartbeat_in(h.seq, echo, Instant::now()),
                FrameKind::Data { dtype, tag, len } => {
                    let Ok(len) = usize::try_from(len) else {
                        return ReadEnd::Failed(format!("declared length {len} does not fit in memory"));
                    };
                    if let Err(cause) = self
                        .on_data(peer, reading, slot, self.frame(tag, dtype, len))
                        .await
                    {
                        return ReadEnd::Failed(cause);
                    }
                }
            }
        }
    }

    /// Routes one data frame whose header was read. While the frame is held
    /// back, the call that posts a receive may read it (and frames behind
    /// it: [`Inner::read_parked`]); this goes on from where that call left
    /// the link.
    async fn on_data(
        self: &Arc<Self>,
        peer: &Peer,
        reading: &mut Option<Link>,
        slot: &mut Option<Posted>,
        mut frame: Frame,
    ) -> std::result::Result<(), String> {
        let from = peer.rank;
        let eager = self.cfg.read_ahead_limit();
        let budget = self.cfg.unexpected_budget;
        // Find where the payload goes before reading (or allocating) anything.
        // `draining`: the peer has closed its side, so nothing more is coming; what
        // is in flight is read into a buffer that grows only with the bytes that
        // actually arrive (not with the declared length), whatever the budget.
        let mut draining = false;
        // `filled`: payload bytes already in the receive's buffer (read by
        // the call that posted it, while this reader held the frame back).
        let (stash, filled) = loop {
            let (tag, len) = (frame.tag, frame.len);
            let link = reading.as_mut().ok_or("internal: the reader lost its link")?;
            if self.closing.load(Ordering::Relaxed) {
                // Our goodbye is out and every receive is about to fail: what
                // still comes is read only to reach the peer's answer.
                discard(&mut link.rd, len as u64, &peer.counters)
                    .await
                    .map_err(|e| format!("discarding a message while closing: {}", describe_io(&e)))?;
                return Ok(());
            }
            let woken = peer.wake.notified();
            match self.lock().route(from, tag, len, eager, budget, draining) {
                Route::Receive(p) => {
                    *slot = Some(p);
                    break (None, 0);
                }
                Route::ReadAhead(v) => break (Some(v), 0),
                Route::Hold => {}
            }
            // No receive yet and no room: leave the payload in the socket (TCP
            // backpressure), and park the link meanwhile: the call that
            // posts this frame's receive may read the payload itself
            // (`read_parked`). While waiting, look for the peer closing or
            // resetting the connection, which reading would otherwise only
            // reveal later.
            let parked = reading.take().is_some_and(|link| {
                let held = Held {
                    link,
                    frame: Some(Frame { into: None, ..frame }),
                    failed: None,
                };
                // A live reader's parking is never ended (only its end does
                // that); if it were, the reader keeps its link.
                match peer.parking.park(held) {
                    None => true,
                    Some(h) => {
                        *reading = Some(h.link);
                        false
                    }
                }
            });
            // A receive that took read-ahead messages between the routing
            // above and the parking found the link not parked yet, so its
            // reopening (`Inner::reopen`) woke no one: look again now that
            // it is (`woken` keeps the permit).
            if parked && !self.lock().holds_back(from, frame.tag, frame.len, eager, budget) {
                peer.wake.notify_one();
            }
            let mut polled = woken_or_polled(woken).await;
            // A timer's wake-up while nothing changed (the same frame parked,
            // the peer still there, still no receive or room for it) leaves
            // the link parked, so a posting call can still borrow it (an
            // any-source receive choosing the earliest frame would otherwise
            // miss this one now and then).
            while parked && polled {
                let woken = peer.wake.notified();
                let unchanged = peer.parking.inspect(|h| {
                    let same = h
                        .frame
                        .as_ref()
                        .is_some_and(|f| f.arrived == frame.arrived && f.into.is_none());
                    same.then(|| !h.link.rd.get_ref().peer_closed())
                });
                if unchanged != Some(true)
                    || !self.lock().holds_back(from, frame.tag, frame.len, eager, budget)
                {
                    break;
                }
                peer.counters.heard();
                polled = woken_or_polled(woken).await;
            }
            if parked {
                let mut held = unpark(peer, &mut polled).await;
                if let Some(e) = held.failed.take() {
                    // Met by a posting call; a receive it was filling fails
                    // with the connection.
                    *slot = held.take_receive();
                    *reading = Some(held.link);
                    return Err(format!("reading a message: {}", describe_io(&e)));
                }
                *reading = Some(held.link);
                // Read whole by a posting call, and no whole header behind it.
                let Some(mut f) = held.frame else {
                    return Ok(());
                };
                // Read part-way into its receive, which the reader fills.
                if let Some((posted, filled)) = f.into.take() {
                    frame = f;
                    *slot = Some(posted);
                    break (None, filled);
                }
                // This frame, or one behind it whose header a posting call read.
                frame = f;
            }
            let link = reading.as_mut().ok_or("internal: the reader lost its link")?;
            if polled {
                draining = link.rd.get_ref().peer_closed();
            }
            // Not reading is our choice: the peer must not look frozen for it.
            peer.counters.heard();
        };
        let Frame { tag, dtype, len, .. } = frame;
        let rd = &mut reading.as_mut().ok_or("internal: the reader lost its link")?.rd;
        let c = &peer.counters;
        match stash {
            None => {
                let Some(p) = slot.as_mut() else {
                    return Err("internal: receive slot empty".into());
                };
                if p.buf.dtype() != dtype || p.buf.nbytes() != len {
                    // Reported before the payload is skipped: a slow payload
                    // must not hold the error back (the caller's deadline
                    // would pass first and hide it).
                    if let Some(p) = slot.take() {
                        let err = mismatch(&p.buf, from, tag, dtype, len as u64);
                        debug!(local = %self.identity, %err, "receive mismatch");
                        let unheard = p.tx.send(RecvDone::failed(p.buf, err)).is_err();
                        if unheard {
                            // Cancelled before it heard: no byte of the
                            // payload is read (a receive that does not fit
                            // is never read into), so the message is routed
                            // again, to the next receive or to be kept.
                            return Box::pin(self.on_data(peer, reading, slot, self.frame(tag, dtype, len)))
                                .await;
                        }
                    }
                    let rd = &mut reading.as_mut().ok_or("internal: the reader lost its link")?.rd;
                    discard(rd, len as u64, c)
                        .await
                        .map_err(|e| format!("discarding a mismatched message: {}", describe_io(&e)))?;
                    c.messages_received.fetch_add(1, Ordering::Relaxed);
                    return Ok(());
                }
                let rest = p.buf.bytes_mut().get_mut(filled..).unwrap_or_default();
                read_payload(rd, rest, c)
                    .await
                    .map_err(|e| format!("reading a {len}-byte message: {}", describe_io(&e)))?;
                if !p.buf.validate_after_write() {
                    return Err("protocol violation: bool payload holds bytes other than 0 and 1".into());
                }
                c.messages_received.fetch_add(1, Ordering::Relaxed);
                if let Some(p) = slot.take() {
                    if let Err(done) = p.tx.send(RecvDone {
                        buf: p.buf,
                        result: Ok(from),
                        arrival: p.arrival,
                    }) {
                        // Cancelled while arriving: keep it for the next receive
                        // (a copy if the buffer was lent: the loan ends here).
                        self.redeliver(peer, from, tag, dtype, done).await?;
                    }
                }
            }
            Some(mut v) => {
                let read = read_fresh(rd, &mut v, len, draining, c).await;
                if let Err(e) = read {
                    self.release_held(from, len);
                    return Err(format!("reading a {len}-byte message: {}", describe_io(&e)));
                }
                if dtype == DType::Bool && !valid_bool_bytes(&v) {
                    return Err("protocol violation: bool payload holds bytes other than 0 and 1".into());
                }
                c.messages_received.fetch_add(1, Ordering::Relaxed);
                self.deliver_or_stash(from, tag, dtype, StashData::Bytes(v), true);
            }
        }
        Ok(())
    }
}

/// Messages from this many bytes on that a reader hands to the next receive
/// ([`Inner::redeliver`]) are handed over on a blocking-pool thread.
const REDELIVER_OFF_RUNTIME_FROM: usize = 1 << 20;

impl Inner {
    /// Hands a message that was read whole into a receive that was cancelled
    /// meanwhile (`done`) to the next matching receive, or keeps it: for
    /// lent memory, a copy (the loan ends here). Either step can copy the
    /// whole message (into an owned tensor, or into the next receive's lent
    /// memory), which can be hundreds of MiB, so a large message is handed
    /// over on a blocking-pool thread: the reader calling this does not hold
    /// a runtime thread (and whatever waits behind it there: other worlds'
    /// readers, heartbeats, watchdogs) that long. Meanwhile nothing is read
    /// from `peer`, by our choice, so the peer counts as heard (as while the
    /// reader holds back); otherwise a copy longer than the heartbeat timeout
    /// (a busy machine) would break the world for a silent peer.
    async fn redeliver(
        self: &Arc<Self>,
        peer: &Peer,
        from: Rank,
        tag: Tag,
        dtype: DType,
        done: RecvDone,
    ) -> std::result::Result<(), String> {
        let RecvDone { buf, arrival, .. } = done;
        if buf.nbytes() < REDELIVER_OFF_RUNTIME_FROM {
            let buf = StashData::Tensor(buf.into_owned());
            self.deliver(from, tag, dtype, buf, false, Some(arrival));
            return Ok(());
        }
        let inner = Arc::clone(self);
        let hand_over = tokio::task::spawn_blocking(move || {
            let buf = StashData::Tensor(buf.into_owned());
            inner.deliver(from, tag, dtype, buf, false, Some(arrival));
        });
        tokio::pin!(hand_over);
        loop {
            tokio::select! {
                r = &mut hand_over => {
                    return r.map_err(|e| format!("internal: keeping a cancelled receive's message: {e}"));
                }
                _ = tokio::time::sleep(CLOSED_POLL) => peer.counters.heard(),
            }
        }
    }
}

enum ReadEnd {
    Bye,
    Failed(String),
}

/// The reader takes its parked link back, waiting while a posting call has
/// it (which wakes the reader when it gives it back). Meanwhile the peer
/// counts as heard, as while holding back; `polled` is set when a
/// [`CLOSED_POLL`] went by.
async fn unpark(peer: &Peer, polled: &mut bool) -> Held<Link> {
    loop {
        let given_back = peer.wake.notified();
        if let Some(held) = peer.parking.unpark() {
            return held;
        }
        if woken_or_polled(given_back).await {
            *polled = true;
            peer.counters.heard();
        }
    }
}

/// Waits for `woken` or for [`CLOSED_POLL`], whichever comes first: true
/// when the time went by.
async fn woken_or_polled(woken: Notified<'_>) -> bool {
    tokio::select! {
        _ = woken => false,
        _ = tokio::time::sleep(CLOSED_POLL) => true,
    }
}

/// Copies what is there now of a payload into `buf`: first what the reader
/// had buffered past the frame's header, then non-blocking reads from the
/// link until `buf` is full or the link has nothing more, ends (the reader
/// sees the end itself when it reads on) or fails (kept in `held.failed`
/// for the reader: a reset is reported only once). Returns the bytes
/// copied; each read counts as progress.
fn read_available(held: &mut Held<Link>, buf: &mut [u8], progress: &Counters) -> usize {
    let rd = &mut held.link.rd;
    let buffered = rd.buffer();
    let mut filled = buffered.len().min(buf.len());
    buf[..filled].copy_from_slice(&buffered[..filled]);
    rd.consume(filled);
    if filled > 0 {
        progress.received(filled);
    }
    while let Some(rest) = buf.get_mut(filled..).filter(|r| !r.is_empty()) {
        match rd.get_mut().try_read(rest) {
            Ok(0) => break,
            Ok(n) => {
                filled += n;
                progress.received(n);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) => {
                held.failed = Some(e);
                break;
            }
        }
    }
    filled
}

/// Ends a peer's parking however its reader task ends, also when the task
/// is dropped unfinished (its runtime shutting down): a link parked then is
/// dropped, closing the connection, and a receive it was being read into
/// fails (its channel goes) rather than wait on a parking nobody reads.
struct EndParking<'a>(&'a Peer);

impl Drop for EndParking<'_> {
    fn drop(&mut self) {
        drop(self.0.parking.end());
    }
}

async fn reader_task(inner: Arc<Inner>, peer: Arc<Peer>, half: ReadLink) {
    let _end = EndParking(&peer);
    // `None` while parked (`crate::parking`).
    let mut reading = Some(Link {
        rd: BufReader::with_capacity(READ_BUF, half),
        seq: RxSequencer::new(inner.identity.generation),
    });
    // The receive whose buffer is being filled, kept out here so that it can be
    // failed (and its buffer returned) whatever ends the loop.
    let mut slot: Option<Posted> = None;
    let end = tokio::select! {
        biased;
        _ = peer.token.cancelled() => None,
        end = inner.read_loop(&peer, &mut reading, &mut slot) => Some(end),
    };
    // A link parked when the loop ended comes back here (with a receive a
    // posting thread read part-way, to be failed below); one lent to a
    // posting thread now is that thread's to drop.
    if let Some(mut held) = peer.parking.end() {
        if let Some(posted) = held.take_receive() {
            slot = Some(posted);
        }
        reading = Some(held.link);
    }
    let cause: Option<Arc<str>> = match end {
        None => None,
        Some(ReadEnd::Bye) => {
            peer.departed.store(true, Ordering::Relaxed);
            Some(Arc::from("peer closed its communicator (orderly close)"))
        }
        Some(ReadEnd::Failed(c)) => Some(Arc::from(c)),
    };
    match &cause {
        Some(c) => inner.peer_lost(peer.rank, Arc::clone(c)),
        // Cancelled from outside (the token given to `join_with_token`): turn it
        // into a full abort so no posted receive is left waiting.
        None if peer.lost.get().is_none() => {
            inner.abort_with("the world's cancellation token was cancelled");
        }
        None => {}
    }
    if let Some(link) = &reading
        && !inner.graceful()
    {
        link.rd.get_ref().reset_on_close();
    }
    if let Some(p) = slot.take() {
        let _ = p.tx.send(RecvDone::failed(p.buf, inner.peer_error(&peer)));
    }
}

/// Every `every`, writes a heartbeat frame to each live peer whose connection
/// is idle. A busy connection needs none: its data frames are signs of life
/// too. Writes never wait: a full send buffer means the peer is not reading
/// us, and the peer then counts us as heard (see [`PeerLiveness`]); a header
/// that only partly fits is finished on a task of its own, so one frozen peer
/// never delays the heartbeats of the others.
async fn heartbeat_task(inner: Arc<Inner>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            _ = inner.token.cancelled() => return,
            _ = tick.tick() => {}
        }
        for peer in inner.peers.iter().flatten() {
            if peer.lost.get().is_some() {
                continue;
            }
            let Ok(mut w) = Arc::clone(&peer.writer).try_lock_owned() else {
                continue;
            };
            let seq = w.seq;
            let Some(half) = w.half.as_mut() else {
                continue;
            };
            let echo = peer.counters.heartbeat_out(seq, Instant::now());
            let header = FrameHeader {
                kind: FrameKind::Heartbeat { echo },
                seq,
                generation: inner.identity.generation,
            }
            .encode();
            match half.try_write(&header) {
                Ok(n) if n == HEADER_LEN => w.seq = seq.wrapping_add(1),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Ok(n) => {
                    let (inner2, peer2) = (Arc::clone(&inner), Arc::clone(peer));
                    inner.tracker.spawn(async move {
                        let r = match w.half.as_mut() {
                            None => return,
                            Some(half) => tokio::select! {
                                biased;
                                _ = peer2.token.cancelled() => None,
                                r = half.write_all(&header[n..]) => Some(r),
                            },
                        };
                        match r {
                            Some(Ok(())) => w.seq = seq.wrapping_add(1),
                            Some(Err(e)) => {
                                inner2.drop_writer(&mut w);
                                drop(w);
                                inner2.peer_lost(
                                    peer2.rank,
                                    format!("heartbeat write failed: {}", describe_io(&e)),
                                );
                            }
                            None => inner2.drop_writer(&mut w),
                        }
                    });
                }
                Err(e) => {
                    inner.drop_writer(&mut w);
                    drop(w);
                    inner.peer_lost(peer.rank, format!("heartbeat write failed: {}", describe_io(&e)));
                }
            }
        }
    }
}

/// Writes the rest of a header and payload (from offset `written`) straight from
/// the caller's buffer. `written` counts progress so a cancelled write can tell
/// whether the stream is now broken.
async fn write_frame(
    w: &mut WriteLink,
    header: &[u8],
    payload: &[u8],
    written: &mut usize,
) -> io::Result<()> {
    let total = header.len() + payload.len();
    let mut bufs = [IoSlice::new(header), IoSlice::new(payload)];
    let mut slices: &mut [IoSlice<'_>] = &mut bufs;
    IoSlice::advance_slices(&mut slices, *written);
    while *written < total {
        let n = w.write_vectored(slices).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        *written += n;
        IoSlice::advance_slices(&mut slices, n);
    }
    Ok(())
}

async fn read_payload(rd: &mut BufReader<ReadLink>, buf: &mut [u8], progress: &Counters) -> io::Result<()> {
    // Every read counts as a sign of life, so a slow but live sender is never
    // mistaken for a frozen one however large its message. A read as large as
    // the rest of the buffer bypasses the BufReader (no extra copy).
    let mut filled = 0;
    while filled < buf.len() {
        let n = rd.read(&mut buf[filled..]).await?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        filled += n;
        progress.received(n);
    }
    Ok(())
}

/// Reads `len` bytes into `v` (emptied first) through its spare capacity, so
/// its memory is not zeroed first only to be overwritten (a read-ahead buffer
/// of every early message); each read counts as progress. With `grow`, the
/// buffer grows only as data arrive (when it is full, by [`GROW_STEP`] or
/// what is left, amortised: at most about twice what has arrived), as the
/// declared length of a frame from a closing peer is not trusted for
/// allocation; without, it is sized for `len` at once.
async fn read_fresh(
    rd: &mut BufReader<ReadLink>,
    v: &mut Vec<u8>,
    len: usize,
    grow: bool,
    progress: &Counters,
) -> io::Result<()> {
    use bytes::BufMut;
    v.clear();
    if !grow {
        v.reserve_exact(len);
    }
    while v.len() < len {
        let left = len - v.len();
        if v.capacity() == v.len() {
            v.reserve(left.min(GROW_STEP));
        }
        let n = rd.read_buf(&mut (&mut *v).limit(left)).await?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        progress.received(n);
    }
    Ok(())
}

/// Reads and drops `len` payload bytes, each read counting as progress.
async fn discard(rd: &mut BufReader<ReadLink>, len: u64, progress: &Counters) -> io::Result<()> {
    let mut scratch = [0u8; 8 << 10];
    let mut left = len;
    while left > 0 {
        let want = usize::try_from(left).unwrap_or(usize::MAX).min(scratch.len());
        let n = rd.read(&mut scratch[..want]).await?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        left -= n as u64;
        progress.received(n);
    }
    Ok(())
}

fn describe_io(e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::UnexpectedEof => "connection closed by peer in the middle of a frame".into(),
        io::ErrorKind::ConnectionReset => "connection reset by peer".into(),
        io::ErrorKind::BrokenPipe => "connection closed by peer (broken pipe)".into(),
        _ => e.to_string(),
    }
}

/// Marks the connection lost if a send is dropped after part of its frame went out.
struct MidFrame<'a> {
    inner: &'a Inner,
    rank: Rank,
    written: usize,
    finished: bool,
}

impl Drop for MidFrame<'_> {
    fn drop(&mut self) {
        if !self.finished && self.written > 0 {
            self.inner.peer_lost(
                self.rank,
                "a send was cancelled part-way through a message; the stream cannot be resynchronised",
            );
        }
    }
}

/// Handle of an [`Communicator::isend`]. Await it (it is a `Future`) or call
/// [`SendHandle::wait`] to get the tensor back once it is written to the socket.
/// Dropping it does not cancel the send.
#[must_use = "dropping a SendHandle lets the send finish in the background; await it to see errors"]
pub struct SendHandle {
    state: SendState,
    timeout: Option<Duration>,
}

enum SendState {
    Ready(Option<Result<Tensor>>),
    Running(JoinHandle<Result<Tensor>>),
}

impl SendHandle {
    fn ready(r: Result<Tensor>, timeout: Option<Duration>) -> Self {
        SendHandle {
            state: SendState::Ready(Some(r)),
            timeout,
        }
    }

    /// True once the send finished (successfully or not).
    pub fn is_completed(&self) -> bool {
        match &self.state {
            SendState::Ready(_) => true,
            SendState::Running(j) => j.is_finished(),
        }
    }

    /// Waits for the send, at most the configured `op_timeout` (after which the
    /// send carries on in the background and [`Error::Timeout`] is returned).
    pub async fn wait(self) -> Result<Tensor> {
        match self.timeout {
            None => self.await,
            Some(after) => tokio::time::timeout(after, self)
                .await
                .unwrap_or(Err(Error::Timeout { op: "isend", after })),
        }
    }
}

impl Future for SendHandle {
    type Output = Result<Tensor>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        match &mut this.state {
            SendState::Ready(r) => Poll::Ready(
                r.take()
                    .unwrap_or_else(|| Err(Error::invalid("SendHandle polled after completion"))),
            ),
            SendState::Running(j) => match Pin::new(j).poll(cx) {
                Poll::Pending => Poll::Pending,
                Poll::Ready(Ok(r)) => {
                    this.state = SendState::Ready(None);
                    Poll::Ready(r)
                }
                Poll::Ready(Err(e)) => {
                    this.state = SendState::Ready(None);
                    if e.is_panic() {
                        std::panic::resume_unwind(e.into_panic());
                    }
                    Poll::Ready(Err(Error::Aborted {
                        reason: Arc::from("send task cancelled (runtime shutting down)"),
                    }))
                }
            },
        }
    }
}

/// A receive that failed, with the caller's buffer given back (see
/// [`RecvHandle::wait_timeout`]).
#[derive(Debug)]
pub struct RecvFailed {
    /// Why: [`Error::Timeout`] when the call's deadline passed first.
    pub error: Error,
    /// The buffer the receive was posted with (its contents are unspecified
    /// after a failure).
    pub buffer: Tensor,
}

/// Handle of an [`Communicator::irecv`]. Await it (it is a `Future`) or call
/// [`RecvHandle::wait`]. Dropping it cancels the receive cleanly.
#[must_use = "dropping a RecvHandle cancels the receive"]
pub struct RecvHandle {
    inner: Arc<Inner>,
    tag: Tag,
    state: RecvState,
    /// Whether this receive's turn was taken (see [`RecvHandle::poll_done`]).
    paced: bool,
}

enum RecvState {
    Ready(RecvDone),
    Waiting {
        id: u64,
        rx: oneshot::Receiver<RecvDone>,
    },
    Taken,
}

impl RecvHandle {
    /// True once the receive finished (successfully or not).
    pub fn is_completed(&self) -> bool {
        match &self.state {
            RecvState::Ready(_) => true,
            RecvState::Waiting { rx, .. } => !rx.is_empty(),
            RecvState::Taken => true,
        }
    }

    /// Cancels the receive if its message has not started arriving, and returns
    /// its buffer. Returns `None` if it is already being filled or done; the handle
    /// then still yields the result.
    pub fn cancel(&mut self) -> Option<Tensor> {
        let RecvState::Waiting { id, .. } = &self.state else {
            return None;
        };
        let buf = self.inner.cancel_posted(self.tag, *id)?;
        self.state = RecvState::Taken;
        Some(buf)
    }

    /// Waits for the message at most `after`, a deadline of this call alone
    /// (beside the communicator's `op_timeout`). Every failure gives the
    /// caller's buffer back ([`RecvFailed`]): when the deadline passes before
    /// the message started arriving, the receive is cancelled and the error is
    /// [`Error::Timeout`]; a message already arriving then is waited for (its
    /// transfer ends when the last byte lands or the peer is lost).
    pub async fn wait_timeout(mut self, after: Duration) -> std::result::Result<Received, RecvFailed> {
        let done = match tokio::time::timeout(after, poll_fn(|cx| self.poll_done(cx))).await {
            Ok(done) => done,
            Err(_) => match self.cancel() {
                Some(buffer) => {
                    return Err(RecvFailed {
                        error: Error::Timeout { op: "irecv", after },
                        buffer,
                    });
                }
                None => poll_fn(|cx| self.poll_done(cx)).await,
            },
        };
        match done.result {
            Ok(src) => Ok(Received {
                src,
                tensor: done.buf,
            }),
            Err(error) => Err(RecvFailed {
                error,
                buffer: done.buf,
            }),
        }
    }

    /// Waits for the message, at most the configured `op_timeout` (after which the
    /// receive is cancelled and [`Error::Timeout`] returned; the buffer is
    /// dropped; [`RecvHandle::wait_timeout`] gives it back).
    pub async fn wait(self) -> Result<Received> {
        match self.inner.cfg.op_timeout {
            None => self.await,
            Some(after) => tokio::time::timeout(after, self)
                .await
                .unwrap_or(Err(Error::Timeout { op: "irecv", after })),
        }
    }

    /// Waits for the outcome, first polling for up to `spin` (yielding to the
    /// runtime, which polls its sockets in between) before sleeping. Waking a
    /// sleeping thread costs tens of microseconds on some machines; a message that
    /// arrives within `spin` is seen without that wake-up.
    async fn done_spinning(&mut self, spin: Duration) -> RecvDone {
        if !spin.is_zero() {
            let until = std::time::Instant::now() + spin;
            loop {
                if let Poll::Ready(d) = self.poll_done(&mut Context::from_waker(Waker::noop())) {
                    return d;
                }
                if std::time::Instant::now() >= until {
                    break;
                }
                tokio::task::yield_now().await;
            }
        }
        poll_fn(|cx| self.poll_done(cx)).await
    }

    /// Polls for the outcome. A receive that completed when it was posted (its
    /// message had already arrived, read ahead) counts against the task's
    /// cooperative budget, as the channel a waiting receive polls does: a loop
    /// taking such messages never waits, and would otherwise hold its runtime
    /// thread for as long as the peer keeps them coming, starving the
    /// heartbeats and other worlds' tasks queued behind it.
    /// Every [`READY_BURST`]th such receive in a row on the communicator
    /// also yields once, whatever the budget (unless [`without_pacing`]). A blocking
    /// receive does both before it posts (`Inner::pace`), so that dropping
    /// it at its yield takes nothing; a handle from [`Communicator::irecv`]
    /// does them here (dropping it then gives its message back).
    fn poll_done(&mut self, cx: &mut Context<'_>) -> Poll<RecvDone> {
        if matches!(self.state, RecvState::Ready(_)) && !self.paced {
            // `turn_is_up` starts the streak over, so the next poll goes on.
            if self.inner.turn_is_up() {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            std::task::ready!(tokio::task::coop::poll_proceed(cx)).made_progress();
            self.paced = true;
        }
        match std::mem::replace(&mut self.state, RecvState::Taken) {
            RecvState::Ready(d) => Poll::Ready(d),
            RecvState::Waiting { id, mut rx } => match Pin::new(&mut rx).poll(cx) {
                Poll::Pending => {
                    self.inner.ready_in_a_row.store(0, Ordering::Relaxed);
                    self.state = RecvState::Waiting { id, rx };
                    Poll::Pending
                }
                Poll::Ready(Ok(d)) => Poll::Ready(d),
                // Every path that removes a posted receive sends on its channel;
                // this is the fallback if that invariant is ever broken.
                Poll::Ready(Err(_)) => Poll::Ready(RecvDone::failed(
                    Tensor::default(),
                    self.inner
                        .aborted_error()
                        .unwrap_or_else(|| Error::invalid("receive was dropped by the communicator")),
                )),
            },
            RecvState::Taken => Poll::Ready(RecvDone::failed(
                Tensor::default(),
                Error::invalid("RecvHandle polled after completion"),
            )),
        }
    }
}

impl Future for RecvHandle {
    type Output = Result<Received>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.get_mut()
            .poll_done(cx)
            .map(|d| d.result.map(|src| Received { src, tensor: d.buf }))
    }
}

impl Drop for RecvHandle {
    fn drop(&mut self) {
        // Drops the buffer if the receive had not started; if it had, the reader
        // finds the channel closed and keeps the message for the next receive.
        if self.cancel().is_some() {
            return;
        }
        // Or the message was already handed over but not taken: put it back, so
        // that dropping a receive never loses a message.
        let done = match std::mem::replace(&mut self.state, RecvState::Taken) {
            // Closed first, so the reader either handed the message over before
            // (taken here) or finds the channel closed and keeps it: no window
            // in which a message sent now would be dropped with the channel.
            RecvState::Waiting { mut rx, .. } => {
                rx.close();
                rx.try_recv().ok()
            }
            RecvState::Ready(d) => Some(d),
            RecvState::Taken => None,
        };
        if let Some(RecvDone {
            buf,
            result: Ok(from),
            arrival,
        }) = done
        {
            self.inner.give_back(from, self.tag, buf, arrival);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use tokio::net::TcpStream;

    /// A blocking caller is the future its thread drives with `block_on`,
    /// not the tasks that thread may also run (a current-thread runtime's),
    /// and only inside `as_blocking_caller`.
    #[test]
    fn only_the_future_block_on_drives_is_a_blocking_caller() {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        assert!(!on_blocking_caller());
        let (root, task) = as_blocking_caller(|| {
            rt.block_on(async {
                let root = on_blocking_caller();
                let task = tokio::spawn(async { on_blocking_caller() }).await.unwrap();
                (root, task)
            })
        });
        assert!(root, "the future block_on drives");
        assert!(!task, "a task of the runtime");
        assert!(!on_blocking_caller(), "after as_blocking_caller");
        assert!(
            !rt.block_on(async { on_blocking_caller() }),
            "outside as_blocking_caller"
        );
    }

    /// A message handed on after the communicator aborted (a cancelled
    /// receive's, which a blocking thread hands over) is dropped: the abort
    /// already emptied the stash, and nothing could ever take it.
    #[tokio::test]
    async fn a_message_handed_on_after_an_abort_is_not_kept() {
        let world = multiworld_types::WorldName::new("handed-on").unwrap();
        let cfg = CommConfig::new(world, multiworld_types::Generation(1), Rank(0), 1);
        let comm = Communicator::join(cfg, &crate::MemoryRendezvous::new())
            .await
            .unwrap();
        comm.abort_with_reason("test");
        let t = Tensor::from_vec(vec![1.0f32; 1024], [1024]).unwrap();
        comm.inner
            .deliver(Rank(0), Tag(3), DType::F32, StashData::Tensor(t), false, Some(0));
        let (stash, _) = comm.inner.lock().take_all_stashed();
        assert!(stash.is_empty(), "{} stashed after the abort", stash.len());
    }

    /// A connected loopback pair: the reading half (buffered like a reader
    /// task's) and the writing stream.
    async fn pair() -> (BufReader<ReadLink>, TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let writer = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let (reader, _) = listener.accept().await.unwrap();
        let (rd, _wr) = reader.into_split();
        (BufReader::with_capacity(READ_BUF, ReadLink::Tcp(rd)), writer)
    }

    /// Sends `total` bytes in slices of `step` every `every`, the way a slow but
    /// live link delivers them.
    async fn trickle(mut w: TcpStream, total: usize, step: usize, every: Duration) {
        let data = vec![7u8; step];
        let mut sent = 0;
        while sent < total {
            let n = step.min(total - sent);
            w.write_all(&data[..n]).await.unwrap();
            sent += n;
            tokio::time::sleep(every).await;
        }
    }

    /// Largest gap between "last heard" updates seen while `read` runs.
    async fn longest_silence(counters: &Counters, read: impl Future<Output = io::Result<()>>) -> Duration {
        let mut read = std::pin::pin!(read);
        let mut longest = Duration::ZERO;
        loop {
            tokio::select! {
                r = &mut read => {
                    r.unwrap();
                    return longest;
                }
                _ = tokio::time::sleep(Duration::from_millis(20)) => {
                    longest = longest.max(counters.last_heard().elapsed());
                }
            }
        }
    }

    /// A large message arriving at ~640 KiB/s keeps its sender heard: every
    /// read counts, not every MiB (which took 1.6 s here and looked frozen to a
    /// 1 s heartbeat timeout).
    #[tokio::test]
    async fn a_slow_large_payload_keeps_the_sender_heard() {
        let (mut rd, w) = pair().await;
        let counters = Counters::new(Instant::now());
        let total = 2 << 20;
        let sender = tokio::spawn(trickle(w, total, 32 << 10, Duration::from_millis(50)));
        let mut buf = vec![0u8; total];
        let silence = longest_silence(&counters, read_payload(&mut rd, &mut buf, &counters)).await;
        sender.await.unwrap();
        assert!(buf.iter().all(|&b| b == 7));
        assert_eq!(counters.bytes_received.load(Ordering::Relaxed), total as u64);
        // Slices arrive every 50 ms; a busy machine may delay some, never by 0.5 s.
        assert!(
            silence < Duration::from_millis(500),
            "silent for {silence:?} while bytes arrived"
        );
    }

    /// The same holds for a message being discarded (a mismatch) and one read
    /// while the peer is draining.
    #[tokio::test]
    async fn discarded_and_drained_payloads_count_as_progress() {
        let total = 1 << 20;
        let (mut rd, w) = pair().await;
        let counters = Counters::new(Instant::now());
        let sender = tokio::spawn(trickle(w, total, 32 << 10, Duration::from_millis(40)));
        let silence = longest_silence(&counters, discard(&mut rd, total as u64, &counters)).await;
        sender.await.unwrap();
        assert_eq!(counters.bytes_received.load(Ordering::Relaxed), total as u64);
        assert!(
            silence < Duration::from_millis(500),
            "discard: silent for {silence:?}"
        );

        let (mut rd, w) = pair().await;
        let counters = Counters::new(Instant::now());
        let sender = tokio::spawn(trickle(w, total, 32 << 10, Duration::from_millis(40)));
        let mut v = Vec::new();
        let silence = longest_silence(&counters, read_fresh(&mut rd, &mut v, total, true, &counters)).await;
        sender.await.unwrap();
        assert_eq!(v.len(), total);
        assert!(
            silence < Duration::from_millis(500),
            "drain: silent for {silence:?}"
        );
    }

    /// A payload cut short is an error, not a hang or a short read.
    #[tokio::test]
    async fn a_payload_cut_short_is_unexpected_eof() {
        let (mut rd, mut w) = pair().await;
        let counters = Counters::new(Instant::now());
        w.write_all(&[1u8; 100]).await.unwrap();
        drop(w);
        let mut buf = vec![0u8; 1000];
        let err = read_payload(&mut rd, &mut buf, &counters).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
        assert_eq!(counters.bytes_received.load(Ordering::Relaxed), 100);
    }
}
