//! [`WorldConfig`]: everything needed to join one world, with defaults, and
//! [`WorldConfig::from_env`] for processes started by a launcher (`m8d
//! launch`, torchrun and friends) that sets `RANK`, `LOCAL_RANK`,
//! `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT`.

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
    /// handles, finish). An operation still pending at its deadline means the
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
}

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
        }
    }

    /// Reads `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` (required),
    /// `LOCAL_RANK` (default 0), and the optional `MULTIWORLD_BACKEND` (tcp or
    /// nccl), `MULTIWORLD_LISTEN_HOST` and `MULTIWORLD_SECRET` from the
    /// process environment.
    pub fn from_env(name: impl AsRef<str>) -> Result<WorldConfig, ConfigError> {
        let vars: HashMap<String, String> = std::env::vars().collect();
        WorldConfig::from_vars(name, &vars)
    }

    /// [`from_env`](Self::from_env) over an explicit map (testable without
    /// touching the process environment).
    pub fn from_vars(
        name: impl AsRef<str>,
        vars: &HashMap<String, String>,
    ) -> Result<WorldConfig, ConfigError> {
        let get = |key: &'static str| vars.get(key).map(|v| v.trim()).filter(|v| !v.is_empty());
        let number = |key: &'static str| -> Result<u32, ConfigError> {
            let v = get(key).ok_or(ConfigError::Missing(key))?;
            v.parse().map_err(|e| ConfigError::Invalid {
                what: key,
                value: v.to_string(),
                why: format!("{e}"),
            })
        };
        let rank = number("RANK")?;
        let size = number("WORLD_SIZE")?;
        let local_rank = match get("LOCAL_RANK") {
            Some(_) => number("LOCAL_RANK")?,
            None => 0,
        };
        let addr = get("MASTER_ADDR").ok_or(ConfigError::Missing("MASTER_ADDR"))?;
        let port = get("MASTER_PORT").ok_or(ConfigError::Missing("MASTER_PORT"))?;
        let port: u16 = port.parse().map_err(|e| ConfigError::Invalid {
            what: "MASTER_PORT",
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

#[cfg(test)]
mod tests {
    use super::*;
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
