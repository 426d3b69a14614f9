//! One connection of the framed protocol (codec in [`crate::framed`]): its
//! reader, its replies, its keepalive and its deadlines, under the same
//! bounds as an HTTP/2 connection.
//!
//! The reader takes one frame at a time. A request is judged by the gate
//! from its head (method, world, proof) before its message is read; a
//! refused one is answered and its message skipped without being kept. An
//! admitted message is read only after its memory is reserved from the
//! server's budget, within `request_body_timeout`. Requests that cannot
//! wait run on the reader itself and answer at once; waits (`Get`, `Wait`,
//! `MultiGet`) run on their own tasks, so the connection goes on reading,
//! and a `Cancel` frame or the end of the connection drops them (and their
//! waiters). Replies of all of them go out through one writer lock. The
//! server pings every `keepalive_interval` and closes a connection whose
//! pong is `keepalive_timeout` late, which also releases the waits of a
//! client that froze.
//!
//! A connection the server closes on purpose (its stop, `idle_timeout`,
//! `first_request_timeout`; not an eviction, which frees its place at once)
//! goes away in order: the reader
//! stops at the next frame boundary, a `GoAway` frame tells the client how
//! many of its requests were read (it sends the later ones again elsewhere),
//! the waits among them may answer within a grace, then the connection
//! closes.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, atomic::AtomicU64},
};

use bytes::{Buf, BytesMut};
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWriteExt},
    sync::{mpsc, watch},
    task::AbortHandle,
    time::Instant,
};
use tokio_util::{sync::CancellationToken, task::TaskTracker};

use super::{Accepted, CLOSE_GRACE, Conn, InFlight, Unauthenticated, admit, count_refusal};
use crate::{
    error::{Limit, StoreError},
    framed::{
        self, CONTROL_QUEUE, Controls, Counted, HEADER, Head, Kind, Method, Out, PREFACE, READ_CHUNK,
        keepalive, read_message, write_controls,
    },
    limits::over,
    server::{Caller, Shared, client_id},
};

/// The waits running on their own tasks, by request id, until they start
/// writing their answer.
#[derive(Default)]
struct Waits {
    running: Mutex<HashMap<u32, AbortHandle>>,
    /// Every wait task, answering or not: the connection ends only when all
    /// have.
    tracker: TaskTracker,
    /// Cancelled when the connection ends: an answer still being written
    /// (to a client that stopped reading) is given up.
    closed: CancellationToken,
}

impl Waits {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u32, AbortHandle>> {
        self.running.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn cancel(&self, id: u32) {
        if let Some(task) = self.lock().remove(&id) {
            task.abort();
        }
    }

    /// Drops every wait (their waiters leave the table) and every answer
    /// being written, and waits until all their tasks have ended.
    async fn end(&self) {
        self.closed.cancel();
        for (_, task) in self.lock().drain() {
            task.abort();
        }
        self.tracker.close();
        self.tracker.wait().await;
    }
}

/// Why a connection ends early.
type Closed = String;

/// Serves one framed connection until the client leaves, a bound or a
/// deadline closes it, or the server stops.
pub(super) async fn serve(accepted: Accepted, shared: &Arc<Shared>) {
    let (stream, remote, conn, stop, kill) = accepted.into_parts();
    let config = &shared.config;
    let (rd, wr) = stream.into_split();
    let moved = Arc::new(AtomicU64::new(0));
    let rd = Counted::new(rd, &moved);
    let out = Arc::new(Out::new(wr, &moved));
    let waits = Arc::new(Waits::default());
    let (pong_tx, pong_rx) = watch::channel(0u32);
    let (controls, mut queued) = mpsc::channel(CONTROL_QUEUE);
    // Cancelled to make the connection go away in order (the server's stop
    // or a deadline): the reader stops at the next frame boundary.
    let closing = stop.child_token();
    let reader = Reader {
        shared,
        conn: &conn,
        out: &out,
        waits: &waits,
        pongs: &pong_tx,
        client: client_id(Some(remote)),
        buf: BytesMut::with_capacity(READ_CHUNK),
        stop: &closing,
        controls: &controls,
        requests: 0,
    };
    let alive = keepalive(
        &controls,
        pong_rx,
        &moved,
        config.keepalive_interval,
        config.keepalive_timeout,
    );
    let mut rd = rd;
    let why = tokio::select! {
        r = reader.run(&mut rd) => match r {
            // Going away: the reader ended at a frame boundary, after the
            // request it was running. The client learns how many of its
            // requests were read, and the waits among them (which end at
            // once on a stop, their worlds closed) may still answer within
            // the grace.
            Ok(read) if closing.is_cancelled() => {
                let grace = tokio::time::sleep(CLOSE_GRACE);
                tokio::pin!(grace);
                waits.tracker.close();
                let go_away = framed::control(Kind::GoAway, read);
                tokio::select! {
                    _ = async {
                        let _ = out.send(&go_away).await;
                        waits.tracker.wait().await;
                        // The end of our side, then what the client still
                        // sends (requests written before the GoAway reached
                        // it) is read and dropped until it closes too:
                        // closing with unread input would reset the
                        // connection, and a reset can discard the GoAway
                        // before the client reads it.
                        let _ = out.lock().await.shutdown().await;
                        drain(&mut rd).await;
                    } => None,
                    _ = &mut grace => Some("waits still answering at the end of the grace".into()),
                    _ = kill.cancelled() => Some("the server was killed".into()),
                }
            }
            // The client left.
            Ok(_) => None,
            Err(why) => Some(why),
        },
        why = alive => Some(why),
        why = write_controls(&out, &mut queued) => Some(why),
        why = deadlines(&conn, shared, &closing) => Some(why),
        _ = kill.cancelled() => Some("the server was killed".into()),
    };
    if let Some(why) = why {
        tracing::debug!(%remote, why, "store connection closed");
    }
    // A wait whose connection is gone has no one to answer: dropping it
    // removes its waiter from the table.
    waits.end().await;
}

/// Reads and drops what comes until the end of the stream (or an error).
async fn drain(rd: &mut (impl AsyncRead + Unpin)) {
    let mut sink = vec![0u8; READ_CHUNK];
    while matches!(rd.read(&mut sink).await, Ok(n) if n > 0) {}
}

/// Ends at once when the connection is evicted (its place is wanted now).
/// When it sent no request within `first_request_timeout`, or had none in
/// flight for `idle_timeout`: makes it go away in order (`closing`), and
/// ends with the reason if it has not gone within the grace (a request
/// still arriving, a client not reading the `GoAway`).
async fn deadlines(conn: &Conn, shared: &Shared, closing: &CancellationToken) -> Closed {
    let config = &shared.config;
    let why: Closed = loop {
        let check = conn.next_check(config);
        tokio::select! {
            _ = conn.changed.notified() => {}
            _ = tokio::time::sleep_until(check) => {}
            // The server's stop: the reader's end takes it from here.
            _ = closing.cancelled() => std::future::pending::<()>().await,
        }
        if conn.evicted.load(std::sync::atomic::Ordering::Acquire) {
            return "evicted to make room".into();
        }
        if let Some(why) = conn.expired(Instant::now(), config) {
            break why.into();
        }
    };
    tracing::debug!(why, "store connection going away");
    closing.cancel();
    let gone_by = Instant::now() + CLOSE_GRACE.saturating_add(config.request_body_timeout);
    loop {
        tokio::select! {
            _ = tokio::time::sleep_until(gone_by) => return why,
            _ = conn.changed.notified() => {}
        }
        if conn.evicted.load(std::sync::atomic::Ordering::Acquire) {
            return "evicted to make room".into();
        }
    }
}

struct Reader<'a> {
    shared: &'a Arc<Shared>,
    conn: &'a Arc<Conn>,
    out: &'a Arc<Out>,
    waits: &'a Arc<Waits>,
    pongs: &'a watch::Sender<u32>,
    client: crate::table::ClientId,
    /// Bytes read and not yet taken.
    buf: BytesMut,
    /// The server's stop: the reader ends at the next frame boundary.
    stop: &'a CancellationToken,
    /// Pongs go out through the connection's control queue.
    controls: &'a Controls,
    /// Requests read so far (their headers), modulo 2^32: what a `GoAway`
    /// tells the client.
    requests: u32,
}

impl Reader<'_> {
    /// Reads frames until the client leaves or `stop` (at a frame
    /// boundary); returns how many requests it read.
    async fn run(mut self, mut rd: impl AsyncRead + Unpin) -> Result<u32, Closed> {
        let mut preface = [0u8; PREFACE.len()];
        tokio::select! {
            read = rd.read_exact(&mut preface) => read.map_err(|e| format!("no preface: {e}"))?,
            // Not a framed client yet: nothing to tell it.
            _ = self.stop.cancelled() => return Err("closed before its preface was complete".into()),
        };
        if preface != PREFACE {
            return Err("not a framed store client".into());
        }
        let config = &self.shared.config;
        // The longest head (method, two lengths, a name, a proof) and message.
        let max_body = framed::max_head_len(config.max_name_len).saturating_add(config.max_message_bytes);
        loop {
            // Between frames: the only place the server's stop ends the
            // reader, so no request is cut in half.
            if self.stop.is_cancelled() {
                return Ok(self.requests);
            }
            if self.buf.is_empty() {
                // Nothing read yet: the stop may also come while waiting.
                tokio::select! {
                    _ = self.stop.cancelled() => return Ok(self.requests),
                    more = self.fill(&mut rd, 1, None) => if !more? {
                        return Ok(self.requests);
                    },
                }
            }
            if !self.fill(&mut rd, HEADER, None).await? {
                return Ok(self.requests);
            }
            let mut header = [0u8; HEADER];
            header.copy_from_slice(&self.buf[..HEADER]);
            self.buf.advance(HEADER);
            let h = framed::decode_header(&header, max_body)?;
            match h.kind {
                Kind::Ping => {
                    // Through the control queue: the reader never waits on
                    // the writer for a pong (a full queue drops it).
                    let _ = self.controls.try_send(framed::control(Kind::Pong, h.id));
                }
                Kind::Pong => {
                    self.pongs.send_replace(h.id);
                }
                Kind::Cancel => self.waits.cancel(h.id),
                Kind::Request => {
                    self.requests = self.requests.wrapping_add(1);
                    self.request(&mut rd, h.id, h.len).await?;
                }
                Kind::Reply | Kind::Error | Kind::GoAway => {
                    return Err(format!("a client sent a {:?} frame", h.kind));
                }
            }
        }
    }

    /// Reads until at least `n` bytes are held; `false` at a clean end of
    /// stream before any byte of a frame. `deadline` bounds a frame's rest.
    async fn fill(
        &mut self,
        rd: &mut (impl AsyncRead + Unpin),
        n: usize,
        deadline: Option<Instant>,
    ) -> Result<bool, Closed> {
        while self.buf.len() < n {
            self.buf.reserve(READ_CHUNK);
            if framed::read_within(rd, &mut self.buf, deadline, "a frame's rest").await? == 0 {
                if self.buf.is_empty() && deadline.is_none() {
                    return Ok(false);
                }
                return Err("the client closed the connection in the middle of a frame".into());
            }
        }
        Ok(true)
    }

    async fn answer(&self, frame: &[u8]) -> Result<(), Closed> {
        self.out.send(frame).await.map_err(|e| format!("write: {e}"))
    }

    async fn refuse(
        &mut self,
        rd: &mut (impl AsyncRead + Unpin),
        id: u32,
        err: StoreError,
        rest: usize,
        deadline: Instant,
    ) -> Result<(), Closed> {
        count_refusal(self.shared, &err);
        let stranger = matches!(err, StoreError::Unauthenticated { .. });
        self.answer(&framed::encode_error(id, err)).await?;
        // A stranger's large message is not worth reading through.
        if stranger && rest > self.shared.config.max_unauthenticated_body_bytes {
            return Err("an unauthenticated request with a large message".into());
        }
        framed::skip(rd, &mut self.buf, rest, Some(deadline)).await
    }

    async fn request(
        &mut self,
        rd: &mut (impl AsyncRead + Unpin),
        id: u32,
        len: usize,
    ) -> Result<(), Closed> {
        let in_flight = InFlight::begin(self.conn);
        // Until its head says who it is from and `admit` lets it in, a
        // request is a stranger's: its connection may make room for a
        // member's (a head stalled for `request_body_timeout`, or a refusal
        // whose answer the client does not read, must not hold a place).
        let stranger = Unauthenticated::begin(self.conn);
        let shared = Arc::clone(self.shared);
        let config = &shared.config;
        let deadline = Instant::now() + config.request_body_timeout;
        let head = loop {
            let held = self.buf.len().min(len);
            match framed::decode_request_head(&self.buf[..held], len, config.max_name_len)? {
                Head::Need(n) => {
                    self.fill(rd, n, Some(deadline)).await?;
                }
                Head::Done(head) => break head,
                Head::Bad(why) => {
                    let rest = len - self.buf.len().min(len);
                    let held = self.buf.len().min(len);
                    self.buf.advance(held);
                    return self
                        .refuse(rd, id, StoreError::InvalidArgument(why), rest, deadline)
                        .await;
                }
            }
        };
        self.buf.advance(head.len);
        let rest = len - head.len;
        let Some(method) = Method::from_u8(head.method) else {
            let err = StoreError::InvalidArgument(format!("unknown method {}", head.method));
            return self.refuse(rd, id, err, rest, deadline).await;
        };
        // `admit` counts a pre-authentication request itself.
        drop(stranger);
        let admitted = match admit(
            &shared,
            self.conn,
            method.name(),
            head.world.as_deref(),
            head.proof.as_deref(),
        ) {
            Ok(admitted) => admitted,
            Err(err) => {
                let _stranger = Unauthenticated::begin(self.conn);
                return self.refuse(rd, id, err, rest, deadline).await;
            }
        };
        let bound = admitted.bound;
        if let Err(err) = over(Limit::MessageBytes, bound, rest) {
            return self.refuse(rd, id, err, rest, deadline).await;
        }
        // Waits run beside the reader, so they are what can pile up on one
        // connection; other requests run one at a time on the reader.
        if method.waits() {
            // Counted until its answer is written (the tracker holds every
            // wait's task): answers a client does not read stay bounded.
            let running = self.waits.tracker.len();
            let taken = self.waits.lock().contains_key(&id);
            if taken {
                let err = StoreError::InvalidArgument(format!("request id {id} is already waiting"));
                return self.refuse(rd, id, err, rest, deadline).await;
            }
            if let Err(err) = over(
                Limit::ConnectionRequests,
                config.max_streams_per_connection as usize,
                running + 1,
            ) {
                return self.refuse(rd, id, err, rest, deadline).await;
            }
        }
        let reserve = rest.saturating_mul(2);
        let reservation = match shared.budget.reserve(reserve, config.request_memory_wait).await {
            Ok(r) => r,
            Err(err) => return self.refuse(rd, id, err, rest, deadline).await,
        };
        // The values the message carries into the table pin nothing else.
        let message = match read_message(rd, &mut self.buf, rest, Some(deadline)).await {
            Ok(message) => message,
            Err(why) => {
                if Instant::now() >= deadline {
                    let err = StoreError::Timeout {
                        what: "the rest of the request".into(),
                        after: config.request_body_timeout,
                    };
                    // The connection closes either way.
                    count_refusal(self.shared, &err);
                    let _ = self.answer(&framed::encode_error(id, err)).await;
                }
                return Err(why);
            }
        };
        let caller = Caller {
            world: head.world,
            proof: head.proof,
            client: self.client,
        };
        if !method.waits() {
            let frame = shared
                .dispatch(id, method, &caller, message, Some(reservation))
                .await;
            drop(admitted);
            drop(in_flight);
            return self.answer(&frame).await;
        }
        let (out, waits) = (Arc::clone(self.out), Arc::clone(self.waits));
        let mut registry = self.waits.lock();
        let task = self.waits.tracker.spawn(async move {
            let frame = shared
                .dispatch(id, method, &caller, message, Some(reservation))
                .await;
            // Answering: a cancel comes too late now (the answer is on its
            // way), but the connection's end still stops the write. (The
            // entry is this task's unless a cancel removed it and a new
            // wait took the id since.)
            {
                let mut running = waits.lock();
                let me = tokio::task::try_id();
                if running.get(&id).is_some_and(|h| Some(h.id()) == me) {
                    running.remove(&id);
                }
            }
            drop(admitted);
            drop(in_flight);
            tokio::select! {
                // A write that fails means the connection is going; its
                // reader sees that too.
                _ = out.send(&frame) => {}
                _ = waits.closed.cancelled() => {}
            }
        });
        // Registered under the lock the task takes to leave, so it cannot
        // leave first.
        registry.insert(id, task.abort_handle());
        Ok(())
    }
}
