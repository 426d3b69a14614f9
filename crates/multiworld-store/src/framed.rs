//! The framed protocol's codec: pure functions from bytes to frames and
//! back, shared by the client and the server and tested without sockets.
//!
//! The framed protocol carries the same requests and replies as the gRPC
//! service (the same protobuf messages, the same methods, the same errors)
//! in a few bytes of framing of its own instead of HTTP/2, on the same port:
//! the server tells the two apart by a connection's first byte (`M` here,
//! `P` for HTTP/2's preface). See docs/protocol.md, "The framed protocol".
//!
//! A connection opens with the client's 8-byte [`PREFACE`]. Then both sides
//! send frames of a 9-byte header (`u32` body length, `u8` kind, `u32` id,
//! big-endian) and a body:
//! - `Request` (client): method `u8`, world name (`u16` length, UTF-8; empty
//!   for a world-less call), proof (`u16` length, the `mw-auth` value; empty
//!   for none), then the method's protobuf request;
//! - `Reply` (server): the method's protobuf response;
//! - `Error` (server): gRPC code `u8`, kind (`u8` length, the `mw-error`
//!   value), detail (`u8` length: the `mw-generation` or `mw-limit` value),
//!   then the message in UTF-8;
//! - `Cancel` (client, empty): the request with this id is abandoned;
//! - `Ping` / `Pong` (either side, empty): keepalive, the pong echoing the
//!   ping's id;
//! - `GoAway` (server, empty): the server closes the connection and reads
//!   no request after the first `id` requests of it (counted from 1, in
//!   the order they were sent, modulo 2^32); it still answers those, then
//!   closes. A request after them was never seen, so the client may send
//!   it again on a new connection.
//!
//! Every length is checked against its bound before anything is allocated
//! for it, and nothing here panics on any input.
//!
//! The few I/O pieces both ends share (the writer, the keepalive, reading a
//! message into a buffer of its own) close the module.

use std::{
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf},
    net::tcp::OwnedWriteHalf,
    sync::watch,
    time::Instant,
};
use tonic::{Code, Status, metadata::MetadataValue};

use crate::error::{ERROR_GENERATION_METADATA, ERROR_KIND_METADATA, ERROR_LIMIT_METADATA, StoreError};

/// What a framed client sends first; `M` tells it from HTTP/2's `P`.
pub(crate) const PREFACE: [u8; 8] = *b"MWSTORE\x01";
/// A frame header's length.
pub(crate) const HEADER: usize = 9;
/// Longest proof (an `mw-auth` value is 100 bytes).
pub(crate) const MAX_PROOF_LEN: usize = 128;
/// Longest error message kept from an error frame.
const MAX_ERROR_MESSAGE: usize = 4096;
/// Longest error frame body: code, kind, detail and message.
pub(crate) const MAX_ERROR_BODY: usize = 3 + 255 + 255 + MAX_ERROR_MESSAGE;
/// Longest body a header can state.
pub(crate) const MAX_BODY: usize = u32::MAX as usize;

/// What a frame is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Request = 1,
    Reply = 2,
    Error = 3,
    Cancel = 4,
    Ping = 5,
    Pong = 6,
    GoAway = 7,
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) kind: Kind,
    pub(crate) id: u32,
    /// Bytes of body that follow.
    pub(crate) len: usize,
}

/// Decodes a header, refusing an unknown kind, a control frame with a body,
/// or a body over `max_body`.
pub(crate) fn decode_header(b: &[u8; HEADER], max_body: usize) -> Result<Header, String> {
    let len = u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize;
    let id = u32::from_be_bytes([b[5], b[6], b[7], b[8]]);
    let kind = match b[4] {
        1 => Kind::Request,
        2 => Kind::Reply,
        3 => Kind::Error,
        4 => Kind::Cancel,
        5 => Kind::Ping,
        6 => Kind::Pong,
        7 => Kind::GoAway,
        k => return Err(format!("unknown frame kind {k}")),
    };
    let control = matches!(kind, Kind::Cancel | Kind::Ping | Kind::Pong | Kind::GoAway);
    if control && len != 0 {
        return Err(format!("a {kind:?} frame with a {len}-byte body"));
    }
    if len > max_body {
        return Err(format!("a {len}-byte frame body; the bound is {max_body}"));
    }
    Ok(Header { kind, id, len })
}

fn put_header(out: &mut BytesMut, kind: Kind, id: u32, len: usize) {
    // Callers keep bodies within MAX_BODY (the client checks a request's
    // length before it encodes it; a reply over it becomes an error frame).
    out.put_u32(len as u32);
    out.put_u8(kind as u8);
    out.put_u32(id);
}

/// A body-less frame (`Cancel`, `Ping`, `Pong`, `GoAway`).
pub(crate) fn control(kind: Kind, id: u32) -> [u8; HEADER] {
    let mut b = [0u8; HEADER];
    b[4] = kind as u8;
    b[5..].copy_from_slice(&id.to_be_bytes());
    b
}

/// The store's methods, numbered as on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Method {
    Open = 1,
    Close,
    Set,
    Get,
    TryGet,
    Add,
    CompareAndSet,
    Wait,
    Check,
    Delete,
    MultiGet,
    MultiSet,
    Append,
    NumKeys,
    Ping,
}

impl Method {
    const ALL: [Method; 15] = [
        Method::Open,
        Method::Close,
        Method::Set,
        Method::Get,
        Method::TryGet,
        Method::Add,
        Method::CompareAndSet,
        Method::Wait,
        Method::Check,
        Method::Delete,
        Method::MultiGet,
        Method::MultiSet,
        Method::Append,
        Method::NumKeys,
        Method::Ping,
    ];

    pub(crate) fn from_u8(n: u8) -> Option<Method> {
        Method::ALL.get(usize::from(n).checked_sub(1)?).copied()
    }

    /// The gRPC method name (what the gate judges).
    pub(crate) fn name(self) -> &'static str {
        crate::gate::WORLD_METHODS[self as usize - 1]
    }

    /// The gRPC path of the method.
    pub(crate) fn path(self) -> &'static str {
        match self {
            Method::Open => "/multiworld.store.v1.Store/Open",
            Method::Close => "/multiworld.store.v1.Store/Close",
            Method::Set => "/multiworld.store.v1.Store/Set",
            Method::Get => "/multiworld.store.v1.Store/Get",
            Method::TryGet => "/multiworld.store.v1.Store/TryGet",
            Method::Add => "/multiworld.store.v1.Store/Add",
            Method::CompareAndSet => "/multiworld.store.v1.Store/CompareAndSet",
            Method::Wait => "/multiworld.store.v1.Store/Wait",
            Method::Check => "/multiworld.store.v1.Store/Check",
            Method::Delete => "/multiworld.store.v1.Store/Delete",
            Method::MultiGet => "/multiworld.store.v1.Store/MultiGet",
            Method::MultiSet => "/multiworld.store.v1.Store/MultiSet",
            Method::Append => "/multiworld.store.v1.Store/Append",
            Method::NumKeys => "/multiworld.store.v1.Store/NumKeys",
            Method::Ping => "/multiworld.store.v1.Store/Ping",
        }
    }

    /// Whether the method may wait for keys (the server runs it on its own
    /// task so that other requests on the connection go on meanwhile).
    pub(crate) fn waits(self) -> bool {
        matches!(self, Method::Get | Method::Wait | Method::MultiGet)
    }
}

/// Bytes a request's head (method, world, proof) takes before its message.
pub(crate) fn head_len(world: &str, proof: Option<&str>) -> usize {
    5 + world.len() + proof.map_or(0, str::len)
}

/// The longest head a server with names of up to `max_name_len` bytes
/// accepts.
pub(crate) fn max_head_len(max_name_len: usize) -> usize {
    5 + max_name_len + MAX_PROOF_LEN
}

/// Encodes a whole request frame.
pub(crate) fn encode_request(
    id: u32,
    method: Method,
    world: &str,
    proof: Option<&str>,
    message: &impl prost::Message,
) -> Bytes {
    let proof = proof.unwrap_or("");
    let body = head_len(world, Some(proof)) + message.encoded_len();
    let mut out = BytesMut::with_capacity(HEADER + body);
    put_header(&mut out, Kind::Request, id, body);
    out.put_u8(method as u8);
    // World names and proofs are bounded far below 64 KiB (checked by the
    // client before it sends).
    out.put_u16(world.len() as u16);
    out.put_slice(world.as_bytes());
    out.put_u16(proof.len() as u16);
    out.put_slice(proof.as_bytes());
    // Encoding into a buffer with room for `encoded_len` cannot fail.
    let _ = message.encode(&mut out);
    out.freeze()
}

/// A request's head as decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RequestHead {
    /// The method number as sent (unknown numbers are answered, not fatal).
    pub(crate) method: u8,
    /// The world named, if any.
    pub(crate) world: Option<String>,
    /// The proof, if any.
    pub(crate) proof: Option<String>,
    /// Bytes the head took.
    pub(crate) len: usize,
}

/// What decoding a request head from what has arrived so far gave.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Head {
    /// At least this many bytes of the body are needed.
    Need(usize),
    /// The head, complete.
    Done(RequestHead),
    /// A head within its frame that is refused (a name over the bound, a
    /// proof over [`MAX_PROOF_LEN`], text that is not UTF-8): the request is
    /// answered and the rest of its frame skipped; the connection goes on.
    Bad(String),
}

/// Decodes a request's head from the first bytes of its body (`body_len` in
/// all), bounding the name by `max_name_len` and the proof by
/// [`MAX_PROOF_LEN`] before asking for more bytes. An error is a head that
/// runs past its frame: the stream cannot be read further.
pub(crate) fn decode_request_head(buf: &[u8], body_len: usize, max_name_len: usize) -> Result<Head, String> {
    let need = |n: usize| -> Result<Head, String> {
        if n > body_len {
            Err(format!("a request head runs past its {body_len}-byte frame"))
        } else {
            Ok(Head::Need(n))
        }
    };
    if buf.len() < 3 {
        return need(3);
    }
    let method = buf[0];
    let world_len = usize::from(u16::from_be_bytes([buf[1], buf[2]]));
    if world_len > max_name_len {
        return Ok(Head::Bad(format!(
            "a {world_len}-byte world name; the bound is {max_name_len}"
        )));
    }
    let proof_at = 3 + world_len;
    if buf.len() < proof_at + 2 {
        return need(proof_at + 2);
    }
    let proof_len = usize::from(u16::from_be_bytes([buf[proof_at], buf[proof_at + 1]]));
    if proof_len > MAX_PROOF_LEN {
        return Ok(Head::Bad(format!(
            "a {proof_len}-byte proof; the bound is {MAX_PROOF_LEN}"
        )));
    }
    let end = proof_at + 2 + proof_len;
    if buf.len() < end {
        return need(end);
    }
    let text = |bytes: &[u8]| -> Option<Option<String>> {
        if bytes.is_empty() {
            return Some(None);
        }
        std::str::from_utf8(bytes).ok().map(|s| Some(s.to_string()))
    };
    let (Some(world), Some(proof)) = (text(&buf[3..proof_at]), text(&buf[proof_at + 2..end])) else {
        return Ok(Head::Bad("a world name or proof that is not UTF-8".into()));
    };
    Ok(Head::Done(RequestHead {
        method,
        world,
        proof,
        len: end,
    }))
}

/// Encodes a reply frame carrying `message` (an error frame if it could not
/// be framed: over [`MAX_BODY`], which only a server configured with bounds
/// of 4 GiB and more could build).
pub(crate) fn encode_reply(id: u32, message: &impl prost::Message) -> Bytes {
    let len = message.encoded_len();
    if len > MAX_BODY {
        return encode_error(
            id,
            StoreError::LimitExceeded {
                limit: crate::error::Limit::ReplyBytes,
                max: MAX_BODY as u64,
                requested: len as u64,
            },
        );
    }
    let mut out = BytesMut::with_capacity(HEADER + len);
    put_header(&mut out, Kind::Reply, id, len);
    // Encoding into a buffer with room for `encoded_len` cannot fail.
    let _ = message.encode(&mut out);
    out.freeze()
}

/// Encodes an error frame: the same code, kind and detail the gRPC service
/// sends for `err`.
pub(crate) fn encode_error(id: u32, err: StoreError) -> Bytes {
    let status = Status::from(err);
    let meta = |key: &str| -> &[u8] { status.metadata().get(key).map_or(&[][..], |v| v.as_bytes()) };
    let kind = clip(meta(ERROR_KIND_METADATA), usize::from(u8::MAX));
    let detail = meta(ERROR_LIMIT_METADATA);
    let detail = if detail.is_empty() {
        meta(ERROR_GENERATION_METADATA)
    } else {
        detail
    };
    let detail = clip(detail, usize::from(u8::MAX));
    let message = clip(status.message().as_bytes(), MAX_ERROR_MESSAGE);
    let body = 3 + kind.len() + detail.len() + message.len();
    let mut out = BytesMut::with_capacity(HEADER + body);
    put_header(&mut out, Kind::Error, id, body);
    out.put_u8(status.code() as i32 as u8);
    out.put_u8(kind.len() as u8);
    out.put_slice(kind);
    out.put_u8(detail.len() as u8);
    out.put_slice(detail);
    out.put_slice(message);
    out.freeze()
}

fn clip(bytes: &[u8], max: usize) -> &[u8] {
    &bytes[..bytes.len().min(max)]
}

/// Decodes an error frame's body into the status the gRPC client would have
/// received, so that one mapping ([`StoreError::from_status`]) serves both.
pub(crate) fn decode_error(body: &[u8]) -> Result<Status, String> {
    let short = || "a truncated error frame".to_string();
    let (&code, rest) = body.split_first().ok_or_else(short)?;
    let (&kind_len, rest) = rest.split_first().ok_or_else(short)?;
    let (kind, rest) = rest.split_at_checked(usize::from(kind_len)).ok_or_else(short)?;
    let (&detail_len, rest) = rest.split_first().ok_or_else(short)?;
    let (detail, message) = rest.split_at_checked(usize::from(detail_len)).ok_or_else(short)?;
    let message = String::from_utf8_lossy(clip(message, MAX_ERROR_MESSAGE)).into_owned();
    let mut status = Status::new(Code::from_i32(i32::from(code)), message);
    let ascii =
        |b: &[u8]| MetadataValue::try_from(b).map_err(|_| "a non-ASCII error kind or detail".to_string());
    let kind_text = std::str::from_utf8(kind).unwrap_or("");
    if !kind.is_empty() {
        status.metadata_mut().insert(ERROR_KIND_METADATA, ascii(kind)?);
    }
    if !detail.is_empty() {
        let key = if kind_text == "stale-generation" {
            ERROR_GENERATION_METADATA
        } else {
            ERROR_LIMIT_METADATA
        };
        status.metadata_mut().insert(key, ascii(detail)?);
    }
    Ok(status)
}

/// Bytes read from the socket at a time between messages.
pub(crate) const READ_CHUNK: usize = 8 << 10;

/// A connection's writing side, shared by everything that answers or asks
/// on it; a frame goes out whole, in one write when the socket has room.
pub(crate) struct Out(tokio::sync::Mutex<Counted<OwnedWriteHalf>>);

impl Out {
    /// The writing side, counting what it writes in `moved`.
    pub(crate) fn new(half: OwnedWriteHalf, moved: &Arc<AtomicU64>) -> Out {
        Out(tokio::sync::Mutex::new(Counted::new(half, moved)))
    }

    /// The writing side, once no one else is writing.
    pub(crate) async fn lock(&self) -> tokio::sync::MutexGuard<'_, Counted<OwnedWriteHalf>> {
        self.0.lock().await
    }

    pub(crate) async fn send(&self, frame: &[u8]) -> std::io::Result<()> {
        self.lock().await.write_all(frame).await
    }

    /// Writes a control frame without counting it as movement: a ping or
    /// pong written into an empty socket buffer shows nothing about the
    /// peer.
    async fn send_control(&self, frame: &[u8]) -> std::io::Result<()> {
        self.lock().await.inner.write_all(frame).await
    }
}

/// Control frames (pings, pongs, cancels) waiting to be written by their
/// own branch of a connection's driver, so that whoever produces them (the
/// reader, the keepalive, a dropped call) never waits on the writer and a
/// ping is never cut off halfway. Bounded: when the writer is stuck, more
/// are dropped (the keepalive then ends the connection).
pub(crate) type Controls = tokio::sync::mpsc::Sender<[u8; HEADER]>;

/// How many control frames may wait for the writer.
pub(crate) const CONTROL_QUEUE: usize = 64;

/// Writes the control frames handed over through `controls` until the
/// connection ends; returns why it stopped.
pub(crate) async fn write_controls(
    out: &Out,
    controls: &mut tokio::sync::mpsc::Receiver<[u8; HEADER]>,
) -> String {
    while let Some(frame) = controls.recv().await {
        if let Err(e) = out.send_control(&frame).await {
            return format!("write: {e}");
        }
    }
    // The connection itself holds a sender, so this is not reached while it lives.
    "no more control frames".to_string()
}

/// One side of a connection that counts the bytes it moves into a counter
/// both sides share, so that the keepalive takes every byte read or written
/// as a sign of life: a large frame moving slowly in either direction delays
/// a pong behind it, never the bytes (written bytes count too: past the
/// socket's buffer they move only while the peer reads; control frames,
/// written past the count, do not).
pub(crate) struct Counted<T> {
    inner: T,
    moved: Arc<AtomicU64>,
}

impl<T> Counted<T> {
    pub(crate) fn new(inner: T, moved: &Arc<AtomicU64>) -> Counted<T> {
        Counted {
            inner,
            moved: Arc::clone(moved),
        }
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for Counted<R> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        let got = buf.filled().len().saturating_sub(before);
        if got > 0 {
            self.moved.fetch_add(got as u64, Ordering::Relaxed);
        }
        polled
    }
}

impl<W: AsyncWrite + Unpin> AsyncWrite for Counted<W> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = &polled {
            self.moved.fetch_add(*n as u64, Ordering::Relaxed);
        }
        polled
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Hands a ping to the writer when no byte moved either way for `interval`,
/// and ends, saying why, when neither its pong (whose id arrives through
/// `pongs`) nor any other byte (counted in `moved`) came within `timeout`.
pub(crate) async fn keepalive(
    controls: &Controls,
    mut pongs: watch::Receiver<u32>,
    moved: &AtomicU64,
    interval: Duration,
    timeout: Duration,
) -> String {
    let mut seq = 0u32;
    let mut seen = moved.load(Ordering::Relaxed);
    loop {
        tokio::time::sleep(interval).await;
        let now = moved.load(Ordering::Relaxed);
        if now != seen {
            seen = now;
            continue;
        }
        seq = seq.wrapping_add(1);
        // A full queue means the writer is stuck: no pong will come, and the
        // check below decides.
        let _ = controls.try_send(control(Kind::Ping, seq));
        let pong = tokio::time::timeout(timeout, pongs.wait_for(|last| *last == seq)).await;
        let now = moved.load(Ordering::Relaxed);
        if !matches!(pong, Ok(Ok(_))) && now == seen {
            return format!(
                "nothing moved for {:?}: a keepalive ping went unanswered",
                interval + timeout
            );
        }
        seen = now;
    }
}

/// Reads and drops `n` bytes (what `buf` holds of them first), within
/// `deadline` if one is given: the rest of a frame that is not kept.
pub(crate) async fn skip(
    rd: &mut (impl AsyncRead + Unpin),
    buf: &mut BytesMut,
    mut n: usize,
    deadline: Option<Instant>,
) -> Result<(), String> {
    loop {
        let held = n.min(buf.len());
        buf.advance(held);
        n -= held;
        if n == 0 {
            return Ok(());
        }
        buf.reserve(READ_CHUNK);
        if read_within(rd, buf, deadline, "the rest of a frame").await? == 0 {
            return Err("the peer closed the connection in the middle of a frame".into());
        }
    }
}

/// One read into `buf` (0: the end of the stream), within `deadline` if one
/// is given; `what` names what was awaited when the deadline passes.
pub(crate) async fn read_within(
    rd: &mut (impl AsyncRead + Unpin),
    buf: &mut BytesMut,
    deadline: Option<Instant>,
    what: &str,
) -> Result<usize, String> {
    let read = rd.read_buf(buf);
    match deadline {
        Some(d) => tokio::time::timeout_at(d, read)
            .await
            .map_err(|_| format!("{what} did not arrive within request_body_timeout"))?,
        None => read.await,
    }
    .map_err(|e| format!("read: {e}"))
}

/// Takes an `n`-byte message: what `buf` holds of it, then the rest read
/// straight from `rd` into a buffer of exactly `n` bytes (so what the
/// message's fields keep pins nothing else, and nothing past the message is
/// read), within `deadline` if one is given.
pub(crate) async fn read_message(
    rd: &mut (impl AsyncRead + Unpin),
    buf: &mut BytesMut,
    n: usize,
    deadline: Option<Instant>,
) -> Result<Bytes, String> {
    let mut message = BytesMut::with_capacity(n);
    let held = n.min(buf.len());
    message.extend_from_slice(&buf[..held]);
    buf.advance(held);
    while message.len() < n {
        if read_within(rd, &mut message, deadline, "a message").await? == 0 {
            return Err("the peer closed the connection in the middle of a message".into());
        }
    }
    Ok(message.freeze())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use multiworld_proto::store::v1 as pb;
    use proptest::prelude::*;

    use super::*;
    use crate::error::Limit;

    fn header_of(frame: &[u8]) -> Header {
        decode_header(frame[..HEADER].try_into().unwrap(), 1 << 20).unwrap()
    }

    #[test]
    fn a_request_round_trips() {
        let m = pb::SetRequest {
            world: Some(pb::WorldRef {
                name: "w".into(),
                generation: 7,
            }),
            key: Bytes::from_static(b"k"),
            value: Bytes::from_static(b"v"),
        };
        let f = encode_request(42, Method::Set, "w", Some("v1.ab.cd"), &m);
        let h = header_of(&f);
        assert_eq!((h.kind, h.id, h.len), (Kind::Request, 42, f.len() - HEADER));
        let body = &f[HEADER..];
        let Head::Done(head) = decode_request_head(body, h.len, 256).unwrap() else {
            panic!("incomplete head")
        };
        assert_eq!(Method::from_u8(head.method), Some(Method::Set));
        assert_eq!(head.world.as_deref(), Some("w"));
        assert_eq!(head.proof.as_deref(), Some("v1.ab.cd"));
        let back = <pb::SetRequest as prost::Message>::decode(&body[head.len..]).unwrap();
        assert_eq!(back, m);
        // A world-less call has no name and no proof.
        let f = encode_request(1, Method::Ping, "", None, &pb::PingRequest { world: None });
        let Head::Done(head) = decode_request_head(&f[HEADER..], f.len() - HEADER, 256).unwrap() else {
            panic!("incomplete head")
        };
        assert_eq!((head.world, head.proof, head.len), (None, None, 5));
    }

    #[test]
    fn a_head_asks_for_what_it_lacks_and_never_past_its_frame() {
        let f = encode_request(
            1,
            Method::Get,
            "world",
            Some("proof"),
            &pb::PingRequest { world: None },
        );
        let body = &f[HEADER..];
        assert_eq!(
            decode_request_head(&body[..1], body.len(), 256),
            Ok(Head::Need(3))
        );
        assert_eq!(
            decode_request_head(&body[..4], body.len(), 256),
            Ok(Head::Need(10))
        );
        assert_eq!(
            decode_request_head(&body[..10], body.len(), 256),
            Ok(Head::Need(15))
        );
        assert!(matches!(
            decode_request_head(body, body.len(), 256),
            Ok(Head::Done(_))
        ));
        // The same head in a frame that claims to be shorter is refused.
        assert!(decode_request_head(&body[..4], 9, 256).is_err());
        // Over-long names and proofs are refused from their lengths alone,
        // and text that is not UTF-8 once complete; the frame goes on.
        assert!(matches!(
            decode_request_head(&[3, 1, 0], 1000, 255),
            Ok(Head::Bad(_))
        ));
        assert!(matches!(
            decode_request_head(&[3, 0, 0, 0, 200], 1000, 255),
            Ok(Head::Bad(_))
        ));
        assert!(matches!(
            decode_request_head(&[3, 0, 1, 0xff, 0, 0], 1000, 255),
            Ok(Head::Bad(_))
        ));
    }

    #[test]
    fn headers_are_bounded_and_control_frames_are_empty() {
        let mut b = [0u8; HEADER];
        b[..4].copy_from_slice(&100u32.to_be_bytes());
        b[4] = Kind::Request as u8;
        assert!(decode_header(&b, 100).is_ok());
        assert!(decode_header(&b, 99).is_err());
        b[4] = Kind::Ping as u8;
        assert!(decode_header(&b, 1000).is_err());
        b[4] = Kind::GoAway as u8;
        assert!(decode_header(&b, 1000).is_err(), "a GoAway has no body");
        b[4] = 9;
        assert!(decode_header(&b, 1000).is_err());
        assert_eq!(
            decode_header(&control(Kind::GoAway, 3), 0),
            Ok(Header {
                kind: Kind::GoAway,
                id: 3,
                len: 0
            })
        );
        let c = control(Kind::Pong, 5);
        assert_eq!(
            decode_header(&c, 0),
            Ok(Header {
                kind: Kind::Pong,
                id: 5,
                len: 0
            })
        );
    }

    #[test]
    fn every_error_arrives_as_the_same_store_error() {
        let errors = [
            StoreError::Closed { world: "w".into() },
            StoreError::StaleGeneration {
                world: "w".into(),
                requested: 1,
                current: Some(9),
            },
            StoreError::LimitExceeded {
                limit: Limit::ValueLen,
                max: 10,
                requested: 11,
            },
            StoreError::Unauthenticated {
                world: "w".into(),
                reason: "malformed proof".into(),
            },
            StoreError::InvalidArgument("empty key".into()),
            StoreError::WorldNotFound { world: "w".into() },
            StoreError::Timeout {
                what: "keys".into(),
                after: std::time::Duration::ZERO,
            },
        ];
        for err in errors {
            let want = format!(
                "{}",
                StoreError::from_status(&Status::from(err.clone()), "w", "a")
            );
            let f = encode_error(3, err);
            let h = header_of(&f);
            assert_eq!((h.kind, h.id), (Kind::Error, 3));
            let status = decode_error(&f[HEADER..]).unwrap();
            assert_eq!(format!("{}", StoreError::from_status(&status, "w", "a")), want);
        }
    }

    #[test]
    fn method_numbers_names_and_paths_agree() {
        for (i, m) in Method::ALL.iter().enumerate() {
            assert_eq!(Method::from_u8(i as u8 + 1), Some(*m));
            assert!(m.path().ends_with(&format!("/{}", m.name())));
        }
        assert_eq!(Method::from_u8(0), None);
        assert_eq!(Method::from_u8(16), None);
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

        #[test]
        fn no_input_panics(
            bytes in proptest::collection::vec(any::<u8>(), 0..300),
            max in 0usize..512,
            more in 0usize..64,
        ) {
            let mut h = [0u8; HEADER];
            let n = bytes.len().min(HEADER);
            h[..n].copy_from_slice(&bytes[..n]);
            if let Ok(header) = decode_header(&h, max) {
                prop_assert!(header.len <= max);
            }
            match decode_request_head(&bytes, bytes.len() + more, max) {
                Ok(Head::Need(n)) => prop_assert!(n > bytes.len() && n <= bytes.len() + more),
                Ok(Head::Done(head)) => prop_assert!(head.len <= bytes.len()),
                Ok(Head::Bad(_)) | Err(_) => {}
            }
            let _ = decode_error(&bytes);
        }
    }
}
