//! Capturing what the code under test logs: [`with_captured_logs`] runs a
//! future on a current-thread runtime with a `tracing` subscriber (DEBUG and
//! up, no colour, no time) writing into a [`LogCapture`], which the future
//! can also read while it runs.

use std::{
    future::Future,
    io::Write,
    sync::{Arc, Mutex, PoisonError},
};

/// A shared buffer of captured log text.
#[derive(Clone, Default)]
pub struct LogCapture(Arc<Mutex<Vec<u8>>>);

impl LogCapture {
    /// Everything logged so far.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(PoisonError::into_inner)).into_owned()
    }
}

impl Write for LogCapture {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Runs `make(capture)` to completion on a current-thread runtime whose
/// logs go into `capture`; returns its output and everything logged,
/// including what tasks still held by the runtime log as they drop.
pub fn with_captured_logs<F: Future>(make: impl FnOnce(LogCapture) -> F) -> (F::Output, LogCapture) {
    let capture = LogCapture::default();
    let sink = capture.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || sink.clone())
        .with_ansi(false)
        .without_time()
        .with_max_level(tracing_subscriber::filter::LevelFilter::DEBUG)
        .finish();
    let inner = capture.clone();
    let out = tracing_subscriber::util::SubscriberInitExt::set_default(subscriber);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("a current-thread runtime: {e}"));
    let result = rt.block_on(make(inner));
    drop(rt);
    drop(out);
    (result, capture)
}
