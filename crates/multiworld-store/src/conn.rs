//! The client's HTTP/2 connection, driven on `h2` directly rather than
//! through tonic's `Channel` (a tower buffer task in front of hyper's client).
//!
//! Why: through `Channel` a unary call crossed three tasks (the caller, the
//! buffer's worker, hyper's connection task) and hyper spawned a fourth per
//! request to pipe the body, because a stream that is not open yet has no
//! send capacity; the request went out as two writes (HEADERS, then DATA and
//! an empty END_STREAM DATA frame), waking the server twice. Here the
//! caller's own task queues HEADERS and the whole message (END_STREAM set)
//! before the connection task runs, so a request is one write, one frame
//! fewer, and no spawn. The wire protocol is unchanged (gRPC over HTTP/2);
//! what the old stack did is kept: TCP_NODELAY, keepalive pings (a frozen
//! server fails the calls), a bounded header list, a dropped call resets its
//! stream, a dead connection fails every call on it at once, and the next
//! call after that dials again (as tonic's channel reconnected).

use std::{
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll, ready},
    time::Duration,
};

use bytes::Bytes;
use h2::client::SendRequest;
use http_body_util::BodyExt;
use hyper::body::{Body as HttpBody, Frame};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;
use tonic::{Status, body::Body, codegen::Service};

/// Flow-control windows, header bound and send limits of the client's side,
/// as hyper's client (the old stack) set them.
const STREAM_WINDOW: u32 = 2 << 20;
const CONNECTION_WINDOW: u32 = 5 << 20;
const MAX_HEADER_LIST: u32 = 16 << 10;
const MAX_SEND_BUFFER: usize = 1 << 20;
/// Streams opened before the server's SETTINGS state its own limit.
const INITIAL_MAX_SEND_STREAMS: usize = 100;

/// The settings a connection is made with.
#[derive(Debug, Clone)]
pub(crate) struct ConnSettings {
    pub(crate) keepalive_interval: Duration,
    pub(crate) keepalive_timeout: Duration,
}

/// One live HTTP/2 connection: the handle to open streams on it, and a token
/// cancelled when its driver ends.
#[derive(Clone)]
struct Live {
    send: SendRequest<Bytes>,
    gone: CancellationToken,
    /// Which dial made it (the first is 0).
    id: u64,
}

struct Inner {
    addr: Arc<str>,
    settings: ConnSettings,
    current: Mutex<Option<Live>>,
    /// Held while dialing again, so that callers finding the connection
    /// gone together make one new connection, not one each.
    dialing: tokio::sync::Mutex<u64>,
}

/// A client connection to a store server, usable as tonic's transport.
/// Cheap to clone; clones share the connection.
#[derive(Clone)]
pub(crate) struct Conn {
    inner: Arc<Inner>,
}

impl Conn {
    /// Dials `addr` (`host:port`) and performs the HTTP/2 handshake.
    pub(crate) async fn connect(addr: Arc<str>, settings: ConnSettings) -> Result<Conn, String> {
        let live = dial(&addr, &settings, 0).await?;
        Ok(Conn {
            inner: Arc::new(Inner {
                addr,
                settings,
                current: Mutex::new(Some(live)),
                dialing: tokio::sync::Mutex::new(0),
            }),
        })
    }

    fn current(&self) -> Option<Live> {
        self.inner
            .current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// A handle ready to open a stream: on the live connection, or on a new
    /// one if that connection has gone (one attempt; the call's own deadline
    /// bounds it).
    async fn ready(&self) -> Result<SendRequest<Bytes>, Status> {
        let seen = self.current();
        if let Some(live) = &seen
            && !live.gone.is_cancelled()
            && let Ok(send) = live.send.clone().ready().await
        {
            return Ok(send);
        }
        let mut dials = self.inner.dialing.lock().await;
        // Another caller may have dialed while this one waited: use its
        // connection if it is not the one found gone.
        if let Some(live) = self.current()
            && seen.as_ref().is_none_or(|s| s.id != live.id)
            && !live.gone.is_cancelled()
            && let Ok(send) = live.send.ready().await
        {
            return Ok(send);
        }
        *dials += 1;
        let live = dial(&self.inner.addr, &self.inner.settings, *dials)
            .await
            .map_err(Status::unavailable)?;
        *self.inner.current.lock().unwrap_or_else(|e| e.into_inner()) = Some(live.clone());
        drop(dials);
        live.send.ready().await.map_err(h2_status)
    }

    async fn send(self, req: http::Request<Body>) -> Result<http::Response<Body>, Status> {
        let (parts, body) = req.into_parts();
        // A unary request's body is one encoded message, already in memory:
        // collecting it completes at once.
        let body = body.collect().await?.to_bytes();
        for _ in 0..=RESENDS {
            let mut send = self.ready().await?;
            let eos = body.is_empty();
            let (response, mut stream) =
                match send.send_request(http::Request::from_parts(parts.clone(), ()), eos) {
                    Ok(sent) => sent,
                    Err(e) if never_processed(&e) => continue,
                    Err(e) => return Err(h2_status(e)),
                };
            // The server may answer before it has read the body (a refusal,
            // e.g. a wrong secret, sent as trailers only) and close the
            // stream: the body then cannot be sent ("inactive stream"), and
            // the answer is what counts. The send error is reported only if
            // no answer comes.
            let sent = if eos {
                Ok(())
            } else {
                stream.send_data(body.clone(), true)
            };
            let answer = match (response.await, sent) {
                (Ok(answer), _) => answer,
                (Err(e), _) if never_processed(&e) => continue,
                (Err(e), Ok(())) => return Err(h2_status(e)),
                (Err(_), Err(e)) => return Err(h2_status(e)),
            };
            let (parts, recv) = answer.into_parts();
            return Ok(http::Response::from_parts(
                parts,
                Body::new(RecvBody {
                    recv,
                    data_done: false,
                    done: false,
                }),
            ));
        }
        Err(Status::unavailable(format!(
            "the store server went away without processing the request {} times",
            RESENDS + 1
        )))
    }
}

/// How many times a request is sent again after servers that went away
/// without processing it.
const RESENDS: usize = 3;

/// Whether `e` says the server never processed the request: its stream was
/// above the last one a GOAWAY from the server let through (RFC 9113 §6.8:
/// such streams "were not or will not be processed"), or it was refused
/// (`REFUSED_STREAM`, §8.7). Such a request may be sent again.
fn never_processed(e: &h2::Error) -> bool {
    e.is_remote() && (e.is_go_away() || e.reason() == Some(h2::Reason::REFUSED_STREAM))
}

impl Service<http::Request<Body>> for Conn {
    type Response = http::Response<Body>;
    type Error = Status;
    type Future = Pin<Box<dyn Future<Output = Result<http::Response<Body>, Status>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Status>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        Box::pin(self.clone().send(req))
    }
}

/// An h2 error as tonic's transport reported it (tonic finds the h2 error in
/// the chain and maps its reason: a reset or a lost connection becomes
/// `Cancelled`, `Unavailable` or `Unknown`).
fn h2_status(e: h2::Error) -> Status {
    Status::from_error(Box::new(e))
}

async fn dial(addr: &str, settings: &ConnSettings, id: u64) -> Result<Live, String> {
    let tcp = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    tcp.set_nodelay(true).map_err(|e| format!("TCP_NODELAY: {e}"))?;
    let (send, mut connection) = h2::client::Builder::new()
        .enable_push(false)
        .initial_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_header_list_size(MAX_HEADER_LIST)
        .max_send_buffer_size(MAX_SEND_BUFFER)
        .initial_max_send_streams(INITIAL_MAX_SEND_STREAMS)
        .handshake::<_, Bytes>(tcp)
        .await
        .map_err(|e| format!("HTTP/2 handshake: {e}"))?;
    let pings = connection.ping_pong();
    let gone = CancellationToken::new();
    tokio::spawn(drive(connection, pings, gone.clone(), settings.clone()));
    Ok(Live { send, gone, id })
}

/// Drives the connection and its keepalive pings; when either ends, the
/// connection is dropped, which fails every call still on it.
async fn drive(
    connection: h2::client::Connection<TcpStream, Bytes>,
    pings: Option<h2::PingPong>,
    gone: CancellationToken,
    settings: ConnSettings,
) {
    let keepalive = async {
        let Some(mut pings) = pings else {
            return std::future::pending().await;
        };
        loop {
            tokio::time::sleep(settings.keepalive_interval).await;
            match tokio::time::timeout(settings.keepalive_timeout, pings.ping(h2::Ping::opaque())).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return format!("keepalive ping failed: {e}"),
                Err(_) => return format!("keepalive ping unanswered for {:?}", settings.keepalive_timeout),
            }
        }
    };
    tokio::select! {
        r = connection => {
            if let Err(e) = r {
                tracing::debug!(error = %e, "store connection ended with an error");
            }
        }
        why = keepalive => tracing::debug!(why, "closing store connection"),
    }
    gone.cancel();
}

/// A reply's body: its DATA frames (their flow-control capacity released as
/// they are taken, so the server can send more), then its trailers.
struct RecvBody {
    recv: h2::RecvStream,
    data_done: bool,
    done: bool,
}

impl HttpBody for RecvBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let me = self.get_mut();
        if me.done {
            return Poll::Ready(None);
        }
        if !me.data_done {
            match ready!(me.recv.poll_data(cx)) {
                Some(Ok(data)) => {
                    // Fails only if the stream is already gone, which the
                    // next poll reports.
                    let _ = me.recv.flow_control().release_capacity(data.len());
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Some(Err(e)) => {
                    me.done = true;
                    return Poll::Ready(Some(Err(h2_status(e))));
                }
                None => me.data_done = true,
            }
        }
        let trailers = ready!(me.recv.poll_trailers(cx));
        me.done = true;
        match trailers {
            Ok(Some(trailers)) => Poll::Ready(Some(Ok(Frame::trailers(trailers)))),
            Ok(None) => Poll::Ready(None),
            Err(e) => Poll::Ready(Some(Err(h2_status(e)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }
}
