//! Soak: for at least 10 minutes (`MW_SOAK_SECS` to change), random kills,
//! freezes and re-joins of worker processes while checksummed traffic flows
//! in every other world. Reports faults injected, detection times, messages
//! received, corrupted (must be 0) and lost (must be 0: a world's stream is
//! either intact and in order or ended by its break). At the end every
//! worker still running (a generation never faulted) ends its stream with
//! how many messages it sent ([`m8d::fleet::Fleet::end_streams`]): the
//! leader must have received exactly that many from each, so a lost tail
//! counts too, not only gaps. Sent is reported for those generations (a
//! killed worker cannot say).
//!
//! The network variant ([`soak_with_network_faults`]) routes every worker's
//! traffic with the leader (store and mesh) through a fault-injecting proxy of
//! its world ([`WorldProxy`], given to the worker as its store address; the
//! leader hosts the real store and joins it directly), and adds partitions,
//! one-way drops (each direction), half-open stalls and connection resets to
//! the kills and freezes. A network fault is injected, the leader's side of
//! the world must break within a bound (heartbeat timeout for silent faults,
//! at once for resets), the network is healed, the old worker (whose side is
//! broken too: it exits on its own or is killed) is replaced and the name
//! re-joined through the same proxies.
//!
//! Not part of the default test run:
//! `cargo test --release -p m8d --test soak -- --ignored --nocapture`
//! runs both variants, one after the other; add a test's name to run one.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, Mutex, atomic::Ordering},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use m8d::fleet::{Fleet, FleetConfig, WorkerStore};
use multiworld_testkit::proxy::{Direction, Mode, WorldProxy};

const M8D: &str = env!("CARGO_BIN_EXE_m8d");

/// xorshift64*: a seeded, logged source of fault choices.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Default)]
struct Totals {
    received: u64,
    corrupted: u64,
    lost: u64,
    /// Sent by the healthy generations (the last ones, ended cleanly).
    healthy_sent: u64,
    /// Received from those generations.
    healthy_received: u64,
}

fn collect(f: &Fleet, i: usize, t: &mut Totals) {
    let s = &f.members[i].stats;
    t.received += s.messages.load(Ordering::Relaxed);
    t.corrupted += s.corrupted.load(Ordering::Relaxed);
    t.lost += s.lost.load(Ordering::Relaxed);
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

/// One fault of the soak.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    Kill,
    Freeze,
    Partition,
    Drop(Direction),
    Stall,
    Reset,
}

impl Fault {
    fn pick(rng: &mut Rng, network: bool) -> Fault {
        if !network {
            // The original mix (a seed repeats the same sequence).
            return if rng.below(3) == 0 {
                Fault::Freeze
            } else {
                Fault::Kill
            };
        }
        match rng.below(8) {
            0 | 1 => Fault::Kill,
            2 => Fault::Freeze,
            3 => Fault::Partition,
            4 => Fault::Drop(Direction::Up),
            5 => Fault::Drop(Direction::Down),
            6 => Fault::Stall,
            _ => Fault::Reset,
        }
    }

    fn label(self) -> &'static str {
        match self {
            Fault::Kill => "kills",
            Fault::Freeze => "freezes",
            Fault::Partition => "partitions",
            Fault::Drop(Direction::Up) => "drops worker->leader",
            Fault::Drop(Direction::Down) => "drops leader->worker",
            Fault::Stall => "half-open stalls",
            Fault::Reset => "resets",
        }
    }

    /// How long the leader may take to see the world break: a process gone
    /// or a reset at once (plus scheduling), a silence by heartbeats (1 s
    /// timeout, plus one interval and a busy machine).
    fn bound(self) -> Duration {
        match self {
            Fault::Kill | Fault::Reset => Duration::from_secs(2),
            _ => Duration::from_secs(4),
        }
    }
}

/// Every world's proxies, by world name (network mode).
type Proxies = Arc<Mutex<HashMap<String, WorldProxy>>>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "soak: runs for 10 minutes; see the README"]
async fn random_kills_freezes_and_rejoins_for_ten_minutes() {
    soak(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "soak: runs for 10 minutes; see the README"]
async fn soak_with_network_faults() {
    soak(true).await;
}

/// The two soaks run one after the other (the test harness would run them
/// side by side, doubling the load the detection bounds assume).
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn soak(network: bool) {
    let _one = ONE_AT_A_TIME.lock().await;
    let secs: u64 = std::env::var("MW_SOAK_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(600);
    let seed = std::env::var("MW_SOAK_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64 | 1);
    eprintln!(
        "soak{}: {secs} s, seed {seed} (MW_SOAK_SEED={seed} repeats the fault sequence)",
        if network { " with network faults" } else { "" }
    );
    let mut rng = Rng(seed);
    let workers = 4;
    let mut config = FleetConfig::new(M8D, workers);
    let proxies: Proxies = Arc::default();
    if network {
        let proxies = Arc::clone(&proxies);
        config.worker_store = Some(WorkerStore(Arc::new(move |name: &str, store: &str| {
            let mut map = proxies.lock().unwrap();
            map.entry(name.to_string())
                .or_insert_with(|| WorldProxy::new(store.parse().unwrap()))
                .store_addr()
        })));
    }
    let mut f = Fleet::start(config).await.unwrap();
    let end = Instant::now() + Duration::from_secs(secs);
    let mut totals = Totals::default();
    let mut detections: BTreeMap<&'static str, Vec<Duration>> = BTreeMap::new();
    let (mut self_exits, mut network_faults) = (0usize, 0usize);
    let mut longest_healthy_pause = Duration::ZERO;
    while Instant::now() < end {
        // A quiet spell, then one fault on a random world.
        tokio::time::sleep(Duration::from_millis(300 + rng.below(1500))).await;
        let victim = rng.below(workers as u64) as usize;
        let fault = Fault::pick(&mut rng, network);
        for m in &f.members {
            m.stats.take_max_gap();
        }
        let name = f.members[victim].name.clone();
        let with_net = |act: &dyn Fn(&WorldProxy)| {
            let map = proxies.lock().unwrap();
            act(map.get(&name).expect("the world's proxies"));
        };
        let at = match fault {
            Fault::Kill => f.kill(victim).unwrap(),
            Fault::Freeze => f.freeze(victim).unwrap(),
            Fault::Partition | Fault::Drop(_) | Fault::Stall => {
                let mode = match fault {
                    Fault::Partition => Mode::Partition,
                    Fault::Drop(dir) => Mode::Drop(dir),
                    _ => Mode::Stall,
                };
                let at = Instant::now();
                with_net(&|n| n.set_mode(mode));
                at
            }
            Fault::Reset => {
                let at = Instant::now();
                with_net(&|n| {
                    let reset: usize = n.all().iter().map(|p| p.reset_all()).sum();
                    assert!(reset > 0, "{name}: no connection to reset");
                });
                at
            }
        };
        let (err, failed_at) = f.wait_failed(victim, Duration::from_secs(10)).await.unwrap();
        assert!(err.is_world_broken(), "{fault:?}: {err}");
        let detected = failed_at.saturating_duration_since(at);
        assert!(detected < fault.bound(), "{fault:?} detected after {detected:?}");
        detections.entry(fault.label()).or_default().push(detected);
        match fault {
            Fault::Kill => {}
            Fault::Freeze => f.thaw(victim).unwrap(),
            _ => {
                network_faults += 1;
                with_net(&|n| n.heal());
                // The worker's side is broken too: it exits on its own
                // (exit 0, "the world ended") or is killed by the re-spawn.
                let p = f.members[victim].process.as_mut().unwrap();
                let t = Instant::now();
                while t.elapsed() < Duration::from_secs(3) {
                    if p.try_wait().unwrap().is_some() {
                        self_exits += 1;
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
        for (i, m) in f.members.iter().enumerate() {
            if i != victim {
                longest_healthy_pause = longest_healthy_pause.max(m.stats.take_max_gap());
            }
        }
        collect(&f, victim, &mut totals);
        f.respawn(victim).await.unwrap();
    }
    if network {
        // The traffic did go through the proxies (no bypass).
        let map = proxies.lock().unwrap();
        for m in &f.members {
            let n = map.get(&m.name).unwrap();
            let mesh: usize = n.mesh().iter().map(|p| p.accepted()).sum();
            assert!(
                n.store().accepted() > 0 && mesh > 0,
                "{}: the proxies carried no connection",
                m.name
            );
        }
    }
    // The last generation of every world was never faulted: each ends its
    // stream cleanly, saying how many it sent.
    let ended = f.end_streams(Duration::from_secs(30)).await;
    let mut mismatches = Vec::new();
    for i in 0..workers {
        collect(&f, i, &mut totals);
        let m = &f.members[i];
        let received = m.stats.count();
        match m.stats.sent() {
            Some(sent) => {
                totals.healthy_sent += sent;
                totals.healthy_received += received;
                if sent != received {
                    mismatches.push(format!("{}: sent {sent}, received {received}", m.name));
                }
            }
            None => mismatches.push(format!("{}: no clean end (received {received})", m.name)),
        }
    }
    let exits = f.shutdown().await;
    let faults: Vec<String> = detections
        .iter_mut()
        .map(|(k, v)| format!("{} {k} (median detection {:?})", v.len(), median(v)))
        .collect();
    eprintln!(
        "soak done: {}{}; \
         {} messages received, {} corrupted, {} lost; the {} healthy generations (never faulted, ended cleanly) \
         sent {} and the leader received {} of them; longest pause of a healthy world during a fault {:?}; \
         workers' exits {exits:?}",
        faults.join(", "),
        if network {
            format!(
                "; workers that exited by themselves after a network fault: {self_exits} of {network_faults}"
            )
        } else {
            String::new()
        },
        totals.received,
        totals.corrupted,
        totals.lost,
        ended.len(),
        totals.healthy_sent,
        totals.healthy_received,
        longest_healthy_pause,
    );
    assert_eq!(totals.corrupted, 0, "corrupted messages");
    assert_eq!(totals.lost, 0, "messages lost from a stream");
    assert_eq!(
        ended.len(),
        workers,
        "every last generation ends cleanly: {mismatches:?}"
    );
    assert!(
        mismatches.is_empty(),
        "healthy generations: sent != received: {mismatches:?}"
    );
    assert!(
        exits.iter().all(|c| *c == Some(0)),
        "every last worker exits 0: {exits:?}"
    );
}
