//! A caller's numpy array lent to the runtime for one blocking call, so a
//! receive or an in-place collective writes its result straight into the
//! array: no buffer of the runtime's, no copy.
//!
//! The loan is a [`Tensor`] over the array's memory ([`Tensor::from_external`]).
//! The one promise this module keeps is that **the runtime no longer touches
//! the array once the call returns**: [`Loan::settle`] drops the tensor and,
//! if the runtime still holds the memory (a receive cancelled by Ctrl-C or
//! timed out while its message was arriving: the transport finishes reading
//! it, then keeps a copy for the next receive), waits with the GIL released
//! until it lets go. That wait is bounded by the message arriving or the
//! world failing (a silent peer is caught by the watchdog), never by Python.
//!
//! A background receive (`irecv`) gets a loan that holds a reference to the
//! array; its task ends only once the runtime has let go of the array
//! ([`Released`]), and cancelling its handle waits for that too.
//!
//! While the call runs, the array stays alive and exclusively borrowed on
//! the Rust side (the caller holds its `PyReadwriteArray` across the call,
//! `settle` included); other Python threads that write the same array
//! meanwhile race with the runtime, as with any call that releases the GIL.

// Raw parts of the array's memory, valid for the loan (see `Memory`).
#![allow(unsafe_code)]

use std::sync::{Mutex, MutexGuard, PoisonError, mpsc};

use tokio::sync::watch;

use multiworld::{DType, ExternalMemory, Tensor};
use numpy::{
    BorrowError, PyArray1, PyArrayDescrMethods, PyArrayMethods, PyReadonlyArray1, PyReadwriteArray1,
    PyUntypedArray, PyUntypedArrayMethods, npyffi::NPY_ARRAY_WRITEABLE,
};
use pyo3::{Borrowed, exceptions::PyValueError, prelude::*};

/// The array's memory as the runtime sees it. Dropping it (with the tensor
/// that holds it) ends the loan: its range leaves the registry of lent
/// memory, and the channel that [`Loan::settle`] waits on closes.
struct Memory {
    ptr: *mut u8,
    len: usize,
    /// Dropped before `_held`: the range has left the registry by the
    /// time a settling caller sees the loan end.
    _entry: Entry,
    _held: Held,
}

/// What ends with a loan (dropped with its `Memory`).
// Held for their drops, never read.
#[allow(dead_code)]
enum Held {
    /// A blocking call's: the channel [`Loan::settle`] waits on.
    Call(mpsc::Sender<()>),
    /// A background operation's: the channel [`Released`] waits on, and
    /// the array itself, kept alive for as long as the runtime may use it
    /// (its reference dropped where the loan ends; without the GIL, pyo3
    /// defers the decrement to the next thread that holds it).
    Task(watch::Sender<()>, Py<PyAny>),
}

/// Resolves when a background operation's loans have ended: the runtime
/// no longer touches the arrays.
#[derive(Clone)]
pub struct Released(Vec<watch::Receiver<()>>);

impl Released {
    /// Waits until every loan has ended (at once if they have).
    pub async fn wait(self) {
        for mut rx in self.0 {
            // Nothing is ever sent: `changed` fails once the sender is dropped.
            while rx.changed().await.is_ok() {}
        }
    }

    /// Resolves once all of `each` have.
    pub fn all(each: impl IntoIterator<Item = Released>) -> Released {
        Released(each.into_iter().flat_map(|r| r.0).collect())
    }
}

/// One range of the registry, taken out when dropped.
struct Entry {
    start: usize,
    len: usize,
    access: Access,
}

impl Entry {
    /// Registers `len` bytes at `start` for `access`; `None` if that races
    /// with a range there (see [`conflicts`]).
    fn new(start: usize, len: usize, access: Access) -> PyResult<Option<Entry>> {
        let mut lent = registry_for_a_call()?;
        if conflicts(&lent, start, len, access) {
            return Ok(None);
        }
        lent.push((start, len, access));
        Ok(Some(Entry { start, len, access }))
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        let mut lent = registry();
        let me = (self.start, self.len, self.access);
        if let Some(i) = lent.iter().position(|&r| r == me) {
            lent.swap_remove(i);
        }
    }
}

/// How a loan uses its memory: the runtime writes it (a receive, an
/// in-place collective) or only reads it (a lent send). Reads may overlap
/// reads; anything that overlaps a write is refused.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Access {
    Read,
    Write,
}

/// The byte ranges lent right now (start, length, access): a loan that
/// would race with one of them, or a send reading memory being written, is
/// refused instead of racing.
static LENT: Mutex<Vec<(usize, usize, Access)>> = Mutex::new(Vec::new());

fn registry() -> MutexGuard<'static, Vec<(usize, usize, Access)>> {
    // Never held across anything that can panic.
    LENT.lock().unwrap_or_else(PoisonError::into_inner)
}

/// [`registry`] for a call that lends or checks memory: in a forked child
/// `ForkedProcessError` instead, before the lock (which a runtime thread of
/// the parent may have held at the fork).
fn registry_for_a_call() -> PyResult<MutexGuard<'static, Vec<(usize, usize, Access)>>> {
    crate::runtime::runtime()?;
    Ok(registry())
}

/// Whether `access` of `len` bytes at `start` races with a loan in `lent`
/// (no byte, nothing to race over: empty ranges never do).
fn conflicts(lent: &[(usize, usize, Access)], start: usize, len: usize, access: Access) -> bool {
    len > 0
        && lent.iter().any(|&(s, l, a)| {
            l > 0
                && (a == Access::Write || access == Access::Write)
                && start < s.saturating_add(l)
                && s < start.saturating_add(len)
        })
}

/// A flat `uint8` view of a C-contiguous array, as the Python layer passes
/// it, borrowed for reading for one call. While another thread's call holds
/// the array for writing, extracting it is the registry's `ValueError` ("in
/// use by another call"), not rust-numpy's borrow `TypeError`.
pub struct Readable<'py>(pub PyReadonlyArray1<'py, u8>);

impl<'a, 'py> FromPyObject<'a, 'py> for Readable<'py> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let array = obj.extract::<Bound<'py, PyArray1<u8>>>()?;
        array.try_readonly().map(Readable).map_err(|_| in_use("input"))
    }
}

/// [`Readable`] for writing: an output array lent to one call.
pub struct Writable<'py>(pub PyReadwriteArray1<'py, u8>);

impl<'a, 'py> FromPyObject<'a, 'py> for Writable<'py> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let array = obj.extract::<Bound<'py, PyArray1<u8>>>()?;
        array.try_readwrite().map(Writable).map_err(|e| match e {
            BorrowError::NotWriteable => PyValueError::new_err("output: the array is read-only"),
            _ => in_use("output"),
        })
    }
}

/// `bytes`, read by a blocking send with the GIL released, registered as
/// read for as long as the guard lives: a call that would write them meanwhile
/// (a receive or a collective lent them from another thread) is refused,
/// and `ValueError` ("in use") if one writes them now.
pub fn reading(bytes: &[u8], what: &str) -> PyResult<Reading> {
    Entry::new(bytes.as_ptr() as usize, bytes.len(), Access::Read)?
        .map(|entry| Reading { _entry: entry })
        .ok_or_else(|| in_use(what))
}

/// Bytes registered as read by [`reading`] until dropped.
pub struct Reading {
    _entry: Entry,
}

/// Refuses `bytes` (about to be read by a send) while any of it is lent to
/// a call that writes it.
pub fn check_not_lent(bytes: &[u8], what: &str) -> PyResult<()> {
    if conflicts(
        &registry_for_a_call()?,
        bytes.as_ptr() as usize,
        bytes.len(),
        Access::Read,
    ) {
        return Err(in_use(what));
    }
    Ok(())
}

fn in_use(what: &str) -> PyErr {
    PyValueError::new_err(format!(
        "{what}: the array is in use by another call right now (a receive or a collective writes it, or a send reads it)"
    ))
}

// SAFETY: `ptr` points into a numpy array that outlives this value (the
// lender holds the array until `settle` has seen the value dropped, or the
// value holds a reference to the array), and only the one tensor that owns
// this value reads or writes it (the registry refuses a second loan of the
// same memory).
unsafe impl Send for Memory {}
// SAFETY: shared access only reads (`bytes`); writes need `&mut`.
unsafe impl Sync for Memory {}

impl ExternalMemory for Memory {
    fn bytes(&self) -> &[u8] {
        // SAFETY: valid for `len` bytes for as long as `self` lives (above).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above; `&mut self` makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// A tensor of `dtype` and `shape` over `len` bytes at `ptr`, registered
/// as lent for `access` until `held` is dropped with it; `Lend::InUse` if
/// that races with a loan already there.
fn lend_tensor(
    ptr: *mut u8,
    len: usize,
    dtype: DType,
    shape: Vec<usize>,
    held: Held,
    access: Access,
) -> Result<Tensor, Lend> {
    let entry = Entry::new(ptr as usize, len, access)
        .map_err(Lend::Forked)?
        .ok_or(Lend::InUse)?;
    let mem = Memory {
        ptr,
        len,
        _entry: entry,
        _held: held,
    };
    // A refused loan drops `mem`, which leaves the registry.
    Tensor::from_external(dtype, shape, Box::new(mem)).map_err(|e| Lend::Refused(e.to_string()))
}

/// A fast path's view of a loan: the value, `None` for memory the general
/// path must take (it copies), `ValueError` if another call holds it.
fn fast<T>(r: Result<T, Lend>, what: &str) -> PyResult<Option<T>> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(Lend::InUse) => Err(in_use(what)),
        Err(Lend::Refused(_)) => Ok(None),
        Err(Lend::Forked(e)) => Err(e),
    }
}

/// Why memory could not be lent.
enum Lend {
    /// Part of it is lent to another call.
    InUse,
    /// `Tensor::from_external` refused it (misaligned, a bad `bool` byte).
    Refused(String),
    /// This is a forked child (`ForkedProcessError`).
    Forked(PyErr),
}

/// An array lent as a tensor for one call.
pub struct Loan {
    /// The tensor over the array (taken by the call; whatever is left in it
    /// is dropped by `settle`).
    pub tensor: Tensor,
    held: mpsc::Receiver<()>,
}

impl Loan {
    /// Lends `array` (a flat `uint8` view of a C-contiguous array) as a
    /// tensor of `dtype` and `shape`. `ValueError` if the sizes disagree, the
    /// memory is misaligned for `dtype`, or a `bool` byte is not 0 or 1.
    pub fn new(array: &mut Writable<'_>, dtype: DType, shape: Vec<usize>, what: &str) -> PyResult<Loan> {
        let bytes = array
            .0
            .as_slice_mut()
            .map_err(|e| PyValueError::new_err(format!("{what}: {e}")))?;
        Loan::of(bytes.as_mut_ptr(), bytes.len(), dtype, shape).map_err(|e| match e {
            Lend::InUse => in_use(what),
            Lend::Refused(e) => PyValueError::new_err(format!("{what}: {e}")),
            Lend::Forked(e) => e,
        })
    }

    /// Lends `array` (a flat `uint8` view of a C-contiguous array) as a
    /// tensor of `dtype` and `shape` to one call that only reads it (a
    /// collective's input, passed as `&Tensor`: nothing can write through
    /// it, so a read-only array is fine). `Ok(None)` for memory
    /// `Tensor::from_external` refuses (misaligned, a `bool` byte other than
    /// 0 or 1): the caller copies it instead; `ValueError` while a call that
    /// writes the memory holds it.
    pub fn read(
        array: &PyReadonlyArray1<'_, u8>,
        dtype: DType,
        shape: Vec<usize>,
        what: &str,
    ) -> PyResult<Option<Loan>> {
        let bytes = array
            .as_slice()
            .map_err(|e| PyValueError::new_err(format!("{what}: {e}")))?;
        let (tx, held) = mpsc::channel();
        let lent = lend_tensor(
            bytes.as_ptr().cast_mut(),
            bytes.len(),
            dtype,
            shape,
            Held::Call(tx),
            Access::Read,
        );
        fast(lent.map(|tensor| Loan { tensor, held }), what)
    }

    /// The loan of `len` bytes at `ptr`, which must stay valid and otherwise
    /// untouched until [`Loan::settle`] returns (the callers hold the array).
    fn of(ptr: *mut u8, len: usize, dtype: DType, shape: Vec<usize>) -> Result<Loan, Lend> {
        let (tx, held) = mpsc::channel();
        let tensor = lend_tensor(ptr, len, dtype, shape, Held::Call(tx), Access::Write)?;
        Ok(Loan { tensor, held })
    }

    /// Ends the loan: drops the tensor and returns once nothing in the
    /// runtime holds the array's memory (at once, unless the call was
    /// cancelled while a message was being read into it).
    pub fn settle(self, py: Python<'_>) {
        let (tensor, end) = self.into_parts();
        drop(tensor);
        end.settle(py);
    }

    /// The loan's tensor and what ends the loan, for calls that take their
    /// tensors as a slice (a list collective's outputs): drop the tensor,
    /// then [`LoanEnd::settle`].
    pub fn into_parts(self) -> (Tensor, LoanEnd) {
        (self.tensor, LoanEnd(self.held))
    }
}

/// The end of a loan whose tensor was taken out ([`Loan::into_parts`]).
pub struct LoanEnd(mpsc::Receiver<()>);

impl LoanEnd {
    /// Returns once nothing in the runtime holds the array's memory (drop
    /// the tensor first).
    pub fn settle(self, py: Python<'_>) {
        let held = self.0;
        if let Err(mpsc::TryRecvError::Empty) = held.try_recv() {
            // Nothing is ever sent: this returns when the memory is dropped.
            py.detach(move || {
                let _ = held.recv();
            });
        }
    }
}

/// A numpy array the fast paths of `send` and `recv_into` take as it is:
/// C-contiguous, native byte order, of a dtype numpy itself knows
/// (`bfloat16`, from `ml_dtypes`, takes the general path).
pub struct Plain<'a> {
    array: &'a Bound<'a, PyUntypedArray>,
    /// Element type.
    pub dtype: DType,
    ptr: *mut u8,
    len: usize,
}

/// `obj` as a [`Plain`] array, or `None` for anything else (the Python
/// layer then converts it, and words any error).
pub fn plain<'a>(obj: &'a Bound<'a, PyAny>) -> Option<Plain<'a>> {
    // Exactly `numpy.ndarray`: subclasses (masked arrays, matrices) may
    // mean more than their memory, so they take the general path.
    if !obj.is_exact_instance_of::<PyUntypedArray>() {
        return None;
    }
    let array = obj.cast::<PyUntypedArray>().ok()?;
    if !array.is_c_contiguous() {
        return None;
    }
    let d = array.dtype();
    if d.is_native_byteorder() == Some(false) {
        return None;
    }
    let dtype = match (d.kind(), d.itemsize()) {
        (b'f', 2) => DType::F16,
        (b'f', 4) => DType::F32,
        (b'f', 8) => DType::F64,
        (b'i', 1) => DType::I8,
        (b'i', 2) => DType::I16,
        (b'i', 4) => DType::I32,
        (b'i', 8) => DType::I64,
        (b'u', 1) => DType::U8,
        (b'u', 2) => DType::U16,
        (b'u', 4) => DType::U32,
        (b'u', 8) => DType::U64,
        (b'b', 1) => DType::Bool,
        _ => return None,
    };
    // SAFETY: `array` is a live numpy array (we hold a reference), whose
    // object header numpy fills in at creation.
    let ptr = unsafe { (*array.as_array_ptr()).fields.data }.cast::<u8>();
    if ptr.is_null() {
        return None;
    }
    let len = array.len().checked_mul(dtype.size())?;
    Some(Plain {
        array,
        dtype,
        ptr,
        len,
    })
}

impl<'a> Plain<'a> {
    /// The array's shape.
    pub fn shape(&self) -> Vec<usize> {
        self.array.shape().to_vec()
    }

    /// The array's bytes, for a send that ends before the caller returns.
    pub fn bytes(&self) -> &'a [u8] {
        // SAFETY: a C-contiguous array of `len` bytes at `ptr`, kept alive
        // (and, holding a reference, not resizable) by `array`, which
        // outlives `'a`. Other Python threads may write it meanwhile, as
        // they may while any call releases the GIL; bytes have no invalid
        // values.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The array lent for one blocking call; `Ok(None)` if it is read-only
    /// or not lendable (misaligned, or a `bool` byte other than 0 or 1: the
    /// general path copies), `ValueError` if another call holds it.
    pub fn lend(&self, what: &str) -> PyResult<Option<Loan>> {
        if !self.writeable() {
            return Ok(None);
        }
        fast(Loan::of(self.ptr, self.len, self.dtype, self.shape()), what)
    }

    /// The array lent for reading to one blocking call (a collective's
    /// input, passed as `&Tensor`: nothing writes through it, so a
    /// read-only array is fine). `Ok(None)` for a `bool` array (the general
    /// path copies it: the call would read as `bool` bytes another thread
    /// may change) and for memory `from_external` refuses; `ValueError`
    /// while a call that writes the memory holds it.
    pub fn lend_to_read(&self, what: &str) -> PyResult<Option<Loan>> {
        if self.dtype == DType::Bool {
            return Ok(None);
        }
        let (tx, held) = mpsc::channel();
        let lent = lend_tensor(
            self.ptr,
            self.len,
            self.dtype,
            self.shape(),
            Held::Call(tx),
            Access::Read,
        );
        fast(lent.map(|tensor| Loan { tensor, held }), what)
    }

    /// Whether this array's memory and `other`'s overlap.
    pub fn overlaps(&self, other: &Plain<'_>) -> bool {
        let (a, b) = (self.ptr as usize, other.ptr as usize);
        a < b.saturating_add(other.len) && b < a.saturating_add(self.len)
    }

    /// The array lent to a background operation (`irecv`): the tensor holds
    /// a reference to the array, and [`Released`] resolves once the runtime
    /// has let go of it. `Ok(None)` and errors as for [`Plain::lend`].
    pub fn lend_to_task(&self, what: &str) -> PyResult<Option<(Tensor, Released)>> {
        self.lend_in_background(Access::Write, what)
    }

    /// The array lent to a background send (the asyncio API's `send` with
    /// `copy=False`), as [`Plain::lend_to_task`] but for reading: other
    /// sends of the same memory may run at once; a call that writes it
    /// (a receive, an in-place collective) is refused while the send runs,
    /// and the send is refused (`ValueError`) while such a call runs.
    /// `Ok(None)` for memory the general path must take (read-only arrays,
    /// as the runtime's tensors are writable, and what `from_external`
    /// refuses): the caller then sends a copy.
    pub fn lend_to_send(&self) -> PyResult<Option<(Tensor, Released)>> {
        self.lend_in_background(Access::Read, "send")
    }

    /// The array lent for `access` to a background operation: the tensor
    /// holds a reference to the array; [`Released`] resolves when the loan ends.
    fn lend_in_background(&self, access: Access, what: &str) -> PyResult<Option<(Tensor, Released)>> {
        if !self.writeable() {
            return Ok(None);
        }
        let (tx, rx) = watch::channel(());
        let held = Held::Task(tx, self.array.clone().into_any().unbind());
        let lent = lend_tensor(self.ptr, self.len, self.dtype, self.shape(), held, access);
        fast(lent.map(|t| (t, Released(vec![rx]))), what)
    }

    /// Whether a background operation may be lent this array for writing:
    /// writeable and not `bool` (whose bytes the runtime would read as
    /// `bool` while another thread may change them); the loan itself may
    /// still refuse misaligned memory.
    pub fn lendable_to_task(&self) -> bool {
        self.writeable() && self.dtype != DType::Bool
    }

    fn writeable(&self) -> bool {
        // SAFETY: as in `plain`.
        let flags = unsafe { (*self.array.as_array_ptr()).fields.flags };
        flags & NPY_ARRAY_WRITEABLE != 0
    }
}
