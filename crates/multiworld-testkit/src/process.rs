//! Child processes of the tests: one guard, [`Guard`], for every child a test
//! starts (the real `m8d` binary, an example, or the test binary re-executed
//! as a peer), and deadlines on them: a child that hangs fails its test with
//! the output it printed so far instead of hanging `cargo test` for ever, and
//! a child is killed, with its process group, and reaped whatever happens to
//! the test.
//!
//! - [`Guard`]: a child leading a process group of its own; on drop the
//!   group is SIGKILLed and the child reaped. Keeps what a test needs of the
//!   child: its pipes ([`Guard::child`], [`Guard::first_line`]), signals to
//!   its pid ([`Guard::signal`]), [`Guard::try_wait`], [`Guard::kill`] and
//!   [`Guard::wait_within`] a deadline.
//! - [`run`] / [`run_within`]: a child run to completion with its output
//!   captured ([`Ran`]), like `Command::output` but with a deadline
//!   ([`DEADLINE`] by default).
//! - [`self_test_command`]: the command that re-executes this test binary to
//!   run one of its ignored tests (the child half of a multi-process test).
//! - [`KillOnPanic`], [`gone`], [`all_gone`] and [`children_of`]: for
//!   processes a child started (pids seen in its output or under `/proc`),
//!   which no [`Guard`] holds.
//! - [`Guard::stdout_lines`]: the child's output lines as they come, for a
//!   test that waits for one.
//! - [`own_resources`] and [`assert_resources_back`]: this process's
//!   descriptors, threads and memory, for the leak tests.

use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, killpg};
use nix::unistd::Pid;

/// The signals of [`Guard::signal`] (so that tests need not depend on `nix`).
pub use nix::sys::signal::Signal;

/// How long a child may run before its test fails: far above anything the
/// tests run (seconds to a minute on a busy 2-core machine), far below
/// "for ever".
pub const DEADLINE: Duration = Duration::from_secs(240);

/// How often [`Guard::wait_within`] looks at the child.
const POLL: Duration = Duration::from_millis(5);

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

/// A child process that leads its own process group; on drop, unless the
/// test already reaped it, the group is SIGKILLed and the child reaped (so a
/// failing test leaves nothing behind, grandchildren in the group included).
///
/// Once the guard has reaped the child ([`Guard::try_wait`] saw it exit,
/// [`Guard::wait_within`], [`Guard::kill`]), its pid is no longer ours and
/// the group is never signalled again.
pub struct Guard {
    child: Child,
    what: String,
    /// The exit status once reaped.
    status: Option<ExitStatus>,
}

impl Guard {
    /// Starts `cmd` in a process group of its own (panics if it cannot be
    /// started). Pipes, environment and arguments are the caller's.
    pub fn spawn(cmd: &mut Command) -> Guard {
        let what = format!("{cmd:?}");
        let child = cmd
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {what}: {e}"));
        Guard {
            child,
            what,
            status: None,
        }
    }

    /// The child's pid.
    pub fn pid(&self) -> Pid {
        Pid::from_raw(i32::try_from(self.child.id()).expect("pid fits in i32"))
    }

    /// The child itself (to take its pipes).
    pub fn child(&mut self) -> &mut Child {
        &mut self.child
    }

    /// Reads the first line of the child's standard output (which must be
    /// piped; the pipe is closed afterwards), without the line end. Panics
    /// if the child closes its output first.
    pub fn first_line(&mut self) -> String {
        let out = self
            .child
            .stdout
            .take()
            .unwrap_or_else(|| panic!("{}: stdout not piped, or already taken", self.what));
        let mut line = String::new();
        let n = BufReader::new(out)
            .read_line(&mut line)
            .unwrap_or_else(|e| panic!("reading the first line of {}: {e}", self.what));
        assert!(n > 0, "{} closed its output without a line", self.what);
        line.trim_end_matches(['\r', '\n']).to_owned()
    }

    /// The lines of the child's standard output (which must be piped), sent
    /// to the receiver as a thread reads them; the channel closes when the
    /// child closes its output.
    pub fn stdout_lines(&mut self) -> mpsc::Receiver<String> {
        let out = self
            .child
            .stdout
            .take()
            .unwrap_or_else(|| panic!("{}: stdout not piped, or already taken", self.what));
        let (tx, rx) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        rx
    }

    /// Sends `sig` to the child (not its group). Panics if the child was
    /// already reaped.
    pub fn signal(&self, sig: Signal) {
        assert!(
            self.status.is_none(),
            "sending {sig} to {}: already reaped",
            self.what
        );
        kill(self.pid(), sig).unwrap_or_else(|e| panic!("sending {sig} to {}: {e}", self.what));
    }

    /// Whether the child has exited, and how (reaping it if it has).
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self
                .child
                .try_wait()
                .unwrap_or_else(|e| panic!("waiting for {}: {e}", self.what));
        }
        self.status
    }

    /// SIGKILLs the child's process group and reaps the child; returns how
    /// it ended (its earlier exit status if it had already exited and been
    /// reaped).
    pub fn kill(&mut self) -> ExitStatus {
        if let Some(status) = self.status {
            return status;
        }
        // Not reaped yet: the pid (and so the group id) is still ours, even
        // if the child already exited.
        let _ = killpg(self.pid(), Signal::SIGKILL);
        let _ = self.child.kill();
        let status = self
            .child
            .wait()
            .unwrap_or_else(|e| panic!("reaping {}: {e}", self.what));
        self.status = Some(status);
        status
    }

    /// Waits for the child to exit, at most `limit`; past it, kills its
    /// process group and fails the test, with `context()` (the output so
    /// far) in the message.
    pub fn wait_within(&mut self, limit: Duration, context: impl FnOnce() -> String) -> ExitStatus {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.try_wait() {
                return status;
            }
            if Instant::now() >= deadline {
                self.kill();
                panic!(
                    "{} still running after {limit:?}: killed it\n{}",
                    self.what,
                    context()
                );
            }
            thread::sleep(POLL);
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if self.status.is_none() {
            let _ = killpg(self.pid(), Signal::SIGKILL);
            let _ = self.child.kill();
            let _ = self.child.wait();
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
            sink.lock()
                .expect("output buffer lock")
                .extend_from_slice(&chunk[..n]);
        }
        let _ = done.send(());
    });
    (buf, rx)
}

fn text(buf: &Mutex<Vec<u8>>) -> String {
    String::from_utf8_lossy(&buf.lock().expect("output buffer lock")).into_owned()
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

/// The command that re-executes this test binary to run only its ignored
/// test `name` (`name --exact --ignored --nocapture --test-threads=1`): the
/// child half of a test with several processes. Start it with
/// [`Guard::spawn`] or [`run`].
pub fn self_test_command(name: &str) -> Command {
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut cmd = Command::new(exe);
    cmd.args([name, "--exact", "--ignored", "--nocapture", "--test-threads=1"]);
    cmd
}

/// Whether `pid` is gone: no such process, or a zombie nobody reaped yet
/// (an orphan's reaper may be slow, or absent in a container).
pub fn gone(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // "pid (comm) STATE ...": the state follows the last ')'.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])),
    }
}

/// SIGKILLs the processes it holds (pids a child reported: processes it
/// started, which no [`Guard`] holds) if the test fails before they are
/// gone; only then: once a test saw them gone, their pids are not ours.
pub struct KillOnPanic(pub Vec<i32>);

impl Drop for KillOnPanic {
    fn drop(&mut self) {
        if thread::panicking() {
            for &pid in &self.0 {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
        }
    }
}

/// Polls until every pid is [`gone`]; panics naming those still running
/// after `within` (`what` says when, for the message).
pub fn all_gone(pids: &[i32], within: Duration, what: &str) {
    let deadline = Instant::now() + within;
    while !pids.iter().all(|&p| gone(p)) {
        assert!(
            Instant::now() < deadline,
            "{what}: still running: {:?} of {pids:?}",
            pids.iter().filter(|&&p| !gone(p)).collect::<Vec<_>>()
        );
        thread::sleep(Duration::from_millis(20));
    }
}

/// This process's open file descriptors, threads and resident memory (KiB),
/// from `/proc/self` (zeros where it cannot be read).
pub fn own_resources() -> (usize, usize, u64) {
    let fds = std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0);
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (fds, field("Threads:") as usize, field("VmRSS:"))
}

/// Asserts that this process's resources ([`own_resources`]) came back:
/// no more descriptors than `before` plus `extra_fds` (ones the test itself
/// keeps), at most 4 more threads (pools that grew), and resident memory
/// grown by at most `rss_slack_kib`.
pub fn assert_resources_back(
    before: (usize, usize, u64),
    after: (usize, usize, u64),
    extra_fds: usize,
    rss_slack_kib: u64,
) {
    assert!(
        after.0 <= before.0 + extra_fds,
        "file descriptors leaked: {} -> {} ({extra_fds} of them the test's own)",
        before.0,
        after.0
    );
    assert!(
        after.1 <= before.1 + 4,
        "threads grew from {} to {}",
        before.1,
        after.1
    );
    assert!(
        after.2 <= before.2 + rss_slack_kib,
        "RSS grew from {} KiB to {} KiB",
        before.2,
        after.2
    );
}

/// The pids of the live children of `parent` now, with each one's state
/// letter from `/proc/PID/stat` (`R`, `S`, `T` for stopped, ...).
pub fn children_of(parent: i32) -> Vec<(i32, char)> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for entry in dir.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // "pid (comm) STATE PPID ...": the fields after the last ')'.
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let mut fields = rest.split_whitespace();
        let state = fields.next().and_then(|s| s.chars().next());
        let ppid = fields.next().and_then(|p| p.parse::<i32>().ok());
        if let (Some(state), Some(ppid)) = (state, ppid)
            && ppid == parent
            && !matches!(state, 'Z' | 'X')
        {
            found.push((pid, state));
        }
    }
    found
}
