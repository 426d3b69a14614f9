//! Building the fully connected, authenticated mesh of one world. Each rank binds a
//! listener (port 0 by default), publishes its address through the [`Rendezvous`],
//! then connects to every lower rank while accepting from every higher rank (the
//! higher rank always connects, so each pair has exactly one connection). Each
//! connection runs the [`crate::handshake`] protocol; any mismatch is refused with a
//! reason that is logged on both sides. The accept loop keeps running for the life
//! of the world so that strangers (random bytes, half a handshake, a huge declared
//! length, a wrong secret, another world or generation, a duplicate rank) are
//! answered and dropped, each on its own task with a deadline, without touching the
//! established connections. Everything spawned here is tracked by the world's
//! `TaskTracker` and stops with its `CancellationToken`.
//!
//! Hostile strangers who know only the port must not keep members out: an inbound
//! connection has [`CommConfig::hello_timeout`] (default 1 s) to send its complete
//! Hello, and when the handshake slots are full a newcomer is never refused: the
//! [`PendingTable`] picks an older unauthenticated connection to drop instead
//! (silent ones first, from the busiest source address first, with a per-address
//! cap). The connecting side retries a refused, reset or busy attempt with
//! backoff until the join deadline.
//!
//! Strangers can be refused as fast as they connect, so the listener's log lines
//! about refusals (and failed accepts) are rate-limited ([`LogLimiter`]): at most
//! one WARN line per second each, saying how many were held back since the last
//! one (those are logged at DEBUG); `rejected_connections()` still counts every
//! refusal.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

use crate::config::CommConfig;
use crate::error::{Error, Result, Side};
use crate::handshake::{
    self, CHALLENGE_BODY_LEN, Challenge, HELLO_FIXED_LEN, Hello, HelloPrefix, MSG_ACCEPT, MSG_CHALLENGE,
    MSG_PROOF, MSG_REJECT, NONCE_LEN, PROOF_BODY_LEN, Reject, RejectCode, Role,
};
use crate::limiter::{LOG_INTERVAL, LogLimiter};
use crate::rendezvous::Rendezvous;
use multiworld_types::{Generation, Identity, Rank, WorldName};

/// The rendezvous key under which `rank` of `world`/`generation` publishes its
/// listener address (as UTF-8 `ip:port`).
pub fn addr_key(world: &WorldName, generation: Generation, rank: Rank) -> String {
    format!("multiworld/tcp/{world}/{generation}/addr/{rank}")
}

/// The listener address a member published under its [`addr_key`], if the
/// value is one (UTF-8 `ip:port`).
pub fn published_addr(raw: &[u8]) -> Option<SocketAddr> {
    std::str::from_utf8(raw).ok()?.parse().ok()
}

/// Performs the connecting side of the handshake on an open stream: sends Hello to
/// rank `to`, verifies the accepting side's proof, proves knowledge of `secret`,
/// and waits for Accept. Used by the mesh; public so tools and tests can speak the
/// protocol (e.g. to check that a listener refuses a wrong secret). `peer` is only
/// used in errors and logs.
pub async fn client_handshake<S>(
    stream: &mut S,
    local: &Identity,
    to: Rank,
    secret: &[u8],
    peer: SocketAddr,
) -> Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let io = |e: io::Error| Error::io("handshake", e);
    let hello = Hello::new(local, to, rand::random::<[u8; NONCE_LEN]>());
    stream.write_all(&hello.encode()).await.map_err(io)?;
    let mut ty = [0u8; 1];
    stream.read_exact(&mut ty).await.map_err(io)?;
    match ty[0] {
        MSG_CHALLENGE => {}
        MSG_REJECT => {
            let r = read_reject_body(stream).await.map_err(io)?;
            log_remote_refusal(peer, local, to, &r);
            return Err(refused(peer, Side::Remote, r));
        }
        other => {
            let r = Reject::new(
                RejectCode::Malformed,
                format!("unexpected reply type {other:#04x} to hello"),
            );
            warn!(%peer, %local, reason = %r, "refusing connection");
            return Err(refused(peer, Side::Local, r));
        }
    }
    let mut body = [0u8; CHALLENGE_BODY_LEN];
    stream.read_exact(&mut body).await.map_err(io)?;
    let ch = Challenge::decode(&body);
    let t = handshake::transcript(&hello, &ch.nonce);
    if !handshake::verify(secret, Role::Server, &t, &ch.mac) {
        let r = Reject::new(
            RejectCode::Auth,
            "the accepting side's proof is wrong: it does not know the world secret",
        );
        warn!(%peer, %local, to = %to, reason = %r, "refusing connection");
        // Best effort: tell the other side why.
        let _ = stream.write_all(&r.encode()).await;
        return Err(refused(peer, Side::Local, r));
    }
    let proof = handshake::mac(secret, Role::Client, &t);
    stream
        .write_all(&handshake::encode_proof(&proof))
        .await
        .map_err(io)?;
    stream.read_exact(&mut ty).await.map_err(io)?;
    match ty[0] {
        MSG_ACCEPT => Ok(()),
        MSG_REJECT => {
            let r = read_reject_body(stream).await.map_err(io)?;
            log_remote_refusal(peer, local, to, &r);
            Err(refused(peer, Side::Remote, r))
        }
        other => {
            let r = Reject::new(
                RejectCode::Malformed,
                format!("unexpected reply type {other:#04x} to proof"),
            );
            warn!(%peer, %local, reason = %r, "refusing connection");
            Err(refused(peer, Side::Local, r))
        }
    }
}

/// Logs a refusal by the accepting side: at WARN when it is final, at DEBUG
/// when the mesh retries it (busy, too slow: [`is_transient`]), since a
/// listener crowded by strangers turns a joiner away again and again.
fn log_remote_refusal(peer: SocketAddr, local: &Identity, to: Rank, r: &Reject) {
    if matches!(r.code, RejectCode::Busy | RejectCode::Timeout) {
        debug!(%peer, %local, to = %to, reason = %r, "connection refused by peer, will retry");
    } else {
        warn!(%peer, %local, to = %to, reason = %r, "connection refused by peer");
    }
}

fn refused(addr: SocketAddr, side: Side, r: Reject) -> Error {
    Error::Refused {
        addr,
        side,
        code: r.code,
        detail: Arc::from(r.detail),
    }
}

/// Reads the rest of a Reject after its type byte; the detail is at most 255 bytes.
async fn read_reject_body<S: AsyncRead + Unpin>(s: &mut S) -> io::Result<Reject> {
    let mut cl = [0u8; 2];
    s.read_exact(&mut cl).await?;
    let mut detail = vec![0u8; usize::from(cl[1])];
    s.read_exact(&mut detail).await?;
    Ok(Reject::decode(cl[0], &detail))
}

/// A refusal on the accepting side; `tell` says whether to send it to the other end
/// (not when the other end refused us, or the connection is already broken).
struct Refusal {
    reject: Reject,
    tell: bool,
    /// Who refused: this side, or the connecting side (which sent a reject).
    side: Side,
    /// The connection closed before its first byte: a joining member's
    /// check that this listener is alive (`stale_generation` in the
    /// facade), or a port scan. Counted with the refusals, but logged at
    /// DEBUG only, and not what a join that times out reports.
    silent: bool,
}

impl From<Reject> for Refusal {
    fn from(reject: Reject) -> Self {
        Refusal {
            reject,
            tell: true,
            side: Side::Local,
            silent: false,
        }
    }
}

fn io_refusal(what: &str, e: &io::Error) -> Refusal {
    Refusal {
        reject: Reject::new(RejectCode::Malformed, format!("{what}: {e}")),
        tell: false,
        side: Side::Local,
        silent: false,
    }
}

/// State shared by the accept loop and its handshake tasks.
struct AcceptCtx {
    identity: Identity,
    secret: Arc<[u8]>,
    handshake_timeout: Duration,
    hello_timeout: Duration,
    /// Ranks that completed a handshake; claimed once, so duplicates are refused.
    claimed: Mutex<Vec<bool>>,
    established: mpsc::UnboundedSender<(Rank, TcpStream)>,
    /// Asks the join still building the mesh whether its connection from a
    /// rank is closed, and if so to let it go (see [`AcceptCtx::replaces`]).
    replace: mpsc::UnboundedSender<(Rank, oneshot::Sender<bool>)>,
    /// The inbound handshakes in progress, each with the token that evicts it.
    /// Locked only briefly, never across an `.await`.
    pending: Mutex<PendingTable<CancellationToken>>,
    rejected: Arc<AtomicU64>,
    /// The last refused handshake (not counting refusals for being busy):
    /// what a join that times out reports, since a peer with the wrong
    /// secret, world or generation is otherwise only a missing peer here.
    last_refusal: Mutex<Option<(SocketAddr, Side, Reject)>>,
    /// At most one WARN line about refusals per [`LOG_INTERVAL`].
    refusal_log: Mutex<RefusalLog>,
    token: CancellationToken,
    tracker: TaskTracker,
}

impl AcceptCtx {
    fn claimed(&self) -> MutexGuard<'_, Vec<bool>> {
        self.claimed.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Gives back a claim whose connection never came to be.
    fn unclaim(&self, rank: Rank) {
        if let Some(slot) = self.claimed().get_mut(rank.index()) {
            *slot = false;
        }
    }

    /// Whether an authenticated connection from `rank`, already connected,
    /// takes the place of that earlier connection: only while the mesh is
    /// being built, only for a higher rank (which connects to this one),
    /// and only when the earlier connection is closed. A rank whose join
    /// timed out closed its connections; when it tries again in the same
    /// generation (the other members still wait there), its new connection
    /// must not be refused as a duplicate of the dead one, and the mesh
    /// must not form with the dead one.
    async fn replaces(&self, rank: Rank) -> bool {
        if rank <= self.identity.rank {
            return false;
        }
        let (tx, rx) = oneshot::channel();
        if self.replace.send((rank, tx)).is_err() {
            return false;
        }
        rx.await.unwrap_or(false)
    }

    fn claim(&self, rank: Rank) -> bool {
        let mut c = self.claimed();
        match c.get_mut(rank.index()) {
            Some(slot) if !*slot => {
                *slot = true;
                true
            }
            _ => false,
        }
    }

    /// Runs the accepting side of the handshake for the pending entry `id`,
    /// accepted at `since`.
    async fn serve<S: AsyncRead + AsyncWrite + Unpin>(
        &self,
        s: &mut S,
        id: u64,
        since: Instant,
    ) -> Result<Rank, Refusal> {
        let read_hello = async {
            let mut fixed = [0u8; HELLO_FIXED_LEN];
            let first = s
                .read(&mut fixed[..1])
                .await
                .map_err(|e| io_refusal("reading hello", &e))?;
            if first == 0 {
                return Err(Refusal {
                    silent: true,
                    ..io_refusal(
                        "reading hello",
                        &io::Error::new(io::ErrorKind::UnexpectedEof, "closed before its first byte"),
                    )
                });
            }
            s.read_exact(&mut fixed[1..])
                .await
                .map_err(|e| io_refusal("reading hello", &e))?;
            let prefix = HelloPrefix::decode(&fixed)?;
            // Bounded by MAX_WORLD_NAME_LEN in HelloPrefix::decode.
            let mut name = vec![0u8; prefix.name_len()];
            s.read_exact(&mut name)
                .await
                .map_err(|e| io_refusal("reading world name", &e))?;
            Ok::<_, Refusal>(prefix.finish(&name)?)
        };
        let hello = match tokio::time::timeout_at(since + self.hello_timeout, read_hello).await {
            Ok(h) => h?,
            Err(_) => {
                return Err(Reject::new(
                    RejectCode::Timeout,
                    format!("no complete hello within {:?} of connecting", self.hello_timeout),
                )
                .into());
            }
        };
        // The identity is judged only once the peer has proven the secret:
        // a stranger is answered the same way (a Challenge, then Auth)
        // whatever it got wrong, so the refusal confirms no guessed world
        // name, generation, size or rank; a member that proved the secret
        // learns exactly what differs.
        let identity = handshake::check_hello(&hello, &self.identity);
        if identity.is_ok() {
            self.pending_table().promote(id);
        }
        let nonce = rand::random::<[u8; NONCE_LEN]>();
        let t = handshake::transcript(&hello, &nonce);
        let ch = Challenge {
            nonce,
            mac: handshake::mac(&self.secret, Role::Server, &t),
        };
        s.write_all(&ch.encode())
            .await
            .map_err(|e| io_refusal("writing challenge", &e))?;
        let mut ty = [0u8; 1];
        s.read_exact(&mut ty)
            .await
            .map_err(|e| io_refusal("reading proof", &e))?;
        match ty[0] {
            MSG_PROOF => {}
            MSG_REJECT => {
                let r = read_reject_body(s)
                    .await
                    .map_err(|e| io_refusal("reading reject", &e))?;
                return Err(Refusal {
                    reject: Reject::new(r.code, format!("refused by the connecting side: {}", r.detail)),
                    tell: false,
                    side: Side::Remote,
                    silent: false,
                });
            }
            other => {
                return Err(Reject::new(
                    RejectCode::Malformed,
                    format!("expected a proof, got type byte {other:#04x}"),
                )
                .into());
            }
        }
        let mut proof = [0u8; PROOF_BODY_LEN];
        s.read_exact(&mut proof)
            .await
            .map_err(|e| io_refusal("reading proof", &e))?;
        if !handshake::verify(&self.secret, Role::Client, &t, &proof) {
            return Err(Reject::new(
                RejectCode::Auth,
                format!("rank {}'s proof of the world secret is wrong", hello.from),
            )
            .into());
        }
        // Authenticated: no longer a stranger's slot, so no longer evictable
        // (an eviction between the claim and the Accept would lose the rank).
        let _ = self.pending_table().remove(id);
        identity?;
        if !self.claim(hello.from) && !self.replaces(hello.from).await {
            return Err(Reject::new(
                RejectCode::Duplicate,
                format!("rank {} is already connected", hello.from),
            )
            .into());
        }
        if let Err(e) = s.write_all(&[MSG_ACCEPT]).await {
            // The rank never learned it was accepted and will try again:
            // its next attempt must not be refused as a duplicate.
            self.unclaim(hello.from);
            return Err(io_refusal("writing accept", &e));
        }
        Ok(hello.from)
    }

    /// Counts a refusal (always) and logs it: at WARN, with the number of
    /// refusals held back since the previous WARN line, at most once per
    /// [`LOG_INTERVAL`]; the others at DEBUG. The first refusal held back after
    /// a WARN line starts a timer that reports the held-back count once the
    /// interval is over, should no new refusal come to report it.
    fn note_refusal(self: &Arc<Self>, addr: SocketAddr, side: Side, r: &Reject) {
        self.rejected.fetch_add(1, Ordering::Relaxed);
        let (admitted, flush_at) = {
            let mut log = self.refusal_log();
            let admitted = log.limiter.admit(Instant::now());
            let first_held = admitted.is_none() && log.limiter.held() == 1;
            // The line written now names this refusal; one held back is
            // named by the line that reports the count.
            log.latest = admitted.is_none().then(|| (addr, r.clone()));
            (
                admitted,
                if first_held {
                    log.limiter.next_line_at()
                } else {
                    None
                },
            )
        };
        match admitted {
            Some(suppressed) => {
                warn!(peer = %addr, local = %self.identity, code = ?r.code, reason = %r, suppressed, "refused inbound connection");
            }
            None => {
                debug!(peer = %addr, local = %self.identity, code = ?r.code, reason = %r, "refused inbound connection");
            }
        }
        if let Some(at) = flush_at {
            let ctx = Arc::clone(self);
            self.tracker.spawn(async move {
                tokio::select! {
                    // On close, the held-back count is reported by `drop`.
                    _ = ctx.token.cancelled() => {}
                    _ = tokio::time::sleep_until(at) => {
                        let flushed = ctx.refusal_log().flush(Instant::now());
                        if let Some((suppressed, (peer, r))) = flushed {
                            warn!(local = %ctx.identity, suppressed, latest_peer = %peer, latest_code = ?r.code, latest_reason = %r, "refused inbound connections (logged at debug level only)");
                        }
                    }
                }
            });
        }
        if r.code != RejectCode::Busy {
            let mut last = self.last_refusal.lock().unwrap_or_else(|e| e.into_inner());
            *last = Some((addr, side, r.clone()));
        }
    }

    fn refusal_log(&self) -> std::sync::MutexGuard<'_, RefusalLog> {
        // A poisoned lock only means a panic elsewhere while counting.
        self.refusal_log.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn pending_table(&self) -> std::sync::MutexGuard<'_, PendingTable<CancellationToken>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes a handshake slot for a connection from `ip`, evicting older ones if
    /// the table is full; returns the slot's id and the token that evicts it.
    fn admit(&self, addr: SocketAddr) -> (u64, CancellationToken) {
        let token = self.token.child_token();
        let (id, evicted) = self.pending_table().admit(addr.ip(), token.clone());
        for (victim, why) in evicted {
            debug!(newcomer = %addr, local = %self.identity, reason = why.describe(), "evicting a pending handshake");
            victim.cancel();
        }
        (id, token)
    }

    fn last_refusal(&self) -> Option<(SocketAddr, Side, Reject)> {
        self.last_refusal
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

impl Drop for AcceptCtx {
    /// The listener is gone: reports the refusals held back since the last
    /// WARN line, so that every refusal is counted in some WARN line.
    fn drop(&mut self) {
        let log = self.refusal_log.get_mut().unwrap_or_else(|e| e.into_inner());
        let held = log.limiter.take_held();
        if let (true, Some((peer, r))) = (held > 0, log.latest.take()) {
            warn!(local = %self.identity, suppressed = held, latest_peer = %peer, latest_code = ?r.code, latest_reason = %r, "refused inbound connections (logged at debug level only); listener closed");
        }
    }
}

/// The listener's rate limit on WARN lines about refusals, and the latest
/// refusal held back (named in the line that reports the count).
struct RefusalLog {
    limiter: LogLimiter,
    latest: Option<(SocketAddr, Reject)>,
}

impl RefusalLog {
    /// A summary line now, if refusals were held back and a line is allowed:
    /// their count and the latest of them.
    fn flush(&mut self, now: Instant) -> Option<(u64, (SocketAddr, Reject))> {
        let n = self.limiter.flush(now)?;
        Some((n, self.latest.take()?))
    }
}

/// Frees a handshake slot when its task ends, however it ends.
struct SlotGuard<'a> {
    ctx: &'a AcceptCtx,
    id: u64,
}

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        let _ = self.ctx.pending_table().remove(self.id);
    }
}

/// Why a pending handshake was dropped to make room for a newcomer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Eviction {
    /// The newcomer's source address was at its limit.
    PerAddress,
    /// Every slot was taken.
    Full,
}

impl Eviction {
    fn describe(self) -> &'static str {
        match self {
            Eviction::PerAddress => "too many handshakes in progress from this address",
            Eviction::Full => "too many handshakes in progress",
        }
    }
}

/// The "source address" the per-address limit counts by: an IPv4 address (also
/// when it arrives IPv4-mapped on a dual-stack listener), or the /64 prefix of an
/// IPv6 address, since one host commonly holds a whole /64.
pub(crate) fn source_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(std::net::Ipv6Addr::from(u128::from(v6) & !u128::from(u64::MAX))),
        },
    }
}

/// One pending inbound handshake.
#[derive(Debug)]
struct PendingEntry<T> {
    id: u64,
    ip: IpAddr,
    /// Sent a complete, well-formed Hello for this world (still unauthenticated).
    hello: bool,
    payload: T,
}

/// The listener's inbound handshakes in progress (not yet authenticated), oldest
/// first, and the admission policy: a newcomer always gets a slot. If its source
/// address already holds `max_per_ip` slots, that address's oldest silent
/// handshake goes (else its oldest); if all `max_total` slots are taken, the
/// oldest silent handshake of the busiest address goes (else the oldest of the
/// busiest address). "Silent" means no complete Hello yet: a member sends its
/// Hello at once and is authenticated within a round trip, so it is the newest
/// and the least likely victim, while strangers holding connections open are
/// dropped first; and strangers on one address cannot displace other addresses'
/// handshakes while any of their own remain. Pure (no I/O, no clock): `T` is what
/// the caller needs to stop an evicted handshake.
#[derive(Debug)]
pub(crate) struct PendingTable<T> {
    max_total: usize,
    max_per_ip: usize,
    next_id: u64,
    entries: Vec<PendingEntry<T>>,
}

impl<T> PendingTable<T> {
    /// An empty table; both limits are raised to at least 1.
    pub(crate) fn new(max_total: usize, max_per_ip: usize) -> Self {
        PendingTable {
            max_total: max_total.max(1),
            max_per_ip: max_per_ip.max(1),
            next_id: 0,
            entries: Vec::new(),
        }
    }

    /// Number of handshakes holding a slot.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    fn count(&self, ip: IpAddr) -> usize {
        self.entries.iter().filter(|e| e.ip == ip).count()
    }

    /// Index of the entry to evict among those `eligible`: silent before
    /// hello'd, then from the address with the most slots, then the oldest.
    fn victim(&self, eligible: impl Fn(&PendingEntry<T>) -> bool) -> Option<usize> {
        self.entries
            .iter()
            .enumerate()
            .filter(|(_, e)| eligible(e))
            // min_by_key keeps the first (oldest) of equal keys.
            .min_by_key(|(_, e)| (e.hello, std::cmp::Reverse(self.count(e.ip))))
            .map(|(i, _)| i)
    }

    /// Admits a handshake from `ip`; returns its id and the payloads of the
    /// handshakes evicted to make room, with the reason.
    pub(crate) fn admit(&mut self, ip: IpAddr, payload: T) -> (u64, Vec<(T, Eviction)>) {
        let ip = source_key(ip);
        let mut evicted = Vec::new();
        while self.count(ip) >= self.max_per_ip {
            match self.victim(|e| e.ip == ip) {
                Some(i) => evicted.push((self.entries.remove(i).payload, Eviction::PerAddress)),
                None => break,
            }
        }
        while self.entries.len() >= self.max_total {
            match self.victim(|_| true) {
                Some(i) => evicted.push((self.entries.remove(i).payload, Eviction::Full)),
                None => break,
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        self.entries.push(PendingEntry {
            id,
            ip,
            hello: false,
            payload,
        });
        (id, evicted)
    }

    /// Notes that handshake `id` sent a complete, well-formed Hello.
    pub(crate) fn promote(&mut self, id: u64) {
        if let Some(e) = self.entries.iter_mut().find(|e| e.id == id) {
            e.hello = true;
        }
    }

    /// Frees the slot of handshake `id` (finished, failed or authenticated);
    /// returns its payload, or `None` if it is gone (evicted or removed).
    pub(crate) fn remove(&mut self, id: u64) -> Option<T> {
        let i = self.entries.iter().position(|e| e.id == id)?;
        Some(self.entries.remove(i).payload)
    }
}

/// Pause after a failed accept (e.g. EMFILE: out of descriptors), so that the
/// loop does not spin while the error lasts.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(20);

async fn accept_loop(listener: TcpListener, ctx: Arc<AcceptCtx>) {
    // At most one WARN line about failed accepts per interval.
    let mut failures = LogLimiter::new(LOG_INTERVAL);
    loop {
        let accepted = tokio::select! {
            biased;
            _ = ctx.token.cancelled() => break,
            r = listener.accept() => r,
        };
        let (mut stream, addr) = match accepted {
            Ok(x) => {
                if let Some(suppressed) = failures.flush(Instant::now()) {
                    warn!(local = %ctx.identity, suppressed, "accepting again after failures (logged at debug level only)");
                }
                x
            }
            Err(e) => {
                match failures.admit(Instant::now()) {
                    Some(suppressed) => {
                        warn!(local = %ctx.identity, error = %e, suppressed, "accept failed");
                    }
                    None => debug!(local = %ctx.identity, error = %e, "accept failed"),
                }
                // Back off briefly instead of spinning.
                tokio::select! {
                    _ = ctx.token.cancelled() => break,
                    _ = tokio::time::sleep(ACCEPT_BACKOFF) => continue,
                }
            }
        };
        let since = Instant::now();
        let (id, evict) = ctx.admit(addr);
        let ctx2 = Arc::clone(&ctx);
        ctx.tracker.spawn(async move {
            let ctx = ctx2;
            let _slot = SlotGuard { ctx: &ctx, id };
            let _ = stream.set_nodelay(true);
            let outcome = tokio::select! {
                biased;
                _ = evict.cancelled() => {
                    if !ctx.token.is_cancelled() {
                        let r = Reject::new(
                            RejectCode::Busy,
                            "dropped to make room for a newer connection: too many handshakes in progress",
                        );
                        ctx.note_refusal(addr, Side::Local, &r);
                        let _ = stream.try_write(&r.for_the_wire().encode());
                    }
                    return;
                }
                r = tokio::time::timeout(ctx.handshake_timeout, ctx.serve(&mut stream, id, since)) => r,
            };
            match outcome {
                Ok(Ok(rank)) => {
                    debug!(peer = %addr, local = %ctx.identity, from = %rank, "peer connected");
                    // Fails only when the join already gave up; the stream then closes.
                    let _ = ctx.established.send((rank, stream));
                }
                Ok(Err(refusal)) if refusal.silent => {
                    // Counted, but neither warned about nor what a join that
                    // times out blames (see `Refusal::silent`).
                    ctx.rejected.fetch_add(1, Ordering::Relaxed);
                    debug!(peer = %addr, local = %ctx.identity, "a connection closed before sending anything");
                }
                Ok(Err(refusal)) => {
                    ctx.note_refusal(addr, refusal.side, &refusal.reject);
                    if refusal.tell {
                        let bytes = refusal.reject.for_the_wire().encode();
                        let _ =
                            tokio::time::timeout(Duration::from_millis(100), stream.write_all(&bytes)).await;
                    }
                }
                Err(_) => {
                    let r = Reject::new(
                        RejectCode::Timeout,
                        format!("no complete handshake within {:?}", ctx.handshake_timeout),
                    );
                    ctx.note_refusal(addr, Side::Local, &r);
                    let _ = stream.try_write(&r.for_the_wire().encode());
                }
            }
        });
    }
    let held = failures.take_held();
    if held > 0 {
        warn!(local = %ctx.identity, suppressed = held, "accept failed (logged at debug level only); listener closed");
    }
}

/// The result of building the mesh: one stream per peer (`None` at our own rank).
pub(crate) struct Mesh {
    pub(crate) local_addr: SocketAddr,
    pub(crate) streams: Vec<Option<TcpStream>>,
}

/// Whether the other end has closed `stream` (or it failed), without
/// waiting or taking any byte: a peek that finds the end of the stream, or
/// an error. A stream with nothing to read yet is open.
fn is_closed(stream: &TcpStream) -> bool {
    let mut byte = [0u8; 1];
    let mut buf = tokio::io::ReadBuf::new(&mut byte);
    let mut cx = std::task::Context::from_waker(futures::task::noop_waker_ref());
    matches!(
        stream.poll_peek(&mut cx, &mut buf),
        std::task::Poll::Ready(Ok(0) | Err(_))
    )
}

fn configure(stream: &TcpStream) -> io::Result<()> {
    stream.set_nodelay(true)
}

fn new_socket(addr: &SocketAddr, buffer: Option<u32>) -> io::Result<TcpSocket> {
    let s = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    if let Some(n) = buffer {
        s.set_send_buffer_size(n)?;
        s.set_recv_buffer_size(n)?;
    }
    Ok(s)
}

/// Whether a failed connection attempt is worth retrying before the join
/// deadline: the peer is (re)starting, or its listener dropped or refused us for
/// being busy or slow (e.g. while strangers crowd it). Anything that says the
/// peer is the wrong one (wrong secret, world, generation, rank, a duplicate) is
/// final.
pub(crate) fn is_transient(e: &Error) -> bool {
    match e {
        Error::Io { source, .. } => matches!(
            source.kind(),
            io::ErrorKind::ConnectionRefused
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::ConnectionAborted
                | io::ErrorKind::UnexpectedEof
                | io::ErrorKind::BrokenPipe
                | io::ErrorKind::TimedOut
        ),
        Error::Refused {
            side: Side::Remote,
            code: RejectCode::Busy | RejectCode::Timeout,
            ..
        } => true,
        Error::Timeout { .. } => true,
        _ => false,
    }
}

/// Longest pause between two connection attempts.
const MAX_BACKOFF: Duration = Duration::from_millis(200);

/// One connection attempt: connect, then the handshake.
async fn connect_once(
    addr: SocketAddr,
    identity: &Identity,
    to: Rank,
    secret: &[u8],
    buffer: Option<u32>,
) -> Result<TcpStream> {
    let sock = new_socket(&addr, buffer).map_err(|e| Error::io("creating socket", e))?;
    let mut stream = sock
        .connect(addr)
        .await
        .map_err(|e| Error::io("connecting to peer", e))?;
    configure(&stream).map_err(|e| Error::io("configuring socket", e))?;
    client_handshake(&mut stream, identity, to, secret, addr).await?;
    Ok(stream)
}

/// How long a connection attempt that was refused waits for the store to
/// give the peer's address again.
const REREAD_TIMEOUT: Duration = Duration::from_millis(200);

/// What a join's connections to its lower ranks share.
struct Dialer<'a> {
    rdv: &'a dyn Rendezvous,
    identity: &'a Identity,
    secret: &'a [u8],
    buffer: Option<u32>,
    deadline: Instant,
    attempt_timeout: Duration,
}

/// Connects to rank `to` at `addr`, retrying transient failures ([`is_transient`])
/// with jittered exponential backoff until the dialer's deadline; each
/// attempt is bounded by its `attempt_timeout`. On the deadline, returns
/// the last failure. A refused connection (nobody listens there) reads the
/// peer's address (`key`) from the rendezvous again: a peer whose earlier
/// attempt at this join failed and who is trying again in the same
/// generation listens at a new address.
async fn connect_peer(
    d: &Dialer<'_>,
    to: Rank,
    mut addr: SocketAddr,
    key: String,
) -> Result<(Rank, TcpStream)> {
    let Dialer {
        rdv,
        identity,
        secret,
        buffer,
        deadline,
        attempt_timeout,
    } = *d;
    let mut backoff = Duration::from_millis(5);
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        let left = deadline.saturating_duration_since(Instant::now());
        let bound = attempt_timeout.min(left);
        let err = match tokio::time::timeout(bound, connect_once(addr, identity, to, secret, buffer)).await {
            Ok(Ok(stream)) => {
                if attempts > 1 {
                    debug!(%addr, to = %to, attempts, "connected after retrying");
                }
                return Ok((to, stream));
            }
            Ok(Err(e)) => e,
            Err(_) => Error::Timeout {
                op: "handshake",
                after: bound,
            },
        };
        if !is_transient(&err) {
            return Err(err);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(err);
        }
        if matches!(&err, Error::Io { source, .. } if source.kind() == io::ErrorKind::ConnectionRefused) {
            let bound = REREAD_TIMEOUT.min(left);
            if let Ok(Ok(raw)) = tokio::time::timeout(bound, rdv.get(&key, bound)).await
                && let Some(now) = published_addr(&raw)
                && now != addr
            {
                debug!(old = %addr, new = %now, to = %to, "the peer published a new address");
                addr = now;
                continue;
            }
        }
        debug!(%addr, to = %to, attempts, error = %err, "connection attempt failed, retrying");
        // Jitter (50-100% of the backoff) keeps members that were turned away
        // together from coming back together.
        let pause = backoff.mul_f64(0.5 + rand::random::<f64>() / 2.0).min(left);
        tokio::time::sleep(pause).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// How long past the join's deadline a rendezvous call may take to answer:
/// a lookup bounded by the deadline is answered by the store at the
/// deadline, one round trip later, and that answer (which names the missing
/// key) must win over the bound of [`bounded_rdv`].
const RDV_REPLY_GRACE: Duration = Duration::from_millis(250);

/// A rendezvous call of the join (`what` it waits for), ended by the join's
/// deadline (`left` from now, plus [`RDV_REPLY_GRACE`]: `Timeout { op:
/// "join" }`, for a store that stops answering) or its cancellation token.
/// A lookup that the store itself times out stays `Rendezvous(Timeout)`,
/// which names the key nobody published.
async fn bounded_rdv<T>(
    what: String,
    call: impl Future<Output = std::result::Result<T, crate::rendezvous::RendezvousError>>,
    left: Duration,
    token: &CancellationToken,
    join_timeout: Duration,
) -> Result<T> {
    let timed_out = || {
        warn!(%what, after = ?join_timeout, "join timed out waiting for the rendezvous store");
        Error::Timeout {
            op: "join",
            after: join_timeout,
        }
    };
    tokio::select! {
        _ = token.cancelled() => Err(Error::Aborted { reason: Arc::from("join cancelled") }),
        r = tokio::time::timeout(left + RDV_REPLY_GRACE, call) => match r {
            Err(_) => Err(timed_out()),
            Ok(Err(e)) => Err(e.into()),
            Ok(Ok(v)) => Ok(v),
        },
    }
}

/// Binds, publishes, connects and accepts until every peer is connected or the
/// join deadline passes. The accept loop it starts keeps running under `token`.
pub(crate) async fn build(
    cfg: &CommConfig,
    rdv: &dyn Rendezvous,
    token: &CancellationToken,
    tracker: &TaskTracker,
    rejected: Arc<AtomicU64>,
) -> Result<Mesh> {
    let identity = cfg.identity();
    let size = cfg.size as usize;
    let sock = new_socket(&cfg.listen_addr, cfg.socket_buffer_size)
        .map_err(|e| Error::io("creating listener", e))?;
    sock.set_reuseaddr(true)
        .map_err(|e| Error::io("configuring listener", e))?;
    sock.bind(cfg.listen_addr)
        .map_err(|e| Error::io("binding listener", e))?;
    let listener = sock.listen(1024).map_err(|e| Error::io("listening", e))?;
    let local_addr = listener
        .local_addr()
        .map_err(|e| Error::io("reading listener address", e))?;
    let publish = SocketAddr::new(cfg.advertise_host.unwrap_or(local_addr.ip()), local_addr.port());
    if publish.ip().is_unspecified() {
        return Err(Error::invalid(
            "listening on an unspecified address: set advertise_host to an address peers can reach",
        ));
    }
    let secret: Arc<[u8]> = Arc::from(cfg.secret_bytes());
    let (est_tx, mut est_rx) = mpsc::unbounded_channel();
    let (replace_tx, mut replace_rx) = mpsc::unbounded_channel::<(Rank, oneshot::Sender<bool>)>();
    let mut claimed = vec![true; size];
    for slot in claimed.iter_mut().skip(cfg.rank.index() + 1) {
        *slot = false;
    }
    let ctx = Arc::new(AcceptCtx {
        identity: identity.clone(),
        secret: Arc::clone(&secret),
        handshake_timeout: cfg.handshake_timeout,
        hello_timeout: cfg.hello_timeout,
        claimed: Mutex::new(claimed),
        established: est_tx,
        replace: replace_tx,
        pending: Mutex::new(PendingTable::new(
            cfg.max_pending_handshakes,
            cfg.max_pending_per_ip,
        )),
        rejected,
        last_refusal: Mutex::new(None),
        refusal_log: Mutex::new(RefusalLog {
            limiter: LogLimiter::new(LOG_INTERVAL),
            latest: None,
        }),
        token: token.clone(),
        tracker: tracker.clone(),
    });
    tracker.spawn(accept_loop(listener, Arc::clone(&ctx)));

    let start = Instant::now();
    let deadline = start + cfg.join_timeout;
    let timeout_err = || Error::Timeout {
        op: "join",
        after: cfg.join_timeout,
    };
    // The store's calls are bounded by the join's deadline and end with its
    // token, like the rest of the join.
    let mine = addr_key(&cfg.world, cfg.generation, cfg.rank);
    bounded_rdv(
        format!("publishing this rank's address ({mine})"),
        rdv.set(&mine, publish.to_string().into_bytes()),
        deadline.saturating_duration_since(Instant::now()),
        token,
        cfg.join_timeout,
    )
    .await?;

    let mut streams: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
    let dialer = Dialer {
        rdv,
        identity: &identity,
        secret: &secret,
        buffer: cfg.socket_buffer_size,
        deadline,
        attempt_timeout: cfg.handshake_timeout,
    };
    let mut connects = FuturesUnordered::new();
    for p in 0..cfg.rank.0 {
        let p = Rank(p);
        let left = deadline.saturating_duration_since(Instant::now());
        let key = addr_key(&cfg.world, cfg.generation, p);
        let what = format!("rank {p}'s address ({key})");
        let raw = bounded_rdv(what, rdv.get(&key, left), left, token, cfg.join_timeout).await?;
        let addr = published_addr(&raw).ok_or_else(|| {
            Error::invalid(format!(
                "rank {p} published an address that is not ip:port ({} bytes)",
                raw.len()
            ))
        })?;
        connects.push(connect_peer(&dialer, p, addr, key));
    }

    let mut missing = size - 1;
    while missing > 0 {
        tokio::select! {
            Some(joined) = connects.next() => {
                let (rank, stream) = joined?;
                streams[rank.index()] = Some(stream);
                missing -= 1;
            }
            Some((rank, reply)) = replace_rx.recv() => {
                let slot = streams.get_mut(rank.index());
                let dead = slot.as_ref().is_some_and(|s| s.as_ref().is_some_and(is_closed));
                // Let go of the dead one only if the newcomer hears that it
                // may take its place (it may have given up meanwhile: the
                // slot would stay empty with the rank still claimed).
                if dead
                    && let Some(slot) = slot
                    && reply.send(true).is_ok()
                {
                    debug!(local = %identity, from = %rank, "an earlier connection from this rank is closed: its new one takes its place");
                    *slot = None;
                    missing += 1;
                }
            }
            Some((rank, stream)) = est_rx.recv() => {
                if let Some(slot) = streams.get_mut(rank.index()) {
                    *slot = Some(stream);
                    missing -= 1;
                }
            }
            _ = tokio::time::sleep_until(deadline) => {
                let absent: Vec<usize> = streams
                    .iter()
                    .enumerate()
                    .filter(|(i, s)| s.is_none() && *i != cfg.rank.index())
                    .map(|(i, _)| i)
                    .collect();
                warn!(local = %identity, missing = ?absent, "join timed out waiting for peers");
                // A member with the wrong secret, world or generation shows up
                // here only as a refused connection: say so rather than just
                // "timed out".
                return Err(match ctx.last_refusal() {
                    Some((addr, side, r)) => Error::Refused {
                        addr,
                        side,
                        code: r.code,
                        detail: Arc::from(format!(
                            "{}; rank(s) {absent:?} did not connect within {:?}",
                            r.detail, cfg.join_timeout
                        )),
                    },
                    None => timeout_err(),
                });
            }
            _ = token.cancelled() => {
                return Err(Error::Aborted { reason: Arc::from("join cancelled") });
            }
        }
    }
    debug!(local = %identity, elapsed = ?start.elapsed(), "mesh connected");
    Ok(Mesh { local_addr, streams })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn keys_carry_world_and_generation() {
        let w = WorldName::new("pipe-3").unwrap();
        let k = addr_key(&w, Generation(7), Rank(1));
        assert!(
            k.contains("pipe-3") && k.contains("/7/") && k.ends_with("/1"),
            "{k}"
        );
        assert_ne!(k, addr_key(&w, Generation(8), Rank(1)));
    }

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    #[test]
    fn a_newcomer_is_never_refused_and_evicts_its_own_address_oldest_first() {
        let mut t = PendingTable::new(64, 3);
        for i in 0..3 {
            let (_, ev) = t.admit(ip(1), i);
            assert!(ev.is_empty());
        }
        // The fourth from the same address displaces that address's oldest.
        let (_, ev) = t.admit(ip(1), 3);
        assert_eq!(ev, vec![(0, Eviction::PerAddress)]);
        assert_eq!(t.len(), 3);
        // Another address is not affected by the first one's limit.
        let (_, ev) = t.admit(ip(2), 10);
        assert!(ev.is_empty());
        assert_eq!(t.len(), 4);
    }

    #[test]
    fn silent_handshakes_go_before_those_that_sent_a_hello() {
        let mut t = PendingTable::new(64, 3);
        let (a, _) = t.admit(ip(1), "a");
        let (_, _) = t.admit(ip(1), "b");
        let (_, _) = t.admit(ip(1), "c");
        t.promote(a);
        let (_, ev) = t.admit(ip(1), "d");
        assert_eq!(
            ev,
            vec![("b", Eviction::PerAddress)],
            "the oldest silent one, not the hello'd one"
        );
        // When every one sent a hello, the oldest goes.
        let mut t = PendingTable::new(64, 2);
        let (a, _) = t.admit(ip(1), "a");
        let (b, _) = t.admit(ip(1), "b");
        t.promote(a);
        t.promote(b);
        assert_eq!(t.admit(ip(1), "c").1, vec![("a", Eviction::PerAddress)]);
    }

    #[test]
    fn when_full_the_busiest_address_pays() {
        let mut t = PendingTable::new(4, 3);
        let (_, _) = t.admit(ip(9), "member"); // oldest, alone on its address
        for s in ["x1", "x2", "x3"] {
            assert!(t.admit(ip(1), s).1.is_empty());
        }
        let (_, ev) = t.admit(ip(2), "newcomer");
        assert_eq!(
            ev,
            vec![("x1", Eviction::Full)],
            "the member on a quiet address stays"
        );
        assert_eq!(t.len(), 4);
    }

    #[test]
    fn removal_frees_slots_and_tolerates_evicted_ids() {
        let mut t = PendingTable::new(1, 1);
        let (a, _) = t.admit(ip(1), 1);
        let (b, ev) = t.admit(ip(2), 2);
        assert_eq!(ev, vec![(1, Eviction::Full)]);
        assert_eq!(t.remove(a), None, "already evicted");
        assert_eq!(t.remove(b), Some(2));
        assert_eq!(t.len(), 0);
        assert!(t.admit(ip(1), 3).1.is_empty());
        // Zero limits are raised to one rather than refusing everyone.
        let mut z = PendingTable::new(0, 0);
        assert!(z.admit(ip(1), ()).1.is_empty());
        assert_eq!(z.admit(ip(1), ()).1.len(), 1);
    }

    #[test]
    fn an_ipv6_host_counts_as_its_64_prefix() {
        let a: IpAddr = "2001:db8:1:2::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:ffff::7".parse().unwrap();
        let other: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(source_key(a), source_key(b));
        assert_ne!(source_key(a), source_key(other));
        let mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        assert_eq!(source_key(mapped), ip(1));
        let mut t = PendingTable::new(64, 1);
        assert!(t.admit(a, 1).1.is_empty());
        assert_eq!(t.admit(b, 2).1, vec![(1, Eviction::PerAddress)]);
        assert!(t.admit(other, 3).1.is_empty());
    }

    #[test]
    fn only_busy_refused_reset_and_slow_attempts_are_retried() {
        let io = |k| Error::io("connecting to peer", io::Error::from(k));
        assert!(is_transient(&io(io::ErrorKind::ConnectionRefused)));
        assert!(is_transient(&io(io::ErrorKind::ConnectionReset)));
        assert!(is_transient(&io(io::ErrorKind::UnexpectedEof)));
        assert!(!is_transient(&io(io::ErrorKind::PermissionDenied)));
        let refused = |side, code| Error::Refused {
            addr: "127.0.0.1:1".parse().unwrap(),
            side,
            code,
            detail: Arc::from("x"),
        };
        assert!(is_transient(&refused(Side::Remote, RejectCode::Busy)));
        assert!(is_transient(&refused(Side::Remote, RejectCode::Timeout)));
        assert!(!is_transient(&refused(Side::Remote, RejectCode::Auth)));
        assert!(!is_transient(&refused(Side::Remote, RejectCode::Duplicate)));
        assert!(!is_transient(&refused(Side::Local, RejectCode::Auth)));
        assert!(!is_transient(&Error::invalid("x")));
    }
}
