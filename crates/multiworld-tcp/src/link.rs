//! The byte stream under one peer connection of a [`Communicator`](crate::Communicator):
//! a read half ([`ReadLink`]) and a write half ([`WriteLink`]), each an enum
//! with one variant per kind of link, dispatched statically (no boxing, no
//! trait objects). The TCP variant is the connected socket's halves; every
//! method on it is the very call the communicator made on the socket before
//! links existed. With the `memory` feature a second variant carries an
//! in-process byte pipe ([`tokio::io::duplex`]), for worlds built in memory
//! for tests (see [`MemoryWorld`](crate::MemoryWorld)); without the feature the
//! enums have one variant and every `match` compiles to the TCP call alone.
//!
//! What the socket-specific calls mean on a pipe:
//!
//! | call | TCP | memory pipe |
//! |---|---|---|
//! | `try_write*` | the socket's non-blocking write | one poll of the pipe; full = `WouldBlock` |
//! | `try_read` | the socket's non-blocking read | one poll of the pipe; empty = `WouldBlock` |
//! | `peer_closed` | the socket's read-closed readiness (FIN or RST) | the other end's write half was dropped |
//! | `reset_on_close` | SO_LINGER 0, so the close is a reset | nothing: a dropped pipe end is seen at once |
//!
//! Closing: dropping a [`WriteLink`] ends the stream for the peer's reader
//! (EOF once it has read what was written, like a FIN); dropping a
//! [`ReadLink`] fails the peer's writes with `BrokenPipe` (like a reset).

use std::future::Future;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

/// The read half of one peer connection.
pub(crate) enum ReadLink {
    /// A TCP connection's read half.
    Tcp(OwnedReadHalf),
    /// An in-process pipe's reading end.
    #[cfg(feature = "memory")]
    Memory(memory::PipeReader),
}

/// The write half of one peer connection.
pub(crate) enum WriteLink {
    /// A TCP connection's write half.
    Tcp(OwnedWriteHalf),
    /// An in-process pipe's writing end.
    #[cfg(feature = "memory")]
    Memory(memory::PipeWriter),
}

impl ReadLink {
    /// Whether the peer has closed (FIN) or reset its side, without consuming
    /// data. TCP: the socket's read-closed readiness, polled once. Memory: the
    /// peer's writing end was dropped.
    #[inline]
    pub(crate) fn peer_closed(&self) -> bool {
        match self {
            ReadLink::Tcp(h) => {
                let ready = h.ready(Interest::READABLE);
                let mut ready = std::pin::pin!(ready);
                match ready.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
                    Poll::Ready(Ok(r)) => r.is_read_closed(),
                    Poll::Ready(Err(_)) => true,
                    Poll::Pending => false,
                }
            }
            #[cfg(feature = "memory")]
            ReadLink::Memory(p) => p.writer_gone(),
        }
    }

    /// Reads what is there now without waiting: TCP's non-blocking read; on
    /// a pipe, one poll (nothing there is `WouldBlock`). `Ok(0)` is the end
    /// of the stream.
    #[inline]
    pub(crate) fn try_read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            ReadLink::Tcp(h) => h.try_read(buf),
            #[cfg(feature = "memory")]
            ReadLink::Memory(p) => p.try_read(buf),
        }
    }

    /// Makes the coming close abortive (see [`reset_on_close`]); nothing for a
    /// pipe.
    #[inline]
    pub(crate) fn reset_on_close(&self) {
        match self {
            ReadLink::Tcp(h) => reset_on_close(h.as_ref()),
            #[cfg(feature = "memory")]
            ReadLink::Memory(_) => {}
        }
    }
}

impl WriteLink {
    /// Writes what fits now without waiting: TCP's non-blocking vectored
    /// write; on a pipe, one poll (a full pipe is `WouldBlock`).
    #[inline]
    pub(crate) fn try_write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            WriteLink::Tcp(h) => h.try_write_vectored(bufs),
            #[cfg(feature = "memory")]
            WriteLink::Memory(p) => p.try_write_vectored(bufs),
        }
    }

    /// Like [`WriteLink::try_write_vectored`] with one buffer.
    #[inline]
    pub(crate) fn try_write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            WriteLink::Tcp(h) => h.try_write(buf),
            #[cfg(feature = "memory")]
            WriteLink::Memory(p) => p.try_write_vectored(&[IoSlice::new(buf)]),
        }
    }

    /// Makes the coming close abortive (see [`reset_on_close`]); nothing for a
    /// pipe.
    #[inline]
    pub(crate) fn reset_on_close(&self) {
        match self {
            WriteLink::Tcp(h) => reset_on_close(h.as_ref()),
            #[cfg(feature = "memory")]
            WriteLink::Memory(_) => {}
        }
    }
}

/// Makes the coming close of `s` abortive (RST instead of FIN). A FIN queues behind
/// unsent data and never reaches a peer that is not reading (zero window); a reset
/// does, so the peer notices at once. Unsent data is discarded, which is what an
/// abort means.
fn reset_on_close(s: &tokio::net::TcpStream) {
    let _ = s.set_zero_linger();
}

impl AsyncRead for ReadLink {
    #[inline]
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ReadLink::Tcp(h) => Pin::new(h).poll_read(cx, buf),
            #[cfg(feature = "memory")]
            ReadLink::Memory(p) => Pin::new(&mut p.pipe).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for WriteLink {
    #[inline]
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            WriteLink::Tcp(h) => Pin::new(h).poll_write(cx, buf),
            #[cfg(feature = "memory")]
            WriteLink::Memory(p) => Pin::new(&mut p.pipe).poll_write(cx, buf),
        }
    }

    #[inline]
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            WriteLink::Tcp(h) => Pin::new(h).poll_write_vectored(cx, bufs),
            #[cfg(feature = "memory")]
            WriteLink::Memory(p) => Pin::new(&mut p.pipe).poll_write_vectored(cx, bufs),
        }
    }

    #[inline]
    fn is_write_vectored(&self) -> bool {
        match self {
            WriteLink::Tcp(h) => h.is_write_vectored(),
            #[cfg(feature = "memory")]
            WriteLink::Memory(p) => p.pipe.is_write_vectored(),
        }
    }

    #[inline]
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            WriteLink::Tcp(h) => Pin::new(h).poll_flush(cx),
            #[cfg(feature = "memory")]
            WriteLink::Memory(p) => Pin::new(&mut p.pipe).poll_flush(cx),
        }
    }

    #[inline]
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            WriteLink::Tcp(h) => Pin::new(h).poll_shutdown(cx),
            #[cfg(feature = "memory")]
            WriteLink::Memory(p) => {
                p.mark_gone();
                Pin::new(&mut p.pipe).poll_shutdown(cx)
            }
        }
    }
}

/// In-process pipes (feature `memory`).
#[cfg(feature = "memory")]
pub(crate) mod memory {
    use std::io::{self, IoSlice};
    use std::pin::Pin;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::task::{Context, Poll, Waker};

    use tokio::io::{AsyncRead, AsyncWrite, DuplexStream, ReadBuf};

    /// The writing end of a one-way pipe. Dropping it ends the stream for
    /// the reader (after the bytes already written).
    pub(crate) struct PipeWriter {
        /// One end of a duplex pair of which only this direction is used.
        pub(super) pipe: DuplexStream,
        /// Set when this end is dropped or shut down (the reader's
        /// `peer_closed`).
        gone: Arc<AtomicBool>,
    }

    /// The reading end of a one-way pipe. Dropping it fails the writer's
    /// writes with `BrokenPipe`.
    pub(crate) struct PipeReader {
        /// The other end of the writer's duplex pair.
        pub(super) pipe: DuplexStream,
        gone: Arc<AtomicBool>,
    }

    /// A one-way pipe holding at most `capacity` unread bytes (at least 1).
    pub(crate) fn pipe(capacity: usize) -> (PipeWriter, PipeReader) {
        let (w, r) = tokio::io::duplex(capacity.max(1));
        let gone = Arc::new(AtomicBool::new(false));
        (
            PipeWriter {
                pipe: w,
                gone: Arc::clone(&gone),
            },
            PipeReader { pipe: r, gone },
        )
    }

    impl PipeWriter {
        pub(super) fn mark_gone(&self) {
            self.gone.store(true, Ordering::Release);
        }

        /// One poll of the pipe with a no-op waker: what fits is written now;
        /// a full pipe is `WouldBlock` (the caller then awaits a real write,
        /// whose poll registers its own waker in place of this one).
        pub(super) fn try_write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
            let mut cx = Context::from_waker(Waker::noop());
            match Pin::new(&mut self.pipe).poll_write_vectored(&mut cx, bufs) {
                Poll::Ready(r) => r,
                Poll::Pending => Err(io::ErrorKind::WouldBlock.into()),
            }
        }
    }

    impl Drop for PipeWriter {
        fn drop(&mut self) {
            // The pipe itself is dropped right after, which wakes the reader.
            self.mark_gone();
        }
    }

    impl PipeReader {
        /// One poll of the pipe with a no-op waker: what is there is read
        /// now; an empty pipe is `WouldBlock` (the reader task's next poll
        /// registers its own waker again).
        pub(super) fn try_read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let mut cx = Context::from_waker(Waker::noop());
            let mut rb = ReadBuf::new(buf);
            match Pin::new(&mut self.pipe).poll_read(&mut cx, &mut rb) {
                Poll::Ready(Ok(())) => Ok(rb.filled().len()),
                Poll::Ready(Err(e)) => Err(e),
                Poll::Pending => Err(io::ErrorKind::WouldBlock.into()),
            }
        }

        pub(super) fn writer_gone(&self) -> bool {
            self.gone.load(Ordering::Acquire)
        }
    }
}

#[cfg(all(test, feature = "memory"))]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn a_pipe_carries_bytes_and_reports_its_ends() {
        let (w, r) = memory::pipe(8);
        let (mut w, mut r) = (WriteLink::Memory(w), ReadLink::Memory(r));
        // What fits goes now; a full pipe would block.
        assert_eq!(
            w.try_write_vectored(&[IoSlice::new(b"0123"), IoSlice::new(b"456789")])
                .unwrap(),
            8
        );
        assert_eq!(w.try_write(b"x").unwrap_err().kind(), io::ErrorKind::WouldBlock);
        let mut got = [0u8; 8];
        r.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"01234567");
        assert!(!r.peer_closed());
        w.write_all(b"89").await.unwrap();
        drop(w);
        // Closed is seen before the last bytes are read, as a FIN is.
        assert!(r.peer_closed());
        let mut rest = Vec::new();
        r.read_to_end(&mut rest).await.unwrap();
        assert_eq!(rest, b"89");

        // A dropped reader breaks the writer's pipe.
        let (w, r) = memory::pipe(8);
        let mut w = WriteLink::Memory(w);
        drop(r);
        assert_eq!(
            w.write_all(b"a").await.unwrap_err().kind(),
            io::ErrorKind::BrokenPipe
        );
        assert_eq!(w.try_write(b"a").unwrap_err().kind(), io::ErrorKind::BrokenPipe);
    }
}
