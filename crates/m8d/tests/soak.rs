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
//! Not part of the default test run:
//! `cargo test --release -p m8d --test soak -- --ignored --nocapture`
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::{
    sync::atomic::Ordering,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use m8d::fleet::{Fleet, FleetConfig};

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "soak: runs for 10 minutes; see the README"]
async fn random_kills_freezes_and_rejoins_for_ten_minutes() {
    let secs: u64 = std::env::var("MW_SOAK_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(600);
    let seed = std::env::var("MW_SOAK_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64 | 1);
    eprintln!("soak: {secs} s, seed {seed} (MW_SOAK_SEED={seed} repeats the fault sequence)");
    let mut rng = Rng(seed);
    let workers = 4;
    let mut f = Fleet::start(FleetConfig::new(M8D, workers)).await.unwrap();
    let end = Instant::now() + Duration::from_secs(secs);
    let mut totals = Totals::default();
    let (mut kills, mut freezes) = (Vec::new(), Vec::new());
    let mut longest_healthy_pause = Duration::ZERO;
    while Instant::now() < end {
        // A quiet spell, then one fault on a random world.
        tokio::time::sleep(Duration::from_millis(300 + rng.below(1500))).await;
        let victim = rng.below(workers as u64) as usize;
        for m in &f.members {
            m.stats.take_max_gap();
        }
        let freeze = rng.below(3) == 0;
        let at = if freeze {
            f.freeze(victim).unwrap()
        } else {
            f.kill(victim).unwrap()
        };
        let (err, failed_at) = f.wait_failed(victim, Duration::from_secs(10)).await.unwrap();
        assert!(err.is_world_broken(), "{err}");
        let detected = failed_at.saturating_duration_since(at);
        if freeze {
            assert!(
                detected < Duration::from_secs(4),
                "freeze detected after {detected:?}"
            );
            freezes.push(detected);
            f.thaw(victim).unwrap();
        } else {
            assert!(
                detected < Duration::from_secs(2),
                "kill detected after {detected:?}"
            );
            kills.push(detected);
        }
        for (i, m) in f.members.iter().enumerate() {
            if i != victim {
                longest_healthy_pause = longest_healthy_pause.max(m.stats.take_max_gap());
            }
        }
        collect(&f, victim, &mut totals);
        f.respawn(victim).await.unwrap();
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
    eprintln!(
        "soak done: {} kills (median detection {:?}), {} freezes (median detection {:?}); \
         {} messages received, {} corrupted, {} lost; the {} healthy generations (never faulted, ended cleanly) \
         sent {} and the leader received {} of them; longest pause of a healthy world during a fault {:?}; \
         workers' exits {exits:?}",
        kills.len(),
        median(&mut kills),
        freezes.len(),
        median(&mut freezes),
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
