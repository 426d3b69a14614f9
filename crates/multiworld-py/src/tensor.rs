//! Between numpy arrays and the runtime's tensors.
//!
//! The Python layer hands every array over as a flat `uint8` view of its
//! C-contiguous memory plus its dtype name and shape (see
//! `multiworld_rs/_tensors.py`), so this side needs no per-dtype entry points:
//! - a send borrows those bytes as a [`TensorView`] (no copy);
//! - inputs of collectives and of `isend` become owned [`Tensor`]s (one copy:
//!   the runtime's tensors own their memory);
//! - a received or computed [`Tensor`] becomes a numpy array that takes over
//!   its memory (no copy): the aligned bytes of a large tensor, viewed as its
//!   dtype, or the `Vec` of a small one (`bool` re-collected once);
//!   `float16`/`bfloat16` travel as `uint16` and are viewed back in Python.

use multiworld::{DType, Tensor, TensorView, bf16, f16};
use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::{Borrowed, exceptions::PyValueError, prelude::*, types::PySlice};

use crate::lent::Readable;

/// The dtype of a torch/numpy dtype name (`"float32"`, `"bool"`, `"bfloat16"`, ...).
pub fn dtype(name: &str) -> PyResult<DType> {
    DType::ALL
        .into_iter()
        .find(|d| d.name() == name)
        .ok_or_else(|| PyValueError::new_err(format!("unsupported dtype '{name}'")))
}

fn invalid(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// A borrowed view of `bytes` as `dtype` elements (no copy).
pub fn view<'a>(bytes: &'a [u8], dtype: DType) -> PyResult<TensorView<'a>> {
    TensorView::from_bytes(dtype, bytes).map_err(invalid)
}

/// An input tensor given as `(uint8 view, dtype name, shape)`: copied into an
/// owned tensor, or lent to a blocking call ([`Input::for_call`]).
pub struct Input<'py>(PyReadonlyArray1<'py, u8>, String, Vec<usize>);

impl<'a, 'py> FromPyObject<'a, 'py> for Input<'py> {
    type Error = PyErr;

    /// The tuple's own errors, unwrapped: an array another call is writing
    /// is a `ValueError` (see [`Readable`]).
    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let (Readable(array), dtype, shape) = obj.extract::<(Readable<'py>, String, Vec<usize>)>()?;
        Ok(Input(array, dtype, shape))
    }
}

impl Input<'_> {
    /// The owned tensor (one copy of the array's bytes).
    pub fn tensor(&self) -> PyResult<Tensor> {
        let bytes = self.0.as_slice().map_err(invalid)?;
        // Copying reads the array: refused (`ValueError`) while a call that
        // writes it holds it, as a send of it is.
        crate::lent::check_not_lent(bytes, "input")?;
        Tensor::from_bytes(dtype(&self.1)?, self.2.clone(), bytes).map_err(invalid)
    }

    /// The input for one blocking call that only reads it: the array lent
    /// as it is (no copy) where it can be, else the owned copy.
    pub fn for_call(&self, what: &str) -> PyResult<CallInput> {
        let dtype = dtype(&self.1)?;
        // `bool` inputs are copied (checked once), as the background forms'
        // are: the call would read as `bool` bytes another thread may change.
        if dtype == DType::Bool {
            return Ok(CallInput::Copied(self.tensor()?));
        }
        let what = format!("{what} input");
        Ok(
            match crate::lent::Loan::read(&self.0, dtype, self.2.clone(), &what)? {
                Some(loan) => CallInput::Lent(loan),
                None => CallInput::Copied(self.tensor()?),
            },
        )
    }
}

/// A blocking call's input: lent, or copied (see [`Input::for_call`]).
pub enum CallInput {
    /// The caller's array itself, lent for the call.
    Lent(crate::lent::Loan),
    /// A copy (memory that could not be lent).
    Copied(Tensor),
}

impl CallInput {
    /// The tensor to pass to the call.
    pub fn tensor(&self) -> &Tensor {
        match self {
            CallInput::Lent(loan) => &loan.tensor,
            CallInput::Copied(t) => t,
        }
    }

    /// Ends a loan once the call has returned (see `Loan::settle`).
    pub fn settle(self, py: Python<'_>) {
        if let CallInput::Lent(loan) = self {
            loan.settle(py);
        }
    }

    /// The tensor, and the end of its loan if it is lent, for calls that
    /// take their inputs as a slice (see `Loan::into_parts`).
    pub fn into_parts(self) -> (Tensor, Option<crate::lent::LoanEnd>) {
        match self {
            CallInput::Lent(loan) => {
                let (t, end) = loan.into_parts();
                (t, Some(end))
            }
            CallInput::Copied(t) => (t, None),
        }
    }
}

/// An output tensor given as `(dtype name, shape)`: allocated zeroed.
#[derive(FromPyObject)]
pub struct Output(pub String, pub Vec<usize>);

impl Output {
    /// A zeroed tensor of this dtype and shape (64-byte aligned from
    /// `ALIGNED_FROM` bytes, like every tensor the runtime allocates; numpy
    /// takes either kind over without a copy, see [`to_numpy`]).
    pub fn tensor(&self) -> PyResult<Tensor> {
        Tensor::zeros(dtype(&self.0)?, self.1.clone()).map_err(invalid)
    }
}

/// Every input of a list as owned tensors.
pub fn inputs(list: &[Input<'_>]) -> PyResult<Vec<Tensor>> {
    list.iter().map(Input::tensor).collect()
}

/// Every output of a list, allocated.
pub fn outputs(list: &[Output]) -> PyResult<Vec<Tensor>> {
    list.iter().map(Output::tensor).collect()
}

/// The tensor's elements (its own `Vec`, no copy).
fn vec_of<T: multiworld::Element>(t: Tensor) -> PyResult<Vec<T>> {
    t.into_vec::<T>()
        .map_err(|t| invalid(format!("internal: tensor holds {}", t.dtype())))
}

fn give<'py, T: numpy::Element + multiworld::Element>(
    py: Python<'py>,
    t: Tensor,
) -> PyResult<Bound<'py, PyAny>> {
    Ok(PyArray1::from_vec(py, vec_of::<T>(t)?).into_any())
}

fn give_u16<'py, T: multiworld::Element + bytemuck::Pod>(
    py: Python<'py>,
    t: Tensor,
) -> PyResult<Bound<'py, PyAny>> {
    // Same size and alignment (2 bytes): reinterprets the allocation, no copy.
    let v: Vec<u16> = bytemuck::allocation::cast_vec(vec_of::<T>(t)?);
    Ok(PyArray1::from_vec(py, v).into_any())
}

/// A flat numpy array over the tensor's memory (no copy, except a small
/// `bool` tensor). `float16` and `bfloat16` come back as `uint16`; the Python
/// layer views and reshapes.
pub fn to_numpy<'py>(py: Python<'py>, t: Tensor) -> PyResult<Bound<'py, PyAny>> {
    let dt = t.dtype();
    let t = match t.into_aligned_parts() {
        // Aligned memory: numpy owns the whole allocation; the result is a
        // view of the aligned range as the tensor's dtype (the view keeps
        // the allocation alive through its base).
        Ok((buf, range)) => {
            let all = PyArray1::from_vec(py, buf);
            let data = all.get_item(PySlice::new(py, range.start as isize, range.end as isize, 1))?;
            // numpy's name for the dtype (float16/bfloat16 travel as uint16).
            let as_dtype = match dt {
                DType::F16 | DType::BF16 => "uint16",
                d => d.name(),
            };
            return data.call_method1("view", (as_dtype,));
        }
        Err(t) => t,
    };
    match t.dtype() {
        DType::F16 => give_u16::<f16>(py, t),
        DType::BF16 => give_u16::<bf16>(py, t),
        DType::F32 => give::<f32>(py, t),
        DType::F64 => give::<f64>(py, t),
        DType::I8 => give::<i8>(py, t),
        DType::I16 => give::<i16>(py, t),
        DType::I32 => give::<i32>(py, t),
        DType::I64 => give::<i64>(py, t),
        DType::U8 => give::<u8>(py, t),
        DType::U16 => give::<u16>(py, t),
        DType::U32 => give::<u32>(py, t),
        DType::U64 => give::<u64>(py, t),
        DType::Bool => give::<bool>(py, t),
    }
}

/// Several tensors as flat numpy arrays.
pub fn list_to_numpy<'py>(py: Python<'py>, ts: Vec<Tensor>) -> PyResult<Vec<Bound<'py, PyAny>>> {
    ts.into_iter().map(|t| to_numpy(py, t)).collect()
}
