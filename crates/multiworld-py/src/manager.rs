//! `Manager` (the native half of `multiworld_rs.WorldManager`), its event
//! stream and events.

use std::time::Duration;

use multiworld::{Backend, Secret, WatchdogConfig, WorldConfig, WorldEvent, WorldManager, WorldState};
use pyo3::{exceptions::PyRuntimeError, prelude::*};
use tokio::sync::broadcast;

use crate::{errors, runtime, world::World};

/// One row of `Manager.worlds()`: name, generation, rank, size, state, cause.
type InfoRow = (String, u64, u32, u32, &'static str, Option<&'static str>);

/// Owns every world of this process (see `multiworld_rs.WorldManager`).
#[pyclass(module = "multiworld_rs._native", frozen)]
pub struct Manager {
    inner: Option<WorldManager>,
}

impl Drop for Manager {
    fn drop(&mut self) {
        if let Some(m) = self.inner.take() {
            runtime::release(m);
        }
    }
}

/// The settings `join` and `join_env` share.
/// (Passed from Python as a dict.)
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
pub struct JoinOptions {
    secret: Option<Vec<u8>>,
    timeout: f64,
    op_timeout: Option<f64>,
    backend: Option<String>,
    host_store: Option<bool>,
    heartbeat_interval: Option<f64>,
    heartbeat_timeout: Option<f64>,
    /// The CUDA device of an NCCL world (`WorldConfig::local_rank`).
    device: Option<u32>,
    /// `WorldConfig::read_ahead` (the Python side passes its own default).
    read_ahead: Option<usize>,
    /// `WorldConfig::check_device_calls`.
    check_device_calls: Option<bool>,
}

impl JoinOptions {
    fn apply(self, config: &mut WorldConfig) -> PyResult<()> {
        if let Some(b) = &self.backend {
            config.backend = b
                .parse::<Backend>()
                .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
        }
        config.secret = self.secret.map(Secret::new);
        config.join_timeout =
            runtime::seconds("timeout", Some(self.timeout))?.unwrap_or(Duration::from_secs(30));
        config.op_timeout = runtime::seconds("op_timeout", self.op_timeout)?;
        if let Some(h) = self.host_store {
            config.host_store = h;
        }
        let mut wd = WatchdogConfig::default();
        if let Some(i) = runtime::seconds("heartbeat_interval", self.heartbeat_interval)? {
            wd.heartbeat_interval = i;
        }
        if let Some(t) = runtime::seconds("heartbeat_timeout", self.heartbeat_timeout)? {
            wd.heartbeat_timeout = t;
        }
        config.watchdog = wd;
        if let Some(d) = self.device {
            config.local_rank = d;
        }
        if let Some(c) = self.check_device_calls {
            config.check_device_calls = c;
        }
        if let Some(r) = self.read_ahead {
            config.read_ahead = r;
        }
        Ok(())
    }
}

fn config_error(py: Python<'_>, e: multiworld::ConfigError) -> PyErr {
    errors::world(py, multiworld::WorldError::Config(e), None)
}

impl Manager {
    /// The manager, for a method of this handle; in a forked child
    /// `ForkedProcessError`, also for the methods that only read state.
    fn m(&self) -> PyResult<&WorldManager> {
        runtime::runtime()?;
        self.inner
            .as_ref()
            .ok_or_else(|| PyRuntimeError::new_err("the manager was released"))
    }

    fn join_config(&self, py: Python<'_>, config: WorldConfig) -> PyResult<World> {
        let m = self.m()?;
        let timeout = config.join_timeout;
        runtime::wait(py, m.join(config))?
            .map(World::new)
            .map_err(|e| errors::join(py, e, timeout))
    }
}

#[pymethods]
impl Manager {
    #[new]
    fn py_new() -> PyResult<Self> {
        let inner = runtime::enter(WorldManager::default)?;
        Ok(Manager { inner: Some(inner) })
    }

    /// Every metric of the process and its worlds, in Prometheus' text format.
    fn metrics_text(&self) -> PyResult<String> {
        Ok(self.m()?.metrics_text())
    }

    /// Where the metrics endpoint listens (`MULTIWORLD_METRICS_ADDR`), if served.
    fn metrics_addr(&self) -> PyResult<Option<String>> {
        Ok(self.m()?.metrics_addr().map(|a| a.to_string()))
    }

    /// The flight record of the world `name` now: `(json, timeline)`, or
    /// `None` if this process is not a member.
    fn flight_record(&self, name: &str) -> PyResult<Option<(String, String)>> {
        Ok(match self.m()?.flight_record(name) {
            Some(r) => Some((
                serde_json::to_string(&r)
                    .map_err(|e| pyo3::exceptions::PyRuntimeError::new_err(e.to_string()))?,
                r.timeline(),
            )),
            None => None,
        })
    }

    /// Hosts a store at `bind` (`"127.0.0.1:0"`: any free port); returns the
    /// address it listens on.
    fn serve_store(&self, py: Python<'_>, bind: &str) -> PyResult<String> {
        let m = self.m()?;
        runtime::wait(py, m.serve_store(bind))?
            .map(|a| a.to_string())
            .map_err(|e| errors::world(py, e, None))
    }

    /// Joins a world (see the Python wrapper for the arguments).
    fn join(
        &self,
        py: Python<'_>,
        name: &str,
        rank: u32,
        size: u32,
        store: &str,
        options: JoinOptions,
    ) -> PyResult<World> {
        let mut config = WorldConfig::new(name, rank, size, store).map_err(|e| config_error(py, e))?;
        options.apply(&mut config)?;
        config.validate().map_err(|e| config_error(py, e))?;
        self.join_config(py, config)
    }

    /// Joins a world described by RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
    fn join_env(&self, py: Python<'_>, name: &str, options: JoinOptions) -> PyResult<World> {
        let mut config = WorldConfig::from_env(name).map_err(|e| config_error(py, e))?;
        // What the environment set stays unless the call says otherwise.
        let env_secret = config.secret.take();
        let explicit_secret = options.secret.is_some();
        options.apply(&mut config)?;
        if !explicit_secret {
            config.secret = env_secret;
        }
        config.validate().map_err(|e| config_error(py, e))?;
        self.join_config(py, config)
    }

    /// The world of that name, if this process is a member.
    fn world(&self, name: &str) -> PyResult<Option<World>> {
        Ok(self.m()?.world(name).map(World::new))
    }

    /// `(name, generation, rank, size, state, cause)` of every world.
    fn worlds(&self) -> PyResult<Vec<InfoRow>> {
        Ok(self
            .m()?
            .worlds()
            .into_iter()
            .map(|i| {
                let cause = match &i.state {
                    WorldState::Broken(c) => Some(c.kind()),
                    _ => None,
                };
                (
                    i.name.to_string(),
                    i.generation.0,
                    i.rank.0,
                    i.size,
                    i.state.label(),
                    cause,
                )
            })
            .collect())
    }

    /// Leaves a world (without the goodbye of `World.finish`).
    fn leave(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        let m = self.m()?;
        runtime::wait(py, m.leave(name))?.map_err(|e| errors::world(py, e, None))
    }

    /// Leaves every world and stops the hosted stores.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        let m = self.m()?;
        runtime::wait(py, m.shutdown())
    }

    /// A new subscription to the manager's events (from now on).
    fn events(&self) -> PyResult<EventStream> {
        let rx = self.m()?.events();
        Ok(EventStream {
            rx: Some(tokio::sync::Mutex::new(rx)),
        })
    }
}

/// A subscription to a manager's events.
#[pyclass(module = "multiworld_rs._native", frozen)]
pub struct EventStream {
    rx: Option<tokio::sync::Mutex<broadcast::Receiver<WorldEvent>>>,
}

impl Drop for EventStream {
    fn drop(&mut self) {
        if let Some(rx) = self.rx.take() {
            runtime::release(rx);
        }
    }
}

#[pymethods]
impl EventStream {
    /// The next event, waiting at most `timeout` seconds (`None`: forever);
    /// `None` on timeout or once the manager is gone. Events a slow reader
    /// missed (more than 4,096 behind) are skipped.
    #[pyo3(signature = (timeout=None))]
    fn next(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<Event>> {
        let Some(rx) = self.rx.as_ref() else {
            return Ok(None);
        };
        let timeout = runtime::seconds("timeout", timeout)?;
        let next = async {
            let mut rx = rx.lock().await;
            loop {
                match rx.recv().await {
                    Ok(ev) => return Some(ev),
                    Err(broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(broadcast::error::RecvError::Closed) => return None,
                }
            }
        };
        Ok(runtime::wait_for(py, next, timeout)?.flatten().map(Event::from))
    }
}

/// Something that happened to one of the process's worlds.
#[pyclass(module = "multiworld_rs._native", frozen, get_all)]
pub struct Event {
    /// `"joined"`, `"broken"`, `"removed"`, `"quarantined"` or `"watchdog_stalled"`.
    kind: &'static str,
    /// The world's name.
    world: String,
    /// Its generation (`None` for `"watchdog_stalled"`).
    generation: Option<u64>,
    /// For `"broken"`: the cause's kind (`"peer_lost"`, ...).
    cause: Option<&'static str>,
    /// The rank the event is about: this process's for `"joined"`, the
    /// failed member's for a break that names one.
    rank: Option<u32>,
    /// Human-readable detail (the cause, the reason, how long).
    detail: Option<String>,
    /// For `"broken"`: the world's flight record as a timeline (what it was
    /// doing when it broke: its last operations and those pending).
    flight_record: Option<String>,
}

impl From<WorldEvent> for Event {
    fn from(ev: WorldEvent) -> Self {
        let world = ev.world().to_string();
        let mut e = Event {
            kind: "unknown",
            world,
            generation: None,
            cause: None,
            rank: None,
            detail: None,
            flight_record: None,
        };
        match ev {
            WorldEvent::Joined { generation, rank, .. } => {
                e.kind = "joined";
                e.generation = Some(generation.0);
                e.rank = Some(rank.0);
            }
            WorldEvent::Broken {
                generation,
                cause,
                record,
                ..
            } => {
                e.kind = "broken";
                e.flight_record = Some(record.timeline());
                e.generation = Some(generation.0);
                e.cause = Some(cause.kind());
                e.rank = cause.rank().map(|r| r.0);
                e.detail = Some(cause.to_string());
            }
            WorldEvent::Quarantined {
                generation, reason, ..
            } => {
                e.kind = "quarantined";
                e.generation = Some(generation.0);
                e.detail = Some(reason);
            }
            WorldEvent::WatchdogStalled { stuck_for, .. } => {
                e.kind = "watchdog_stalled";
                e.detail = Some(format!("watchdog not run for {stuck_for:?}"));
            }
            WorldEvent::Removed { generation, .. } => {
                e.kind = "removed";
                e.generation = Some(generation.0);
            }
            _ => {}
        }
        e
    }
}

#[pymethods]
impl Event {
    fn __repr__(&self) -> String {
        let mut s = format!("Event(kind={:?}, world={:?}", self.kind, self.world);
        if let Some(g) = self.generation {
            s += &format!(", generation={g}");
        }
        if let Some(c) = self.cause {
            s += &format!(", cause={c:?}");
        }
        if let Some(r) = self.rank {
            s += &format!(", rank={r}");
        }
        s + ")"
    }
}
