//! The world manager with in-process members (two managers play two
//! processes): joining, traffic, events, a break that stays inside its world,
//! re-joining as a new generation, leaving, and losing the world's store.
//! Real-process fault injection (SIGKILL, SIGSTOP) is in `crates/m8d/tests`.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::{Duration, Instant};

use multiworld::{
    BreakCause, JoinFailure, ManagerConfig, Rank, ReduceOp, Secret, Tag, Tensor, WorldConfig, WorldError,
    WorldEvent, WorldManager, WorldState,
};
use multiworld_store::{ServerConfig, StoreServer};
use multiworld_testkit::facade::next_event_for;
use tokio::sync::broadcast;

/// The join timeout of the tests' members, unless one says otherwise.
const JOIN: Duration = Duration::from_secs(20);

fn cfg(name: &str, rank: u32, size: u32, store: &str) -> WorldConfig {
    let mut c = WorldConfig::new(name, rank, size, store).unwrap();
    c.join_timeout = JOIN;
    c.secret = Some(Secret::new("test secret"));
    c
}

/// [`cfg`] for a member of a world whose store is a standalone one (no
/// member hosts it), joining within `join_timeout`.
fn standalone_cfg(name: &str, rank: u32, size: u32, store: &str, join_timeout: Duration) -> WorldConfig {
    let mut c = cfg(name, rank, size, store);
    c.host_store = false;
    c.join_timeout = join_timeout;
    c
}

/// Joins `name` with rank 0 on `leader` (hosting the store at `store`) and
/// rank 1 on `worker`.
async fn pair(
    leader: &WorldManager,
    worker: &WorldManager,
    name: &str,
    store: &str,
) -> (multiworld::World, multiworld::World) {
    let (a, b) = tokio::join!(
        leader.join(cfg(name, 0, 2, store)),
        worker.join(cfg(name, 1, 2, store))
    );
    (a.unwrap(), b.unwrap())
}

/// A standalone store (as `m8d store` runs) that lets members with the
/// tests' secret create their worlds.
async fn standalone_store() -> StoreServer {
    StoreServer::bind(
        "127.0.0.1:0".parse().unwrap(),
        ServerConfig {
            allow_remote_create: true,
            remote_create_secret: Some(Secret::new("test secret")),
            ..ServerConfig::default()
        },
    )
    .await
    .unwrap()
}

async fn ping(a: &multiworld::World, b: &multiworld::World, value: f32) {
    let data = vec![value; 1024];
    let mut got = Tensor::zeros(multiworld::DType::F32, [1024]).unwrap();
    let (s, r) = tokio::join!(
        a.send(Rank(1), Tag(0), &data[..]),
        b.recv(Rank(0), Tag(0), &mut got)
    );
    s.unwrap();
    r.unwrap();
    assert!(got.as_slice::<f32>().unwrap().iter().all(|&x| x == value));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn join_exchange_and_list() {
    multiworld_testkit::init_tracing();
    let leader = WorldManager::default();
    let worker = WorldManager::default();
    let store = leader.serve_store("127.0.0.1:0").await.unwrap().to_string();
    let mut events = leader.events();
    let (a, b) = pair(&leader, &worker, "w", &store).await;
    assert_eq!(a.generation(), b.generation());
    assert_eq!((a.rank(), b.rank(), a.size()), (Rank(0), Rank(1), 2));
    match next_event_for(&mut events, "w", Duration::from_secs(5)).await {
        WorldEvent::Joined {
            rank: Rank(0),
            size: 2,
            ..
        } => {}
        other => panic!("{other:?}"),
    }
    ping(&a, &b, 3.5).await;
    let listed = leader.worlds();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].state, WorldState::Ready);
    assert!(leader.world("w").is_some() && leader.world("nope").is_none());
    // Tags with the top bit set belong to the runtime and the collectives.
    let err = a.send(Rank(1), Tag(1 << 31), &[1u8][..]).await.unwrap_err();
    assert!(matches!(err, WorldError::InvalidArgument { .. }), "{err}");
    // The same name cannot be joined twice at once.
    let err = leader.join(cfg("w", 0, 2, &store)).await.unwrap_err();
    assert!(
        matches!(err, WorldError::AlreadyJoined { state: "ready", .. }),
        "{err}"
    );
}

/// The mesh listens on the interface that reaches the store, so members on
/// other hosts can connect back: a world whose store is reached over this
/// host's routed address (not loopback) is meshed over that address. Also
/// `listen_host` picks the address explicitly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mesh_listens_on_the_interface_that_reaches_the_store() {
    multiworld_testkit::init_tracing();
    let leader = WorldManager::default();
    let worker = WorldManager::default();
    // Explicit: loopback even though the store is on loopback too.
    let store = leader.serve_store("127.0.0.1:0").await.unwrap().to_string();
    let mut c0 = cfg("explicit", 0, 2, &store);
    let mut c1 = cfg("explicit", 1, 2, &store);
    c0.listen_host = Some("127.0.0.1".parse().unwrap());
    c1.listen_host = Some("127.0.0.1".parse().unwrap());
    let (a, b) = tokio::join!(leader.join(c0), worker.join(c1));
    let (a, b) = (a.unwrap(), b.unwrap());
    assert!(a.communicator().local_addr().ip().is_loopback());
    ping(&a, &b, 1.0).await;

    // Derived: this host's routed address, where it has one.
    let probe = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
    let routed = probe
        .connect("10.255.255.254:9")
        .ok()
        .and_then(|()| probe.local_addr().ok())
        .map(|a| a.ip())
        .filter(|ip| !ip.is_unspecified() && !ip.is_loopback());
    let Some(ip) = routed else {
        eprintln!("skipped the routed half: this machine has no route off loopback");
        return;
    };
    let store = leader.serve_store(&format!("{ip}:0")).await.unwrap().to_string();
    let (a, b) = pair(&leader, &worker, "routed", &store).await;
    assert_eq!(a.communicator().local_addr().ip(), ip);
    assert_eq!(b.communicator().local_addr().ip(), ip);
    ping(&a, &b, 2.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_world_breaks_alone_and_its_name_can_be_joined_again() {
    multiworld_testkit::init_tracing();
    let leader = WorldManager::default();
    let worker = WorldManager::default();
    let store = leader.serve_store("127.0.0.1:0").await.unwrap().to_string();
    let (a1, b1) = pair(&leader, &worker, "one", &store).await;
    let (a2, b2) = pair(&leader, &worker, "two", &store).await;
    let mut events = leader.events();

    // A receive in flight on world "one" when its peer aborts.
    let pending = a1.irecv(
        Some(Rank(1)),
        Tag(9),
        Tensor::zeros(multiworld::DType::F32, [4]).unwrap(),
    );
    let broke_at = Instant::now();
    b1.abort();
    let err = pending.wait().await.unwrap_err();
    let noticed = broke_at.elapsed();
    assert!(err.is_world_broken(), "{err}");
    assert!(noticed < Duration::from_secs(2), "noticed after {noticed:?}");
    match next_event_for(&mut events, "one", Duration::from_secs(5)).await {
        WorldEvent::Broken { cause, .. } => assert!(
            matches!(
                cause,
                BreakCause::PeerLost { rank: Rank(1), .. } | BreakCause::ReportedByPeer { rank: Rank(1), .. }
            ),
            "{cause:?}"
        ),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        next_event_for(&mut events, "one", Duration::from_secs(5)).await,
        WorldEvent::Removed { .. }
    ));
    // New operations fail at once with the recorded cause.
    let err = a1.send(Rank(1), Tag(0), &[1.0f32][..]).await.unwrap_err();
    assert!(err.is_world_broken(), "{err}");
    b1.removed().await;

    // World "two" never noticed.
    ping(&a2, &b2, 7.0).await;
    assert_eq!(a2.state(), WorldState::Ready);

    // "one" is joined again as a new generation; traffic resumes.
    let (a1b, b1b) = pair(&leader, &worker, "one", &store).await;
    assert!(a1b.generation() > a1.generation());
    ping(&a1b, &b1b, 9.0).await;
    assert!(matches!(a1.state(), WorldState::Removed));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaving_is_orderly_and_the_peer_learns_of_it() {
    multiworld_testkit::init_tracing();
    let leader = WorldManager::default();
    let worker = WorldManager::default();
    let store = leader.serve_store("127.0.0.1:0").await.unwrap().to_string();
    let (a, b) = pair(&leader, &worker, "w", &store).await;
    let (other_a, other_b) = pair(&leader, &worker, "w-other", &store).await;
    let mut worker_events = worker.events();
    let left_at = Instant::now();
    leader.leave("w").await.unwrap();
    assert!(leader.world("w").is_none());
    assert!(matches!(
        a.send(Rank(1), Tag(0), &[1u8][..]).await.unwrap_err(),
        WorldError::NotJoined { .. }
    ));
    match next_event_for(&mut worker_events, "w", Duration::from_secs(5)).await {
        WorldEvent::Broken { cause, .. } => assert!(
            matches!(cause, BreakCause::PeerLost { rank: Rank(0), .. }),
            "{cause}"
        ),
        other => panic!("{other:?}"),
    }
    // Told by the leaver's goodbye, not found by heartbeats (1 s).
    let told = left_at.elapsed();
    assert!(
        told < Duration::from_millis(700),
        "the peer learned of the leave after {told:?}"
    );
    b.removed().await;
    // The other world of the same two members is untouched.
    assert_eq!(other_a.state(), WorldState::Ready);
    ping(&other_a, &other_b, 1.5).await;
    assert!(worker.world("w").is_none());
    assert!(matches!(
        leader.leave("w").await,
        Err(WorldError::NotJoined { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_the_worlds_store_breaks_only_that_world() {
    multiworld_testkit::init_tracing();
    // World "s" keeps its store on a separate server that dies; world "t" on
    // the leader's own.
    let separate = StoreServer::bind("127.0.0.1:0".parse().unwrap(), ServerConfig::default())
        .await
        .unwrap();
    let separate_addr = separate.local_addr().to_string();
    let leader = WorldManager::default();
    let worker = WorldManager::default();
    let own = leader.serve_store("127.0.0.1:0").await.unwrap().to_string();
    separate
        .open_world(
            "s",
            multiworld_store::WorldOptions {
                secret: Some(multiworld_store::Secret::new("test secret")),
                limits: None,
            },
        )
        .unwrap();
    let mut sa = cfg("s", 0, 2, &separate_addr);
    sa.host_store = false;
    let sb = cfg("s", 1, 2, &separate_addr);
    let (a, b) = tokio::join!(leader.join(sa), worker.join(sb));
    let (a, _b) = (a.unwrap(), b.unwrap());
    let (t_a, t_b) = pair(&leader, &worker, "t", &own).await;
    let mut events = [leader.events(), worker.events()];

    let killed_at = Instant::now();
    separate.shutdown(Duration::from_secs(1)).await;
    // Both members lose the store; whichever breaks first closes its
    // connections, which the other may see before its own store loss.
    let mut causes = Vec::new();
    for rx in &mut events {
        match next_event_for(rx, "s", Duration::from_secs(10)).await {
            WorldEvent::Broken { cause, .. } => causes.push(cause),
            other => panic!("{other:?}"),
        }
    }
    let store_lost = |c: &BreakCause| matches!(c, BreakCause::StoreLost { reason } if !reason.is_empty());
    assert!(causes.iter().any(store_lost), "{causes:?}");
    for (r, c) in causes.iter().enumerate() {
        let other = 1 - r as u32;
        assert!(
            store_lost(c) || matches!(c, BreakCause::PeerLost { rank, .. } if *rank == Rank(other)),
            "member {r}: {c:?}"
        );
    }
    let took = killed_at.elapsed();
    assert!(took < Duration::from_secs(5), "store loss noticed after {took:?}");
    assert!(
        a.send(Rank(1), Tag(0), &[1u8][..])
            .await
            .unwrap_err()
            .is_world_broken()
    );
    ping(&t_a, &t_b, 1.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn joining_alone_or_with_a_missing_member_fails_cleanly() {
    multiworld_testkit::init_tracing();
    let m = WorldManager::default();
    let store = m.serve_store("127.0.0.1:0").await.unwrap().to_string();
    // A world of one works on its own.
    let solo = m.join(cfg("solo", 0, 1, &store)).await.unwrap();
    assert_eq!(solo.size(), 1);
    // A member that never comes: the join fails at its timeout, leaves no
    // trace, and the name can be tried again.
    let mut c = cfg("lonely", 0, 2, &store);
    c.join_timeout = Duration::from_millis(500);
    let started = Instant::now();
    // While it waits it is listed as joining, with the rank and size it joins as.
    let (err, listed) = tokio::join!(m.join(c.clone()), async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        m.worlds().into_iter().find(|w| w.name == "lonely")
    });
    let err = err.unwrap_err();
    let listed = listed.expect("a joining world is listed");
    assert_eq!(
        (listed.state, listed.rank, listed.size),
        (WorldState::Joining, Rank(0), 2)
    );
    assert!(matches!(err, WorldError::JoinFailed { .. }), "{err}");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(m.world("lonely").is_none());
    assert!(m.worlds().iter().all(|w| w.name != "lonely"));
    let err = m.join(c).await.unwrap_err();
    assert!(matches!(err, WorldError::JoinFailed { .. }), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_secret_cannot_join() {
    multiworld_testkit::init_tracing();
    let leader = WorldManager::default();
    let stranger = WorldManager::default();
    let store = leader.serve_store("127.0.0.1:0").await.unwrap().to_string();
    let mut host = cfg("w", 0, 2, &store);
    host.join_timeout = Duration::from_secs(2);
    let mut bad = cfg("w", 1, 2, &store);
    bad.secret = Some(Secret::new("guess"));
    bad.join_timeout = Duration::from_secs(2);
    let (a, b) = tokio::join!(leader.join(host), stranger.join(bad));
    assert!(a.is_err(), "the host must not complete a world with a stranger");
    let err = b.unwrap_err().to_string();
    assert!(err.contains("unauthenticated"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_monitor_sees_running_watchdogs_as_healthy() {
    multiworld_testkit::init_tracing();
    let config = ManagerConfig {
        monitor_interval: Duration::from_millis(50),
        stall_after: Duration::from_millis(800),
        ..ManagerConfig::default()
    };
    let leader = WorldManager::new(config.clone());
    let worker = WorldManager::new(config);
    let store = leader.serve_store("127.0.0.1:0").await.unwrap().to_string();
    let (_a, _b) = pair(&leader, &worker, "w", &store).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        leader.stalled_watchdogs().is_empty(),
        "{:?}",
        leader.stalled_watchdogs()
    );
    assert!(worker.stalled_watchdogs().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_removes_everything_and_refuses_new_joins() {
    multiworld_testkit::init_tracing();
    let leader = WorldManager::default();
    let worker = WorldManager::default();
    let store = leader.serve_store("127.0.0.1:0").await.unwrap().to_string();
    let (_a, b) = pair(&leader, &worker, "w", &store).await;
    leader.shutdown().await;
    assert!(leader.worlds().is_empty());
    // The hosted store is stopped although the world handle `_a` (which
    // shares its server) is still held: the port can be bound at once.
    let again = StoreServer::bind(store.parse().unwrap(), ServerConfig::default()).await;
    if let Err(e) = &again {
        panic!("the store's port is still bound after shutdown: {e}");
    }
    drop(again);
    assert!(matches!(
        leader.join(cfg("x", 0, 1, &store)).await.unwrap_err(),
        WorldError::ShutDown
    ));
    b.removed().await;
}

/// Three managers (the first hosting the store), each subscribed to events
/// before joining, and their members of one world of 3.
struct Three {
    managers: Vec<WorldManager>,
    store: String,
    events: Vec<broadcast::Receiver<WorldEvent>>,
    worlds: Vec<multiworld::World>,
}

async fn three(name: &str) -> Three {
    let managers: Vec<WorldManager> = (0..3).map(|_| WorldManager::default()).collect();
    let store = managers[0].serve_store("127.0.0.1:0").await.unwrap().to_string();
    let events = managers.iter().map(|m| m.events()).collect();
    let joins = managers
        .iter()
        .enumerate()
        .map(|(r, m)| m.join(cfg(name, r as u32, 3, &store)));
    let worlds = futures::future::join_all(joins)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    Three {
        managers,
        store,
        events,
        worlds,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finishing_together_ends_a_world_without_breaking_it() {
    multiworld_testkit::init_tracing();
    let Three {
        managers,
        store: _,
        mut events,
        worlds,
    } = three("together").await;
    // Everyone finishes at slightly different times; nobody's world breaks.
    let finishes = worlds.iter().enumerate().map(|(i, w)| async move {
        tokio::time::sleep(Duration::from_millis(30 * i as u64)).await;
        w.finish(Duration::from_secs(10)).await
    });
    for r in futures::future::join_all(finishes).await {
        r.unwrap();
    }
    for (m, rx) in managers.iter().zip(events.iter_mut()) {
        assert!(m.world("together").is_none());
        while let Ok(e) = rx.try_recv() {
            assert!(!matches!(e, WorldEvent::Broken { .. }), "{e:?}");
        }
    }
}

/// Two managers (the first hosting the store) joined to a world of 2 whose
/// operations have a 300 ms deadline.
async fn pair_with_deadline(
    name: &str,
) -> (WorldManager, WorldManager, multiworld::World, multiworld::World) {
    let leader = WorldManager::default();
    let worker = WorldManager::default();
    let store = leader.serve_store("127.0.0.1:0").await.unwrap().to_string();
    let with_deadline = |rank| {
        let mut c = cfg(name, rank, 2, &store);
        c.op_timeout = Some(Duration::from_millis(300));
        c
    };
    let (a, b) = tokio::join!(leader.join(with_deadline(0)), worker.join(with_deadline(1)));
    (leader, worker, a.unwrap(), b.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_past_its_deadline_breaks_the_world() {
    multiworld_testkit::init_tracing();
    let (leader, worker, a, b) = pair_with_deadline("deadline").await;
    let store = leader.serve_store("127.0.0.1:0").await.unwrap().to_string();
    let (other_a, other_b) = pair(&leader, &worker, "deadline-other", &store).await;
    // Operations that finish in time leave nothing behind...
    for i in 0..5 {
        ping(&a, &b, i as f32).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(a.state(), WorldState::Ready);
    // ...but one that nobody answers breaks the world at its deadline.
    let mut worker_events = worker.events();
    let started = Instant::now();
    let mut buf = Tensor::zeros(multiworld::DType::F32, [4]).unwrap();
    let err = a.recv(Rank(1), Tag(5), &mut buf).await.unwrap_err();
    let took = started.elapsed();
    match &err {
        WorldError::Broken {
            cause: BreakCause::OpDeadline { op, after },
            ..
        } => {
            assert_eq!(op, "recv");
            assert_eq!(*after, Duration::from_millis(300));
        }
        other => panic!("{other:?}"),
    }
    assert!(took >= Duration::from_millis(300), "broke early: {took:?}");
    assert!(took < Duration::from_secs(3), "broke late: {took:?}");
    // The peer learns of it and breaks too.
    assert!(matches!(
        next_event_for(&mut worker_events, "deadline", Duration::from_secs(5)).await,
        WorldEvent::Broken { .. }
    ));
    // The members' other world is untouched.
    assert_eq!(other_a.state(), WorldState::Ready);
    ping(&other_a, &other_b, 2.5).await;
}

/// A collective the members disagree on fails on both with `Mismatch`; as
/// the world's error it names the world, which stays usable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collectives_disagreement_is_the_worlds_mismatch_and_the_world_goes_on() {
    multiworld_testkit::init_tracing();
    let (leader, worker) = (WorldManager::default(), WorldManager::default());
    let store = leader.serve_store("127.0.0.1:0").await.unwrap().to_string();
    let (a, b) = pair(&leader, &worker, "coll-mismatch", &store).await;
    let mut x = Tensor::from_vec(vec![1.0f32; 4], [4]).unwrap();
    let mut y = Tensor::from_vec(vec![1.0f32; 5], [5]).unwrap();
    let (ra, rb) = tokio::join!(
        a.collectives().all_reduce(&mut x, ReduceOp::Sum),
        b.collectives().all_reduce(&mut y, ReduceOp::Sum)
    );
    for (w, r) in [(&a, ra), (&b, rb)] {
        let err = r.unwrap_err();
        assert!(!err.is_world_fatal(), "{err:?}");
        match w.collective_error(err) {
            WorldError::Mismatch { world, .. } => assert_eq!(world.as_str(), "coll-mismatch"),
            other => panic!("{other:?}"),
        }
        assert_eq!(w.state(), WorldState::Ready);
    }
    let mut x = Tensor::from_vec(vec![1.0f32; 4], [4]).unwrap();
    let mut y = Tensor::from_vec(vec![2.0f32; 4], [4]).unwrap();
    let (ra, rb) = tokio::join!(
        a.collectives().all_reduce(&mut x, ReduceOp::Sum),
        b.collectives().all_reduce(&mut y, ReduceOp::Sum)
    );
    ra.unwrap();
    rb.unwrap();
    assert_eq!(x.as_slice::<f32>().unwrap(), &[3.0f32; 4]);
    ping(&a, &b, 1.5).await;
}

/// A collective that a member never joins is bound by the world's
/// `op_timeout` like a send or a receive: the world breaks at the deadline,
/// the call fails naming the world and the cause, and the peer is told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collective_past_its_deadline_breaks_the_world() {
    multiworld_testkit::init_tracing();
    let (_leader, worker, a, b) = pair_with_deadline("coll-deadline").await;
    // Collectives that both members make finish and leave no deadline behind.
    for i in 0..3 {
        let mut x = Tensor::from_vec(vec![i as f32; 8], [8]).unwrap();
        let mut y = Tensor::from_vec(vec![1.0f32; 8], [8]).unwrap();
        let (ra, rb) = tokio::join!(
            a.collectives().all_reduce(&mut x, ReduceOp::Sum),
            b.collectives().all_reduce(&mut y, ReduceOp::Sum)
        );
        ra.unwrap();
        rb.unwrap();
        assert_eq!(x.as_slice::<f32>().unwrap(), &[i as f32 + 1.0; 8]);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(a.state(), WorldState::Ready);
    // Only the leader calls: its call breaks the world at the deadline.
    let mut worker_events = worker.events();
    let started = Instant::now();
    let mut x = Tensor::from_vec(vec![1.0f32; 8], [8]).unwrap();
    let err = a
        .collectives()
        .all_reduce(&mut x, ReduceOp::Sum)
        .await
        .unwrap_err();
    let took = started.elapsed();
    assert!(err.is_world_fatal(), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("coll-deadline") && text.contains("all_reduce"),
        "{text}"
    );
    assert!(took >= Duration::from_millis(300), "broke early: {took:?}");
    assert!(took < Duration::from_secs(3), "broke late: {took:?}");
    // As the world's error: the watchdog's cause, not the abort it led to.
    match a.collective_error(err) {
        WorldError::Broken {
            world,
            cause: BreakCause::OpDeadline { op, .. },
        } => assert_eq!((world.as_str(), op.as_ref()), ("coll-deadline", "all_reduce")),
        other => panic!("{other:?}"),
    }
    match a.state() {
        WorldState::Broken(BreakCause::OpDeadline { op, after }) => {
            assert_eq!(op, "all_reduce");
            assert_eq!(after, Duration::from_millis(300));
        }
        WorldState::Removed => match leader_cause(&a).await {
            Some(BreakCause::OpDeadline { op, .. }) => assert_eq!(op, "all_reduce"),
            other => panic!("{other:?}"),
        },
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        next_event_for(&mut worker_events, "coll-deadline", Duration::from_secs(5)).await,
        WorldEvent::Broken { .. }
    ));
}

/// The break cause a broken world reports to a late caller.
async fn leader_cause(w: &multiworld::World) -> Option<BreakCause> {
    let mut buf = Tensor::zeros(multiworld::DType::F32, [1]).unwrap();
    match w.recv(Rank(1), Tag(0), &mut buf).await {
        Err(WorldError::Broken { cause, .. }) => Some(cause),
        _ => None,
    }
}

/// A member that breaks the world tells the others through the world's
/// store, so they break with its cause even when their own connections and
/// heartbeats are fine (here the announcement is written straight into the
/// store, as a member that saw a cause its peers cannot see would).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_break_announced_in_the_store_reaches_every_member() {
    multiworld_testkit::init_tracing();
    let Three {
        managers,
        store,
        mut events,
        worlds,
    } = three("told").await;
    let other = &managers[1];
    let (x, y) = pair(&managers[0], other, "untouched", &store).await;
    // Announce as rank 2 would, in this generation of the world's store.
    let client = multiworld_store::StoreClient::connect(&store, multiworld_store::ClientConfig::default())
        .await
        .unwrap();
    let options = multiworld_store::OpenOptions {
        secret: Some(multiworld_store::Secret::new(b"test secret")),
        create: false,
        timeout: Duration::from_secs(5),
    };
    let handle = client.open("told", options).await.unwrap();
    assert_eq!(handle.generation(), worlds[0].generation().0);
    handle
        .set(
            "multiworld/broken",
            b"2\nrank 2's operation all_gather passed its deadline".to_vec(),
        )
        .await
        .unwrap();
    // Nothing else is wrong, so the first member to break learned it from
    // the store. Once it has broken, its closed connections may reach the
    // other member before the store does: either cause is right there.
    let mut causes = Vec::new();
    for rx in events.iter_mut().take(2) {
        causes.push(loop {
            match next_event_for(rx, "told", Duration::from_secs(5)).await {
                WorldEvent::Broken { cause, .. } => break cause,
                WorldEvent::Joined { .. } => continue,
                other => panic!("{other:?}"),
            }
        });
    }
    let told = |c: &BreakCause| matches!(c, BreakCause::ReportedByPeer { rank: Rank(2), reason } if reason.contains("all_gather"));
    assert!(causes.iter().any(told), "{causes:?}");
    for (r, c) in causes.iter().enumerate() {
        let other = 1 - r as u32;
        assert!(
            told(c) || matches!(c, BreakCause::PeerLost { rank, .. } if *rank == Rank(other)),
            "member {r}: {c:?}"
        );
    }
    for w in &worlds {
        tokio::time::timeout(Duration::from_secs(10), w.removed())
            .await
            .unwrap();
    }
    // The other world on the same managers and store is untouched.
    assert_eq!(x.state(), WorldState::Ready);
    ping(&x, &y, 7.0).await;
}

/// Without the `nccl` feature an NCCL world cannot be joined, and says why.
/// (With it, `tests/nccl_worlds.rs` covers NCCL joins, including a machine
/// without NCCL.)
#[cfg(not(feature = "nccl"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_nccl_feature_an_nccl_world_is_refused_with_a_clear_reason() {
    let m = WorldManager::default();
    let mut c = cfg("gpu", 0, 1, "127.0.0.1:0");
    c.backend = multiworld::Backend::Nccl;
    let err = m.join(c).await.unwrap_err().to_string();
    assert!(err.contains("enable the `nccl` feature"), "{err}");
    assert!(m.worlds().is_empty());
}

/// A watchdog that cannot run is reported: on a one-thread runtime, blocking
/// the thread stops every watchdog, and the monitor's check (made before the
/// runtime gets the thread back) names the world and how long it was stuck.
#[tokio::test(flavor = "current_thread")]
async fn a_stuck_watchdog_is_reported() {
    multiworld_testkit::init_tracing();
    let leader = WorldManager::default();
    let worker = WorldManager::default();
    let store = leader.serve_store("127.0.0.1:0").await.unwrap().to_string();
    let (_a, _b) = pair(&leader, &worker, "stuck", &store).await;
    // Let the watchdogs tick normally first.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(leader.stalled_watchdogs().is_empty());
    // The event is taken on a thread of its own, timed as it comes.
    let mut events = leader.events();
    let (said_tx, said_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        while let Ok(e) = events.blocking_recv() {
            if let WorldEvent::WatchdogStalled { world, stuck_for } = e {
                let _ = said_tx.send((world, stuck_for, Instant::now()));
                return;
            }
        }
    });
    // Block the runtime's only thread: no watchdog can run meanwhile.
    let blocked = Instant::now();
    std::thread::sleep(Duration::from_millis(3500));
    let stalled = leader.stalled_watchdogs();
    assert_eq!(stalled.len(), 1, "{stalled:?}");
    assert_eq!(stalled[0].0, "stuck");
    assert!(stalled[0].1 >= Duration::from_secs(2), "{stalled:?}");
    // The monitor runs on its own thread, so it said so while the runtime
    // was still blocked, within `stall_after` (2 s) + `monitor_interval`
    // (500 ms) of the block, with some slack.
    let (world, stuck_for, at) = said_rx
        .recv_timeout(Duration::from_secs(5))
        .expect("the monitor thread reported nothing while the runtime was blocked");
    assert_eq!(world, "stuck");
    assert!(stuck_for >= Duration::from_secs(2), "{stuck_for:?}");
    let after = at.saturating_duration_since(blocked);
    assert!(
        after < Duration::from_millis(3200),
        "reported {after:?} into the block (bound 3.2 s: stall_after + monitor_interval + 0.7 s)"
    );
}

/// A receive's own deadline fails only that receive: `WorldError::Timeout`
/// after about the deadline, the world still usable, the buffer given back
/// with its dtype and shape, and a message sent afterwards delivered to the
/// next receive (the withdrawn one took nothing). Every failure of a pending
/// receive gives its buffer back, a broken world's included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receive_deadline_of_its_own_leaves_the_world_usable() {
    multiworld_testkit::init_tracing();
    let leader = WorldManager::default();
    let worker = WorldManager::default();
    let store = leader.serve_store("127.0.0.1:0").await.unwrap().to_string();
    let (a, b) = pair(&leader, &worker, "patience", &store).await;
    let mut buf = Tensor::zeros(multiworld::DType::F32, [256]).unwrap();
    for src in [Some(Rank(1)), None] {
        let started = std::time::Instant::now();
        let err = a
            .recv_timeout(src, Tag(5), &mut buf, Duration::from_millis(200))
            .await
            .unwrap_err();
        let took = started.elapsed();
        assert!(matches!(err, WorldError::Timeout { .. }), "{err}");
        assert!(!err.is_world_broken());
        assert!(took >= Duration::from_millis(200), "{took:?}");
        assert!(took < Duration::from_secs(5), "{took:?}");
        assert_eq!((buf.dtype(), buf.shape()), (multiworld::DType::F32, &[256][..]));
        assert_eq!(a.state(), WorldState::Ready);
    }
    // The message sent now goes to the next receive.
    let data = vec![7.5f32; 256];
    b.send(Rank(0), Tag(5), &data[..]).await.unwrap();
    let from = a
        .recv_timeout(Some(Rank(1)), Tag(5), &mut buf, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(from, Rank(1));
    assert!(buf.as_slice::<f32>().unwrap().iter().all(|&x| x == 7.5));
    ping(&a, &b, 1.5).await;

    // A broken world: the pending receive fails at once and gives its
    // buffer back.
    a.abort();
    let pending = a.irecv(
        Some(Rank(1)),
        Tag(5),
        Tensor::zeros(multiworld::DType::I64, [3]).unwrap(),
    );
    let failed = pending.wait_timeout(Duration::from_secs(10)).await.unwrap_err();
    assert!(failed.error.is_world_broken(), "{}", failed.error);
    assert_eq!(
        (failed.buffer.dtype(), failed.buffer.shape()),
        (multiworld::DType::I64, &[3][..])
    );
}

/// `WorldConfig::read_ahead` reaches the transport: with the default
/// (16 KiB), a 64 KiB message whose receive is not posted waits in the
/// socket; with 256 KiB it is read ahead at once. Both arrive intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_ahead_sets_how_large_an_early_message_is_read() {
    multiworld_testkit::init_tracing();
    let leader = WorldManager::default();
    let worker = WorldManager::default();
    let store = leader.serve_store("127.0.0.1:0").await.unwrap().to_string();
    for (name, read_ahead, early) in [("ra-default", None, false), ("ra-256k", Some(256 << 10), true)] {
        let mut c0 = cfg(name, 0, 2, &store);
        let mut c1 = cfg(name, 1, 2, &store);
        assert_eq!(c1.read_ahead, multiworld::DEFAULT_READ_AHEAD);
        if let Some(r) = read_ahead {
            (c0.read_ahead, c1.read_ahead) = (r, r);
        }
        let (a, b) = tokio::join!(leader.join(c0), worker.join(c1));
        let (a, b) = (a.unwrap(), b.unwrap());
        let data = vec![3u8; 64 << 10];
        a.send(Rank(1), Tag(5), &data[..]).await.unwrap();
        let received = || b.communicator().peer_stats(Rank(0)).unwrap().messages_received;
        // Long enough to be read ahead on a busy machine; absence is
        // checked over a shorter while.
        let wait = if early {
            Duration::from_secs(10)
        } else {
            Duration::from_millis(300)
        };
        let read = multiworld_testkit::eventually(wait, || received() == 1).await;
        assert_eq!(read, early, "{name}: read before its receive");
        let mut got = Tensor::zeros(multiworld::DType::U8, [64 << 10]).unwrap();
        b.recv(Rank(0), Tag(5), &mut got).await.unwrap();
        assert_eq!(got.as_bytes(), &data[..], "{name}");
        assert_eq!(received(), 1);
        let (fa, fb) = tokio::join!(
            a.finish(Duration::from_secs(10)),
            b.finish(Duration::from_secs(10))
        );
        fa.unwrap();
        fb.unwrap();
    }
    leader.shutdown().await;
    worker.shutdown().await;
}

/// A leave whose caller stops waiting (a timeout around it, a `select!`, a
/// Ctrl-C in Python) still tears the world down: the name is freed, the
/// `Removed` event comes, and a later leave, `removed()` and re-join work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leave_whose_caller_stops_waiting_still_removes_the_world() {
    multiworld_testkit::init_tracing();
    let leader = WorldManager::default();
    let worker = WorldManager::default();
    let store = leader.serve_store("127.0.0.1:0").await.unwrap().to_string();
    let (a, b) = pair(&leader, &worker, "w", &store).await;
    let mut events = leader.events();
    // Dropped after its first poll: the goodbye is on its way, nothing more.
    {
        let mut leave = Box::pin(leader.leave("w"));
        assert!(futures::poll!(&mut leave).is_pending());
    }
    tokio::time::timeout(Duration::from_secs(10), a.removed())
        .await
        .expect("the world was never removed after its leave was dropped");
    assert!(leader.world("w").is_none());
    loop {
        match next_event_for(&mut events, "w", Duration::from_secs(5)).await {
            WorldEvent::Removed { .. } => break,
            WorldEvent::Broken { cause, .. } => panic!("a leave is not a break: {cause}"),
            _ => {}
        }
    }
    b.removed().await;
    let (a2, b2) = pair(&leader, &worker, "w", &store).await;
    assert!(a2.generation() > a.generation());
    ping(&a2, &b2, 3.0).await;
}

/// A join of a name whose previous generation is still being left waits
/// for that teardown, as for a broken one, instead of failing with
/// `AlreadyJoined`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_during_a_leave_of_the_same_name_waits_for_it() {
    multiworld_testkit::init_tracing();
    let leader = WorldManager::default();
    let worker = WorldManager::default();
    let store = leader.serve_store("127.0.0.1:0").await.unwrap().to_string();
    let (a, b) = pair(&leader, &worker, "w", &store).await;
    // One poll begins the leave (the world is `Removed` from then on); the
    // join comes before it can have ended.
    let mut leaving = Box::pin(leader.leave("w"));
    assert!(futures::poll!(&mut leaving).is_pending());
    assert_eq!(a.state(), WorldState::Removed);
    // The worker joins again once its side (broken by the goodbye) is gone.
    let (a2, b2) = tokio::join!(leader.join(cfg("w", 0, 2, &store)), async {
        tokio::time::timeout(Duration::from_secs(10), b.removed())
            .await
            .expect("the worker's side was never removed");
        worker.join(cfg("w", 1, 2, &store)).await
    });
    let (a2, b2) = (a2.unwrap(), b2.unwrap());
    assert!(a2.generation() > a.generation());
    ping(&a2, &b2, 4.0).await;
    leaving.await.unwrap();
}

/// A receive still pending on a member that finishes is failed by a peer's
/// orderly departure, but that departure does not break the world: no
/// `Broken` event, and every member's finish succeeds. (Whether the
/// departure reaches the receive before the member's own leave is a race;
/// five rounds make it likely that one does.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pending_receive_failed_by_a_departure_while_finishing_breaks_nothing() {
    multiworld_testkit::init_tracing();
    for round in 0..5 {
        let name = format!("departing-{round}");
        let Three {
            managers,
            store: _,
            mut events,
            worlds,
        } = three(&name).await;
        // Rank 0 waits, in the background, for a message nobody sends.
        let pending = worlds[0].irecv(None, Tag(7), Tensor::zeros(multiworld::DType::U8, [1]).unwrap());
        let waiter = tokio::spawn(pending.wait());
        let finishes = worlds.iter().enumerate().map(|(i, w)| async move {
            // Rank 2 comes last: its tokens let 0 and 1 go at about the same
            // time, so 1's goodbye can reach 0's receive while 0 finishes.
            tokio::time::sleep(Duration::from_millis(if i == 2 { 100 } else { 0 })).await;
            w.finish(Duration::from_secs(10)).await
        });
        for (i, r) in futures::future::join_all(finishes).await.into_iter().enumerate() {
            r.unwrap_or_else(|e| panic!("round {round}: rank {i}'s finish: {e}"));
        }
        assert!(waiter.await.unwrap().is_err(), "the receive cannot succeed");
        for (m, rx) in managers.iter().zip(events.iter_mut()) {
            assert!(m.world(&name).is_none());
            while let Ok(e) = rx.try_recv() {
                assert!(!matches!(e, WorldEvent::Broken { .. }), "round {round}: {e:?}");
            }
        }
    }
}

/// A join in progress when `shutdown` begins ends with `ShutDown`, and no
/// world of that manager outlives the shutdown (a join that completed
/// afterwards used to leave a world listed as ready whose watchdog had
/// stopped). The store is standalone, so it outlives the shutdown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_in_progress_at_shutdown_ends_with_shutdown() {
    multiworld_testkit::init_tracing();
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), ServerConfig::default())
        .await
        .unwrap();
    let store = server.local_addr().to_string();
    let standalone = |rank| standalone_cfg("c", rank, 2, &store, JOIN);
    let leader = WorldManager::default();
    let worker = WorldManager::default();
    let joining = tokio::spawn({
        let (leader, c) = (leader.clone(), standalone(0));
        async move { leader.join(c).await }
    });
    let t0 = Instant::now();
    while leader.worlds().is_empty() {
        assert!(t0.elapsed() < Duration::from_secs(10), "the join never began");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    tokio::time::timeout(Duration::from_secs(10), leader.shutdown())
        .await
        .expect("shutdown waited for the join");
    // The peer arrives after the shutdown: the leader's join must not
    // complete into a world nobody watches.
    let late = tokio::spawn({
        let c = standalone(1);
        async move { worker.join(c).await }
    });
    let r = tokio::time::timeout(Duration::from_secs(10), joining)
        .await
        .expect("the join went on after the shutdown")
        .unwrap();
    assert!(matches!(r, Err(WorldError::ShutDown)), "{r:?}");
    assert!(leader.worlds().is_empty(), "{:?}", leader.worlds());
    late.abort();
}

/// Writing a broken world's flight record never holds a runtime thread: with
/// the record's file a FIFO nobody reads (a hung mount, in effect), another
/// world on the same one-thread runtime keeps working, and the broken world
/// is still removed (the write is given up after a bound).
#[tokio::test(flavor = "current_thread")]
async fn a_flight_record_that_cannot_be_written_stalls_no_other_world() {
    multiworld_testkit::init_tracing();
    let dir = std::env::temp_dir().join(format!("mw-flight-fifo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let leader = WorldManager::new(ManagerConfig {
        flight_recorder_dir: Some(dir.clone()),
        ..ManagerConfig::default()
    });
    let worker = WorldManager::default();
    let store = leader.serve_store("127.0.0.1:0").await.unwrap().to_string();
    let (w0, _w1) = pair(&leader, &worker, "w", &store).await;
    let (v0, v1) = pair(&leader, &worker, "v", &store).await;
    let fifo = dir.join(format!("w-g{}-r0.json", w0.generation().0));
    let made = std::process::Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    // Should the write ever block this thread, a reader opens the FIFO after
    // 5 s, so the test fails on its timings instead of hanging.
    let (done, finished) = std::sync::mpsc::channel::<()>();
    let unblock = {
        let fifo = fifo.clone();
        std::thread::spawn(move || {
            let _ = finished.recv_timeout(Duration::from_secs(5));
            // Opening it for reading lets the blocked writer (if any) go.
            let _ = std::fs::read(&fifo);
        })
    };
    w0.abort();
    let t0 = Instant::now();
    for i in 0..20 {
        ping(&v0, &v1, i as f32).await;
    }
    let took = t0.elapsed();
    assert!(
        took < Duration::from_secs(3),
        "20 pings on another world took {took:?}"
    );
    tokio::time::timeout(Duration::from_secs(10), w0.removed())
        .await
        .expect("the broken world was never removed");
    let _ = done.send(());
    unblock.join().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A send whose handle is dropped goes on (dropping does not cancel it), and
/// the flight record says how it ended, not "cancelled".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_send_handle_is_recorded_as_the_send_ends() {
    multiworld_testkit::init_tracing();
    let leader = WorldManager::default();
    let worker = WorldManager::default();
    let store = leader.serve_store("127.0.0.1:0").await.unwrap().to_string();
    let (a, b) = pair(&leader, &worker, "w", &store).await;
    // 64 MiB: more than the peer reads ahead, so it is still going when
    // its handle is dropped.
    let n = 16 << 20;
    let send = a.isend(Rank(1), Tag(3), Tensor::from(vec![1.5f32; n]));
    assert!(!send.is_completed());
    drop(send);
    let mut got = Tensor::zeros(multiworld::DType::F32, [n]).unwrap();
    b.recv(Rank(0), Tag(3), &mut got).await.unwrap();
    assert!(got.as_slice::<f32>().unwrap().iter().all(|&x| x == 1.5));
    let t0 = Instant::now();
    loop {
        let record = leader.flight_record("w").unwrap();
        let op = record
            .ops
            .iter()
            .find(|o| o.kind == "isend")
            .expect("the send is recorded");
        match &op.outcome {
            multiworld::OpOutcome::Done => break,
            multiworld::OpOutcome::Pending => {}
            other => panic!("the dropped send was recorded as {other:?}"),
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "still pending after it was received"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A world whose every member died without closing it stays open on a
/// standalone store, with their addresses. A new job's members of that
/// name find the generation stale (a member of their rank joined it
/// before), close it and join a fresh one, instead of dialling the dead
/// members' addresses until the join times out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generation_left_open_by_members_that_all_died_is_replaced() {
    use multiworld_store::{ClientConfig, OpenOptions, StoreClient};
    multiworld_testkit::init_tracing();
    let server = standalone_store().await;
    let store = server.local_addr().to_string();
    // What two SIGKILLed members leave: the world open, their addresses in it
    // (ports nobody listens on any more).
    let dead = StoreClient::connect(&store, ClientConfig::default())
        .await
        .unwrap()
        .open(
            "w",
            OpenOptions {
                secret: Some(Secret::new("test secret")),
                create: true,
                ..OpenOptions::default()
            },
        )
        .await
        .unwrap();
    let old = multiworld_tcp::Generation(dead.generation());
    for r in 0..2 {
        let gone = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let name = multiworld_tcp::WorldName::new("w").unwrap();
        dead.set(multiworld_tcp::addr_key(&name, old, Rank(r)), gone.to_string())
            .await
            .unwrap();
    }
    let standalone = |rank| standalone_cfg("w", rank, 2, &store, Duration::from_secs(8));
    let (m0, m1) = (WorldManager::default(), WorldManager::default());
    // Rank 1 first: it would read rank 0's dead address.
    let (b, a) = tokio::join!(m1.join(standalone(1)), async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        m0.join(standalone(0)).await
    });
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.generation(), b.generation());
    assert_ne!(a.generation().0, old.0, "joined the stale generation");
    ping(&a, &b, 5.0).await;
}

/// A large stale generation whose members' addresses do not answer at all
/// (their hosts gone: the connection attempts hang rather than being
/// refused) is found stale within one probe bound, not one bound per batch
/// of members.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_generation_of_unanswering_members_is_found_within_one_probe_bound() {
    use multiworld_store::{ClientConfig, OpenOptions, StoreClient};
    multiworld_testkit::init_tracing();
    let server = standalone_store().await;
    let store = server.local_addr().to_string();
    // A listener that never accepts, its queue full: a connection attempt
    // to it hangs (its SYN is dropped), as to a vanished host.
    let clogged = tokio::net::TcpSocket::new_v4().unwrap();
    clogged.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let clogged = clogged.listen(1).unwrap();
    let sink = clogged.local_addr().unwrap();
    let mut queued = Vec::new();
    for _ in 0..2 {
        queued.push(std::net::TcpStream::connect(sink).unwrap());
    }
    let options = |create| OpenOptions {
        secret: Some(Secret::new("test secret")),
        create,
        ..OpenOptions::default()
    };
    let client = StoreClient::connect(&store, ClientConfig::default())
        .await
        .unwrap();
    let dead = client.open("wide", options(true)).await.unwrap();
    let old = dead.generation();
    let name = multiworld_tcp::WorldName::new("wide").unwrap();
    for r in 0..40 {
        dead.set(
            multiworld_tcp::addr_key(&name, multiworld_tcp::Generation(old), Rank(r)),
            sink.to_string(),
        )
        .await
        .unwrap();
    }
    let c = standalone_cfg("wide", 0, 40, &store, Duration::from_secs(8));
    let m = WorldManager::default();
    let t0 = Instant::now();
    let joining = tokio::spawn({
        let m = m.clone();
        async move { m.join(c).await }
    });
    let replaced_after = loop {
        if let Ok(now) = client.open("wide", options(false)).await
            && now.generation() != old
        {
            break t0.elapsed();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(6),
            "the stale generation was never replaced"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        replaced_after < Duration::from_millis(2500),
        "the stale generation was replaced only after {replaced_after:?}"
    );
    joining.abort();
    m.shutdown().await;
    drop(queued);
}

/// A rank that retries a join that timed out finds its own address from
/// the failed attempt in the generation. When another member is still
/// waiting there (rank 0, accepting), the generation is not stale: the
/// retry joins it, and both members meet at once, instead of the retry
/// closing the generation under the waiting member.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_join_meets_a_member_already_waiting_in_its_generation() {
    multiworld_testkit::init_tracing();
    let server = standalone_store().await;
    let store = server.local_addr().to_string();
    let standalone = |rank, timeout| standalone_cfg("retried", rank, 2, &store, timeout);
    let (m0, m1) = (WorldManager::default(), WorldManager::default());
    // The worker starts first and gives up before the leader comes.
    let early = m1.join(standalone(1, Duration::from_millis(300))).await;
    assert!(early.is_err(), "joined without a leader");
    let leader = tokio::spawn({
        let m0 = m0.clone();
        let c = standalone(0, Duration::from_secs(10));
        async move { m0.join(c).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let t0 = Instant::now();
    let b = m1.join(standalone(1, Duration::from_secs(10))).await.unwrap();
    let a = leader.await.unwrap().unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "the retry and the waiting leader met only after {:?}",
        t0.elapsed()
    );
    assert_eq!(a.generation(), b.generation());
    ping(&a, &b, 5.0).await;
}

/// A retrying rank whose store answers too slowly for the stale-generation
/// check to read the other members' addresses (a loaded or distant store)
/// cannot tell, and takes the generation as it is: it goes on in it and
/// meets the member waiting there (the check used to count the slow lookups
/// as "nobody answers" and close the generation under that member).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_through_a_slow_store_keeps_the_generation_its_peer_waits_in() {
    use multiworld_testkit::proxy::{Link, Proxy};
    multiworld_testkit::init_tracing();
    let server = standalone_store().await;
    let store = server.local_addr().to_string();
    // 1.3 s round trips: more than the check's 1.2 s bound.
    let slow = Proxy::new(server.local_addr());
    slow.set_link(Link {
        latency: Duration::from_millis(650),
        ..Link::default()
    });
    let slow_store = slow.addr().to_string();
    let standalone = |rank, timeout, store: &str| standalone_cfg("slow-retry", rank, 2, store, timeout);
    let (m0, m1) = (WorldManager::default(), WorldManager::default());
    let early = m1.join(standalone(1, Duration::from_millis(300), &store)).await;
    assert!(early.is_err(), "joined without a leader");
    let leader = tokio::spawn({
        let m0 = m0.clone();
        let c = standalone(0, Duration::from_secs(25), &store);
        async move { m0.join(c).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let b = m1
        .join(standalone(1, Duration::from_secs(25), &slow_store))
        .await
        .unwrap();
    let a = leader.await.unwrap().unwrap();
    assert_eq!(a.generation(), b.generation());
    ping(&a, &b, 5.5).await;
}

/// The same with the lower rank retrying: the worker came while the
/// leader's failed attempt had left its address, and keeps being refused
/// there; it reads the address again and meets the leader's retry at once
/// (it used to retry the dead address until both joins timed out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_join_of_a_lower_rank_meets_the_member_waiting_for_it() {
    multiworld_testkit::init_tracing();
    let server = standalone_store().await;
    let store = server.local_addr().to_string();
    let standalone = |rank, timeout| standalone_cfg("retried-low", rank, 2, &store, timeout);
    let (m0, m1) = (WorldManager::default(), WorldManager::default());
    let early = m0.join(standalone(0, Duration::from_millis(300))).await;
    assert!(early.is_err(), "joined without a worker");
    let worker = tokio::spawn({
        let m1 = m1.clone();
        let c = standalone(1, Duration::from_secs(10));
        async move { m1.join(c).await }
    });
    // The worker reads the leader's dead address and is refused there.
    tokio::time::sleep(Duration::from_millis(150)).await;
    let t0 = Instant::now();
    let a = m0.join(standalone(0, Duration::from_secs(10))).await.unwrap();
    let b = worker.await.unwrap().unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "the leader's retry and the waiting worker met only after {:?}",
        t0.elapsed()
    );
    assert_eq!(a.generation(), b.generation());
    ping(&a, &b, 6.0).await;
}

/// In a world of three, a rank whose failed join had already connected to
/// a lower rank retries in the same generation: the lower rank, still
/// waiting there, lets the failed attempt's closed connection go and takes
/// the new one (it used to refuse it as a duplicate, and would have formed
/// the world with the dead connection); the three then meet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_join_replaces_its_failed_attempts_connection_to_a_lower_rank() {
    multiworld_testkit::init_tracing();
    let server = standalone_store().await;
    let store = server.local_addr().to_string();
    let standalone = |rank, timeout| standalone_cfg("retried-three", rank, 3, &store, timeout);
    let (m0, m1, m2) = (
        WorldManager::default(),
        WorldManager::default(),
        WorldManager::default(),
    );
    let leader = tokio::spawn({
        let m0 = m0.clone();
        let c = standalone(0, Duration::from_secs(15));
        async move { m0.join(c).await }
    });
    // Rank 1 connects to rank 0, then gives up waiting for rank 2.
    let early = m1.join(standalone(1, Duration::from_millis(600))).await;
    assert!(early.is_err(), "joined without rank 2");
    let t0 = Instant::now();
    let middle = tokio::spawn({
        let m1 = m1.clone();
        let c = standalone(1, Duration::from_secs(10));
        async move { m1.join(c).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let c = m2.join(standalone(2, Duration::from_secs(10))).await.unwrap();
    let b = middle.await.unwrap().unwrap();
    let a = leader.await.unwrap().unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(4),
        "the retry and the others met only after {:?}",
        t0.elapsed()
    );
    assert_eq!(a.generation(), b.generation());
    assert_eq!(b.generation(), c.generation());
    ping(&a, &b, 7.0).await;
    // The world did not form with the dead connection: it stays up.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(a.state(), WorldState::Ready, "{:?}", a.state());
    ping(&a, &b, 8.0).await;
}

/// A member whose lower rank never publishes its address fails its join
/// with the rendezvous timeout that names the missing key (the store
/// answers the lookup at the deadline), not a bare join timeout that
/// blames the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_lower_rank_is_named_by_the_join_error() {
    multiworld_testkit::init_tracing();
    let server = standalone_store().await;
    let c = standalone_cfg(
        "lonely",
        1,
        2,
        &server.local_addr().to_string(),
        Duration::from_millis(300),
    );
    for _ in 0..5 {
        let e = WorldManager::default().join(c.clone()).await.unwrap_err();
        match &e {
            WorldError::JoinFailed {
                reason: JoinFailure::Transport(multiworld_tcp::Error::Rendezvous(r)),
                ..
            } => assert!(r.to_string().contains("addr/0"), "{e}"),
            other => panic!("expected the rendezvous timeout naming rank 0's key: {other}"),
        }
        assert!(e.is_join_timeout(), "{e:?}");
    }
}

/// A member whose store never comes up (its rank 0, which hosts it, never
/// started) retries until its deadline, and that is a timeout that keeps
/// the store's last error inside.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_never_comes_up_is_a_join_timeout() {
    multiworld_testkit::init_tracing();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut c = cfg("no-store", 1, 2, &format!("127.0.0.1:{port}"));
    c.join_timeout = Duration::from_millis(500);
    let started = Instant::now();
    let e = WorldManager::default().join(c).await.unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    assert!(e.is_join_timeout(), "{e:?}");
    match &e {
        WorldError::JoinFailed {
            reason: JoinFailure::TimedOut(inner),
            ..
        } => assert!(matches!(**inner, JoinFailure::Store(_)), "{inner:?}"),
        other => panic!("{other:?}"),
    }
}

/// A shutdown that comes as a join ends leaves the new world at once: the
/// join fails with `ShutDown` (or succeeds, if it ended first), neither
/// waits for tasks the never-started world does not have, and a `Removed`
/// event always comes after its generation's `Joined`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_racing_a_join_ends_both_promptly() {
    shutdowns_racing_joins(Duration::from_micros(100)).await;
}

/// The same with the join's log line taking 10 ms (a full stderr pipe): the
/// join's "joined world" line no longer opens a window in which a shutdown
/// finds the world and has it `Removed` before its `Joined` is sent.
#[test]
fn a_shutdown_racing_a_join_with_slow_logging_reports_joined_first() {
    struct SlowLog;
    impl tracing::Subscriber for SlowLog {
        fn enabled(&self, m: &tracing::Metadata<'_>) -> bool {
            *m.level() <= tracing::Level::INFO
        }
        fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
            tracing::span::Id::from_u64(1)
        }
        fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
        fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
        fn event(&self, e: &tracing::Event<'_>) {
            // The join's own line ("joined world", the one with `took`).
            if e.metadata().fields().field("took").is_some() {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        fn enter(&self, _: &tracing::span::Id) {}
        fn exit(&self, _: &tracing::span::Id) {}
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .on_thread_start(|| {
            // For the thread's whole life: the runtime's threads log slowly.
            std::mem::forget(tracing::dispatcher::set_default(&tracing::Dispatch::new(SlowLog)));
        })
        .build()
        .unwrap();
    // Joins take longer here: spread the shutdowns over 0–48 ms.
    runtime.block_on(shutdowns_racing_joins(Duration::from_micros(2500)));
}

async fn shutdowns_racing_joins(step: Duration) {
    let server = standalone_store().await;
    let store = server.local_addr().to_string();
    let mut slowest = Duration::ZERO;
    for i in 0..60u64 {
        let m = WorldManager::default();
        let mut events = m.events();
        let c = standalone_cfg(&format!("race-{i}"), 0, 1, &store, JOIN);
        let t0 = Instant::now();
        let joining = tokio::spawn({
            let m = m.clone();
            async move { m.join(c).await }
        });
        // Spread the shutdowns over the join's last moments.
        tokio::time::sleep(step * (i % 20) as u32).await;
        m.shutdown().await;
        let joined = joining.await.unwrap();
        assert!(matches!(joined, Ok(_) | Err(WorldError::ShutDown)), "{joined:?}");
        slowest = slowest.max(t0.elapsed());
        let mut joined_generations = Vec::new();
        while let Ok(ev) = events.try_recv() {
            match ev {
                WorldEvent::Joined { generation, .. } => joined_generations.push(generation),
                WorldEvent::Removed { generation, .. } => assert!(
                    joined_generations.contains(&generation),
                    "Removed before Joined for generation {generation:?}"
                ),
                _ => {}
            }
        }
    }
    assert!(
        slowest < Duration::from_millis(1500),
        "a join and its shutdown took {slowest:?}"
    );
}

/// A rank restarted while its world is still up on a standalone store (its
/// old process vanished without a word, before the others noticed) finds
/// the world formed in that generation: it closes the generation, the
/// survivors' world breaks at once, and they meet it in a fresh one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_restarted_into_a_formed_world_replaces_its_generation() {
    multiworld_testkit::init_tracing();
    let server = standalone_store().await;
    let store = server.local_addr().to_string();
    let standalone = |rank| standalone_cfg("restarted", rank, 2, &store, Duration::from_secs(10));
    let (m0, m1) = (WorldManager::default(), WorldManager::default());
    let (a, b) = tokio::join!(m0.join(standalone(0)), m1.join(standalone(1)));
    let (a, _b) = (a.unwrap(), b.unwrap());
    let old = a.generation();
    // The "restarted" rank 1: another process, while the first still holds
    // its connection (not yet noticed as gone).
    let m1b = WorldManager::default();
    let t0 = Instant::now();
    let rejoin = tokio::spawn({
        let m1b = m1b.clone();
        let c = standalone(1);
        async move { m1b.join(c).await }
    });
    while matches!(a.state(), WorldState::Ready) {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "rank 0's world did not break when its generation was replaced"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut c0 = standalone(0);
    c0.join_timeout = Duration::from_secs(10);
    let deadline = Instant::now() + Duration::from_secs(10);
    let a2 = loop {
        // The old world's teardown may still hold the name for a moment.
        match m0.join(c0.clone()).await {
            Ok(w) => break w,
            Err(e) => {
                assert!(Instant::now() < deadline, "rank 0 could not join again: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let b2 = rejoin.await.unwrap().unwrap();
    assert_eq!(a2.generation(), b2.generation());
    assert_ne!(a2.generation(), old, "joined the replaced generation");
    ping(&a2, &b2, 9.0).await;
}

/// A `finish` whose caller stops waiting (its own timeout, a `select!`,
/// Ctrl-C in Python) still ends: when the other member leaves instead of
/// finishing, this member's world is removed, not left ready and deaf to
/// departures for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finish_whose_caller_stops_waiting_still_ends_the_world() {
    let (ma, mb) = (WorldManager::default(), WorldManager::default());
    let store = ma.serve_store("127.0.0.1:0").await.unwrap().to_string();
    let (a, b) = tokio::join!(
        ma.join(cfg("finish-dropped", 0, 2, &store)),
        mb.join(cfg("finish-dropped", 1, 2, &store))
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    let gave_up = tokio::time::timeout(Duration::from_millis(200), b.finish(Duration::from_secs(30))).await;
    assert!(gave_up.is_err(), "finish ended without the other member");
    drop(a);
    ma.leave("finish-dropped").await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), b.removed())
        .await
        .expect("the world of the member whose finish was dropped was never removed");
    assert!(mb.world("finish-dropped").is_none());
}

/// `World::abort` from a thread of no runtime (a compute thread, a signal
/// handler's thread) breaks the world and tears it down like any break.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_from_a_plain_thread_tears_the_world_down() {
    let m = WorldManager::default();
    let store = m.serve_store("127.0.0.1:0").await.unwrap().to_string();
    let w = m.join(cfg("aborted-off-runtime", 0, 1, &store)).await.unwrap();
    let w2 = w.clone();
    std::thread::spawn(move || w2.abort())
        .join()
        .expect("abort panicked off the runtime");
    tokio::time::timeout(Duration::from_secs(5), w.removed())
        .await
        .expect("the aborted world was never removed");
    assert!(m.world("aborted-off-runtime").is_none());
}

/// `barrier(Duration::MAX)` waits without a deadline (it used to overflow
/// the clock and panic).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_barrier_without_a_deadline_meets() {
    multiworld_testkit::init_tracing();
    let (leader, worker) = (WorldManager::default(), WorldManager::default());
    let store = leader.serve_store("127.0.0.1:0").await.unwrap().to_string();
    let (a, b) = pair(&leader, &worker, "forever", &store).await;
    let (x, y) = tokio::join!(a.barrier(Duration::MAX), b.barrier(Duration::MAX));
    x.unwrap();
    y.unwrap();
    ping(&a, &b, 2.0).await;
}

/// A barrier longer than the store's own bound on one wait (`max_timeout`)
/// waits again rather than timing out at that bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_barrier_outlasts_the_stores_bound_on_one_wait() {
    multiworld_testkit::init_tracing();
    let mut config = ServerConfig {
        allow_remote_create: true,
        remote_create_secret: Some(Secret::new("test secret")),
        ..ServerConfig::default()
    };
    config.limits.max_timeout = Duration::from_millis(200);
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), config)
        .await
        .unwrap();
    let store = server.local_addr().to_string();
    let standalone = |rank| standalone_cfg("long-barrier", rank, 2, &store, JOIN);
    let (m0, m1) = (WorldManager::default(), WorldManager::default());
    let (a, b) = tokio::join!(m0.join(standalone(0)), m1.join(standalone(1)));
    let (a, b) = (a.unwrap(), b.unwrap());
    let (x, y) = tokio::join!(a.barrier(Duration::MAX), async {
        tokio::time::sleep(Duration::from_millis(700)).await;
        b.barrier(Duration::from_secs(10)).await
    });
    x.unwrap();
    y.unwrap();
    // One that nobody else enters times out at its own timeout, and says so.
    let err = a.barrier(Duration::from_millis(700)).await.unwrap_err();
    match &err {
        WorldError::Timeout { after, .. } => assert_eq!(*after, Duration::from_millis(700), "{err}"),
        other => panic!("expected the barrier's timeout: {other}"),
    }
    assert_eq!(a.state(), WorldState::Ready);
    ping(&a, &b, 3.0).await;
}

/// A store bound that refuses the barrier's request every time (here: one
/// key per request, and the barrier waits on one key per member) fails the
/// barrier at once with an error naming the bound, instead of retrying it
/// until the timeout; the world goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_barrier_over_a_store_bound_fails_at_once_and_the_world_goes_on() {
    multiworld_testkit::init_tracing();
    let mut config = ServerConfig {
        allow_remote_create: true,
        remote_create_secret: Some(Secret::new("test secret")),
        ..ServerConfig::default()
    };
    config.limits.max_keys_per_request = 1;
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), config)
        .await
        .unwrap();
    let store = server.local_addr().to_string();
    let standalone = |rank| standalone_cfg("bounded", rank, 2, &store, JOIN);
    let (m0, m1) = (WorldManager::default(), WorldManager::default());
    let (a, b) = tokio::join!(m0.join(standalone(0)), m1.join(standalone(1)));
    let (a, b) = (a.unwrap(), b.unwrap());
    let t0 = Instant::now();
    let err = a.barrier(Duration::from_secs(10)).await.unwrap_err();
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "the barrier over a bound took {:?}",
        t0.elapsed()
    );
    match &err {
        WorldError::InvalidArgument { detail, .. } => assert!(detail.contains("keys per request"), "{err}"),
        other => panic!("expected the bound named as an invalid argument: {other}"),
    }
    assert_eq!(a.state(), WorldState::Ready);
    ping(&a, &b, 4.0).await;
}

/// A send dropped part-way through a large message (its caller's timeout)
/// leaves the stream impossible to resynchronise: the world breaks at once,
/// on both members, saying why, and the members' other world goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_dropped_part_way_breaks_its_world_at_once_and_only_it() {
    multiworld_testkit::init_tracing();
    let (leader, worker) = (WorldManager::default(), WorldManager::default());
    let store = leader.serve_store("127.0.0.1:0").await.unwrap().to_string();
    let (a, b) = pair(&leader, &worker, "cut", &store).await;
    let (other_a, other_b) = pair(&leader, &worker, "cut-other", &store).await;
    let mut worker_events = worker.events();
    // Nobody receives it: the socket's buffers fill and the send waits
    // part-way through the message when its caller gives up.
    let big = vec![1u8; 64 << 20];
    let cut = tokio::time::timeout(Duration::from_millis(100), a.send(Rank(1), Tag(3), &big[..])).await;
    assert!(cut.is_err(), "a 64 MiB send nobody receives completed");
    let dropped_at = Instant::now();
    match next_event_for(&mut worker_events, "cut", Duration::from_secs(5)).await {
        WorldEvent::Broken { .. } => {}
        other => panic!("{other:?}"),
    }
    let told = dropped_at.elapsed();
    assert!(
        told < Duration::from_millis(700),
        "the peer broke only after {told:?}"
    );
    let err = a.send(Rank(1), Tag(4), &[1u8][..]).await.unwrap_err();
    assert!(err.is_world_broken(), "{err}");
    assert!(err.to_string().contains("part-way"), "{err}");
    assert_eq!(other_a.state(), WorldState::Ready);
    ping(&other_a, &other_b, 4.5).await;
    let _ = b;
}

/// The store closing a world's generation (an operator's `close_world`, or
/// a restarted member that replaced it) breaks that world at once for every
/// member, as lost to its store, well before `store_grace`; another world
/// on the same store goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_world_closed_by_its_store_breaks_at_once_and_only_it() {
    multiworld_testkit::init_tracing();
    let server = standalone_store().await;
    let store = server.local_addr().to_string();
    let standalone = |name: &str, rank| standalone_cfg(name, rank, 2, &store, JOIN);
    let (m0, m1) = (WorldManager::default(), WorldManager::default());
    let (a, b) = tokio::join!(m0.join(standalone("closed", 0)), m1.join(standalone("closed", 1)));
    let (a, b) = (a.unwrap(), b.unwrap());
    let (x, y) = tokio::join!(m0.join(standalone("kept", 0)), m1.join(standalone("kept", 1)));
    let (x, y) = (x.unwrap(), y.unwrap());
    let (mut e0, mut e1) = (m0.events(), m1.events());
    let closed_at = Instant::now();
    assert!(server.close_world("closed"));
    let mut causes = Vec::new();
    for events in [&mut e0, &mut e1] {
        match next_event_for(events, "closed", Duration::from_secs(5)).await {
            WorldEvent::Broken { cause, .. } => causes.push(cause),
            other => panic!("{other:?}"),
        }
    }
    // The first to hear from the store breaks as lost to it; the other may
    // hear of that first (told, or its connection closing).
    assert!(
        causes.iter().any(|c| matches!(c, BreakCause::StoreLost { .. })),
        "{causes:?}"
    );
    assert!(
        causes.iter().all(|c| matches!(
            c,
            BreakCause::StoreLost { .. } | BreakCause::ReportedByPeer { .. } | BreakCause::PeerLost { .. }
        )),
        "{causes:?}"
    );
    // The default store_grace is 1 s: this is the store's answer, not the
    // grace running out.
    let took = closed_at.elapsed();
    assert!(took < Duration::from_millis(700), "broke only after {took:?}");
    assert!(!matches!(a.state(), WorldState::Ready) && !matches!(b.state(), WorldState::Ready));
    assert_eq!(x.state(), WorldState::Ready);
    ping(&x, &y, 6.5).await;
}
