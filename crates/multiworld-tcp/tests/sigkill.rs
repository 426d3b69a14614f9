//! A real peer process is SIGKILLed in the middle of a large transfer; the
//! surviving receiver must fail quickly with an error naming the peer. The peer is
//! this test binary re-executed in "child" mode (see `sigkill_child_peer`); the two
//! processes rendezvous through files in a temporary directory.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Stdio;
use std::time::{Duration, Instant};

use multiworld_tcp::{Communicator, DType, Error, HealthEvent, Rank, Tag, Tensor};
use multiworld_testkit::process::{Guard, Signal, self_test_command};
use multiworld_testkit::*;

const CHILD_ENV: &str = "MW_TCP_SIGKILL_CHILD_DIR";
const CHILD_TEST: &str = "sigkill_child_peer";
const SIZE: usize = 128 << 20;

/// The peer process: joins as rank 1 and streams large messages to rank 0 until it
/// is killed (or rank 0 goes away). Does nothing unless started by the test below.
#[test]
#[ignore = "helper process for peer_killed_mid_transfer_fails_the_receiver"]
fn sigkill_child_peer() {
    let Ok(dir) = std::env::var(CHILD_ENV) else {
        eprintln!("{CHILD_TEST}: not started by the parent test; nothing to do");
        return;
    };
    runtime().block_on(async {
        let rdv = FileRendezvous { dir: dir.into() };
        let comm = Communicator::join(config("sigkill", 1, 2), &rdv).await.unwrap();
        let big = Tensor::zeros(DType::U8, [SIZE]).unwrap();
        while comm.send(Rank(0), Tag(1), &big).await.is_ok() {}
    });
}

#[test]
fn peer_killed_mid_transfer_fails_the_receiver() {
    init_tracing();
    let dir = temp_dir("sigkill");
    // Killed with its process group if the test fails before it does.
    let mut child = Guard::spawn(
        self_test_command(CHILD_TEST)
            .env(CHILD_ENV, &dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null()),
    );
    runtime().block_on(async {
        let rdv = FileRendezvous { dir: dir.clone() };
        let comm = Communicator::join(config("sigkill", 0, 2), &rdv).await.unwrap();
        let mut events = comm.health_events();
        let handle = comm.irecv(Rank(1), Tag(1), Tensor::zeros(DType::U8, [SIZE]).unwrap());
        // Wait until the transfer is really under way, then kill the sender.
        let started = eventually(Duration::from_secs(30), || {
            comm.peer_stats(Rank(1)).unwrap().bytes_received >= 2 << 20
        })
        .await;
        assert!(started, "the transfer never started");
        assert!(child.try_wait().is_none(), "child still running");
        child.signal(Signal::SIGKILL);
        let killed_at = Instant::now();
        let at_kill = comm.peer_stats(Rank(1)).unwrap().bytes_received;
        let r = tokio::time::timeout(Duration::from_secs(10), handle)
            .await
            .expect("the receive must fail, not hang");
        let took = killed_at.elapsed();
        let e = r.unwrap_err();
        println!("receive failed {took:?} after SIGKILL, {at_kill} of {SIZE} bytes in: {e}");
        assert!(at_kill < SIZE as u64, "killed in the middle of the transfer");
        match &e {
            Error::PeerLost { rank, cause } => {
                assert_eq!(*rank, Rank(1));
                assert!(!cause.is_empty());
            }
            other => panic!("expected PeerLost, got {other}"),
        }
        assert!(e.to_string().contains("rank 1"), "{e}");
        // Target is 50 ms; the bound is generous for a loaded 2-core machine.
        assert!(took < Duration::from_secs(2), "took {took:?}");
        match events.recv().await.unwrap() {
            HealthEvent::PeerLost { rank, .. } => assert_eq!(rank, Rank(1)),
            other => panic!("unexpected {other:?}"),
        }
    });
    let _ = std::fs::remove_dir_all(&dir);
}
