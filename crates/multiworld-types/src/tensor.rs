//! Host tensors: a [`DType`] (with its stable wire code, size and name), a shape, and
//! contiguous typed storage. A [`Tensor`] is built from a `Vec<T>` without copying
//! and viewed as `&[T]`, `&mut [T]` or bytes without copying (through `bytemuck`: this module
//! has no `unsafe`; the crate's only `unsafe`, an `madvise` call, is in `huge_pages`). `bool` is stored as bytes that are always
//! 0 or 1: bytes received from the network are validated before a `bool` tensor is
//! handed back, so a `&[bool]` view never sees an invalid value. [`TensorView`] is
//! a borrowed, read-only view of any tensor or slice, which is what sends take.
//! A tensor can also work on memory it does not own ([`ExternalMemory`], e.g. a
//! Python array's buffer), so results land in the caller's memory.

use std::fmt;

use half::{bf16, f16};

use crate::error::{InvalidArgument as Error, Result};

/// Element type of a tensor. Wire codes (see [`DType::code`]) are part of the
/// protocol and never change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
// Exhaustive on purpose: every backend's tables (wire codes, NCCL types,
// kernels) match on it, so adding a variant is a compile error wherever one
// must be taught about it.
pub enum DType {
    /// IEEE 754 half precision.
    F16,
    /// bfloat16.
    BF16,
    /// IEEE 754 single precision.
    F32,
    /// IEEE 754 double precision.
    F64,
    /// Signed 8-bit integer.
    I8,
    /// Signed 16-bit integer.
    I16,
    /// Signed 32-bit integer.
    I32,
    /// Signed 64-bit integer.
    I64,
    /// Unsigned 8-bit integer.
    U8,
    /// Unsigned 16-bit integer.
    U16,
    /// Unsigned 32-bit integer.
    U32,
    /// Unsigned 64-bit integer.
    U64,
    /// Boolean, one byte per element, always 0 or 1.
    Bool,
}

impl DType {
    /// Every dtype, in wire-code order.
    pub const ALL: [DType; 13] = [
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::U16,
        DType::U32,
        DType::U64,
        DType::Bool,
    ];

    /// The stable one-byte wire code (never 0; 0 marks "no dtype" in control frames).
    pub const fn code(self) -> u8 {
        match self {
            DType::F16 => 1,
            DType::BF16 => 2,
            DType::F32 => 3,
            DType::F64 => 4,
            DType::I8 => 5,
            DType::I16 => 6,
            DType::I32 => 7,
            DType::I64 => 8,
            DType::U8 => 9,
            DType::U16 => 10,
            DType::U32 => 11,
            DType::U64 => 12,
            DType::Bool => 13,
        }
    }

    /// The dtype of a wire code, if it is known.
    pub const fn from_code(code: u8) -> Option<DType> {
        Some(match code {
            1 => DType::F16,
            2 => DType::BF16,
            3 => DType::F32,
            4 => DType::F64,
            5 => DType::I8,
            6 => DType::I16,
            7 => DType::I32,
            8 => DType::I64,
            9 => DType::U8,
            10 => DType::U16,
            11 => DType::U32,
            12 => DType::U64,
            13 => DType::Bool,
            _ => return None,
        })
    }

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 | DType::Bool => 1,
            DType::F16 | DType::BF16 | DType::I16 | DType::U16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
        }
    }

    /// The name torch uses for this dtype (`"float32"`, `"bool"`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::U8 => "uint8",
            DType::U16 => "uint16",
            DType::U32 => "uint32",
            DType::U64 => "uint64",
            DType::Bool => "bool",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether `bytes` are all valid `bool` values (0 or 1).
pub fn valid_bool_bytes(bytes: &[u8]) -> bool {
    bytes.iter().all(|&b| b <= 1)
}

mod storage {
    use half::{bf16, f16};

    use super::{ALIGNED_FROM, AlignedBytes, DType, ExternalMemory};

    /// Typed contiguous storage: owned (`Vec`s), or memory the tensor does not
    /// own (`External`, of any dtype). `Bool` holds bytes that are always 0 or 1
    /// (an invariant kept by every constructor and by the receive path, which
    /// validates).
    pub enum Storage {
        F16(Vec<f16>),
        BF16(Vec<bf16>),
        F32(Vec<f32>),
        F64(Vec<f64>),
        I8(Vec<i8>),
        I16(Vec<i16>),
        I32(Vec<i32>),
        I64(Vec<i64>),
        U8(Vec<u8>),
        U16(Vec<u16>),
        U32(Vec<u32>),
        U64(Vec<u64>),
        Bool(Vec<u8>),
        /// Owned bytes of any dtype whose first byte is 64-byte aligned: what
        /// `Storage::zeros` makes for [`ALIGNED_FROM`] bytes and more.
        Aligned {
            dtype: DType,
            mem: AlignedBytes,
        },
        /// Memory lent by the tensor's creator; its length is a whole number
        /// of elements and its address aligned to the element size (checked by
        /// `Tensor::from_external`).
        External {
            dtype: DType,
            mem: Box<dyn ExternalMemory>,
        },
    }

    /// `$e` with `$v` bound to the `Vec` of a typed storage, `$x` with
    /// `$mem` bound to the bytes of an aligned or external one (both have
    /// `bytes` and `bytes_mut`).
    macro_rules! each {
        ($s:expr, $v:ident => $e:expr, $mem:ident => $x:expr) => {
            match $s {
                Storage::F16($v) => $e,
                Storage::BF16($v) => $e,
                Storage::F32($v) => $e,
                Storage::F64($v) => $e,
                Storage::I8($v) => $e,
                Storage::I16($v) => $e,
                Storage::I32($v) => $e,
                Storage::I64($v) => $e,
                Storage::U8($v) => $e,
                Storage::U16($v) => $e,
                Storage::U32($v) => $e,
                Storage::U64($v) => $e,
                Storage::Bool($v) => $e,
                Storage::Aligned { mem: $mem, .. } => $x,
                Storage::External { mem: $mem, .. } => $x,
            }
        };
    }

    impl Storage {
        /// `n` zero elements: 64-byte aligned from [`ALIGNED_FROM`] bytes on.
        pub fn zeros(dtype: DType, n: usize) -> Storage {
            let bytes = n.saturating_mul(dtype.size());
            if bytes >= ALIGNED_FROM {
                return Storage::Aligned {
                    dtype,
                    mem: AlignedBytes::zeroed(bytes),
                };
            }
            Storage::zeros_vec(dtype, n)
        }

        /// `n` zero elements in a typed `Vec`, whatever the size.
        fn zeros_vec(dtype: DType, n: usize) -> Storage {
            match dtype {
                DType::F16 => Storage::F16(vec![f16::ZERO; n]),
                DType::BF16 => Storage::BF16(vec![bf16::ZERO; n]),
                DType::F32 => Storage::F32(vec![0.0; n]),
                DType::F64 => Storage::F64(vec![0.0; n]),
                DType::I8 => Storage::I8(vec![0; n]),
                DType::I16 => Storage::I16(vec![0; n]),
                DType::I32 => Storage::I32(vec![0; n]),
                DType::I64 => Storage::I64(vec![0; n]),
                DType::U8 => Storage::U8(vec![0; n]),
                DType::U16 => Storage::U16(vec![0; n]),
                DType::U32 => Storage::U32(vec![0; n]),
                DType::U64 => Storage::U64(vec![0; n]),
                DType::Bool => Storage::Bool(vec![0; n]),
            }
        }

        pub fn dtype(&self) -> DType {
            match self {
                Storage::F16(_) => DType::F16,
                Storage::BF16(_) => DType::BF16,
                Storage::F32(_) => DType::F32,
                Storage::F64(_) => DType::F64,
                Storage::I8(_) => DType::I8,
                Storage::I16(_) => DType::I16,
                Storage::I32(_) => DType::I32,
                Storage::I64(_) => DType::I64,
                Storage::U8(_) => DType::U8,
                Storage::U16(_) => DType::U16,
                Storage::U32(_) => DType::U32,
                Storage::U64(_) => DType::U64,
                Storage::Bool(_) => DType::Bool,
                Storage::Aligned { dtype, .. } | Storage::External { dtype, .. } => *dtype,
            }
        }

        pub fn len(&self) -> usize {
            each!(self, v => v.len(), mem => mem.bytes().len() / self.dtype().size())
        }

        pub fn bytes(&self) -> &[u8] {
            each!(self, v => bytemuck::cast_slice(v.as_slice()), mem => mem.bytes())
        }

        /// Raw mutable bytes. For `Bool` the caller must restore the 0/1 invariant
        /// before the storage is observed as `bool` again.
        pub fn bytes_mut(&mut self) -> &mut [u8] {
            each!(self, v => bytemuck::cast_slice_mut(v.as_mut_slice()), mem => mem.bytes_mut())
        }

        pub fn is_external(&self) -> bool {
            matches!(self, Storage::External { .. })
        }

        pub fn is_page_locked(&self) -> bool {
            matches!(self, Storage::External { mem, .. } if mem.page_locked())
        }

        /// Whether the data is held as bytes (aligned or external) rather
        /// than in a typed `Vec`.
        pub(crate) fn is_bytes(&self) -> bool {
            matches!(self, Storage::Aligned { .. } | Storage::External { .. })
        }

        /// The same elements in a typed `Vec` (a copy), for comparisons that
        /// must follow the element type's equality (NaN, -0.0).
        fn typed(&self) -> Storage {
            let b = self.bytes();
            match self.dtype() {
                DType::F16 => Storage::F16(bytemuck::pod_collect_to_vec(b)),
                DType::BF16 => Storage::BF16(bytemuck::pod_collect_to_vec(b)),
                DType::F32 => Storage::F32(bytemuck::pod_collect_to_vec(b)),
                DType::F64 => Storage::F64(bytemuck::pod_collect_to_vec(b)),
                DType::I8 => Storage::I8(bytemuck::pod_collect_to_vec(b)),
                DType::I16 => Storage::I16(bytemuck::pod_collect_to_vec(b)),
                DType::I32 => Storage::I32(bytemuck::pod_collect_to_vec(b)),
                DType::I64 => Storage::I64(bytemuck::pod_collect_to_vec(b)),
                DType::U8 => Storage::U8(b.to_vec()),
                DType::U16 => Storage::U16(bytemuck::pod_collect_to_vec(b)),
                DType::U32 => Storage::U32(bytemuck::pod_collect_to_vec(b)),
                DType::U64 => Storage::U64(bytemuck::pod_collect_to_vec(b)),
                DType::Bool => Storage::Bool(b.to_vec()),
            }
        }

        /// An owned copy of external storage (owned storage is cloned).
        fn to_owned_storage(&self) -> Storage {
            match self {
                Storage::Aligned { dtype, mem } => Storage::Aligned {
                    dtype: *dtype,
                    mem: mem.clone(),
                },
                Storage::External { dtype, mem } => {
                    let mut s = Storage::zeros(*dtype, self.len());
                    s.bytes_mut().copy_from_slice(mem.bytes());
                    s
                }
                Storage::F16(v) => Storage::F16(v.clone()),
                Storage::BF16(v) => Storage::BF16(v.clone()),
                Storage::F32(v) => Storage::F32(v.clone()),
                Storage::F64(v) => Storage::F64(v.clone()),
                Storage::I8(v) => Storage::I8(v.clone()),
                Storage::I16(v) => Storage::I16(v.clone()),
                Storage::I32(v) => Storage::I32(v.clone()),
                Storage::I64(v) => Storage::I64(v.clone()),
                Storage::U8(v) => Storage::U8(v.clone()),
                Storage::U16(v) => Storage::U16(v.clone()),
                Storage::U32(v) => Storage::U32(v.clone()),
                Storage::U64(v) => Storage::U64(v.clone()),
                Storage::Bool(v) => Storage::Bool(v.clone()),
            }
        }
    }

    impl Clone for Storage {
        /// A clone of external storage owns a copy of its data.
        fn clone(&self) -> Self {
            self.to_owned_storage()
        }
    }

    impl PartialEq for Storage {
        /// Same dtype and equal elements (floats compare as numbers, so NaN is
        /// never equal), wherever the data lives.
        fn eq(&self, other: &Self) -> bool {
            match (self, other) {
                (Storage::F16(a), Storage::F16(b)) => a == b,
                (Storage::BF16(a), Storage::BF16(b)) => a == b,
                (Storage::F32(a), Storage::F32(b)) => a == b,
                (Storage::F64(a), Storage::F64(b)) => a == b,
                (Storage::I8(a), Storage::I8(b)) => a == b,
                (Storage::I16(a), Storage::I16(b)) => a == b,
                (Storage::I32(a), Storage::I32(b)) => a == b,
                (Storage::I64(a), Storage::I64(b)) => a == b,
                (Storage::U8(a), Storage::U8(b)) => a == b,
                (Storage::U16(a), Storage::U16(b)) => a == b,
                (Storage::U32(a), Storage::U32(b)) => a == b,
                (Storage::U64(a), Storage::U64(b)) => a == b,
                (Storage::Bool(a), Storage::Bool(b)) => a == b,
                (a, b) if a.is_bytes() || b.is_bytes() => a.dtype() == b.dtype() && a.typed() == b.typed(),
                _ => false,
            }
        }
    }
}

#[doc(hidden)]
pub use storage::Storage;

/// Size from which a tensor the runtime allocates ([`Tensor::zeros`]) gets
/// 64-byte aligned memory instead of a typed `Vec`. Measured reason: the
/// kernel copies a socket's bytes several times slower into or out of a
/// buffer that sits 16 bytes into a page, which is where the C allocator puts
/// every large (memory-mapped) block: a 1 MiB ping-pong between two
/// processes took 545 µs with such buffers and 172-193 µs with aligned ones
/// (see docs/benchmarks.md).
pub const ALIGNED_FROM: usize = 4096;

pub use crate::huge_pages::HUGE_PAGES_FROM;

/// Alignment of [`AlignedBytes`]: a cache line.
pub const ALIGNMENT: usize = 64;

/// Owned, zero-initialised bytes whose first byte is [`ALIGNMENT`]-aligned:
/// a `Vec<u8>` with up to `ALIGNMENT - 1` unused bytes in front (safe code,
/// no custom allocation; the zeroed allocation maps its pages lazily).
#[doc(hidden)]
pub struct AlignedBytes {
    buf: Vec<u8>,
    at: usize,
    len: usize,
}

impl AlignedBytes {
    /// `len` zero bytes, aligned; from [`HUGE_PAGES_FROM`] bytes on, in
    /// huge pages where the system has them (see `huge_pages`).
    pub fn zeroed(len: usize) -> Self {
        let buf = vec![0u8; len.saturating_add(ALIGNMENT - 1)];
        if len >= HUGE_PAGES_FROM {
            crate::huge_pages::advise(&buf);
        }
        // Always below ALIGNMENT for a byte pointer; `min` keeps the slice in
        // bounds even if it were not (the data would then merely be unaligned).
        let at = buf.as_ptr().align_offset(ALIGNMENT).min(ALIGNMENT - 1);
        AlignedBytes { buf, at, len }
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.buf[self.at..self.at + self.len]
    }

    /// The bytes, writable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.buf[self.at..self.at + self.len]
    }

    /// The whole allocation and the range of it that holds the bytes.
    pub fn into_parts(self) -> (Vec<u8>, std::ops::Range<usize>) {
        let range = self.at..self.at + self.len;
        (self.buf, range)
    }
}

impl Clone for AlignedBytes {
    /// A new aligned allocation with the same bytes.
    fn clone(&self) -> Self {
        let mut c = AlignedBytes::zeroed(self.len);
        c.bytes_mut().copy_from_slice(self.bytes());
        c
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A Rust type that can be a tensor element. Implemented for `f16`, `bf16`
/// (from the `half` crate, re-exported by this crate), `f32`, `f64`, `i8`..`i64`,
/// `u8`..`u64` and `bool`; sealed.
pub trait Element: sealed::Sealed + Copy + Send + Sync + fmt::Debug + PartialEq + 'static {
    /// The dtype of this element type.
    const DTYPE: DType;
    #[doc(hidden)]
    fn into_storage(v: Vec<Self>) -> Storage;
    #[doc(hidden)]
    fn slice(s: &Storage) -> Option<&[Self]>;
    #[doc(hidden)]
    fn slice_mut(s: &mut Storage) -> Option<&mut [Self]>;
    #[doc(hidden)]
    fn into_vec(s: Storage) -> std::result::Result<Vec<Self>, Storage>;
    #[doc(hidden)]
    fn as_bytes(v: &[Self]) -> &[u8];
}

macro_rules! pod_element {
    ($t:ty, $variant:ident) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = DType::$variant;
            fn into_storage(v: Vec<Self>) -> Storage {
                Storage::$variant(v)
            }
            fn slice(s: &Storage) -> Option<&[Self]> {
                match s {
                    Storage::$variant(v) => Some(v),
                    s if s.is_bytes() && s.dtype() == DType::$variant => {
                        bytemuck::try_cast_slice(s.bytes()).ok()
                    }
                    _ => None,
                }
            }
            fn slice_mut(s: &mut Storage) -> Option<&mut [Self]> {
                match s {
                    Storage::$variant(v) => Some(v),
                    s if s.is_bytes() && s.dtype() == DType::$variant => {
                        bytemuck::try_cast_slice_mut(s.bytes_mut()).ok()
                    }
                    _ => None,
                }
            }
            fn into_vec(s: Storage) -> std::result::Result<Vec<Self>, Storage> {
                match s {
                    Storage::$variant(v) => Ok(v),
                    s if s.is_bytes() && s.dtype() == DType::$variant => {
                        Ok(bytemuck::pod_collect_to_vec(s.bytes()))
                    }
                    other => Err(other),
                }
            }
            fn as_bytes(v: &[Self]) -> &[u8] {
                bytemuck::cast_slice(v)
            }
        }
    };
}

pod_element!(f16, F16);
pod_element!(bf16, BF16);
pod_element!(f32, F32);
pod_element!(f64, F64);
pod_element!(i8, I8);
pod_element!(i16, I16);
pod_element!(i32, I32);
pod_element!(i64, I64);
pod_element!(u8, U8);
pod_element!(u16, U16);
pod_element!(u32, U32);
pod_element!(u64, U64);

impl sealed::Sealed for bool {}
impl Element for bool {
    const DTYPE: DType = DType::Bool;
    fn into_storage(v: Vec<Self>) -> Storage {
        // Same size and alignment: reinterprets the allocation, no copy.
        Storage::Bool(bytemuck::allocation::cast_vec(v))
    }
    fn slice(s: &Storage) -> Option<&[Self]> {
        match s {
            // Validates every byte (cheap next to any use of the data); cannot fail
            // while the 0/1 invariant holds.
            Storage::Bool(v) => bytemuck::checked::try_cast_slice(v).ok(),
            s if s.is_bytes() && s.dtype() == DType::Bool => {
                bytemuck::checked::try_cast_slice(s.bytes()).ok()
            }
            _ => None,
        }
    }
    fn slice_mut(s: &mut Storage) -> Option<&mut [Self]> {
        match s {
            Storage::Bool(v) => bytemuck::checked::try_cast_slice_mut(v).ok(),
            s if s.is_bytes() && s.dtype() == DType::Bool => {
                bytemuck::checked::try_cast_slice_mut(s.bytes_mut()).ok()
            }
            _ => None,
        }
    }
    fn into_vec(s: Storage) -> std::result::Result<Vec<Self>, Storage> {
        match s {
            // Safe Rust cannot reinterpret Vec<u8> as Vec<bool>: this one copies.
            Storage::Bool(v) => Ok(v.into_iter().map(|b| b != 0).collect()),
            s if s.is_bytes() && s.dtype() == DType::Bool => Ok(s.bytes().iter().map(|&b| b != 0).collect()),
            other => Err(other),
        }
    }
    fn as_bytes(v: &[Self]) -> &[u8] {
        bytemuck::cast_slice(v)
    }
}

/// Host memory a [`Tensor`] works on without owning it (see
/// [`Tensor::from_external`]): for example a Python array's buffer, so that a
/// receive or a collective writes its result where the caller wants it, with
/// no copy. Dropping the value ends the loan; whoever lends the memory can
/// watch for that drop to know the runtime no longer touches it.
///
/// Both methods must return the same region (address and length) at every
/// call, and nothing else may write it while the value lives.
pub trait ExternalMemory: Send + Sync + 'static {
    /// The memory, read-only.
    fn bytes(&self) -> &[u8];
    /// The memory, writable.
    fn bytes_mut(&mut self) -> &mut [u8];
    /// Whether the memory is page-locked ("pinned"): a device's DMA engine
    /// may read and write it while the host does not wait, so a device copy
    /// can target it directly instead of going through staging memory.
    /// `false` unless the implementation knows it is (a wrong `true` makes
    /// such a copy wait on the host, inside the driver, for the copy itself).
    fn page_locked(&self) -> bool {
        false
    }
}

/// An n-dimensional array of one dtype over contiguous host memory (row-major).
#[derive(Clone, PartialEq)]
pub struct Tensor {
    shape: Vec<usize>,
    storage: Storage,
}

impl Default for Tensor {
    /// An empty one-dimensional `float32` tensor (shape `[0]`).
    fn default() -> Self {
        Tensor {
            shape: vec![0],
            storage: Storage::F32(Vec::new()),
        }
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tensor")
            .field("dtype", &self.dtype())
            .field("shape", &self.shape)
            .finish_non_exhaustive()
    }
}

/// The byte size of `n` elements of `dtype` (shape `shape`, for the
/// message): refused above what one allocation can hold (`isize::MAX` less
/// the alignment slack of [`AlignedBytes`]), where allocating would panic.
fn byte_size(dtype: DType, shape: &[usize], n: usize) -> Result<usize> {
    const MAX_BYTES: usize = isize::MAX as usize - ALIGNMENT;
    n.checked_mul(dtype.size())
        .filter(|&b| b <= MAX_BYTES)
        .ok_or_else(|| {
            Error::new(format!(
                "shape {shape:?} of {dtype} is larger than any allocation"
            ))
        })
}

fn numel_of(shape: &[usize]) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| Error::new(format!("shape {shape:?} overflows usize")))
}

impl Tensor {
    /// Wraps `data` with `shape` without copying; fails if the shape's element count
    /// is not `data.len()`.
    pub fn from_vec<T: Element>(data: Vec<T>, shape: impl Into<Vec<usize>>) -> Result<Self> {
        let shape = shape.into();
        let n = numel_of(&shape)?;
        if n != data.len() {
            return Err(Error::new(format!(
                "shape {shape:?} has {n} elements but the data has {}",
                data.len()
            )));
        }
        Ok(Tensor {
            shape,
            storage: T::into_storage(data),
        })
    }

    /// A tensor of zeros (or `false`). From [`ALIGNED_FROM`] bytes on its
    /// data is 64-byte aligned (sockets copy into and out of such memory
    /// faster; see [`ALIGNED_FROM`]), which [`Tensor::into_vec`] then copies
    /// (`Tensor::from_vec` keeps the caller's `Vec`).
    pub fn zeros(dtype: DType, shape: impl Into<Vec<usize>>) -> Result<Self> {
        let shape = shape.into();
        let n = numel_of(&shape)?;
        byte_size(dtype, &shape, n)?;
        Ok(Tensor {
            shape,
            storage: Storage::zeros(dtype, n),
        })
    }

    /// A tensor copied from raw little-endian bytes (this copies). Fails if the byte
    /// count does not fit the shape, or if a `bool` byte is not 0 or 1.
    pub fn from_bytes(dtype: DType, shape: impl Into<Vec<usize>>, bytes: &[u8]) -> Result<Self> {
        let shape = shape.into();
        // Checked before anything is allocated: a wrong shape must not
        // allocate what it claims.
        let want = byte_size(dtype, &shape, numel_of(&shape)?)?;
        if want != bytes.len() {
            return Err(Error::new(format!(
                "{} bytes do not fit {shape:?} of {dtype} ({want} bytes)",
                bytes.len(),
            )));
        }
        let mut t = Tensor::zeros(dtype, shape)?;
        if dtype == DType::Bool && !valid_bool_bytes(bytes) {
            return Err(Error::new("bool bytes must be 0 or 1"));
        }
        t.storage.bytes_mut().copy_from_slice(bytes);
        Ok(t)
    }

    /// A tensor over memory it does not own (no copy): everything written to
    /// the tensor lands in `mem`, and dropping the tensor drops `mem`. Fails
    /// if the memory's length is not the shape's byte size, if its address is
    /// not aligned to the element size, or if a `bool` byte is not 0 or 1.
    /// Cloning such a tensor, or taking its data with [`Tensor::into_vec`],
    /// copies; [`Tensor::take_storage_from`] copies into it.
    pub fn from_external(
        dtype: DType,
        shape: impl Into<Vec<usize>>,
        mem: Box<dyn ExternalMemory>,
    ) -> Result<Self> {
        let shape = shape.into();
        let n = numel_of(&shape)?;
        let bytes = mem.bytes();
        if Some(bytes.len()) != n.checked_mul(dtype.size()) {
            return Err(Error::new(format!(
                "{} bytes do not fit {shape:?} of {dtype}",
                bytes.len()
            )));
        }
        if bytes.as_ptr().align_offset(dtype.size()) != 0 {
            return Err(Error::new(format!(
                "memory at {:p} is not aligned for {dtype} ({} bytes)",
                bytes.as_ptr(),
                dtype.size()
            )));
        }
        if dtype == DType::Bool && !valid_bool_bytes(bytes) {
            return Err(Error::new("bool bytes must be 0 or 1"));
        }
        Ok(Tensor {
            shape,
            storage: Storage::External { dtype, mem },
        })
    }

    /// Whether the data lives in memory lent through [`Tensor::from_external`].
    pub fn is_external(&self) -> bool {
        self.storage.is_external()
    }

    /// Whether the data lives in external memory that says it is page-locked
    /// ([`ExternalMemory::page_locked`]).
    pub fn is_page_locked(&self) -> bool {
        self.storage.is_page_locked()
    }

    /// This tensor with data it owns: itself, or for a tensor over external
    /// memory a copy (which ends the loan). For whoever keeps a tensor beyond
    /// the call it was lent for.
    pub fn into_owned(self) -> Tensor {
        if self.is_external() { self.clone() } else { self }
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.storage.dtype()
    }

    /// Dimensions, row-major.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.storage.len()
    }

    /// Size of the data in bytes.
    pub fn nbytes(&self) -> usize {
        self.storage.bytes().len()
    }

    /// True when the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.numel() == 0
    }

    /// Changes the shape (same element count), without touching the data.
    pub fn reshape(&mut self, shape: impl Into<Vec<usize>>) -> Result<()> {
        let shape = shape.into();
        let n = numel_of(&shape)?;
        if n != self.numel() {
            return Err(Error::new(format!(
                "cannot reshape {:?} ({} elements) to {shape:?} ({n} elements)",
                self.shape,
                self.numel()
            )));
        }
        self.shape = shape;
        Ok(())
    }

    /// The data as a typed slice (no copy); fails if `T` is not the dtype.
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        T::slice(&self.storage).ok_or_else(|| self.wrong_type(T::DTYPE))
    }

    /// The data as a mutable typed slice (no copy); fails if `T` is not the dtype.
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T]> {
        let dtype = self.dtype();
        T::slice_mut(&mut self.storage).ok_or_else(|| wrong_type(dtype, T::DTYPE))
    }

    /// Gives the data back as a `Vec<T>`: no copy for a tensor made from a
    /// `Vec`; a copy for `bool`, whose bytes are re-collected, for external
    /// memory, and for the aligned memory of a large [`Tensor::zeros`]. On a
    /// dtype mismatch the tensor is returned unchanged.
    pub fn into_vec<T: Element>(self) -> std::result::Result<Vec<T>, Tensor> {
        let Tensor { shape, storage } = self;
        T::into_vec(storage).map_err(|storage| Tensor { shape, storage })
    }

    /// For a tensor whose data is the aligned memory of a large
    /// [`Tensor::zeros`]: that memory without a copy, as the whole
    /// allocation and the range of it that holds the data (64-byte aligned),
    /// for whoever hands the data on as bytes (the Python package gives it to
    /// numpy and views the range). Any other tensor comes back unchanged.
    #[doc(hidden)]
    pub fn into_aligned_parts(self) -> std::result::Result<(Vec<u8>, std::ops::Range<usize>), Tensor> {
        match self.storage {
            Storage::Aligned { mem, .. } => Ok(mem.into_parts()),
            storage => Err(Tensor {
                shape: self.shape,
                storage,
            }),
        }
    }

    /// The data as bytes in native (on every supported target: little-endian) order.
    pub fn as_bytes(&self) -> &[u8] {
        self.storage.bytes()
    }

    /// A borrowed read-only view, e.g. for a transport's send.
    pub fn view(&self) -> TensorView<'_> {
        TensorView {
            dtype: self.dtype(),
            bytes: self.as_bytes(),
        }
    }

    /// Raw mutable bytes, for a receive path writing a message in place. For
    /// `bool` the writer must call [`Tensor::validate_after_write`] afterwards;
    /// until then typed reads of a `bool` tensor holding a byte other than 0 or 1
    /// fail (they are checked), never misbehave.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        self.storage.bytes_mut()
    }

    /// Restores the `bool` invariant after raw bytes were written: returns false (and
    /// zeroes the data, so the tensor is still valid) if any byte was not 0 or 1.
    pub fn validate_after_write(&mut self) -> bool {
        if self.dtype() == DType::Bool {
            let bytes = self.storage.bytes_mut();
            if !valid_bool_bytes(bytes) {
                bytes.fill(0);
                return false;
            }
        }
        true
    }

    /// Moves `other`'s data into `self`, keeping `self`'s shape (no copy; if
    /// `self` is over external memory, the data is copied into that memory, so
    /// it stays where its lender expects it). Refused, giving `other` back,
    /// unless both have the same dtype and number of elements.
    pub fn take_storage_from(&mut self, other: Tensor) -> std::result::Result<(), Tensor> {
        if other.dtype() != self.dtype() || other.storage.len() != self.storage.len() {
            return Err(other);
        }
        if self.storage.is_external() {
            self.storage.bytes_mut().copy_from_slice(other.storage.bytes());
        } else {
            self.storage = other.storage;
        }
        Ok(())
    }

    fn wrong_type(&self, wanted: DType) -> Error {
        wrong_type(self.dtype(), wanted)
    }
}

fn wrong_type(have: DType, wanted: DType) -> Error {
    if have == wanted {
        // Only a bool view fails on its own dtype: a byte written through
        // `bytes_mut` that is not 0 or 1.
        return Error::new(format!("{have} tensor holds a byte other than 0 or 1"));
    }
    Error::new(format!("tensor holds {have}, not {wanted}"))
}

impl<T: Element> From<Vec<T>> for Tensor {
    /// A one-dimensional tensor over `data`, without copying.
    fn from(data: Vec<T>) -> Self {
        Tensor {
            shape: vec![data.len()],
            storage: T::into_storage(data),
        }
    }
}

/// A borrowed, read-only, flat view of tensor data: what a send needs (dtype and
/// bytes). Built from a [`Tensor`], a slice or a `Vec` reference without copying.
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    dtype: DType,
    bytes: &'a [u8],
}

impl<'a> TensorView<'a> {
    /// A view of raw native-endian bytes as elements of `dtype`, without
    /// copying. Fails if the length is not a whole number of elements, or if
    /// a `bool` byte is not 0 or 1.
    pub fn from_bytes(dtype: DType, bytes: &'a [u8]) -> Result<Self> {
        if bytes.len() % dtype.size() != 0 {
            return Err(Error::new(format!(
                "{} bytes is not a whole number of {dtype} elements",
                bytes.len()
            )));
        }
        if dtype == DType::Bool && !valid_bool_bytes(bytes) {
            return Err(Error::new("bool bytes must be 0 or 1"));
        }
        Ok(TensorView { dtype, bytes })
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The data as bytes.
    pub fn as_bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.bytes.len() / self.dtype.size()
    }
}

impl<'a> From<&'a Tensor> for TensorView<'a> {
    fn from(t: &'a Tensor) -> Self {
        t.view()
    }
}

impl<'a, T: Element> From<&'a [T]> for TensorView<'a> {
    fn from(s: &'a [T]) -> Self {
        TensorView {
            dtype: T::DTYPE,
            bytes: T::as_bytes(s),
        }
    }
}

impl<'a, T: Element> From<&'a Vec<T>> for TensorView<'a> {
    fn from(s: &'a Vec<T>) -> Self {
        TensorView::from(s.as_slice())
    }
}

impl<'a, T: Element, const N: usize> From<&'a [T; N]> for TensorView<'a> {
    fn from(s: &'a [T; N]) -> Self {
        TensorView::from(s.as_slice())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    /// Sizes no allocation can hold are errors, never a panic; a byte count
    /// that does not fit the shape is refused before anything is allocated.
    #[test]
    fn impossible_sizes_are_errors_not_panics() {
        for (dtype, n) in [
            (DType::U8, isize::MAX as usize),
            (DType::U8, usize::MAX),
            (DType::F64, usize::MAX / 8),
            (DType::F32, isize::MAX as usize / 4 + 1),
        ] {
            let e = Tensor::zeros(dtype, [n]).unwrap_err();
            assert!(e.to_string().contains("larger than any allocation"), "{e}");
        }
        let e = Tensor::zeros(DType::U16, [1 << 40, 1 << 40]).unwrap_err();
        assert!(e.to_string().contains("overflows"), "{e}");
        // A claimed 1 TiB with four bytes in hand: refused without allocating.
        let e = Tensor::from_bytes(DType::U8, [1usize << 40], &[0; 4]).unwrap_err();
        assert!(e.to_string().contains("4 bytes do not fit"), "{e}");
        assert!(Tensor::from_bytes(DType::U8, [isize::MAX as usize], &[0; 4]).is_err());
        let t = Tensor::from_bytes(DType::U16, [2], &[1, 0, 2, 0]).unwrap();
        assert_eq!(t.as_slice::<u16>().unwrap(), &[1, 2]);
    }

    #[test]
    fn dtype_codes_roundtrip_and_are_unique() {
        let mut seen = std::collections::HashSet::new();
        for d in DType::ALL {
            assert_ne!(d.code(), 0);
            assert!(seen.insert(d.code()));
            assert_eq!(DType::from_code(d.code()), Some(d));
            assert!(!d.name().is_empty());
        }
        assert_eq!(DType::from_code(0), None);
        assert_eq!(DType::from_code(200), None);
        assert_eq!(DType::F32.to_string(), "float32");
        assert_eq!(DType::BF16.size(), 2);
    }

    fn check_zero_copy<T: Element + Default>(vals: Vec<T>) {
        let ptr = vals.as_ptr();
        let n = vals.len();
        let t = Tensor::from_vec(vals.clone(), vec![n]).unwrap();
        assert_eq!(t.dtype(), T::DTYPE);
        assert_eq!(t.nbytes(), n * T::DTYPE.size());
        assert_eq!(t.as_slice::<T>().unwrap(), &vals[..]);
        // from_vec keeps the allocation: view it from the original vec directly.
        let t2 = Tensor::from(vals);
        assert_eq!(t2.as_slice::<T>().unwrap().as_ptr(), ptr);
        assert_eq!(t2.as_bytes().as_ptr() as usize, ptr as usize);
        if T::DTYPE != DType::Bool {
            let back = t2.into_vec::<T>().unwrap();
            assert_eq!(back.as_ptr(), ptr, "into_vec must not copy");
        }
    }

    #[test]
    fn all_dtypes_zero_copy() {
        check_zero_copy(vec![f16::from_f32(1.5), f16::from_f32(-2.0)]);
        check_zero_copy(vec![bf16::from_f32(1.5), bf16::from_f32(-2.0)]);
        check_zero_copy(vec![1.0f32, 2.0, 3.0]);
        check_zero_copy(vec![1.0f64, -2.0]);
        check_zero_copy(vec![-1i8, 2]);
        check_zero_copy(vec![-1i16, 2]);
        check_zero_copy(vec![-1i32, 2]);
        check_zero_copy(vec![-1i64, 2]);
        check_zero_copy(vec![1u8, 2]);
        check_zero_copy(vec![1u16, 2]);
        check_zero_copy(vec![1u32, 2]);
        check_zero_copy(vec![1u64, 2]);
        check_zero_copy(vec![true, false, true]);
    }

    #[test]
    fn a_bool_view_of_bytes_other_than_0_or_1_says_so() {
        let mut t = Tensor::zeros(DType::Bool, [3]).unwrap();
        t.bytes_mut()[1] = 2;
        let e = t.as_slice::<bool>().unwrap_err().to_string();
        assert!(e.contains("other than 0 or 1") && !e.contains("not bool"), "{e}");
        let e = t.as_mut_slice::<bool>().unwrap_err().to_string();
        assert!(e.contains("other than 0 or 1"), "{e}");
    }

    #[test]
    fn wrong_type_views_fail() {
        let mut t = Tensor::from(vec![1.0f32, 2.0]);
        assert!(t.as_slice::<f64>().is_err());
        assert!(t.as_mut_slice::<i32>().is_err());
        let t = t.into_vec::<u8>().unwrap_err();
        assert_eq!(t.dtype(), DType::F32);
    }

    #[test]
    fn shapes() {
        let mut t = Tensor::from_vec(vec![0i32; 6], [2, 3]).unwrap();
        assert_eq!(t.shape(), &[2, 3]);
        t.reshape([3, 2]).unwrap();
        assert!(t.reshape([4, 2]).is_err());
        assert!(Tensor::from_vec(vec![0i32; 5], [2, 3]).is_err());
        assert!(Tensor::zeros(DType::F64, [usize::MAX, 2]).is_err());
        let z = Tensor::zeros(DType::Bool, [4]).unwrap();
        assert_eq!(z.as_slice::<bool>().unwrap(), &[false; 4]);
        let scalar = Tensor::zeros(DType::F32, Vec::new()).unwrap();
        assert_eq!(scalar.numel(), 1);
        assert!(Tensor::default().is_empty());
    }

    #[test]
    fn bool_invariant() {
        assert!(Tensor::from_bytes(DType::Bool, [2], &[0, 2]).is_err());
        let t = Tensor::from_bytes(DType::Bool, [2], &[1, 0]).unwrap();
        assert_eq!(t.as_slice::<bool>().unwrap(), &[true, false]);
        let mut t = Tensor::zeros(DType::Bool, [3]).unwrap();
        t.bytes_mut().copy_from_slice(&[1, 7, 0]);
        assert!(!t.validate_after_write());
        assert_eq!(t.as_slice::<bool>().unwrap(), &[false; 3]);
        let mut t = Tensor::zeros(DType::Bool, [2]).unwrap();
        t.as_mut_slice::<bool>().unwrap()[1] = true;
        assert_eq!(t.as_bytes(), &[0, 1]);
        assert_eq!(t.into_vec::<bool>().unwrap(), vec![false, true]);
    }

    #[test]
    fn from_bytes_checks_size() {
        assert!(Tensor::from_bytes(DType::F32, [2], &[0; 7]).is_err());
        let t = Tensor::from_bytes(DType::U16, [2], &[1, 0, 2, 0]).unwrap();
        assert_eq!(t.as_slice::<u16>().unwrap(), &[1, 2]);
    }

    #[test]
    fn views() {
        let v = vec![1u32, 2, 3];
        let view = TensorView::from(&v);
        assert_eq!(view.dtype(), DType::U32);
        assert_eq!(view.numel(), 3);
        assert_eq!(view.as_bytes().as_ptr() as usize, v.as_ptr() as usize);
        let t = Tensor::from(vec![true]);
        assert_eq!(TensorView::from(&t).as_bytes(), &[1]);
        let arr = [1i8, 2];
        assert_eq!(TensorView::from(&arr).dtype(), DType::I8);
    }

    #[test]
    fn large_zeros_are_aligned_and_behave_like_vec_tensors() {
        for dtype in [DType::F32, DType::F64, DType::U8, DType::Bool, DType::BF16] {
            let n = ALIGNED_FROM / dtype.size() + 3;
            let mut t = Tensor::zeros(dtype, [n]).unwrap();
            assert_eq!(t.as_bytes().as_ptr() as usize % ALIGNMENT, 0, "{dtype}");
            assert_eq!(t.nbytes(), n * dtype.size());
            assert!(t.as_bytes().iter().all(|&b| b == 0));
            assert!(!t.is_external());
            t.bytes_mut()[0] = 1;
            let c = t.clone();
            assert_eq!(c.as_bytes().as_ptr() as usize % ALIGNMENT, 0);
            assert_eq!(c, t);
        }
        // Small ones stay typed vectors (no copy out of them).
        let small = Tensor::zeros(DType::F32, [4]).unwrap();
        assert_eq!(small.into_vec::<f32>().unwrap(), vec![0.0; 4]);
        // Typed access, equality with a Vec tensor, and into_vec (a copy).
        let n = ALIGNED_FROM;
        let mut t = Tensor::zeros(DType::F32, [n]).unwrap();
        t.as_mut_slice::<f32>().unwrap()[n - 1] = f32::NAN;
        t.as_mut_slice::<f32>().unwrap()[0] = -0.0;
        let mut v = vec![0.0f32; n];
        v[n - 1] = f32::NAN;
        assert_ne!(
            t,
            Tensor::from(v.clone()),
            "NaN is never equal, as for Vec tensors"
        );
        v[n - 1] = 2.0;
        t.as_mut_slice::<f32>().unwrap()[n - 1] = 2.0;
        assert_eq!(t, Tensor::from(v.clone()), "-0.0 equals 0.0, as for Vec tensors");
        assert!(t.as_slice::<f64>().is_err());
        assert_eq!(t.into_vec::<f32>().unwrap()[n - 1], 2.0);
        let mut b = Tensor::zeros(DType::Bool, [ALIGNED_FROM]).unwrap();
        b.as_mut_slice::<bool>().unwrap()[5] = true;
        assert_eq!(b.into_vec::<bool>().unwrap().iter().filter(|&&x| x).count(), 1);
        // Handing the aligned memory on as bytes: no copy, the range aligned.
        let mut t = Tensor::zeros(DType::U16, [ALIGNED_FROM]).unwrap();
        t.as_mut_slice::<u16>().unwrap()[1] = 7;
        let at = t.as_bytes().as_ptr() as usize;
        let (buf, range) = t.into_aligned_parts().unwrap();
        assert_eq!(buf[range.clone()].as_ptr() as usize, at);
        assert_eq!(range.len(), 2 * ALIGNED_FROM);
        assert_eq!(&buf[range.start + 2..range.start + 4], &7u16.to_ne_bytes());
        assert!(
            Tensor::zeros(DType::U16, [4])
                .unwrap()
                .into_aligned_parts()
                .is_err()
        );
        // Swapping storage with an aligned tensor keeps it aligned.
        let mut dst = Tensor::zeros(DType::U8, [ALIGNED_FROM]).unwrap();
        dst.take_storage_from(Tensor::zeros(DType::U8, [ALIGNED_FROM]).unwrap())
            .unwrap();
        assert_eq!(dst.as_bytes().as_ptr() as usize % ALIGNMENT, 0);
    }

    /// Page-locked memory (as far as the tensor knows: it asks the memory).
    struct Locked(Vec<u8>);

    impl ExternalMemory for Locked {
        fn bytes(&self) -> &[u8] {
            &self.0
        }
        fn bytes_mut(&mut self) -> &mut [u8] {
            &mut self.0
        }
        fn page_locked(&self) -> bool {
            true
        }
    }

    #[test]
    fn only_external_memory_that_says_so_is_page_locked() {
        let t = Tensor::from_external(DType::U8, [4], Box::new(Locked(vec![0; 4]))).unwrap();
        assert!(t.is_page_locked());
        assert!(!t.clone().is_page_locked(), "a clone owns ordinary memory");
        let (mem, _) = lent(0, 8);
        assert!(
            !Tensor::from_external(DType::U8, [8], mem)
                .unwrap()
                .is_page_locked()
        );
        assert!(!Tensor::zeros(DType::U8, [ALIGNED_FROM]).unwrap().is_page_locked());
        assert!(!Tensor::zeros(DType::F32, [3]).unwrap().is_page_locked());
    }

    /// Lent memory for the tests: a `u64` allocation (so 8-aligned), a window
    /// of it, and a flag set when the loan ends.
    struct Lent {
        buf: Vec<u64>,
        at: usize,
        len: usize,
        dropped: std::sync::Arc<std::sync::atomic::AtomicBool>,
    }

    impl ExternalMemory for Lent {
        fn bytes(&self) -> &[u8] {
            &bytemuck::cast_slice(&self.buf)[self.at..self.at + self.len]
        }
        fn bytes_mut(&mut self) -> &mut [u8] {
            &mut bytemuck::cast_slice_mut(&mut self.buf)[self.at..self.at + self.len]
        }
    }

    impl Drop for Lent {
        fn drop(&mut self) {
            self.dropped.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    fn lent(
        at: usize,
        len: usize,
    ) -> (
        Box<dyn ExternalMemory>,
        std::sync::Arc<std::sync::atomic::AtomicBool>,
    ) {
        let dropped = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mem = Lent {
            buf: vec![0; (at + len).div_ceil(8)],
            at,
            len,
            dropped: dropped.clone(),
        };
        (Box::new(mem), dropped)
    }

    #[test]
    fn external_memory_is_written_in_place_and_released_on_drop() {
        let (mem, dropped) = lent(0, 16);
        let addr = mem.bytes().as_ptr() as usize;
        let mut t = Tensor::from_external(DType::F32, [2, 2], mem).unwrap();
        assert!(t.is_external());
        assert_eq!((t.dtype(), t.numel(), t.nbytes()), (DType::F32, 4, 16));
        assert_eq!(t.as_bytes().as_ptr() as usize, addr, "no copy");
        t.as_mut_slice::<f32>()
            .unwrap()
            .copy_from_slice(&[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(t.as_slice::<f32>().unwrap(), &[1.0, 2.0, 3.0, 4.0]);
        assert!(t.as_slice::<i32>().is_err());
        // Another tensor's data is copied into the lent memory, not swapped in.
        t.take_storage_from(Tensor::from(vec![5.0f32, 6.0, 7.0, 8.0]))
            .unwrap();
        assert!(t.is_external());
        assert_eq!(t.as_bytes().as_ptr() as usize, addr);
        assert_eq!(t.as_slice::<f32>().unwrap(), &[5.0, 6.0, 7.0, 8.0]);
        assert!(t.take_storage_from(Tensor::from(vec![1.0f64; 2])).is_err());
        // Clones and Vecs own copies; equality looks at the elements only.
        let c = t.clone();
        assert!(!c.is_external());
        assert_eq!(c, t);
        assert_ne!(c.as_bytes().as_ptr() as usize, addr);
        assert!(!dropped.load(std::sync::atomic::Ordering::SeqCst));
        let (mem, dropped2) = lent(0, 4);
        let kept = Tensor::from_external(DType::I32, [1], mem).unwrap().into_owned();
        assert!(!kept.is_external() && dropped2.load(std::sync::atomic::Ordering::SeqCst));
        assert_eq!(t.into_vec::<f32>().unwrap(), vec![5.0, 6.0, 7.0, 8.0]);
        assert!(
            dropped.load(std::sync::atomic::Ordering::SeqCst),
            "the loan ends with the tensor"
        );
    }

    #[test]
    fn external_memory_is_checked() {
        let (mem, dropped) = lent(0, 12);
        assert!(
            Tensor::from_external(DType::F32, [4], mem).is_err(),
            "12 bytes are not 4 f32"
        );
        assert!(
            dropped.load(std::sync::atomic::Ordering::SeqCst),
            "a refused loan ends at once"
        );
        let (mem, _) = lent(2, 8);
        let e = Tensor::from_external(DType::F32, [2], mem).unwrap_err();
        assert!(e.to_string().contains("not aligned"), "{e}");
        let (mem, _) = lent(2, 8);
        assert!(
            Tensor::from_external(DType::U16, [4], mem).is_ok(),
            "2-aligned is enough for u16"
        );
        let (mut mem, _) = lent(0, 3);
        mem.bytes_mut().copy_from_slice(&[1, 2, 0]);
        assert!(Tensor::from_external(DType::Bool, [3], mem).is_err());
        let (mut mem, _) = lent(0, 3);
        mem.bytes_mut().copy_from_slice(&[1, 0, 1]);
        let mut t = Tensor::from_external(DType::Bool, [3], mem).unwrap();
        assert_eq!(t.as_slice::<bool>().unwrap(), &[true, false, true]);
        t.bytes_mut()[1] = 9;
        assert!(!t.validate_after_write());
        assert_eq!(
            t.as_bytes(),
            &[0, 0, 0],
            "an invalid write is zeroed in the lent memory"
        );
        assert_eq!(t.into_vec::<bool>().unwrap(), vec![false; 3]);
    }
}
