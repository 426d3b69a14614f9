//! `m8d launch` across nodes: two launchers as two "nodes" on two loopback
//! addresses (node 0 on 127.0.0.1, node 1 on 127.0.0.2, two ranks each) form
//! one world of four whose ranks join it from the environment, all-reduce,
//! and check that they listen on their own node's address; the multi-node
//! environment contract of one launcher; and the launches it refuses.
//!
//! The rank program is this test binary itself, re-executed to run its
//! ignored test `rank_of_two_nodes` (`process::self_test_command`).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::{
    collections::HashSet,
    ffi::OsString,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener},
    process::Command,
    time::Duration,
};

use multiworld::{DType, ReduceOp, Tensor, WorldConfig, WorldManager};
use multiworld_testkit::process::{self, self_test_command};

const M8D: &str = env!("CARGO_BIN_EXE_m8d");

/// The world's name.
const WORLD: &str = "two-nodes";

/// How long a rank may live before it gives up on its own (so a hung world
/// never outlives the test, even if its launcher were killed first).
const RANK_LIMIT: Duration = Duration::from_secs(100);

/// How long each launcher may run before the test fails (above RANK_LIMIT).
const LAUNCHER_LIMIT: Duration = Duration::from_secs(150);

/// The addresses this process listens on (its TCP sockets in state LISTEN,
/// from `/proc/self/fd` and `/proc/self/net/tcp{,6}`).
fn listening_addresses() -> Vec<SocketAddr> {
    let mut inodes = HashSet::new();
    for fd in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        if let Ok(target) = std::fs::read_link(fd.path()) {
            let target = target.to_string_lossy().into_owned();
            if let Some(inode) = target.strip_prefix("socket:[").and_then(|t| t.strip_suffix(']')) {
                inodes.insert(inode.to_owned());
            }
        }
    }
    let mut found = Vec::new();
    for table in ["/proc/self/net/tcp", "/proc/self/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            if fields.len() < 10 || fields[3] != "0A" || !inodes.contains(fields[9]) {
                continue;
            }
            let (ip, port) = fields[1].split_once(':').unwrap();
            let port = u16::from_str_radix(port, 16).unwrap();
            // The address is printed as 32-bit words in the kernel's byte
            // order: each word's native bytes are the address's bytes.
            let words: Vec<[u8; 4]> = (0..ip.len() / 8)
                .map(|i| {
                    u32::from_str_radix(&ip[i * 8..i * 8 + 8], 16)
                        .unwrap()
                        .to_ne_bytes()
                })
                .collect();
            let ip = if words.len() == 1 {
                IpAddr::V4(Ipv4Addr::from(words[0]))
            } else {
                let bytes: Vec<u8> = words.concat();
                IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(bytes).unwrap()))
            };
            found.push(SocketAddr::new(ip, port));
        }
    }
    found
}

fn var(key: &str) -> u32 {
    let v = std::env::var(key).unwrap_or_else(|_| panic!("{key} is not set"));
    v.parse().unwrap_or_else(|e| panic!("{key}={v}: {e}"))
}

/// One rank of the two-node world, run by `m8d launch` (ignored when the
/// tests run: it needs the launcher's environment).
#[test]
#[ignore = "a rank of the two-node launch, started by two_launchers_on_two_loopback_addresses_form_one_world"]
fn rank_of_two_nodes() {
    std::thread::spawn(|| {
        std::thread::sleep(RANK_LIMIT);
        eprintln!("rank still running after {RANK_LIMIT:?}: giving up");
        std::process::exit(3);
    });
    // The launcher's variables decide, whatever a scheduler set around it.
    let config = WorldConfig::from_env(WORLD).unwrap();
    let (rank, node, local) = (var("RANK"), var("GROUP_RANK"), var("LOCAL_RANK"));
    assert_eq!(var("LOCAL_WORLD_SIZE"), 2);
    assert_eq!(var("WORLD_SIZE"), 4);
    assert_eq!(rank, node * 2 + local, "torchrun's numbering");
    assert_eq!((config.rank.0, config.size, config.local_rank), (rank, 4, local));
    let node_addr: IpAddr = std::env::var("MULTIWORLD_LISTEN_HOST").unwrap().parse().unwrap();
    assert_eq!(config.listen_host, Some(node_addr));

    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let manager = WorldManager::default();
        let world = manager.join(config).await.unwrap();
        let mut x = Tensor::from_vec(vec![(rank + 1) as f32; 4], [4]).unwrap();
        world
            .collectives()
            .all_reduce(&mut x, ReduceOp::Sum)
            .await
            .unwrap();
        assert_eq!(x.dtype(), DType::F32);
        assert_eq!(x.as_slice::<f32>().unwrap(), &[10.0; 4], "1 + 2 + 3 + 4");
        // Every member listens on its node's address, and only there (rank
        // 0's store too: MASTER_ADDR is node 0's address).
        let listening = listening_addresses();
        assert!(!listening.is_empty(), "rank {rank} listens nowhere");
        assert!(
            listening.iter().all(|a| a.ip() == node_addr),
            "rank {rank} of node {node} listens on {listening:?}, not only on {node_addr}"
        );
        world.barrier(Duration::from_secs(60)).await.unwrap();
        println!("rank {rank} of node {node}: all_reduce 10 listening on {node_addr}: {listening:?}");
        world.finish(Duration::from_secs(60)).await.unwrap();
        manager.shutdown().await;
    });
}

/// The launcher command line for node `node_rank` of 2 with 2 ranks each.
fn node(node_rank: u32, node_addr: &str, port: u16) -> Command {
    let rank_program = self_test_command("rank_of_two_nodes");
    let mut cmd = Command::new(M8D);
    cmd.args(["launch", "--nnodes", "2", "--nproc-per-node", "2", "--grace", "5"])
        .args(["--node-rank", &node_rank.to_string()])
        .args(["--master-addr", "127.0.0.1", "--master-port", &port.to_string()])
        .args(["--node-addr", node_addr, "--"])
        .arg(rank_program.get_program())
        .args(rank_program.get_args().map(OsString::from))
        // As if each launcher were one Slurm task and one MPI rank of its
        // own: the ranks must not take these for their place in the world.
        .env("SLURM_PROCID", node_rank.to_string())
        .env("SLURM_NTASKS", "2")
        .env("OMPI_COMM_WORLD_RANK", node_rank.to_string())
        .env("OMPI_COMM_WORLD_SIZE", "2");
    cmd
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn two_launchers_on_two_loopback_addresses_form_one_world() {
    let port = free_port();
    let (node0, node1) = std::thread::scope(|s| {
        // Node 1 first: its ranks wait for the store node 0's rank 0 hosts.
        let node1 = s.spawn(|| process::run_within(&mut node(1, "127.0.0.2", port), LAUNCHER_LIMIT));
        let node0 = s.spawn(|| process::run_within(&mut node(0, "127.0.0.1", port), LAUNCHER_LIMIT));
        (node0.join().unwrap(), node1.join().unwrap())
    });
    let report = format!("node 0: {node0:?}\nnode 1: {node1:?}");
    assert!(node0.success() && node1.success(), "{report}");
    for (ran, ranks, addr) in [(&node0, [0, 1], "127.0.0.1"), (&node1, [2, 3], "127.0.0.2")] {
        for r in ranks {
            // The test harness prints its own words before the rank's.
            let said = format!("rank {r} of node {}: all_reduce 10 listening on {addr}:", r / 2);
            assert!(
                ran.stdout
                    .lines()
                    .any(|l| l.starts_with(&format!("[rank {r}] ")) && l.contains(&said)),
                "{said:?} missing\n{report}"
            );
        }
    }
}

#[test]
fn every_rank_of_a_node_gets_torchruns_environment() {
    let out = process::run(
        Command::new(M8D)
            .args([
                "launch",
                "--nnodes",
                "3",
                "--node-rank",
                "1",
                "--nproc_per_node",
                "2",
            ])
            .args(["--master-addr", "10.9.8.7", "--master-port", "29555"])
            .args(["--node-addr", "127.0.0.2", "--"])
            .args([
                "sh",
                "-c",
                "echo rank=$RANK local=$LOCAL_RANK size=$WORLD_SIZE lws=$LOCAL_WORLD_SIZE \
                 group=$GROUP_RANK at=$MASTER_ADDR:$MASTER_PORT listen=$MULTIWORLD_LISTEN_HOST",
            ]),
    );
    assert!(out.success(), "{out:?}");
    for (rank, local) in [(2, 0), (3, 1)] {
        let line = format!(
            "[rank {rank}] rank={rank} local={local} size=6 lws=2 group=1 \
             at=10.9.8.7:29555 listen=127.0.0.2"
        );
        assert!(out.stdout.contains(&line), "{line:?} missing: {out:?}");
    }
}

#[test]
fn impossible_multi_node_launches_are_refused() {
    for (flags, says) in [
        (
            &["--nnodes", "2", "--nproc-per-node", "1"][..],
            "--master-port is required with --nnodes 2",
        ),
        (
            &[
                "--nnodes",
                "2",
                "--node-rank",
                "2",
                "--nproc",
                "1",
                "--master-port",
                "29555",
            ][..],
            "--node-rank 2 is out of range",
        ),
        (
            &["--nnodes", "0", "--nproc", "1"][..],
            "--nnodes must be at least 1",
        ),
    ] {
        let out = process::run(Command::new(M8D).arg("launch").args(flags).args([
            "--",
            "sh",
            "-c",
            "echo started",
        ]));
        // A usage error, like a bad value: exit 2, with what is wrong.
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {out:?}");
        assert!(out.stderr.contains(says), "{flags:?}: {out:?}");
        assert!(!out.stdout.contains("started"), "{flags:?}: a rank ran: {out:?}");
    }
    // A node address must be an IP address (a usage error).
    let out = process::run(Command::new(M8D).args([
        "launch",
        "--nproc",
        "1",
        "--node-addr",
        "node-1",
        "--",
        "true",
    ]));
    assert_eq!(out.status.code(), Some(2), "{out:?}");
}
