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
//! While the call runs, the array stays alive and exclusively borrowed on
//! the Rust side (the caller holds its `PyReadwriteArray` across the call,
//! `settle` included); other Python threads that write the same array
//! meanwhile race with the runtime, as with any call that releases the GIL.

// Raw parts of the array's memory, valid for the loan (see `Memory`).
#![allow(unsafe_code)]

use std::sync::mpsc;

use multiworld::{DType, ExternalMemory, Tensor};
use numpy::{
    PyArrayDescrMethods, PyReadwriteArray1, PyUntypedArray, PyUntypedArrayMethods,
    npyffi::NPY_ARRAY_WRITEABLE,
};
use pyo3::{exceptions::PyValueError, prelude::*};

/// The array's memory as the runtime sees it. Dropping it (with the tensor
/// that holds it) closes the channel that [`Loan::settle`] waits on, or, for
/// a background operation's loan, lets go of the array.
struct Memory {
    ptr: *mut u8,
    len: usize,
    _held: Option<mpsc::Sender<()>>,
    /// The array, for a loan that outlives the call that made it (dropped
    /// with the GIL held when the operation's outcome is taken; otherwise
    /// pyo3 defers the decrement to the next thread that holds the GIL).
    _array: Option<Py<PyAny>>,
}

// SAFETY: `ptr` points into a numpy array that outlives this value (the
// lender holds the array borrowed until `settle` has seen the value dropped,
// or the value holds a reference to the array), and only the one tensor that
// owns this value reads or writes it.
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
    pub fn new(
        array: &mut PyReadwriteArray1<'_, u8>,
        dtype: DType,
        shape: Vec<usize>,
        what: &str,
    ) -> PyResult<Loan> {
        let bytes = array
            .as_slice_mut()
            .map_err(|e| PyValueError::new_err(format!("{what}: {e}")))?;
        Loan::of(bytes.as_mut_ptr(), bytes.len(), dtype, shape)
            .map_err(|e| PyValueError::new_err(format!("{what}: {e}")))
    }

    /// The loan of `len` bytes at `ptr`, which must stay valid and otherwise
    /// untouched until [`Loan::settle`] returns (the callers hold the array).
    fn of(ptr: *mut u8, len: usize, dtype: DType, shape: Vec<usize>) -> Result<Loan, String> {
        let (tx, held) = mpsc::channel();
        let mem = Memory {
            ptr,
            len,
            _held: Some(tx),
            _array: None,
        };
        let tensor = Tensor::from_external(dtype, shape, Box::new(mem)).map_err(|e| e.to_string())?;
        Ok(Loan { tensor, held })
    }

    /// Ends the loan: drops the tensor and returns once nothing in the
    /// runtime holds the array's memory (at once, unless the call was
    /// cancelled while a message was being read into it).
    pub fn settle(self, py: Python<'_>) {
        let Loan { tensor, held } = self;
        drop(tensor);
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

    /// The array lent for one blocking call; `None` if it is read-only or
    /// not lendable (misaligned, or a `bool` byte other than 0 or 1).
    pub fn lend(&self) -> Option<Loan> {
        if !self.writeable() {
            return None;
        }
        Loan::of(self.ptr, self.len, self.dtype, self.shape()).ok()
    }

    /// The array lent to a background operation (`irecv`): the tensor holds
    /// a reference to it, so it lives as long as the operation uses it; the
    /// caller must not use the array until the operation has ended (as with
    /// any `irecv`). `None` as for [`Plain::lend`].
    pub fn lend_to_task(&self) -> Option<Tensor> {
        if !self.writeable() {
            return None;
        }
        let mem = Memory {
            ptr: self.ptr,
            len: self.len,
            _held: None,
            _array: Some(self.array.clone().into_any().unbind()),
        };
        Tensor::from_external(self.dtype, self.shape(), Box::new(mem)).ok()
    }

    fn writeable(&self) -> bool {
        // SAFETY: as in `plain`.
        let flags = unsafe { (*self.array.as_array_ptr()).fields.flags };
        flags & NPY_ARRAY_WRITEABLE != 0
    }
}
