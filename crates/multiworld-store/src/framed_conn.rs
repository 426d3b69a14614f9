//! The client's connection in the framed protocol (codec in
//! [`crate::framed`]), the default.
//!
//! A call is written by the caller's own task, under the connection's writer
//! lock, as one frame in one write; its answer is read by the connection's
//! driver task and handed over through a oneshot channel. The driver never
//! waits on the writer lock to go on reading (its pongs, pings and cancels
//! go out from a branch of their own), so two large frames crossing cannot
//! stop both ends. What the HTTP/2
//! connection ([`crate::conn`]) gives is kept: TCP_NODELAY, keepalive pings
//! (a frozen server fails the calls), replies bounded before allocation, a
//! dropped call tells the server (a `Cancel` frame, so the server forgets
//! the wait), a dead connection fails every call on it at once, and the next
//! call after that dials again. A server that closes the connection on
//! purpose says so first (`GoAway`, with how many requests it read): the
//! calls it never read are sent again on a new connection (at most
//! [`RESENDS`] times), those it read still get their answers, and new calls
//! go to a new connection.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU32, AtomicU64, Ordering},
    },
};

use bytes::{Buf, Bytes, BytesMut};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpStream, tcp::OwnedReadHalf},
    sync::{mpsc, oneshot, watch},
};
use tokio_util::sync::CancellationToken;
use tonic::Status;

use crate::{
    conn::ConnSettings,
    framed::{
        self, CONTROL_QUEUE, Controls, Counted, HEADER, Kind, MAX_BODY, MAX_ERROR_BODY, Method, Out, PREFACE,
        keepalive, read_message, write_controls,
    },
};

/// Why a connection ended when the server answered the framed preface with
/// an HTTP/2 frame: a server of an earlier version, which speaks only gRPC.
pub(crate) const HTTP2_ONLY: &str = "the server answered in HTTP/2: it speaks only gRPC";

/// Whether a connection's first 9 bytes from the server are an HTTP/2
/// SETTINGS frame (type 4, no flags, stream 0), which an HTTP/2 server
/// sends first. No framed frame looks like that: its fifth byte is its
/// kind, never 0.
fn is_http2_settings(header: &[u8; HEADER]) -> bool {
    header[3] == 4 && header[4] == 0 && header[5..] == [0, 0, 0, 0]
}

/// What a call gets back: the reply's message, or the status of an error
/// frame or of the connection's end.
type Answer = Result<Bytes, Status>;

/// How a call on one connection ends.
enum Outcome {
    Answer(Answer),
    /// The server went away without reading the request: send it again on
    /// another connection.
    Resend,
}

/// How many times a call is sent again after servers that went away
/// without reading it.
const RESENDS: usize = 3;

/// A call waiting for its answer.
struct Waiting {
    tx: oneshot::Sender<Outcome>,
    /// Its request's place among the connection's requests (from 1), once
    /// written.
    seq: Option<u32>,
}

#[derive(Default)]
struct Calls {
    waiting: HashMap<u32, Waiting>,
    /// Why the connection ended, once it has.
    ended: Option<String>,
    /// Requests written so far, modulo 2^32.
    written: u32,
    /// The server's `GoAway`: how many requests it read. No request is
    /// written after it.
    going_away: Option<u32>,
}

/// Whether a request written `seq`-th (from 1) is among the first `read`
/// (modulo 2^32: fewer than 2^31 requests are ever outstanding).
fn was_read(seq: u32, read: u32) -> bool {
    read.wrapping_sub(seq) < 1 << 31
}

/// One live connection.
struct Link {
    /// Which dial made it (the first is 0).
    dial: u64,
    out: Out,
    calls: Mutex<Calls>,
    next_id: AtomicU32,
    gone: CancellationToken,
    /// Control frames (cancels, pongs, pings) for the driver to write.
    control: Controls,
}

impl Link {
    fn calls(&self) -> std::sync::MutexGuard<'_, Calls> {
        self.calls.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Ends the connection: every call on it fails with `why`.
    fn end(&self, why: String) {
        let waiting = {
            let mut calls = self.calls();
            if calls.ended.is_none() {
                calls.ended = Some(why.clone());
            }
            std::mem::take(&mut calls.waiting)
        };
        for (_, w) in waiting {
            let _ = w.tx.send(Outcome::Answer(Err(Status::unavailable(why.clone()))));
        }
        self.gone.cancel();
    }

    /// Whether new calls may use this connection.
    fn usable(&self) -> bool {
        !self.gone.is_cancelled() && self.calls().going_away.is_none()
    }

    /// The server goes away having read `read` requests: the calls it did
    /// not read are told to go elsewhere; the others wait for their answers.
    fn go_away(&self, read: u32) {
        let resend: Vec<Waiting> = {
            let mut calls = self.calls();
            calls.going_away = Some(read);
            let ids: Vec<u32> = calls
                .waiting
                .iter()
                .filter(|(_, w)| w.seq.is_some_and(|s| !was_read(s, read)))
                .map(|(id, _)| *id)
                .collect();
            ids.iter().filter_map(|id| calls.waiting.remove(id)).collect()
        };
        for w in resend {
            let _ = w.tx.send(Outcome::Resend);
        }
    }
}

/// A call in progress. Dropped before its answer, it leaves the table of
/// calls; if its request went out, it tells the server (`Cancel`); if it was
/// dropped halfway through writing its request, it ends the connection,
/// whose stream could not be read past a partial frame.
struct Call<'a> {
    link: &'a Link,
    id: u32,
    state: CallState,
}

#[derive(PartialEq, Eq)]
enum CallState {
    /// Waiting for the writer lock: nothing sent yet.
    Queued,
    Writing,
    Sent,
    Answered,
}

impl Drop for Call<'_> {
    fn drop(&mut self) {
        match self.state {
            CallState::Answered => {}
            CallState::Queued => {
                self.link.calls().waiting.remove(&self.id);
            }
            CallState::Sent => {
                if self.link.calls().waiting.remove(&self.id).is_some() {
                    // A full queue (the writer stuck) drops it: the server's
                    // wait then ends at its own timeout or with the connection.
                    let _ = self.link.control.try_send(framed::control(Kind::Cancel, self.id));
                }
            }
            CallState::Writing => self
                .link
                .end("a call was abandoned halfway through writing its request".into()),
        }
    }
}

struct Inner {
    addr: Arc<str>,
    settings: ConnSettings,
    max_reply: usize,
    current: Mutex<Option<Arc<Link>>>,
    /// Held while dialing again, so that callers finding the connection
    /// gone together make one new connection, not one each.
    dialing: tokio::sync::Mutex<u64>,
}

impl Drop for Inner {
    /// The last handle is gone: so is the connection (its driver ends and
    /// the socket closes), as an HTTP/2 connection goes with its last
    /// request handle.
    fn drop(&mut self) {
        let current = self.current.get_mut().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(link) = current {
            link.end("the client was dropped".into());
        }
    }
}

/// A client connection in the framed protocol. Cheap to clone; clones share
/// the connection.
#[derive(Clone)]
pub(crate) struct FramedConn {
    inner: Arc<Inner>,
}

impl FramedConn {
    /// Dials `addr` (`host:port`) and sends the preface.
    pub(crate) async fn connect(
        addr: Arc<str>,
        settings: ConnSettings,
        max_reply: usize,
    ) -> Result<FramedConn, String> {
        let link = dial(&addr, &settings, max_reply, 0).await?;
        Ok(FramedConn {
            inner: Arc::new(Inner {
                addr,
                settings,
                max_reply,
                current: Mutex::new(Some(link)),
                dialing: tokio::sync::Mutex::new(0),
            }),
        })
    }

    fn current(&self) -> Option<Arc<Link>> {
        self.inner
            .current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The live connection, or a new one if it has gone (one attempt; the
    /// call's own deadline bounds it).
    async fn ready(&self) -> Result<Arc<Link>, Status> {
        let seen = self.current();
        if let Some(link) = &seen
            && link.usable()
        {
            return Ok(Arc::clone(link));
        }
        let mut dials = self.inner.dialing.lock().await;
        // Another caller may have dialed while this one waited.
        if let Some(link) = self.current()
            && seen.as_ref().is_none_or(|s| s.dial != link.dial)
            && link.usable()
        {
            return Ok(link);
        }
        *dials += 1;
        let link = dial(
            &self.inner.addr,
            &self.inner.settings,
            self.inner.max_reply,
            *dials,
        )
        .await
        .map_err(Status::unavailable)?;
        *self.inner.current.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::clone(&link));
        Ok(link)
    }

    /// Sends one request and waits for its answer; sends it again on a new
    /// connection if the server went away without reading it.
    pub(crate) async fn call(
        &self,
        method: Method,
        world: &str,
        proof: Option<&str>,
        message: &impl prost::Message,
    ) -> Answer {
        let len = framed::head_len(world, proof).saturating_add(message.encoded_len());
        if len > MAX_BODY {
            return Err(Status::out_of_range(format!(
                "message length too large: found {len} bytes, the limit is: {MAX_BODY} bytes"
            )));
        }
        for _ in 0..=RESENDS {
            let link = self.ready().await?;
            let frame = |id| framed::encode_request(id, method, world, proof, message);
            match call_on(&link, frame).await {
                Outcome::Answer(answer) => return answer,
                Outcome::Resend => {}
            }
        }
        Err(Status::unavailable(format!(
            "the store server went away without reading the request {} times",
            RESENDS + 1
        )))
    }
}

/// One call on `link`: its request (`frame` of the call's id) written under
/// the writer lock, unless the server is going away, and its outcome.
async fn call_on(link: &Link, frame: impl FnOnce(u32) -> Bytes) -> Outcome {
    let (tx, rx) = oneshot::channel();
    let id = {
        let mut calls = link.calls();
        // Going away first: a server that said so and then closed never saw
        // this call, whichever the call finds.
        if calls.going_away.is_some() {
            return Outcome::Resend;
        }
        if let Some(why) = &calls.ended {
            return Outcome::Answer(Err(Status::unavailable(why.clone())));
        }
        // Ids wrap after 2^32 calls: skip one still in use.
        let mut id = link.next_id.fetch_add(1, Ordering::Relaxed);
        while calls.waiting.contains_key(&id) {
            id = link.next_id.fetch_add(1, Ordering::Relaxed);
        }
        calls.waiting.insert(id, Waiting { tx, seq: None });
        id
    };
    let mut call = Call {
        link,
        id,
        state: CallState::Queued,
    };
    let frame = frame(id);
    let mut out = link.out.lock().await;
    // Under the writer lock, so `seq` is the order the server reads in;
    // under the calls lock, so a `GoAway` sees either this request's place
    // or no request written.
    let placed = {
        let mut calls = link.calls();
        let seq = calls.written.wrapping_add(1);
        if calls.going_away.is_some() {
            calls.waiting.remove(&id);
            Err(Some(Outcome::Resend))
        } else if let Some(w) = calls.waiting.get_mut(&id) {
            w.seq = Some(seq);
            calls.written = seq;
            Ok(())
        } else {
            // The connection ended meanwhile: its end failed this call.
            Err(None)
        }
    };
    if let Err(now) = placed {
        drop(out);
        call.state = CallState::Answered;
        return match now {
            Some(outcome) => outcome,
            None => rx
                .await
                .unwrap_or_else(|_| Outcome::Answer(Err(Status::unavailable("the store connection ended")))),
        };
    }
    call.state = CallState::Writing;
    let written = out.write_all(&frame).await;
    drop(out);
    call.state = CallState::Sent;
    if let Err(e) = written {
        link.end(format!("write: {e}"));
    }
    let outcome = rx
        .await
        .unwrap_or_else(|_| Outcome::Answer(Err(Status::unavailable("the store connection ended"))));
    call.state = CallState::Answered;
    outcome
}

async fn dial(addr: &str, settings: &ConnSettings, max_reply: usize, dial: u64) -> Result<Arc<Link>, String> {
    let mut tcp = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    tcp.set_nodelay(true).map_err(|e| format!("TCP_NODELAY: {e}"))?;
    tcp.write_all(&PREFACE)
        .await
        .map_err(|e| format!("preface: {e}"))?;
    let (rd, wr) = tcp.into_split();
    let moved = Arc::new(AtomicU64::new(0));
    let rd = Counted::new(rd, &moved);
    let (control, controls) = mpsc::channel(CONTROL_QUEUE);
    let link = Arc::new(Link {
        dial,
        out: Out::new(wr, &moved),
        calls: Mutex::new(Calls::default()),
        next_id: AtomicU32::new(1),
        gone: CancellationToken::new(),
        control,
    });
    tokio::spawn(drive(
        Arc::clone(&link),
        rd,
        moved,
        controls,
        settings.clone(),
        max_reply,
    ));
    Ok(link)
}

/// Reads the connection's answers and writes its control frames (cancels,
/// pongs, pings), each on a branch of its own; when any of them or the
/// keepalive ends, so does the connection and every call on it.
async fn drive(
    link: Arc<Link>,
    rd: Counted<OwnedReadHalf>,
    moved: Arc<AtomicU64>,
    mut controls: mpsc::Receiver<[u8; HEADER]>,
    settings: ConnSettings,
    max_reply: usize,
) {
    let (pong_tx, pong_rx) = watch::channel(0u32);
    let why = tokio::select! {
        why = read_answers(&link, rd, max_reply, &pong_tx) => why,
        why = keepalive(&link.control, pong_rx, &moved, settings.keepalive_interval, settings.keepalive_timeout) => why,
        why = write_controls(&link.out, &mut controls) => why,
        _ = link.gone.cancelled() => "closed by a call".into(),
    };
    tracing::debug!(why, "store connection ended");
    link.end(why);
    // Our side's end too, now rather than when the last handle lets go of
    // the link: a server going away waits for it (briefly) before it closes.
    let _ = tokio::time::timeout(std::time::Duration::from_millis(100), async {
        link.out.lock().await.shutdown().await
    })
    .await;
}

async fn read_answers(
    link: &Link,
    mut rd: Counted<OwnedReadHalf>,
    max_reply: usize,
    pongs: &watch::Sender<u32>,
) -> String {
    let mut buf = BytesMut::with_capacity(framed::READ_CHUNK);
    let mut first = true;
    loop {
        while buf.len() < HEADER {
            buf.reserve(framed::READ_CHUNK);
            match rd.read_buf(&mut buf).await {
                Ok(0) if buf.is_empty() => return "the server closed the connection".into(),
                Ok(0) => return "the server closed the connection in the middle of a frame".into(),
                Ok(_) => {}
                Err(e) => return format!("read: {e}"),
            }
        }
        let mut header = [0u8; HEADER];
        header.copy_from_slice(&buf[..HEADER]);
        buf.advance(HEADER);
        if std::mem::take(&mut first) && is_http2_settings(&header) {
            return HTTP2_ONLY.into();
        }
        let h = match framed::decode_header(&header, MAX_BODY) {
            Ok(h) => h,
            Err(e) => return format!("a bad frame from the server: {e}"),
        };
        let answer = match h.kind {
            Kind::Ping => {
                // Never waits for the writer: the reading goes on.
                let _ = link.control.try_send(framed::control(Kind::Pong, h.id));
                continue;
            }
            Kind::Pong => {
                pongs.send_replace(h.id);
                continue;
            }
            Kind::GoAway => {
                link.go_away(h.id);
                continue;
            }
            Kind::Reply if h.len > max_reply => {
                // Over this client's bound: that call fails at once, typed as
                // the gRPC codec's bound is, and the connection goes on once
                // the reply has been skipped.
                let waiting = link.calls().waiting.remove(&h.id);
                if let Some(w) = waiting {
                    let _ = w.tx.send(Outcome::Answer(Err(Status::out_of_range(format!(
                        "message length too large: found {} bytes, the limit is: {max_reply} bytes",
                        h.len
                    )))));
                }
                if let Err(e) = framed::skip(&mut rd, &mut buf, h.len, None).await {
                    return e;
                }
                continue;
            }
            Kind::Reply => match read_message(&mut rd, &mut buf, h.len, None).await {
                Ok(body) => Ok(body),
                Err(e) => return e,
            },
            Kind::Error if h.len > MAX_ERROR_BODY => {
                return format!("a {}-byte error frame from the server", h.len);
            }
            Kind::Error => {
                let body = match read_message(&mut rd, &mut buf, h.len, None).await {
                    Ok(body) => body,
                    Err(e) => return e,
                };
                match framed::decode_error(&body) {
                    Ok(status) => Err(status),
                    Err(e) => return format!("a bad error frame from the server: {e}"),
                }
            }
            Kind::Request | Kind::Cancel => return format!("the server sent a {:?} frame", h.kind),
        };
        // Absent when the call was abandoned: nothing to do.
        let waiting = link.calls().waiting.remove(&h.id);
        if let Some(w) = waiting {
            let _ = w.tx.send(Outcome::Answer(answer));
        }
    }
}
