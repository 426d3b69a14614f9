//! A fault-injecting TCP proxy, for tests of network faults between the
//! members of a world.
//!
//! A [`Proxy`] listens on `127.0.0.1` (port 0) and forwards every connection
//! it accepts to one target address. On command it injects the faults of a
//! real network, per direction ([`Direction::Up`]: from the side that
//! connected to the proxy towards the target; [`Direction::Down`]: back):
//!
//! | command | what the two ends see |
//! |---|---|
//! | [`Mode::Partition`], [`Mode::Drop`] | the network loses the packets, both ways or one way: the proxy reads the bytes and throws them away, so the sender's writes still complete and the receiver gets nothing; a FIN or RST is not passed on either (it is delivered once the direction forwards again). A connection that lost bytes is never resumed: when its direction is healed the proxy resets it (as TCP does once its retransmissions give up) |
//! | [`Mode::Stall`] | half-open, a host that vanished without FIN or RST: nothing is read or forwarded either way and nothing is lost, so the senders' kernel buffers fill and their writes block; healing resumes every stalled connection intact |
//! | [`Link`] | latency plus uniform jitter (order kept, as TCP does) and a bandwidth cap, without loss |
//! | [`Proxy::reset_all`], [`Proxy::reset_after`] | a connection reset (close with `SO_LINGER` 0, so both ends get an RST and no FIN), now or right after `n` more bytes of one direction, i.e. in the middle of a frame that is in flight |
//! | [`Proxy::close`], [`Proxy::close_all`] | an orderly close (FIN to both ends) of one or all of its connections |
//! | [`Proxy::heal`] | back to forwarding at full speed; new connections are accepted and forwarded |
//!
//! A connection accepted while the mode is not [`Mode::Forward`] is held
//! (nothing read, the target not connected: its "SYN" is lost) until the mode
//! is `Forward` again; then it is connected and forwarded intact.
//!
//! [`WorldProxy`] puts proxies between the members of one world of the
//! facade, without any change to the library: members that do not host the
//! world's store are given the store proxy's address as `store_addr`, and
//! that proxy rewrites, in the replies it carries back, every mesh address
//! the members published (`127.0.0.1:<5 digits>`) to the address of a proxy
//! in front of that member's listener (created on first sight, same length so
//! no length field changes). A member that connects to a peer therefore
//! connects through a proxy, and every connection between the member hosting
//! the store and the others (store and mesh) can be faulted. This relies on
//! loopback IPv4 listeners, 5-digit ephemeral ports (Linux: 32768–60999) and
//! uncompressed store replies; tests should check that the mesh proxies did
//! carry connections ([`Proxy::accepted`]), so that a bypass fails loudly.
//!
//! Every task of a proxy stops when its last handle is dropped: the listener
//! closes and every connection is closed.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, DropGuard};

/// One direction of a proxied connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// From the side that connected to the proxy towards the target.
    Up,
    /// From the target back to the side that connected.
    Down,
}

impl Direction {
    fn index(self) -> usize {
        match self {
            Direction::Up => 0,
            Direction::Down => 1,
        }
    }
}

/// What the proxy does with the traffic (see the module's table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Forward everything (subject to the [`Link`]).
    Forward,
    /// Lose every byte both ways.
    Partition,
    /// Lose every byte of one direction; forward the other.
    Drop(Direction),
    /// Half-open: read and forward nothing, lose nothing.
    Stall,
}

impl Mode {
    fn drops(self, dir: Direction) -> bool {
        match self {
            Mode::Partition => true,
            Mode::Drop(d) => d == dir,
            Mode::Forward | Mode::Stall => false,
        }
    }
}

/// Latency, jitter and bandwidth of the proxied link (no loss). `Default`:
/// no delay, no cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Link {
    /// Added to every chunk of bytes, each direction.
    pub latency: Duration,
    /// Up to this much more, uniformly at random per chunk (order is kept).
    pub jitter: Duration,
    /// Bytes per second, each direction; `None`: no cap.
    pub bandwidth: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Settings {
    mode: Mode,
    link: Link,
}

const CHUNK: usize = 64 << 10;
/// Chunks in flight per direction between the proxy's reader and writer
/// (bounds what a slow link buffers in the proxy: 16 MiB).
const QUEUE_CHUNKS: usize = 256;
/// How long the address rewriter holds back a tail that might be the start of
/// an address when no more bytes come.
const REWRITE_FLUSH: Duration = Duration::from_millis(20);

/// Maps a published mesh address to the address to publish instead.
type AddrMap = Arc<dyn Fn(SocketAddr) -> Option<SocketAddr> + Send + Sync>;

struct ConnCtl {
    token: CancellationToken,
    reset: AtomicBool,
    /// Bytes were lost in this direction.
    lossy: [AtomicBool; 2],
}

impl ConnCtl {
    fn reset(&self) {
        self.reset.store(true, Ordering::SeqCst);
        self.token.cancel();
    }
}

struct Shared {
    target: SocketAddr,
    settings: watch::Sender<Settings>,
    token: CancellationToken,
    conns: Mutex<HashMap<u64, Arc<ConnCtl>>>,
    next_id: AtomicU64,
    accepted: AtomicUsize,
    forwarded: [AtomicU64; 2],
    dropped: [AtomicU64; 2],
    resets: AtomicUsize,
    reset_arm: Mutex<Option<(Direction, u64)>>,
    last_reset: Mutex<Option<std::time::Instant>>,
    rewrite: Option<AddrMap>,
}

impl Shared {
    fn reset_conn(&self, ctl: &ConnCtl) {
        if !ctl.reset.swap(true, Ordering::SeqCst) {
            self.resets.fetch_add(1, Ordering::SeqCst);
            *self.last_reset.lock().unwrap() = Some(std::time::Instant::now());
        }
        ctl.reset();
    }
}

/// A fault-injecting TCP proxy in front of one target (see the module
/// documentation). Cheap to clone; every task stops when the last clone is
/// dropped. Must be created inside a Tokio runtime.
#[derive(Clone)]
pub struct Proxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    _guard: Arc<DropGuard>,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy")
            .field("addr", &self.addr)
            .field("target", &self.shared.target)
            .field("mode", &self.mode())
            .field("open", &self.open())
            .finish()
    }
}

impl Proxy {
    /// A proxy on `127.0.0.1:0` forwarding to `target`.
    pub fn new(target: SocketAddr) -> Proxy {
        Proxy::start(
            target,
            None,
            Settings {
                mode: Mode::Forward,
                link: Link::default(),
            },
        )
    }

    fn start(target: SocketAddr, rewrite: Option<AddrMap>, settings: Settings) -> Proxy {
        let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("binding the proxy");
        listener.set_nonblocking(true).unwrap();
        let listener = TcpListener::from_std(listener).expect("a proxy needs a Tokio runtime");
        let addr = listener.local_addr().unwrap();
        let token = CancellationToken::new();
        let shared = Arc::new(Shared {
            target,
            settings: watch::Sender::new(settings),
            token: token.clone(),
            conns: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
            accepted: AtomicUsize::new(0),
            forwarded: [AtomicU64::new(0), AtomicU64::new(0)],
            dropped: [AtomicU64::new(0), AtomicU64::new(0)],
            resets: AtomicUsize::new(0),
            reset_arm: Mutex::new(None),
            last_reset: Mutex::new(None),
            rewrite,
        });
        tokio::spawn(accept_loop(Arc::clone(&shared), listener));
        Proxy {
            addr,
            shared,
            _guard: Arc::new(token.drop_guard()),
        }
    }

    /// Where the proxy listens (give this to the side that connects).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where it forwards to.
    pub fn target(&self) -> SocketAddr {
        self.shared.target
    }

    /// The mode now.
    pub fn mode(&self) -> Mode {
        self.shared.settings.borrow().mode
    }

    /// Sets the mode. A connection that lost bytes in a direction the new
    /// mode forwards is reset.
    pub fn set_mode(&self, mode: Mode) {
        self.shared.settings.send_modify(|s| s.mode = mode);
        if mode == Mode::Stall {
            return;
        }
        let conns: Vec<Arc<ConnCtl>> = self.shared.conns.lock().unwrap().values().cloned().collect();
        for ctl in conns {
            let healed_lossy = [Direction::Up, Direction::Down]
                .iter()
                .any(|&d| !mode.drops(d) && ctl.lossy[d.index()].load(Ordering::SeqCst));
            if healed_lossy {
                self.shared.reset_conn(&ctl);
            }
        }
    }

    /// Sets latency, jitter and bandwidth (applies to bytes read from now on).
    pub fn set_link(&self, link: Link) {
        self.shared.settings.send_modify(|s| s.link = link);
    }

    /// Back to forwarding at full speed.
    pub fn heal(&self) {
        self.set_link(Link::default());
        self.set_mode(Mode::Forward);
    }

    /// Resets every open connection now (both ends get an RST); returns how
    /// many.
    pub fn reset_all(&self) -> usize {
        let conns: Vec<Arc<ConnCtl>> = self.shared.conns.lock().unwrap().values().cloned().collect();
        for ctl in &conns {
            self.shared.reset_conn(ctl);
        }
        conns.len()
    }

    /// Arms a reset: the first connection to forward `bytes` more bytes in
    /// `dir` forwards exactly those and is then reset (both ends get an RST).
    pub fn reset_after(&self, dir: Direction, bytes: u64) {
        *self.shared.reset_arm.lock().unwrap() = Some((dir, bytes));
    }

    /// Ids of the open connections, oldest first.
    pub fn connections(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = self.shared.conns.lock().unwrap().keys().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// Closes one connection in an orderly way (a FIN to both ends); false if
    /// it is not open.
    pub fn close(&self, id: u64) -> bool {
        match self.shared.conns.lock().unwrap().get(&id) {
            Some(ctl) => {
                ctl.token.cancel();
                true
            }
            None => false,
        }
    }

    /// Closes every open connection in an orderly way; returns how many.
    pub fn close_all(&self) -> usize {
        let conns = self.shared.conns.lock().unwrap();
        for ctl in conns.values() {
            ctl.token.cancel();
        }
        conns.len()
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> usize {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.shared.conns.lock().unwrap().len()
    }

    /// Bytes forwarded in `dir` so far.
    pub fn forwarded(&self, dir: Direction) -> u64 {
        self.shared.forwarded[dir.index()].load(Ordering::SeqCst)
    }

    /// Bytes lost in `dir` so far.
    pub fn dropped(&self, dir: Direction) -> u64 {
        self.shared.dropped[dir.index()].load(Ordering::SeqCst)
    }

    /// Connections reset so far (by command, an armed reset, a healed loss,
    /// or passing on an RST).
    pub fn resets(&self) -> usize {
        self.shared.resets.load(Ordering::SeqCst)
    }

    /// When the last reset happened.
    pub fn last_reset(&self) -> Option<std::time::Instant> {
        *self.shared.last_reset.lock().unwrap()
    }
}

async fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    loop {
        let accepted = tokio::select! {
            _ = shared.token.cancelled() => return,
            r = listener.accept() => r,
        };
        let Ok((stream, _)) = accepted else {
            // Out of descriptors or similar: try again shortly.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let id = shared.next_id.fetch_add(1, Ordering::SeqCst);
        let ctl = Arc::new(ConnCtl {
            token: shared.token.child_token(),
            reset: AtomicBool::new(false),
            lossy: [AtomicBool::new(false), AtomicBool::new(false)],
        });
        shared.conns.lock().unwrap().insert(id, Arc::clone(&ctl));
        shared.accepted.fetch_add(1, Ordering::SeqCst);
        tokio::spawn(serve(Arc::clone(&shared), id, ctl, stream));
    }
}

async fn serve(shared: Arc<Shared>, id: u64, ctl: Arc<ConnCtl>, client: TcpStream) {
    run_conn(&shared, &ctl, client).await;
    shared.conns.lock().unwrap().remove(&id);
}

async fn run_conn(shared: &Arc<Shared>, ctl: &Arc<ConnCtl>, client: TcpStream) {
    // A connection that arrives during a fault waits for the network to heal.
    let mut settings = shared.settings.subscribe();
    let healed = tokio::select! {
        _ = ctl.token.cancelled() => false,
        r = settings.wait_for(|s| s.mode == Mode::Forward) => r.is_ok(),
    };
    if !healed {
        if ctl.reset.load(Ordering::SeqCst) {
            let _ = client.set_zero_linger();
        }
        return;
    }
    let upstream = tokio::select! {
        _ = ctl.token.cancelled() => {
            // Reset (or closed) while connecting to the target: a reset
            // must still reach the client as an RST, not a FIN.
            if ctl.reset.load(Ordering::SeqCst) {
                let _ = client.set_zero_linger();
            }
            return;
        }
        r = TcpStream::connect(shared.target) => r,
    };
    let Ok(upstream) = upstream else {
        // The target refuses: so does the proxy.
        let _ = client.set_zero_linger();
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let (client_rd, client_wr) = client.into_split();
    let (up_rd, up_wr) = upstream.into_split();
    tokio::join!(
        direction(shared, ctl, Direction::Up, client_rd, up_wr),
        direction(shared, ctl, Direction::Down, up_rd, client_wr),
    );
}

enum Event {
    Data(Vec<u8>),
    Eof,
    Reset,
}

struct Item {
    event: Event,
    at: Instant,
}

async fn direction(
    shared: &Arc<Shared>,
    ctl: &Arc<ConnCtl>,
    dir: Direction,
    rd: OwnedReadHalf,
    wr: OwnedWriteHalf,
) {
    let (tx, rx) = mpsc::channel(QUEUE_CHUNKS);
    tokio::join!(reader(shared, ctl, dir, rd, tx), writer(shared, ctl, dir, wr, rx));
}

/// A small xorshift generator for the jitter (no need for a crate).
struct Jitter(u64);

impl Jitter {
    fn sample(&mut self, max: Duration) -> Duration {
        if max.is_zero() {
            return Duration::ZERO;
        }
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        let nanos = max.as_nanos().min(u128::from(u64::MAX)) as u64;
        Duration::from_nanos(self.0 % (nanos + 1))
    }
}

async fn reader(
    shared: &Arc<Shared>,
    ctl: &Arc<ConnCtl>,
    dir: Direction,
    mut rd: OwnedReadHalf,
    tx: mpsc::Sender<Item>,
) {
    let mut settings = shared.settings.subscribe();
    let mut buf = vec![0u8; CHUNK];
    let mut rewriter = match (dir, &shared.rewrite) {
        (Direction::Down, Some(map)) => Some(AddrRewriter::new(Arc::clone(map))),
        _ => None,
    };
    let mut jitter = Jitter(0x9E37_79B9_7F4A_7C15 ^ shared.next_id.load(Ordering::SeqCst));
    let mut last_at = Instant::now();
    loop {
        // Half-open: read nothing.
        tokio::select! {
            _ = ctl.token.cancelled() => break,
            r = settings.wait_for(|s| s.mode != Mode::Stall) => if r.is_err() { break },
        }
        let holding = rewriter.as_ref().is_some_and(|r| !r.held.is_empty());
        let event = tokio::select! {
            _ = ctl.token.cancelled() => break,
            _ = settings.changed() => continue,
            _ = tokio::time::sleep(REWRITE_FLUSH), if holding => {
                Event::Data(rewriter.as_mut().map(AddrRewriter::flush).unwrap_or_default())
            }
            r = rd.read(&mut buf) => match r {
                Ok(0) => Event::Eof,
                Ok(n) => match rewriter.as_mut() {
                    Some(rw) => Event::Data(rw.push(&buf[..n])),
                    None => Event::Data(buf[..n].to_vec()),
                },
                Err(_) => Event::Reset,
            },
        };
        let last = !matches!(event, Event::Data(_));
        let event = match event {
            // Whatever is held back goes before the end of the stream.
            Event::Eof | Event::Reset => {
                if let Some(rest) = rewriter
                    .as_mut()
                    .map(AddrRewriter::flush)
                    .filter(|r| !r.is_empty())
                {
                    if !send_item(
                        shared,
                        ctl,
                        dir,
                        &tx,
                        &mut settings,
                        Event::Data(rest),
                        &mut jitter,
                        &mut last_at,
                    )
                    .await
                    {
                        break;
                    }
                }
                event
            }
            data => data,
        };
        if !send_item(
            shared,
            ctl,
            dir,
            &tx,
            &mut settings,
            event,
            &mut jitter,
            &mut last_at,
        )
        .await
            || last
        {
            break;
        }
    }
    if ctl.reset.load(Ordering::SeqCst) {
        // The socket closes with an RST once the write half is gone too.
        let _ = rd.as_ref().set_zero_linger();
    }
}

/// Passes one event to the writer, or loses it: waits while the link is
/// stalled; loses data while the direction drops; holds an end of stream
/// until the direction forwards again. False when the connection is gone.
#[allow(clippy::too_many_arguments)]
async fn send_item(
    shared: &Shared,
    ctl: &ConnCtl,
    dir: Direction,
    tx: &mpsc::Sender<Item>,
    settings: &mut watch::Receiver<Settings>,
    event: Event,
    jitter: &mut Jitter,
    last_at: &mut Instant,
) -> bool {
    if matches!(&event, Event::Data(d) if d.is_empty()) {
        return true;
    }
    loop {
        let now = *settings.borrow_and_update();
        if now.mode == Mode::Stall || (now.mode.drops(dir) && !matches!(event, Event::Data(_))) {
            tokio::select! {
                _ = ctl.token.cancelled() => return false,
                r = settings.changed() => if r.is_err() { return false },
            }
            continue;
        }
        if now.mode.drops(dir) {
            if let Event::Data(d) = &event {
                shared.dropped[dir.index()].fetch_add(d.len() as u64, Ordering::SeqCst);
                ctl.lossy[dir.index()].store(true, Ordering::SeqCst);
            }
            return true;
        }
        let at = (Instant::now() + now.link.latency + jitter.sample(now.link.jitter)).max(*last_at);
        *last_at = at;
        return tokio::select! {
            _ = ctl.token.cancelled() => false,
            r = tx.send(Item { event, at }) => r.is_ok(),
        };
    }
}

async fn writer(
    shared: &Arc<Shared>,
    ctl: &Arc<ConnCtl>,
    dir: Direction,
    mut wr: OwnedWriteHalf,
    mut rx: mpsc::Receiver<Item>,
) {
    let mut settings = shared.settings.subscribe();
    let mut next_free = Instant::now();
    'items: loop {
        let item = tokio::select! {
            _ = ctl.token.cancelled() => break,
            i = rx.recv() => match i { Some(i) => i, None => break },
        };
        tokio::select! {
            _ = ctl.token.cancelled() => break,
            _ = tokio::time::sleep_until(item.at) => {}
        }
        let bytes = match item.event {
            Event::Data(bytes) => bytes,
            Event::Eof => {
                let _ = wr.shutdown().await;
                break;
            }
            Event::Reset => {
                shared.reset_conn(ctl);
                break;
            }
        };
        let mut off = 0;
        while off < bytes.len() {
            // Bytes already on their way are subject to the mode too.
            let now = *settings.borrow_and_update();
            if now.mode == Mode::Stall {
                tokio::select! {
                    _ = ctl.token.cancelled() => break 'items,
                    _ = settings.changed() => {}
                }
                continue;
            }
            if now.mode.drops(dir) {
                shared.dropped[dir.index()].fetch_add((bytes.len() - off) as u64, Ordering::SeqCst);
                ctl.lossy[dir.index()].store(true, Ordering::SeqCst);
                continue 'items;
            }
            let mut piece = bytes.len() - off;
            if let Some(rate) = now.link.bandwidth.filter(|&r| r > 0) {
                // Paced in pieces of 20 ms worth, so the receiver sees a trickle.
                piece = piece.min((rate / 50).max(1024) as usize);
                tokio::select! {
                    _ = ctl.token.cancelled() => break 'items,
                    _ = tokio::time::sleep_until(next_free) => {}
                }
                next_free =
                    next_free.max(Instant::now()) + Duration::from_secs_f64(piece as f64 / rate as f64);
            }
            let mut reset_now = false;
            {
                let mut arm = shared.reset_arm.lock().unwrap();
                if let Some((d, left)) = *arm
                    && d == dir
                {
                    if piece as u64 >= left {
                        piece = left as usize;
                        reset_now = true;
                        *arm = None;
                    } else {
                        *arm = Some((d, left - piece as u64));
                    }
                }
            }
            if piece > 0 {
                let written = tokio::select! {
                    _ = ctl.token.cancelled() => break 'items,
                    r = wr.write_all(&bytes[off..off + piece]) => r,
                };
                if written.is_err() {
                    // The destination reset: pass it on.
                    shared.reset_conn(ctl);
                    break 'items;
                }
                shared.forwarded[dir.index()].fetch_add(piece as u64, Ordering::SeqCst);
                off += piece;
            }
            if reset_now {
                let _ = wr.flush().await;
                shared.reset_conn(ctl);
                break 'items;
            }
        }
    }
    if ctl.reset.load(Ordering::SeqCst) {
        // Close with SO_LINGER 0 and no FIN: the socket goes when the read
        // half (held by the other direction) is dropped, with an RST.
        let _ = wr.as_ref().set_zero_linger();
        wr.forget();
    }
}

/// Rewrites `127.0.0.1:<5 digits>` in a byte stream to another address of the
/// same length, holding back a tail that may be the start of one.
struct AddrRewriter {
    map: AddrMap,
    held: Vec<u8>,
}

const ADDR_PREFIX: &[u8] = b"127.0.0.1:";
const ADDR_LEN: usize = ADDR_PREFIX.len() + 5;

impl AddrRewriter {
    fn new(map: AddrMap) -> AddrRewriter {
        AddrRewriter {
            map,
            held: Vec::new(),
        }
    }

    /// Takes newly read bytes; returns those ready to forward.
    fn push(&mut self, data: &[u8]) -> Vec<u8> {
        let mut buf = std::mem::take(&mut self.held);
        buf.extend_from_slice(data);
        let mut i = 0;
        while let Some(pos) = find(&buf[i..], ADDR_PREFIX) {
            let start = i + pos;
            let digits_from = start + ADDR_PREFIX.len();
            if start + ADDR_LEN > buf.len() {
                if buf[digits_from..].iter().all(u8::is_ascii_digit) {
                    self.held = buf.split_off(start);
                    return buf;
                }
                i = start + 1;
                continue;
            }
            let digits = &buf[digits_from..start + ADDR_LEN];
            let port = std::str::from_utf8(digits)
                .ok()
                .and_then(|s| s.parse::<u16>().ok());
            match port {
                Some(port) if digits.iter().all(u8::is_ascii_digit) => {
                    let from = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
                    if let Some(to) = (self.map)(from) {
                        let to = to.to_string();
                        if to.len() == ADDR_LEN {
                            buf[start..start + ADDR_LEN].copy_from_slice(to.as_bytes());
                        }
                    }
                    i = start + ADDR_LEN;
                }
                _ => i = start + 1,
            }
        }
        // A tail that is the beginning of the prefix may continue in the next read.
        for k in (1..ADDR_PREFIX.len()).rev() {
            if buf.len() >= i + k && buf.ends_with(&ADDR_PREFIX[..k]) {
                self.held = buf.split_off(buf.len() - k);
                break;
            }
        }
        buf
    }

    fn flush(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.held)
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Proxies between the members of one world (see the module documentation):
/// a proxy in front of the world's store that makes the members reach each
/// other's mesh listeners through proxies of their own. Faults set here apply
/// to every one of its proxies, present and future.
pub struct WorldProxy {
    store: Proxy,
    mesh: Arc<Mutex<Vec<Proxy>>>,
}

impl WorldProxy {
    /// Proxies for a world whose store is at `store` (the address its host
    /// serves, e.g. from `WorldManager::serve_store`).
    pub fn new(store: SocketAddr) -> WorldProxy {
        let mesh: Arc<Mutex<Vec<Proxy>>> = Arc::new(Mutex::new(Vec::new()));
        let settings: Arc<Mutex<Option<watch::Receiver<Settings>>>> = Arc::new(Mutex::new(None));
        let map: AddrMap = {
            let mesh = Arc::clone(&mesh);
            let settings = Arc::clone(&settings);
            Arc::new(move |published: SocketAddr| {
                let mut mesh = mesh.lock().unwrap();
                if let Some(p) = mesh.iter().find(|p| p.target() == published) {
                    return Some(p.addr());
                }
                // A new proxy starts with the world's faults of the moment.
                let now = settings.lock().unwrap().as_ref().map(|s| *s.borrow());
                let now = now.unwrap_or(Settings {
                    mode: Mode::Forward,
                    link: Link::default(),
                });
                let p = Proxy::start(published, None, now);
                let addr = p.addr();
                mesh.push(p);
                Some(addr)
            })
        };
        let store = Proxy::start(
            store,
            Some(map),
            Settings {
                mode: Mode::Forward,
                link: Link::default(),
            },
        );
        *settings.lock().unwrap() = Some(store.shared.settings.subscribe());
        WorldProxy { store, mesh }
    }

    /// The store address to give the members that do not host the store.
    pub fn store_addr(&self) -> String {
        self.store.addr().to_string()
    }

    /// The proxy in front of the store.
    pub fn store(&self) -> Proxy {
        self.store.clone()
    }

    /// The proxies in front of members' mesh listeners, in the order the
    /// addresses were first seen.
    pub fn mesh(&self) -> Vec<Proxy> {
        self.mesh.lock().unwrap().clone()
    }

    /// The proxy in front of the mesh listener at `real`, if one was made.
    pub fn mesh_for(&self, real: SocketAddr) -> Option<Proxy> {
        self.mesh
            .lock()
            .unwrap()
            .iter()
            .find(|p| p.target() == real)
            .cloned()
    }

    /// Every proxy: the store's first, then the mesh proxies.
    pub fn all(&self) -> Vec<Proxy> {
        let mut all = vec![self.store.clone()];
        all.extend(self.mesh());
        all
    }

    /// Sets the mode of every proxy (and of those made later).
    pub fn set_mode(&self, mode: Mode) {
        // New mesh proxies copy the store proxy's settings (under the mesh
        // lock), so set it first: one made meanwhile either copies the new
        // mode or is already listed below.
        self.store.set_mode(mode);
        for p in self.mesh() {
            p.set_mode(mode);
        }
    }

    /// Sets the link of every proxy (and of those made later).
    pub fn set_link(&self, link: Link) {
        self.store.set_link(link);
        for p in self.mesh() {
            p.set_link(link);
        }
    }

    /// Heals every proxy.
    pub fn heal(&self) {
        self.store.heal();
        for p in self.mesh() {
            p.heal();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rewriter() -> AddrRewriter {
        AddrRewriter::new(Arc::new(|a: SocketAddr| {
            Some(SocketAddr::from((Ipv4Addr::LOCALHOST, a.port() + 1)))
        }))
    }

    use std::time::Instant as StdInstant;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const LIMIT: Duration = Duration::from_secs(10);

    /// A target that echoes every connection's bytes back.
    async fn echo_server() -> (SocketAddr, tokio::task::JoinHandle<()>) {
        let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
        let addr = l.local_addr().unwrap();
        let task = tokio::spawn(async move {
            loop {
                let (s, _) = l.accept().await.unwrap();
                tokio::spawn(async move {
                    let (mut r, mut w) = s.into_split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        (addr, task)
    }

    /// A target that hands each accepted connection to the test.
    async fn handing_server() -> (
        SocketAddr,
        mpsc::UnboundedReceiver<TcpStream>,
        tokio::task::JoinHandle<()>,
    ) {
        let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
        let addr = l.local_addr().unwrap();
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                if tx.send(s).is_err() {
                    return;
                }
            }
        });
        (addr, rx, task)
    }

    async fn read_exact_within(s: &mut TcpStream, n: usize, limit: Duration) -> Vec<u8> {
        let mut buf = vec![0u8; n];
        tokio::time::timeout(limit, s.read_exact(&mut buf))
            .await
            .expect("bytes within the limit")
            .expect("reading");
        buf
    }

    /// `proxy`'s count of bytes forwarded in `dir` once it reaches `total`
    /// (or what it is after [`LIMIT`], for the caller's assertion to show).
    async fn counted(proxy: &Proxy, dir: Direction, total: u64) -> u64 {
        let until = StdInstant::now() + LIMIT;
        loop {
            let n = proxy.forwarded(dir);
            if n >= total || StdInstant::now() >= until {
                return n;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Nothing arrives on `s` within `quiet`.
    async fn silent(s: &mut TcpStream, quiet: Duration) -> bool {
        let mut b = [0u8; 1];
        tokio::time::timeout(quiet, s.read(&mut b)).await.is_err()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bytes_are_forwarded_intact_both_ways_and_latency_and_bandwidth_apply() {
        let (target, _server) = echo_server().await;
        let proxy = Proxy::new(target);
        let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
        let data = crate::pattern(4 << 20, 7, false);
        let (mut r, mut w) = c.split();
        let send = async {
            w.write_all(&data).await.unwrap();
        };
        let mut back = vec![0u8; data.len()];
        let recv = async {
            r.read_exact(&mut back).await.unwrap();
        };
        tokio::time::timeout(LIMIT, async { tokio::join!(send, recv) })
            .await
            .unwrap();
        assert!(back == data, "4 MiB came back changed");
        // A piece is counted once its write returns, which may be after the
        // far end has read it: the counts reach the total soon after.
        for dir in [Direction::Up, Direction::Down] {
            assert_eq!(
                counted(&proxy, dir, data.len() as u64).await,
                data.len() as u64,
                "{dir:?}"
            );
        }
        assert_eq!((proxy.accepted(), proxy.open()), (1, 1));

        // 50 ms + up to 20 ms each way: a round trip takes 100 to ~140 ms.
        proxy.set_link(Link {
            latency: Duration::from_millis(50),
            jitter: Duration::from_millis(20),
            bandwidth: None,
        });
        let started = StdInstant::now();
        c.write_all(b"ping").await.unwrap();
        assert_eq!(read_exact_within(&mut c, 4, LIMIT).await, b"ping");
        let rtt = started.elapsed();
        assert!(rtt >= Duration::from_millis(100), "round trip {rtt:?}");

        // 1 MiB at 4 MB/s: at least ~250 ms one way.
        proxy.set_link(Link {
            bandwidth: Some(4_000_000),
            ..Link::default()
        });
        let mib = crate::pattern(1 << 20, 9, false);
        let started = StdInstant::now();
        let (mut r, mut w) = c.split();
        let mut back = vec![0u8; mib.len()];
        tokio::time::timeout(LIMIT, async {
            tokio::join!(async { w.write_all(&mib).await.unwrap() }, async {
                r.read_exact(&mut back).await.unwrap()
            })
        })
        .await
        .unwrap();
        let took = started.elapsed();
        assert!(back == mib);
        assert!(
            took >= Duration::from_millis(240),
            "1 MiB at 4 MB/s took {took:?}"
        );
        eprintln!("latency 50+20 ms: rtt {rtt:?}; 1 MiB at 4 MB/s (each way): {took:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_partition_loses_bytes_both_ways_and_healing_resets_the_damaged_connection() {
        let (target, mut accepted, _server) = handing_server().await;
        let proxy = Proxy::new(target);
        let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
        let mut t = accepted.recv().await.unwrap();
        c.write_all(b"before").await.unwrap();
        assert_eq!(read_exact_within(&mut t, 6, LIMIT).await, b"before");

        proxy.set_mode(Mode::Partition);
        // The senders' writes complete (the network took the bytes) ...
        let lost = vec![1u8; 1 << 20];
        tokio::time::timeout(LIMIT, c.write_all(&lost))
            .await
            .unwrap()
            .unwrap();
        tokio::time::timeout(LIMIT, t.write_all(&lost))
            .await
            .unwrap()
            .unwrap();
        // ... and nothing arrives either way.
        assert!(silent(&mut t, Duration::from_millis(300)).await);
        assert!(silent(&mut c, Duration::from_millis(10)).await);
        assert!(
            crate::eventually(LIMIT, || proxy.dropped(Direction::Up) == 1 << 20
                && proxy.dropped(Direction::Down) == 1 << 20)
            .await
        );
        // A FIN is lost too.
        t.shutdown().await.unwrap();
        assert!(silent(&mut c, Duration::from_millis(200)).await);
        // A new connection is held: the target sees nothing.
        let mut c2 = TcpStream::connect(proxy.addr()).await.unwrap();
        c2.write_all(b"held").await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            accepted.try_recv().is_err(),
            "a connection reached the target through a partition"
        );

        proxy.heal();
        // The damaged connection is reset (never resumed with a gap) ...
        let mut b = [0u8; 16];
        let r = tokio::time::timeout(LIMIT, c.read(&mut b)).await.unwrap();
        assert!(r.is_err(), "expected a reset, got {r:?}");
        assert_eq!(proxy.resets(), 1);
        // ... and the held one goes through intact.
        let mut t2 = tokio::time::timeout(LIMIT, accepted.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(read_exact_within(&mut t2, 4, LIMIT).await, b"held");
        t2.write_all(b"ok").await.unwrap();
        assert_eq!(read_exact_within(&mut c2, 2, LIMIT).await, b"ok");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_one_way_drop_loses_one_direction_only() {
        let (target, mut accepted, _server) = handing_server().await;
        let proxy = Proxy::new(target);
        let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
        let mut t = accepted.recv().await.unwrap();
        proxy.set_mode(Mode::Drop(Direction::Down));
        c.write_all(b"up goes").await.unwrap();
        assert_eq!(read_exact_within(&mut t, 7, LIMIT).await, b"up goes");
        t.write_all(b"down is lost").await.unwrap();
        assert!(silent(&mut c, Duration::from_millis(300)).await);
        assert_eq!(proxy.dropped(Direction::Down), 12);
        assert_eq!(proxy.dropped(Direction::Up), 0);

        // Down forwards again: the connection that lost bytes there is reset.
        proxy.set_mode(Mode::Drop(Direction::Up));
        let mut b = [0u8; 1];
        let r = tokio::time::timeout(LIMIT, c.read(&mut b)).await.unwrap();
        assert!(
            matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
            "{r:?}"
        );
        assert_eq!(proxy.resets(), 1);
        // A new connection is held while a direction drops; once it forwards
        // both ways, the other direction can be dropped.
        let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
        proxy.set_mode(Mode::Forward);
        let mut t = tokio::time::timeout(LIMIT, accepted.recv())
            .await
            .unwrap()
            .unwrap();
        assert!(crate::eventually(LIMIT, || proxy.open() == 1).await);
        proxy.set_mode(Mode::Drop(Direction::Up));
        c.write_all(b"lost").await.unwrap();
        t.write_all(b"down goes").await.unwrap();
        assert_eq!(read_exact_within(&mut c, 9, LIMIT).await, b"down goes");
        assert!(silent(&mut t, Duration::from_millis(300)).await);
        assert_eq!(proxy.dropped(Direction::Up), 4);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stall_keeps_connections_open_loses_nothing_and_blocks_the_writers() {
        let (target, _server) = echo_server().await;
        let proxy = Proxy::new(target);
        let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
        c.write_all(b"x").await.unwrap();
        assert_eq!(read_exact_within(&mut c, 1, LIMIT).await, b"x");
        proxy.set_mode(Mode::Stall);
        let (up, down) = (proxy.forwarded(Direction::Up), proxy.forwarded(Direction::Down));
        let data = crate::pattern(32 << 20, 3, false);
        let (mut r, mut w) = c.into_split();
        let writer = tokio::spawn({
            let data = data.clone();
            async move {
                w.write_all(&data).await.unwrap();
                w
            }
        });
        tokio::time::sleep(Duration::from_millis(500)).await;
        // The writer is blocked: kernel buffers hold a few MiB, not 32.
        assert!(!writer.is_finished(), "32 MiB went into a stalled link");
        // Nothing was forwarded or lost, and the connection is still open.
        assert!(proxy.forwarded(Direction::Up) - up <= CHUNK as u64);
        assert_eq!(proxy.forwarded(Direction::Down), down);
        assert_eq!(proxy.dropped(Direction::Up) + proxy.dropped(Direction::Down), 0);
        assert_eq!(proxy.open(), 1);

        proxy.heal();
        let mut back = vec![0u8; data.len()];
        tokio::time::timeout(LIMIT, r.read_exact(&mut back))
            .await
            .unwrap()
            .unwrap();
        assert!(back == data, "the stalled bytes came back changed");
        tokio::time::timeout(LIMIT, writer).await.unwrap().unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reset_mid_stream_cuts_after_exactly_the_armed_bytes_with_an_rst() {
        let (target, mut accepted, _server) = handing_server().await;
        let proxy = Proxy::new(target);
        let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
        let mut t = accepted.recv().await.unwrap();
        proxy.reset_after(Direction::Down, 100_000);
        let data = crate::pattern(1 << 20, 5, false);
        let sender = tokio::spawn(async move {
            let r = t.write_all(&data).await;
            (t, r)
        });
        let mut got = Vec::new();
        let mut buf = vec![0u8; 1 << 16];
        let err = loop {
            match tokio::time::timeout(LIMIT, c.read(&mut buf)).await.unwrap() {
                Ok(0) => panic!("an orderly end (FIN) after {} bytes, expected a reset", got.len()),
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) => break e,
            }
        };
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset, "{err}");
        assert!(got.len() <= 100_000, "{} bytes passed an armed reset", got.len());
        assert!(got == crate::pattern(1 << 20, 5, false)[..got.len()]);
        // The target's side is reset too: its write fails, or (if the proxy
        // had taken every byte) its next read.
        let (mut t, written) = tokio::time::timeout(LIMIT, sender).await.unwrap().unwrap();
        let mut b = [0u8; 1];
        if written.is_ok() {
            let r = tokio::time::timeout(LIMIT, t.read(&mut b)).await.unwrap();
            assert!(
                matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
                "{r:?}"
            );
        }
        assert_eq!(proxy.resets(), 1);
        assert!(proxy.last_reset().is_some());
        eprintln!("reset after {} of 100000 armed bytes", got.len());

        // reset_all: now, every connection.
        let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
        let _t = accepted.recv().await.unwrap();
        assert!(crate::eventually(LIMIT, || proxy.open() == 1).await);
        assert_eq!(proxy.reset_all(), 1);
        let r = tokio::time::timeout(LIMIT, c.read(&mut b)).await.unwrap();
        assert!(
            matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
            "{r:?}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn closing_one_connection_leaves_the_others_and_dropping_the_proxy_stops_everything() {
        let (target, _server) = echo_server().await;
        let proxy = Proxy::new(target);
        let mut a = TcpStream::connect(proxy.addr()).await.unwrap();
        let mut b = TcpStream::connect(proxy.addr()).await.unwrap();
        for s in [&mut a, &mut b] {
            s.write_all(b"hi").await.unwrap();
            assert_eq!(read_exact_within(s, 2, LIMIT).await, b"hi");
        }
        let ids = proxy.connections();
        assert_eq!(ids.len(), 2);
        assert!(proxy.close(ids[0]));
        let mut buf = [0u8; 4];
        // An orderly end for the first ...
        let r = tokio::time::timeout(LIMIT, a.read(&mut buf)).await.unwrap();
        assert!(matches!(r, Ok(0)), "{r:?}");
        // ... the second still flows.
        b.write_all(b"yes").await.unwrap();
        assert_eq!(read_exact_within(&mut b, 3, LIMIT).await, b"yes");
        assert!(crate::eventually(LIMIT, || proxy.connections() == ids[1..]).await);

        let addr = proxy.addr();
        drop(proxy);
        let r = tokio::time::timeout(LIMIT, b.read(&mut buf)).await.unwrap();
        assert!(matches!(r, Ok(0) | Err(_)), "{r:?}");
        // The listener is gone.
        assert!(
            crate::eventually(LIMIT, || std::net::TcpStream::connect(addr).is_err()).await,
            "the proxy still listens after being dropped"
        );
    }

    #[test]
    fn the_rewriter_replaces_addresses_even_split_across_reads() {
        let mut r = rewriter();
        assert_eq!(r.push(b"xx127.0.0.1:40000yy"), b"xx127.0.0.1:40001yy");
        // Split anywhere: the tail is held, then completed.
        let whole = b"a127.0.0.1:50000b127.0.0.1:50010";
        for cut in 0..whole.len() {
            let mut r = rewriter();
            let mut out = r.push(&whole[..cut]);
            out.extend(r.push(&whole[cut..]));
            out.extend(r.flush());
            assert_eq!(out, b"a127.0.0.1:50001b127.0.0.1:50011", "cut at {cut}");
        }
        // Not an address: untouched; a lone prefix is flushed as is.
        let mut r = rewriter();
        assert_eq!(
            r.push(b"127.0.0.1:4x000 127.0.0.1:99999"),
            b"127.0.0.1:4x000 127.0.0.1:99999"
        );
        let mut out = r.push(b"z127.0.0.");
        assert_eq!(out, b"z");
        out.extend(r.flush());
        assert_eq!(out, b"z127.0.0.");
    }
}
