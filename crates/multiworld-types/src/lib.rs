//! `multiworld-types`: the vocabulary every part of multiworld speaks, with no
//! I/O and no async runtime. The transport (`multiworld-tcp`), the collectives,
//! the NCCL backend and the facade all use these types; none defines its own.
//!
//! Map of the modules:
//!
//! | module | what |
//! |---|---|
//! | `id` | [`Rank`], [`Tag`], [`Generation`], [`WorldName`], [`Source`], [`Identity`], [`Secret`] |
//! | `tags` | the tag partition: user tags, the collectives' reserved range, the runtime's own tags |
//! | `tensor` | [`DType`], [`Element`], [`Tensor`], [`TensorView`], [`ExternalMemory`]: typed host memory, zero-copy from/to `Vec<T>`, slices and lent memory |
//! | `reduce` | [`ReduceOp`], which dtype each is defined for, and the element kernels ([`Kernel`], [`with_type!`]) |
//! | `huge_pages` | large tensors ask the kernel for huge pages ([`HUGE_PAGES_FROM`]): a memory hint, the crate's one system call |
//! | `error` | [`InvalidArgument`], the one error of this crate |

// Tensor payloads go on the wire as their in-memory bytes, and the wire format is
// little-endian.
#[cfg(target_endian = "big")]
compile_error!("multiworld supports little-endian targets only");

mod error;
mod huge_pages;
mod id;
mod reduce;
mod tags;
mod tensor;

pub use error::{InvalidArgument, Result};
pub use half::{bf16, f16};
pub use id::{Generation, Identity, MAX_WORLD_NAME_LEN, Rank, Secret, Source, Tag, WorldName};
pub use reduce::{ElemOp, Kernel, ReduceOp};
pub use tags::{
    GROUP_ID_BITS, INTERNAL_TAG_BIT, MAX_GROUP_ID, Phase, RUNTIME_GROUP_ID, SEQ_BITS, check_user_tag,
    collective_tag, is_internal_tag, runtime_tag,
};
pub use tensor::{
    ALIGNED_FROM, ALIGNMENT, DType, Element, ExternalMemory, HUGE_PAGES_FROM, Tensor, TensorView,
    valid_bool_bytes,
};
