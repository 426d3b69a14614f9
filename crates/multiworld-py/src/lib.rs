//! `multiworld_rs._native`: the Rust half of the `multiworld_rs` Python
//! package (the pure-Python half in `python/multiworld_rs/` prepares
//! arguments, converts arrays and documents the API; see `docs/python.md`).
//!
//! | module | what |
//! |---|---|
//! | `runtime` | the process-wide Tokio runtime, GIL-free waits in slices (Ctrl-C), the fork guard |
//! | `errors` | runtime errors → the Python exception classes of `multiworld_rs.errors` |
//! | `tensor` | numpy bytes ↔ tensors: borrowed views for sends, owned `Vec`s handed to numpy |
//! | `manager` | `Manager`, `EventStream`, `Event` |
//! | `world` | `World` (p2p, collectives, object collectives, sub-groups), `Work` (handles) |
//! | `notify` | `Notifier`: wake-ups of an asyncio loop when background operations end |

mod errors;
mod manager;
mod notify;
mod runtime;
mod tensor;
mod world;

use pyo3::prelude::*;

/// The native module.
#[pymodule]
mod _native {
    #[pymodule_export]
    use crate::manager::{Event, EventStream, Manager};
    #[pymodule_export]
    use crate::notify::Notifier;
    #[pymodule_export]
    use crate::world::{Work, World};
}
