//! `multiworld_rs._native`: the Rust half of the `multiworld_rs` Python
//! package (the pure-Python half in `python/multiworld_rs/` prepares
//! arguments, converts arrays and documents the API; see `docs/python.md`).
//!
//! | module | what |
//! |---|---|
//! | `runtime` | the process-wide Tokio runtime, GIL-free waits in slices (Ctrl-C), which copies run with the GIL held or on an event loop's thread, the fork guard |
//! | `errors` | runtime errors → the Python exception classes of `multiworld_rs.errors` |
//! | `tensor` | numpy bytes ↔ tensors: borrowed views for sends, owned `Vec`s handed to numpy |
//! | `lent` | a caller's array lent to the runtime, for one blocking call or to a background operation (receives and collectives write into it, sends and collectives read it; no copy), and the registry that refuses calls that would race (`ValueError`) |
//! | `manager` | `Manager`, `EventStream`, `Event` |
//! | `world` | `World` (p2p, collectives, object collectives, sub-groups), `Work` (handles) |
//! | `notify` | `Notifier`: wake-ups of an asyncio loop when background operations end |
//! | `polled` | an operation whose handle needs no task (a posted receive): polled by whoever waits on it |
//! | `device` | (feature `nccl`) `Nccl`: an NCCL world's operations on torch CUDA tensors' memory, borrowed in place; `InFlight` holds the tensors until the operation completes |

#[cfg(feature = "nccl")]
mod device;
mod errors;
mod lent;
mod manager;
mod notify;
mod polled;
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

    use pyo3::prelude::*;

    /// Whether this build has the `nccl` feature (`backend="nccl"` worlds
    /// and CUDA tensors through NCCL).
    #[pyfunction]
    fn nccl_built() -> bool {
        cfg!(feature = "nccl")
    }

    /// Sets how many seconds (at most 0.05) every blocking call polls its
    /// operation before its thread parks (`None`: leave it); returns the
    /// setting in effect.
    #[pyfunction]
    #[pyo3(signature = (seconds=None))]
    fn spin(seconds: Option<f64>) -> PyResult<f64> {
        if let Some(d) = crate::runtime::seconds("spin", seconds)? {
            if d > crate::runtime::SLICE {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "spin must be at most {} seconds (Ctrl-C is checked between spins), got {}",
                    crate::runtime::SLICE.as_secs_f64(),
                    d.as_secs_f64()
                )));
            }
            crate::runtime::set_spin(d);
        }
        Ok(crate::runtime::spin().as_secs_f64())
    }

    /// Sets the most bytes an asyncio receive copies on the event loop's
    /// thread (`None`: leave it); returns the setting in effect.
    #[pyfunction]
    #[pyo3(signature = (nbytes=None))]
    fn loop_copy_max(nbytes: Option<usize>) -> usize {
        if let Some(n) = nbytes {
            crate::runtime::set_loop_copy_max(n);
        }
        crate::runtime::loop_copy_max()
    }

    /// `runtime::loop_leaves_held`, set first to `on` unless `None`;
    /// returns the setting in effect.
    #[pyfunction]
    #[pyo3(signature = (on=None))]
    fn loop_leaves_held(on: Option<bool>) -> bool {
        if let Some(on) = on {
            crate::runtime::set_loop_leaves_held(on);
        }
        crate::runtime::loop_leaves_held()
    }

    /// Adds what only the `nccl` build has: `Nccl` and `nccl_world`.
    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        #[cfg(feature = "nccl")]
        {
            m.add_class::<crate::device::Nccl>()?;
            m.add_function(wrap_pyfunction!(crate::device::nccl_world, m)?)?;
        }
        let _ = m;
        Ok(())
    }
}
