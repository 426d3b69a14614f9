//! [`WorldConfig`]: everything needed to join one world, with defaults, and
//! [`WorldConfig::from_env`] for processes started by a launcher: `m8d
//! launch` and torchrun (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`), Slurm's `srun`
//! (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`), Open MPI's `mpirun`
//! (`OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`,
//! `OMPI_COMM_WORLD_LOCAL_RANK`) or a Kubernetes indexed Job
//! (`JOB_COMPLETION_INDEX`, with `WORLD_SIZE`), each with `MASTER_ADDR` and
//! `MASTER_PORT` naming the world's store.

use std::{collections::HashMap, net::IpAddr, time::Duration};

use multiworld_types::{Rank, Secret, WorldName};

use crate::watchdog::WatchdogConfig;

/// Which communicator carries a world's tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Backend {
    /// TCP between the ranks, for host memory (works everywhere).
    #[default]
    Tcp,
    /// NCCL, for GPU memory (needs the `nccl` feature and a GPU at run time).
    Nccl,
}

impl std::str::FromStr for Backend {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Backend, ConfigError> {
        match s.to_ascii_lowercase().as_str() {
            "tcp" | "gloo" => Ok(Backend::Tcp),
            "nccl" => Ok(Backend::Nccl),
            other => Err(ConfigError::Invalid {
                what: "backend",
                value: other.to_string(),
                why: "expected tcp or nccl".into(),
            }),
        }
    }
}

/// A configuration that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A required environment variable is not set.
    #[error("environment variable {0} is not set")]
    Missing(&'static str),
    /// None of the launchers' variables is set, so this process's rank and
    /// the world's size are unknown; the message names every set of
    /// variables [`WorldConfig::from_env`] looks for.
    #[error("no launcher variables found: {LAUNCHERS}")]
    NoLauncher,
    /// A value is malformed or out of range.
    #[error("invalid {what} '{value}': {why}")]
    Invalid {
        /// Which setting.
        what: &'static str,
        /// The value given.
        value: String,
        /// What is wrong with it.
        why: String,
    },
}

/// What [`ConfigError::NoLauncher`] says: every set of variables
/// [`WorldConfig::from_env`] looks for, in the order it looks.
const LAUNCHERS: &str = "set RANK and WORLD_SIZE (m8d launch, torchrun), \
    or SLURM_PROCID and SLURM_NTASKS (Slurm srun), \
    or OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE (Open MPI mpirun), \
    or JOB_COMPLETION_INDEX and WORLD_SIZE (Kubernetes indexed Job); \
    and MASTER_ADDR and MASTER_PORT (where rank 0 hosts the world's store)";

/// One launcher's variables: which one gives the rank, the size and the
/// local rank (optional, default 0).
struct LauncherVars {
    rank: &'static str,
    size: &'static str,
    local_rank: Option<&'static str>,
}

/// The launchers [`WorldConfig::from_env`] understands, in the order it
/// looks for them: the first whose rank variable is set decides.
const LAUNCHER_VARS: [LauncherVars; 4] = [
    // m8d launch, torchrun (and anything that follows their contract).
    LauncherVars {
        rank: "RANK",
        size: "WORLD_SIZE",
        local_rank: Some("LOCAL_RANK"),
    },
    // Slurm: every task `srun` starts.
    LauncherVars {
        rank: "SLURM_PROCID",
        size: "SLURM_NTASKS",
        local_rank: Some("SLURM_LOCALID"),
    },
    // Open MPI's `mpirun`.
    LauncherVars {
        rank: "OMPI_COMM_WORLD_RANK",
        size: "OMPI_COMM_WORLD_SIZE",
        local_rank: Some("OMPI_COMM_WORLD_LOCAL_RANK"),
    },
    // A Kubernetes indexed Job: the pod's completion index is its rank; the
    // size is the Job's `completions`, which the pod spec passes as
    // WORLD_SIZE (Kubernetes sets no variable for it). One rank per pod, so
    // the local rank is LOCAL_RANK if the pod sets it, else 0.
    LauncherVars {
        rank: "JOB_COMPLETION_INDEX",
        size: "WORLD_SIZE",
        local_rank: Some("LOCAL_RANK"),
    },
];

/// This process's place in the world, as its launcher's variables say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Placement {
    rank: u32,
    size: u32,
    local_rank: u32,
}

/// Finds this process's rank, the world's size and its local rank in the
/// first launcher's variables that are set (see [`LAUNCHER_VARS`]). With
/// none set, `WORLD_SIZE` alone means a torchrun-style launch missing
/// `RANK`; nothing at all is [`ConfigError::NoLauncher`].
fn placement(vars: &HashMap<String, String>) -> Result<Placement, ConfigError> {
    let get = |key: &'static str| vars.get(key).map(|v| v.trim()).filter(|v| !v.is_empty());
    let number = |key: &'static str| -> Result<u32, ConfigError> {
        let v = get(key).ok_or(ConfigError::Missing(key))?;
        v.parse().map_err(|e| ConfigError::Invalid {
            what: key,
            value: v.to_string(),
            why: format!("{e}"),
        })
    };
    let Some(launcher) = LAUNCHER_VARS.iter().find(|l| get(l.rank).is_some()) else {
        return Err(if get("WORLD_SIZE").is_some() {
            ConfigError::Missing("RANK")
        } else {
            ConfigError::NoLauncher
        });
    };
    let rank = number(launcher.rank)?;
    let size = number(launcher.size)?;
    if size == 0 {
        return Err(ConfigError::Invalid {
            what: launcher.size,
            value: "0".into(),
            why: "the world size must be at least 1".into(),
        });
    }
    if rank >= size {
        return Err(ConfigError::Invalid {
            what: launcher.rank,
            value: rank.to_string(),
            why: format!("must be below the world size {size} ({})", launcher.size),
        });
    }
    let local_rank = match launcher.local_rank {
        Some(key) if get(key).is_some() => number(key)?,
        _ => 0,
    };
    Ok(Placement {
        rank,
        size,
        local_rank,
    })
}

/// How to join one world. `WorldConfig::new` fills in the defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorldConfig {
    /// The world's name (unique among the worlds this process is in).
    pub name: WorldName,
    /// This process's rank in the world, `0..size`.
    pub rank: Rank,
    /// Number of members.
    pub size: u32,
    /// This process's rank on its machine (informational; picks a GPU for NCCL).
    pub local_rank: u32,
    /// Where the world's store is, `host:port`. The rank that hosts it
    /// (`host_store`) listens there; the others connect there.
    pub store_addr: String,
    /// Whether this rank hosts the world's store (default: rank 0 does).
    pub host_store: bool,
    /// The address this member's connections to the other members listen on
    /// and are published at (`MULTIWORLD_LISTEN_HOST`). Default: the address
    /// of this host's interface that reaches the store (loopback when the
    /// store is on loopback), so members on other hosts can connect back.
    pub listen_host: Option<IpAddr>,
    /// Which communicator to use.
    pub backend: Backend,
    /// The world's shared secret, if it has one (store and transport
    /// connections must prove it).
    pub secret: Option<Secret>,
    /// How long joining may take before it fails (default 30 s).
    pub join_timeout: Duration,
    /// Deadline of every operation of the world (send, receive, their
    /// handles, collectives; not `finish`, which has its own timeout
    /// argument). An operation still pending at its deadline means the
    /// world is not healthy: the watchdog breaks it with
    /// `BreakCause::OpDeadline`, failing that operation and every other one.
    /// Default none: heartbeats already bound how long a dead or frozen world
    /// can hold an operation.
    pub op_timeout: Option<Duration>,
    /// Failure detection timing.
    pub watchdog: WatchdogConfig,
    /// NCCL worlds: how long tearing the world down waits for
    /// `ncclCommAbort` before it quarantines (leaks) the communicator and
    /// reports `WorldEvent::Quarantined` (default 5 s).
    pub nccl_abort_deadline: Duration,
    /// Largest message read off a socket before its receive is posted (the
    /// transport's `eager_limit`; default [`DEFAULT_READ_AHEAD`], 16 KiB).
    /// Larger messages wait in the socket and land in the receive's buffer
    /// without a copy (unless a receive waits behind them on the same
    /// connection). Messages above 16 KiB are read ahead only while a peer's
    /// early bytes stay within 1 MiB, so a value above 1 MiB acts as 1 MiB.
    /// More (256 KiB) streams messages of tens of KiB faster, but a receive
    /// of a message read ahead completes without waiting: a task that
    /// computes for long per message then keeps its runtime thread for up to
    /// 16 messages (receives of messages already here yield every 16 in a
    /// row), delaying the heartbeats and other worlds' tasks behind it by
    /// that much work. Raise it where the work per message runs off the
    /// runtime threads (the Python package does: it reads 256 KiB ahead).
    /// `docs/protocol.md`, "Receives yield".
    pub read_ahead: usize,
    /// NCCL worlds: check every device call against the other members'
    /// before it reaches NCCL, which takes its arguments on trust (members
    /// that disagree make it hang until the device deadline breaks the
    /// world, or compute wrong data). A collective gathers every member's
    /// description of it (which collective, dtype, element count, root,
    /// reduce op) over the world's TCP mesh, and members that disagree all
    /// fail with the same `WorldError::Mismatch`; a send announces its
    /// message over TCP (without waiting), and a receive waits for that and
    /// fails with `Mismatch` if it disagrees (the message is then drained
    /// into scratch device memory, so the world goes on). Costs a small TCP
    /// exchange per call, so it is off by default (as torch.distributed's
    /// NCCL checks are); turn it on while developing. The check waits on
    /// the calling thread (`block_in_place` on a runtime worker: the
    /// calling task's other branches, in a `join!` or `select!`, are not
    /// polled meanwhile) for at most the device operations' deadline
    /// (`op_timeout`, else 60 s), past which the world breaks with
    /// `OpDeadline`; it needs a multi-threaded runtime (`InvalidArgument`
    /// otherwise). Every member must set it alike (a member without it
    /// would go straight to NCCL while the others wait in the check): a
    /// join whose setting differs from rank 0's fails. TCP worlds always
    /// check their own calls.
    pub check_device_calls: bool,
}

/// Default of [`WorldConfig::read_ahead`]: the transport's default `eager_limit`.
pub const DEFAULT_READ_AHEAD: usize = multiworld_tcp::DEFAULT_EAGER_LIMIT;

/// A world of one (`"world"`, rank 0 of 1) whose store rank 0 hosts at
/// `127.0.0.1:29500` (torch.distributed's customary `MASTER_PORT`), with
/// every other setting at its default; set the fields that differ, or start
/// from [`WorldConfig::new`] or [`WorldConfig::from_env`].
impl Default for WorldConfig {
    fn default() -> Self {
        // "world" is a valid name (short, printable), so this cannot fail.
        #[allow(clippy::expect_used)]
        let name = WorldName::new("world").expect("a valid literal name");
        WorldConfig::with_defaults(name, Rank(0), 1, "127.0.0.1:29500".into())
    }
}

impl WorldConfig {
    /// A configuration with the defaults: TCP backend, rank 0 hosts the store
    /// at `store_addr`, no secret, 30 s to join, default watchdog. Refuses a
    /// name that is not a valid [`WorldName`], a size of 0, a rank not below
    /// the size and an empty store address.
    pub fn new(
        name: impl AsRef<str>,
        rank: impl Into<Rank>,
        size: u32,
        store_addr: impl Into<String>,
    ) -> Result<WorldConfig, ConfigError> {
        let name = name.as_ref();
        let name = WorldName::new(name).map_err(|e| ConfigError::Invalid {
            what: "world name",
            value: name.to_string(),
            why: e.to_string(),
        })?;
        let config = WorldConfig::with_defaults(name, rank.into(), size, store_addr.into());
        config.validate()?;
        Ok(config)
    }

    fn with_defaults(name: WorldName, rank: Rank, size: u32, store_addr: String) -> WorldConfig {
        WorldConfig {
            name,
            rank,
            size,
            local_rank: 0,
            store_addr,
            host_store: rank == Rank(0),
            listen_host: None,
            backend: Backend::Tcp,
            secret: None,
            join_timeout: Duration::from_secs(30),
            op_timeout: None,
            nccl_abort_deadline: Duration::from_secs(5),
            watchdog: WatchdogConfig::default(),
            read_ahead: DEFAULT_READ_AHEAD,
            check_device_calls: false,
        }
    }

    /// Reads this process's place in the world from the process
    /// environment, as the first of these launchers that set it describes it:
    ///
    /// | launcher | rank | size | local rank (default 0) |
    /// |---|---|---|---|
    /// | `m8d launch`, torchrun | `RANK` | `WORLD_SIZE` | `LOCAL_RANK` |
    /// | Slurm `srun` | `SLURM_PROCID` | `SLURM_NTASKS` | `SLURM_LOCALID` |
    /// | Open MPI `mpirun` | `OMPI_COMM_WORLD_RANK` | `OMPI_COMM_WORLD_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK` |
    /// | Kubernetes indexed Job | `JOB_COMPLETION_INDEX` | `WORLD_SIZE` (set it to the Job's `completions`) | `LOCAL_RANK` |
    ///
    /// `MASTER_ADDR` and `MASTER_PORT` (where rank 0 hosts the world's
    /// store) are required with every launcher: only torchrun and `m8d
    /// launch` set them, so under Slurm, Open MPI and Kubernetes the job sets
    /// them (`docs/deploy.md` shows how). `MULTIWORLD_STORE_PORT`, when set,
    /// replaces `MASTER_PORT`; it is required under torchrun when torchrun's
    /// own store already listens at `MASTER_PORT`
    /// (`TORCHELASTIC_USE_AGENT_STORE=True`, its default). Optional:
    /// `MULTIWORLD_BACKEND` (tcp or nccl), `MULTIWORLD_LISTEN_HOST` and
    /// `MULTIWORLD_SECRET`.
    ///
    /// A variable of the chosen launcher that is missing or malformed is
    /// named in the error ([`ConfigError::Missing`],
    /// [`ConfigError::Invalid`]); with no launcher's variables at all the
    /// error ([`ConfigError::NoLauncher`]) names every set looked for.
    pub fn from_env(name: impl AsRef<str>) -> Result<WorldConfig, ConfigError> {
        WorldConfig::from_vars(name, &env_map(std::env::vars_os()))
    }

    /// [`from_env`](Self::from_env) over an explicit map (testable without
    /// touching the process environment).
    pub fn from_vars(
        name: impl AsRef<str>,
        vars: &HashMap<String, String>,
    ) -> Result<WorldConfig, ConfigError> {
        let get = |key: &'static str| vars.get(key).map(|v| v.trim()).filter(|v| !v.is_empty());
        let Placement {
            rank,
            size,
            local_rank,
        } = placement(vars)?;
        let addr = get("MASTER_ADDR").ok_or(ConfigError::Missing("MASTER_ADDR"))?;
        // torchrun's agent on the first node hosts its own store at
        // MASTER_PORT and says so: the world's store needs another port.
        let (port_var, port) = match get("MULTIWORLD_STORE_PORT") {
            Some(port) => ("MULTIWORLD_STORE_PORT", port),
            None => {
                let master_port = get("MASTER_PORT").ok_or(ConfigError::Missing("MASTER_PORT"))?;
                if get("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
                    return Err(ConfigError::Invalid {
                        what: "MASTER_PORT",
                        value: master_port.to_string(),
                        why: "torchrun's own store listens there (TORCHELASTIC_USE_AGENT_STORE=True): \
                              set MULTIWORLD_STORE_PORT to another port, the same on every node and \
                              open between them, for the world's store"
                            .into(),
                    });
                }
                ("MASTER_PORT", master_port)
            }
        };
        let port: u16 = port.parse().map_err(|e| ConfigError::Invalid {
            what: port_var,
            value: port.to_string(),
            why: format!("{e}"),
        })?;
        // An IPv6 literal needs brackets in host:port form.
        let host = if addr.contains(':') && !addr.starts_with('[') {
            format!("[{addr}]")
        } else {
            addr.to_string()
        };
        let mut config = WorldConfig::new(name, rank, size, format!("{host}:{port}"))?;
        config.local_rank = local_rank;
        if let Some(b) = get("MULTIWORLD_BACKEND") {
            config.backend = b.parse()?;
        }
        if let Some(h) = get("MULTIWORLD_LISTEN_HOST") {
            config.listen_host = Some(h.parse().map_err(|e| ConfigError::Invalid {
                what: "MULTIWORLD_LISTEN_HOST",
                value: h.to_string(),
                why: format!("{e}"),
            })?);
        }
        if let Some(s) = vars.get("MULTIWORLD_SECRET").filter(|s| !s.is_empty()) {
            config.secret = Some(Secret::new(s));
        }
        config.validate()?;
        Ok(config)
    }

    /// Refuses configurations that cannot work.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |what: &'static str, value: String, why: &str| ConfigError::Invalid {
            what,
            value,
            why: why.to_string(),
        };
        if self.size == 0 {
            return Err(invalid("world size", "0".into(), "must be at least 1"));
        }
        if self.rank.0 >= self.size {
            return Err(invalid(
                "rank",
                self.rank.to_string(),
                &format!("must be below the world size {}", self.size),
            ));
        }
        if self.store_addr.is_empty() {
            return Err(invalid("store address", String::new(), "must not be empty"));
        }
        self.watchdog
            .validate()
            .map_err(|why| invalid("watchdog timing", format!("{:?}", self.watchdog), &why))?;
        Ok(())
    }
}

/// The environment as text, for [`WorldConfig::from_env`]. A variable that
/// is not UTF-8 must not stop a launch (`std::env::vars` panics on one): a
/// name that is not is left out (no variable read here has such a name), a
/// value that is not is kept with U+FFFD for its bad bytes, so that a
/// malformed `RANK` is reported as malformed rather than missing.
fn env_map(vars: impl Iterator<Item = (std::ffi::OsString, std::ffi::OsString)>) -> HashMap<String, String> {
    vars.filter_map(|(k, v)| Some((k.into_string().ok()?, v.to_string_lossy().into_owned())))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_environment_may_hold_variables_that_are_not_utf8() {
        use std::ffi::OsString;
        use std::os::unix::ffi::OsStringExt;
        let vars = vec![
            (OsString::from("RANK"), OsString::from("1")),
            (OsString::from_vec(b"BAD\xffNAME".to_vec()), OsString::from("x")),
            (OsString::from("OTHER"), OsString::from_vec(b"v\xff".to_vec())),
            (
                OsString::from("WORLD_SIZE"),
                OsString::from_vec(b"2\xff".to_vec()),
            ),
        ];
        let map = env_map(vars.into_iter());
        assert_eq!(map["RANK"], "1");
        assert_eq!(map["OTHER"], "v\u{fffd}");
        assert!(!map.keys().any(|k| k.starts_with("BAD")));
        // A malformed value is reported as malformed, naming the variable.
        let e = WorldConfig::from_vars("w", &map).unwrap_err().to_string();
        assert!(e.contains("WORLD_SIZE"), "{e}");
    }
    use multiworld_types::{Rank, Secret};

    fn vars(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    const BASE: [(&str, &str); 4] = [
        ("RANK", "1"),
        ("WORLD_SIZE", "3"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ];

    #[test]
    fn reads_the_launcher_variables() {
        let mut v = vars(&BASE);
        v.insert("LOCAL_RANK".into(), "1".into());
        let c = WorldConfig::from_vars("w", &v).unwrap();
        assert_eq!((c.rank, c.size, c.local_rank), (Rank(1), 3, 1));
        assert_eq!(c.store_addr, "127.0.0.1:29500");
        assert!(!c.host_store, "only rank 0 hosts by default");
        assert_eq!(c.backend, Backend::Tcp);
        assert_eq!(c.secret, None);
    }

    #[test]
    fn rank_zero_hosts_and_options_are_read() {
        let mut v = vars(&BASE);
        v.insert("RANK".into(), "0".into());
        v.insert("MULTIWORLD_BACKEND".into(), "NCCL".into());
        v.insert("MULTIWORLD_SECRET".into(), "s".into());
        v.insert("MULTIWORLD_LISTEN_HOST".into(), "10.1.2.3".into());
        let c = WorldConfig::from_vars("w", &v).unwrap();
        assert!(c.host_store);
        assert_eq!(c.backend, Backend::Nccl);
        assert_eq!(c.secret, Some(Secret::new("s")));
        assert_eq!(c.listen_host, Some("10.1.2.3".parse().unwrap()));
        v.insert("MULTIWORLD_LISTEN_HOST".into(), "not-an-ip".into());
        assert!(matches!(
            WorldConfig::from_vars("w", &v),
            Err(ConfigError::Invalid {
                what: "MULTIWORLD_LISTEN_HOST",
                ..
            })
        ));
    }

    #[test]
    fn ipv6_addresses_get_brackets() {
        let mut v = vars(&BASE);
        v.insert("MASTER_ADDR".into(), "::1".into());
        assert_eq!(WorldConfig::from_vars("w", &v).unwrap().store_addr, "[::1]:29500");
    }

    #[test]
    fn missing_and_bad_values_are_named() {
        for key in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"] {
            let mut v = vars(&BASE);
            v.remove(key);
            assert_eq!(WorldConfig::from_vars("w", &v), Err(ConfigError::Missing(key)));
        }
        let mut v = vars(&BASE);
        v.insert("RANK".into(), "3".into());
        let err = WorldConfig::from_vars("w", &v).unwrap_err().to_string();
        assert!(err.contains("below the world size 3"), "{err}");
        let mut v = vars(&BASE);
        v.insert("MASTER_PORT".into(), "70000".into());
        assert!(
            WorldConfig::from_vars("w", &v)
                .unwrap_err()
                .to_string()
                .contains("MASTER_PORT")
        );
        let mut v = vars(&BASE);
        v.insert("RANK".into(), "one".into());
        assert!(matches!(
            WorldConfig::from_vars("w", &v),
            Err(ConfigError::Invalid { what: "RANK", .. })
        ));
        let mut v = vars(&BASE);
        v.insert("MULTIWORLD_BACKEND".into(), "mpi".into());
        assert!(WorldConfig::from_vars("w", &v).is_err());
    }

    /// `MASTER_ADDR` and `MASTER_PORT`, which every launcher needs, plus `pairs`.
    fn with_master(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        let mut v = vars(&[("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "29500")]);
        v.extend(vars(pairs));
        v
    }

    fn placed(v: &HashMap<String, String>) -> (u32, u32, u32) {
        let c = WorldConfig::from_vars("w", v).unwrap();
        assert_eq!(c.store_addr, "10.0.0.1:29500");
        (c.rank.0, c.size, c.local_rank)
    }

    /// Each launcher's variables, as the launcher sets them.
    const SLURM: [(&str, &str); 3] = [
        ("SLURM_PROCID", "5"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_LOCALID", "1"),
    ];
    const OMPI: [(&str, &str); 3] = [
        ("OMPI_COMM_WORLD_RANK", "2"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
    ];
    const K8S: [(&str, &str); 2] = [("JOB_COMPLETION_INDEX", "3"), ("WORLD_SIZE", "4")];

    #[test]
    fn reads_every_launchers_variables() {
        // torchrun / m8d launch (LOCAL_RANK and LOCAL_WORLD_SIZE, GROUP_RANK
        // are informational).
        let torchrun = [
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("GROUP_RANK", "1"),
        ];
        assert_eq!(placed(&with_master(&torchrun)), (3, 4, 1));
        assert_eq!(placed(&with_master(&SLURM)), (5, 8, 1));
        assert_eq!(placed(&with_master(&OMPI)), (2, 4, 0));
        assert_eq!(placed(&with_master(&K8S)), (3, 4, 0));
        // A pod running several ranks says so with LOCAL_RANK.
        let mut v = with_master(&K8S);
        v.insert("LOCAL_RANK".into(), "1".into());
        assert_eq!(placed(&v), (3, 4, 1));
        // The local rank is optional with every launcher.
        let mut v = with_master(&SLURM);
        v.remove("SLURM_LOCALID");
        assert_eq!(placed(&v), (5, 8, 0));
        let mut v = with_master(&OMPI);
        v.remove("OMPI_COMM_WORLD_LOCAL_RANK");
        assert_eq!(placed(&v), (2, 4, 0));
        // Surrounding blanks are ignored, as for every variable.
        let v = with_master(&[("SLURM_PROCID", " 1 "), ("SLURM_NTASKS", "2\n")]);
        assert_eq!(placed(&v), (1, 2, 0));
    }

    #[test]
    fn explicit_rank_wins_then_slurm_then_open_mpi_then_kubernetes() {
        // A launcher started inside another (m8d launch or torchrun under
        // srun, one per node) sets RANK: its ranks must not read the outer
        // task's variables.
        let mut v = with_master(&SLURM);
        v.extend(with_master(&OMPI));
        v.extend(with_master(&[("JOB_COMPLETION_INDEX", "0")]));
        v.extend(vars(&[("RANK", "6"), ("WORLD_SIZE", "16"), ("LOCAL_RANK", "2")]));
        assert_eq!(placed(&v), (6, 16, 2));
        v.remove("RANK");
        // WORLD_SIZE is still set (for the Kubernetes entry): Slurm wins.
        assert_eq!(placed(&v), (5, 8, 1));
        v.remove("SLURM_PROCID");
        assert_eq!(placed(&v), (2, 4, 0));
        v.remove("OMPI_COMM_WORLD_RANK");
        assert_eq!(placed(&v), (0, 16, 2));
        // An empty rank variable counts as unset.
        let mut v = with_master(&K8S);
        v.insert("SLURM_PROCID".into(), " ".into());
        assert_eq!(placed(&v), (3, 4, 0));
    }

    #[test]
    fn a_launchers_missing_variable_is_named() {
        for (launcher, size) in [
            (&SLURM[..], "SLURM_NTASKS"),
            (&OMPI[..], "OMPI_COMM_WORLD_SIZE"),
            (&K8S[..], "WORLD_SIZE"),
        ] {
            let mut v = with_master(launcher);
            v.remove(size);
            assert_eq!(WorldConfig::from_vars("w", &v), Err(ConfigError::Missing(size)));
            // MASTER_ADDR and MASTER_PORT are needed with every launcher.
            for key in ["MASTER_ADDR", "MASTER_PORT"] {
                let mut v = with_master(launcher);
                v.remove(key);
                assert_eq!(WorldConfig::from_vars("w", &v), Err(ConfigError::Missing(key)));
            }
        }
    }

    #[test]
    fn a_launchers_bad_variable_is_named() {
        // (a launcher's variables, the one made bad, its bad value)
        type Case = (
            &'static [(&'static str, &'static str)],
            &'static str,
            &'static str,
        );
        let cases: [Case; 9] = [
            (&SLURM, "SLURM_PROCID", "x"),
            (&SLURM, "SLURM_NTASKS", "-1"),
            (&SLURM, "SLURM_LOCALID", "1.5"),
            (&OMPI, "OMPI_COMM_WORLD_RANK", "two"),
            (&OMPI, "OMPI_COMM_WORLD_SIZE", "4x"),
            (&OMPI, "OMPI_COMM_WORLD_LOCAL_RANK", "-3"),
            (&K8S, "JOB_COMPLETION_INDEX", "a"),
            (&K8S, "WORLD_SIZE", "99999999999"),
            (&K8S, "LOCAL_RANK", "z"),
        ];
        for (launcher, key, bad) in cases {
            let mut v = with_master(launcher);
            v.insert(key.into(), bad.into());
            let err = WorldConfig::from_vars("w", &v).unwrap_err();
            assert!(
                matches!(&err, ConfigError::Invalid { what, value, .. } if *what == key && value == bad),
                "{key}={bad}: {err:?}"
            );
            assert!(err.to_string().contains(key), "{err}");
        }
        // A rank at or past the size, and a size of 0, name the launcher's
        // variables.
        for (launcher, rank, size) in [
            (&SLURM[..], "SLURM_PROCID", "SLURM_NTASKS"),
            (&OMPI[..], "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
            (&K8S[..], "JOB_COMPLETION_INDEX", "WORLD_SIZE"),
        ] {
            let mut v = with_master(launcher);
            v.insert(rank.into(), "4".into());
            v.insert(size.into(), "4".into());
            let err = WorldConfig::from_vars("w", &v).unwrap_err().to_string();
            assert!(err.contains(rank) && err.contains(size), "{err}");
            assert!(err.contains("below the world size 4"), "{err}");
            v.insert(rank.into(), "0".into());
            v.insert(size.into(), "0".into());
            let err = WorldConfig::from_vars("w", &v).unwrap_err();
            assert!(
                matches!(err, ConfigError::Invalid { what, .. } if what == size),
                "{err:?}"
            );
        }
    }

    #[test]
    fn no_launcher_names_every_variable_looked_for() {
        for v in [with_master(&[]), HashMap::new(), vars(&[("LOCAL_RANK", "0")])] {
            let err = WorldConfig::from_vars("w", &v).unwrap_err();
            assert_eq!(err, ConfigError::NoLauncher);
            let text = err.to_string();
            for key in [
                "RANK",
                "WORLD_SIZE",
                "SLURM_PROCID",
                "SLURM_NTASKS",
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "JOB_COMPLETION_INDEX",
                "MASTER_ADDR",
                "MASTER_PORT",
            ] {
                assert!(text.contains(key), "{key} not named: {text}");
            }
        }
        // WORLD_SIZE alone is a torchrun-style launch that lost RANK.
        let v = with_master(&[("WORLD_SIZE", "2")]);
        assert_eq!(WorldConfig::from_vars("w", &v), Err(ConfigError::Missing("RANK")));
    }

    #[test]
    fn the_store_port_can_differ_from_torchruns() {
        // torchrun's agent hosts its own store at MASTER_PORT and says so.
        let mut v = vars(&BASE);
        v.insert("TORCHELASTIC_USE_AGENT_STORE".into(), "True".into());
        let err = WorldConfig::from_vars("w", &v).unwrap_err();
        assert!(
            matches!(&err, ConfigError::Invalid { what: "MASTER_PORT", value, .. } if value == "29500"),
            "{err:?}"
        );
        assert!(err.to_string().contains("MULTIWORLD_STORE_PORT"), "{err}");
        v.insert("MULTIWORLD_STORE_PORT".into(), "29600".into());
        assert_eq!(
            WorldConfig::from_vars("w", &v).unwrap().store_addr,
            "127.0.0.1:29600"
        );
        // Without torchrun's store, MASTER_PORT is used unless overridden,
        // and the override does not need MASTER_PORT at all.
        v.insert("TORCHELASTIC_USE_AGENT_STORE".into(), "False".into());
        v.remove("MULTIWORLD_STORE_PORT");
        assert_eq!(
            WorldConfig::from_vars("w", &v).unwrap().store_addr,
            "127.0.0.1:29500"
        );
        v.remove("MASTER_PORT");
        v.insert("MULTIWORLD_STORE_PORT".into(), "29601".into());
        assert_eq!(
            WorldConfig::from_vars("w", &v).unwrap().store_addr,
            "127.0.0.1:29601"
        );
        v.insert("MULTIWORLD_STORE_PORT".into(), "port".into());
        assert!(matches!(
            WorldConfig::from_vars("w", &v),
            Err(ConfigError::Invalid {
                what: "MULTIWORLD_STORE_PORT",
                ..
            })
        ));
    }

    #[test]
    fn validation() {
        assert!(WorldConfig::new("w", 0, 1, "x:1").unwrap().validate().is_ok());
        // `new` refuses what `validate` would, and names the setting.
        let refused = |c: Result<WorldConfig, ConfigError>, what: &str| {
            let e = c.unwrap_err().to_string();
            assert!(e.contains(what), "{e}");
        };
        refused(WorldConfig::new("", 0, 1, "x:1"), "world name");
        refused(WorldConfig::new("a\nb", 0, 1, "x:1"), "world name");
        refused(WorldConfig::new("w", 0, 0, "x:1"), "world size");
        refused(WorldConfig::new("w", 2, 2, "x:1"), "rank");
        refused(WorldConfig::new("w", 0, 1, ""), "store address");
        // A configuration edited after `new` is checked again by `validate`
        // (and by `join`).
        let mut c = WorldConfig::new("w", 0, 2, "x:1").unwrap();
        c.rank = Rank(5);
        assert!(c.validate().is_err());
        c.rank = Rank(1);
        c.watchdog.heartbeat_timeout = Duration::from_millis(1);
        assert!(c.validate().unwrap_err().to_string().contains("watchdog"));
    }

    #[test]
    fn the_default_is_a_valid_world_of_one_hosting_its_store() {
        let c = WorldConfig::default();
        assert!(c.validate().is_ok());
        assert_eq!((c.name.as_str(), c.rank, c.size), ("world", Rank(0), 1));
        assert!(c.host_store);
        assert_eq!(c.store_addr, "127.0.0.1:29500");
        assert_eq!(c.backend, Backend::Tcp);
        assert!(c.secret.is_none() && c.op_timeout.is_none());
    }
}
