//! Child processes with a deadline, for the tests that run `m8d` or an
//! example as a subprocess: a child that hangs fails its test with the
//! output it printed so far, instead of hanging `cargo test` for ever, and a
//! child is killed and reaped whatever happens to the test.
//!
//! Shared by `crates/m8d/tests/*.rs` (as `mod common;`) and
//! `examples/tests/examples.rs` (through `#[path]`); not every user needs
//! every item.
#![allow(dead_code)]

use std::{
    io::Read,
    process::{Child, Command, ExitStatus, Stdio},
    sync::{Arc, Mutex, mpsc},
    thread,
    time::{Duration, Instant},
};

use nix::{
    sys::signal::{Signal, kill, killpg},
    unistd::Pid,
};

/// How long a child may run before its test fails: far above anything the
/// tests run (seconds to a minute on a busy 2-core machine), far below
/// "for ever".
pub const DEADLINE: Duration = Duration::from_secs(240);

/// What a finished child printed.
#[derive(Debug)]
pub struct Ran {
    /// How it exited.
    pub status: ExitStatus,
    /// Its standard output.
    pub stdout: String,
    /// Its standard error.
    pub stderr: String,
}

impl Ran {
    /// Whether it exited 0.
    pub fn success(&self) -> bool {
        self.status.success()
    }
}

/// A child process that leads its own process group; on drop, the group is
/// SIGKILLed and the child reaped (so a failing test leaves nothing behind).
pub struct Guard {
    child: Child,
    what: String,
}

impl Guard {
    /// Starts `cmd` in a process group of its own.
    pub fn spawn(cmd: &mut Command) -> Guard {
        use std::os::unix::process::CommandExt;
        let what = format!("{cmd:?}");
        let child = cmd
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {what}: {e}"));
        Guard { child, what }
    }

    /// The child's pid.
    pub fn pid(&self) -> Pid {
        Pid::from_raw(i32::try_from(self.child.id()).expect("pid fits in i32"))
    }

    /// The child itself (to take its pipes).
    pub fn child(&mut self) -> &mut Child {
        &mut self.child
    }

    /// Sends `sig` to the child (not its group).
    pub fn signal(&self, sig: Signal) {
        kill(self.pid(), sig).unwrap_or_else(|e| panic!("sending {sig} to {}: {e}", self.what));
    }

    /// Waits for the child to exit, at most `limit`; past it, kills its
    /// process group and fails the test, with `context()` (the output so far)
    /// in the message.
    pub fn wait_within(&mut self, limit: Duration, context: impl FnOnce() -> String) -> ExitStatus {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().expect("waiting for a child") {
                return status;
            }
            if Instant::now() >= deadline {
                self.kill_group();
                panic!(
                    "{} still running after {limit:?}: killed it\n{}",
                    self.what,
                    context()
                );
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    fn kill_group(&mut self) {
        let _ = killpg(self.pid(), Signal::SIGKILL);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            self.kill_group();
        }
    }
}

/// Copies `from` into a shared buffer on a thread; the sender says when it
/// reached the end.
fn collect(mut from: impl Read + Send + 'static) -> (Arc<Mutex<Vec<u8>>>, mpsc::Receiver<()>) {
    let buf = Arc::new(Mutex::new(Vec::new()));
    let (done, rx) = mpsc::channel();
    let sink = Arc::clone(&buf);
    thread::spawn(move || {
        let mut chunk = [0u8; 8192];
        while let Ok(n) = from.read(&mut chunk) {
            if n == 0 {
                break;
            }
            sink.lock().unwrap().extend_from_slice(&chunk[..n]);
        }
        let _ = done.send(());
    });
    (buf, rx)
}

fn text(buf: &Mutex<Vec<u8>>) -> String {
    String::from_utf8_lossy(&buf.lock().unwrap()).into_owned()
}

/// Runs `cmd` to completion (stdin closed, output captured) like
/// `Command::output`, but for at most `limit`: past it, the child's process
/// group is killed and the test fails with the output so far.
pub fn run_within(cmd: &mut Command, limit: Duration) -> Ran {
    let mut guard = Guard::spawn(
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    let (out, out_done) = collect(guard.child().stdout.take().expect("piped stdout"));
    let (err, err_done) = collect(guard.child().stderr.take().expect("piped stderr"));
    let status = guard.wait_within(limit, || {
        format!("stdout so far:\n{}\nstderr so far:\n{}", text(&out), text(&err))
    });
    // The output is complete once the pipes close; a grandchild that
    // outlived the child and still holds them is not waited for long.
    for done in [out_done, err_done] {
        let _ = done.recv_timeout(Duration::from_secs(10));
    }
    Ran {
        status,
        stdout: text(&out),
        stderr: text(&err),
    }
}

/// [`run_within`] with the default [`DEADLINE`].
pub fn run(cmd: &mut Command) -> Ran {
    run_within(cmd, DEADLINE)
}
