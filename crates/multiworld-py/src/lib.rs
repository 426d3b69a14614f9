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
//! | `world` | `World` (p2p, collectives, object collectives), `Work` (handles) |

mod errors;
mod manager;
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
    use crate::world::{Work, World};
}
