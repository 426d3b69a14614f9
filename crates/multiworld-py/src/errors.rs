//! From the runtime's typed errors to Python exceptions.
//!
//! The exception classes live in Python (`multiworld_rs/errors.py`), so they
//! have ordinary constructors, fields and docstrings; this module imports
//! them once and instantiates them with keyword fields. The mapping (also in
//! `docs/python.md`):
//!
//! | Rust | Python |
//! |---|---|
//! | `WorldError::Broken` | `BrokenWorldError` (`world`, `generation`, `cause`, `rank`, `detail`) |
//! | `WorldError::Timeout` | `WorldTimeoutError` (a `TimeoutError`) |
//! | `WorldError::Mismatch` | `MismatchError` (a `ValueError`) |
//! | `WorldError::InvalidArgument` | `InvalidArgumentError` (a `ValueError`) |
//! | `WorldError::Config` | `ConfigError` (a `ValueError`) |
//! | `WorldError::NotJoined` | `NotJoinedError` (a `LookupError`) |
//! | `WorldError::AlreadyJoined` | `AlreadyJoinedError` |
//! | `WorldError::JoinFailed` that ran out of time (mapped by [`join`]) | `JoinTimeoutError` (a `JoinError` and a `TimeoutError`) |
//! | `WorldError::JoinFailed`, `HostStore` | `JoinError` |
//! | `WorldError::Transport` | `TransportError` |
//! | `WorldError::Device` | `DeviceError` |
//! | `WorldError::ShutDown` | `ShutDownError` |
//!
//! A collective's error is the transport's (`CommError`), mapped as a
//! send's is (`World::collective_error`): a world-fatal one breaks the world
//! and is reported as `BrokenWorldError` with the cause the world recorded;
//! a member that left in an orderly way while this one finishes fails the
//! call with `TransportError` and breaks nothing.

use multiworld::{WorldError, WorldName};
use pyo3::{
    IntoPyObjectExt,
    prelude::*,
    sync::PyOnceLock,
    types::{PyDict, PyModule},
};

static ERRORS: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

fn module(py: Python<'_>) -> PyResult<&Bound<'_, PyModule>> {
    ERRORS
        .get_or_try_init(py, || Ok(py.import("multiworld_rs.errors")?.unbind()))
        .map(|m| m.bind(py))
}

/// An instance of the Python exception class `name` with `message` and the
/// keyword `fields`.
pub fn new(py: Python<'_>, name: &str, message: String, fields: &[(&str, Py<PyAny>)]) -> PyErr {
    let build = || -> PyResult<PyErr> {
        let class = module(py)?.getattr(name)?;
        let kwargs = PyDict::new(py);
        for (k, v) in fields {
            kwargs.set_item(k, v)?;
        }
        let value = class.call((message.clone(),), Some(&kwargs))?;
        Ok(PyErr::from_value(value))
    };
    // Only a broken installation (errors.py missing) makes `build` fail.
    build().unwrap_or_else(|e| e)
}

fn obj<'py>(py: Python<'py>, v: impl IntoPyObject<'py>) -> Py<PyAny> {
    // Strings, integers, floats and None always convert.
    v.into_bound_py_any(py)
        .map(Bound::unbind)
        .unwrap_or_else(|_| py.None())
}

/// Maps a world error; `generation` is the world's, when the caller knows it.
pub fn world(py: Python<'_>, err: WorldError, generation: Option<u64>) -> PyErr {
    let message = err.to_string();
    match err {
        WorldError::Broken { world, cause } => new(
            py,
            "BrokenWorldError",
            message,
            &[
                ("world", obj(py, world.as_str())),
                ("generation", obj(py, generation)),
                ("cause", obj(py, cause.kind())),
                ("rank", obj(py, cause.rank().map(|r| r.0))),
                ("detail", obj(py, cause.to_string())),
            ],
        ),
        WorldError::Timeout { world, op, after } => new(
            py,
            "WorldTimeoutError",
            message,
            &[
                ("world", obj(py, world.as_str())),
                ("op", obj(py, op)),
                ("after", obj(py, after.as_secs_f64())),
            ],
        ),
        WorldError::Mismatch { world, detail } => {
            new(py, "MismatchError", message, &fields(py, &world, detail))
        }
        WorldError::InvalidArgument { world, detail } => {
            new(py, "InvalidArgumentError", message, &fields(py, &world, detail))
        }
        WorldError::Device { world, detail } => new(py, "DeviceError", message, &fields(py, &world, detail)),
        WorldError::NotJoined { world } => new(py, "NotJoinedError", message, &[("world", obj(py, world))]),
        WorldError::AlreadyJoined { world, state } => new(
            py,
            "AlreadyJoinedError",
            message,
            &[("world", obj(py, world.as_str())), ("state", obj(py, state))],
        ),
        WorldError::Transport { world, source } => new(
            py,
            "TransportError",
            message,
            &fields(py, &world, source.to_string()),
        ),
        WorldError::JoinFailed { world, reason } => {
            new(py, "JoinError", message, &fields(py, &world, reason.to_string()))
        }
        WorldError::HostStore { addr, reason } => new(
            py,
            "JoinError",
            message,
            &[("detail", obj(py, reason.to_string())), ("addr", obj(py, addr))],
        ),
        WorldError::Config(e) => new(py, "ConfigError", message, &[("detail", obj(py, e.to_string()))]),
        WorldError::ShutDown => new(py, "ShutDownError", message, &[]),
        _ => new(py, "MultiworldError", message, &[]),
    }
}

/// Maps a join's error: one that ran out of time (`timeout`, the join's) is
/// a `JoinTimeoutError`, both a `JoinError` and a `TimeoutError`.
pub fn join(py: Python<'_>, err: WorldError, timeout: std::time::Duration) -> PyErr {
    if let WorldError::JoinFailed { world, reason } = &err
        && reason.is_timeout()
    {
        return new(
            py,
            "JoinTimeoutError",
            err.to_string(),
            &[
                ("world", obj(py, world.as_str())),
                ("detail", obj(py, reason.to_string())),
                ("after", obj(py, timeout.as_secs_f64())),
            ],
        );
    }
    self::world(py, err, None)
}

fn fields(py: Python<'_>, world: &WorldName, detail: String) -> [(&'static str, Py<PyAny>); 2] {
    [("world", obj(py, world.as_str())), ("detail", obj(py, detail))]
}

/// The error of a forked child touching the runtime of its parent `pid`.
pub fn forked(parent: u32) -> PyErr {
    Python::attach(|py| {
        new(
            py,
            "ForkedProcessError",
            format!(
                "this process (pid {}) was forked from pid {parent}, which had started the \
                 multiworld runtime; a forked child cannot use it (its threads did not survive \
                 the fork). Start worker processes with the 'spawn' start method instead: \
                 multiprocessing.get_context('spawn') or multiprocessing.set_start_method('spawn')",
                std::process::id()
            ),
            &[("parent_pid", obj(py, parent))],
        )
    })
}
