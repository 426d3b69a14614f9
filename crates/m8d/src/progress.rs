//! Progress of long commands on a terminal (indicatif): a bar with a count
//! when the amount of work is known, a spinner with the elapsed time when it
//! is not. Both draw on stderr only when stderr is a terminal; piped or
//! redirected, they print nothing at all.

use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A bar over `len` steps of `what` (e.g. "rounds").
pub fn bar(len: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    // A template with only known keys always parses.
    if let Ok(style) = ProgressStyle::with_template(&format!(
        "{{spinner}} [{{elapsed_precise}}] {{bar:30}} {{pos}}/{{len}} {what} {{msg}}"
    )) {
        pb.set_style(style);
    }
    pb.enable_steady_tick(Duration::from_millis(200));
    pb
}

/// A spinner for work of unknown length, with `what` and the elapsed time.
pub fn spinner(what: &str) -> ProgressBar {
    let pb = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template("{spinner} [{elapsed_precise}] {msg}") {
        pb.set_style(style);
    }
    pb.set_message(what.to_string());
    pb.enable_steady_tick(Duration::from_millis(200));
    pb
}
