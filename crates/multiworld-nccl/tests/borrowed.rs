//! `DeviceBuffer::borrowed` against the fake CUDA driver and NCCL of the
//! test kit (`multiworld_testkit::fake_nccl`), whose "device memory" is host
//! memory: a `Vec` owned by the test stands in for memory another library
//! (torch) allocated on the device. Operations over borrowed buffers give
//! the exact results, the buffers check their world like owned ones, and
//! dropping them frees nothing (the allocation count does not move and the
//! owner's memory is still there, and freed once, by its owner).
//!
//! The fake completes collectives of a world of one only (a multi-rank
//! fake communicator has no peers), so the worlds here have one member;
//! values combined across ranks are checked by the GPU tests.

// Test code: a failed unwrap is a failed test; `borrowed` is unsafe.
#![allow(clippy::unwrap_used, clippy::expect_used, unsafe_code)]

use std::time::Duration;

use multiworld_nccl::{CommConfig, DeviceBuffer, NcclComm};
use multiworld_testkit::fake_nccl::fake;
use multiworld_types::{DType, ReduceOp};

const T: Duration = Duration::from_secs(10);

fn cfg() -> CommConfig {
    CommConfig::new(0, 1)
        .with_init_timeout(T)
        .with_op_timeout(T)
        .with_abort_deadline(Duration::from_secs(2))
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

/// A borrowed f32 buffer of `comm` over `v`'s memory.
///
/// SAFETY (of the callers): `v` outlives the buffer and every operation on
/// it, which each test waits for before touching `v` again.
unsafe fn over(comm: &NcclComm, v: &mut [f32]) -> DeviceBuffer {
    unsafe { DeviceBuffer::borrowed(comm, v.as_mut_ptr() as u64, DType::F32, v.len()) }.unwrap()
}

const ALLOCS: usize = 1; // index of the device allocation count in `live()`

#[test]
fn operations_over_borrowed_memory_give_exact_results_and_free_nothing() {
    let (_g, f) = fake();
    let rt = f.runtime().unwrap();
    let comm = NcclComm::init(&rt, &cfg(), &rt.unique_id().unwrap()).unwrap();
    let allocs = f.live()[ALLOCS];

    let x: Vec<f32> = (0..1000).map(|i| (i % 97) as f32 * 0.25 - 7.5).collect();
    let mut src = x.clone();
    // Poisoned: no input holds this value, so a write that did not happen shows.
    let mut dst = vec![f32::from_bits(0xA5A5_A5A5); x.len()];
    {
        let send = unsafe { over(&comm, &mut src) };
        let mut recv = unsafe { over(&comm, &mut dst) };
        assert!(!send.is_owned() && !recv.is_owned());
        assert_eq!((send.len(), send.dtype(), send.device()), (1000, DType::F32, 0));
        assert_eq!(send.device_ptr(), src.as_ptr() as u64);
        comm.all_reduce(&send, &mut recv, ReduceOp::Sum)
            .unwrap()
            .wait()
            .unwrap();
        // Host copies of a borrowed buffer read the owner's memory.
        assert_eq!(recv.to_host_vec(T).unwrap(), f32_bytes(&x));
        assert_eq!(f.live()[ALLOCS], allocs, "borrowing allocates nothing");
    }
    // Dropped: the owner's memory is intact and holds the result.
    assert_eq!(dst, x);
    assert_eq!(
        f.live()[ALLOCS],
        allocs,
        "dropping a borrowed buffer frees nothing"
    );

    // In place, and an upload into borrowed memory.
    let mut v = vec![0f32; 8];
    {
        let mut b = unsafe { over(&comm, &mut v) };
        b.copy_from_host(&f32_bytes(&[1.5; 8]), T).unwrap();
        comm.all_reduce_in_place(&mut b, ReduceOp::Max)
            .unwrap()
            .wait()
            .unwrap();
        comm.broadcast(&mut b, 0).unwrap().wait().unwrap();
        b.reshape([2, 4]).unwrap();
        assert_eq!(b.shape(), &[2, 4]);
    }
    assert_eq!(v, vec![1.5; 8]);

    // Owned and borrowed buffers mix: an owned source into borrowed memory.
    let owned = comm.upload(DType::F32, &f32_bytes(&x)).unwrap();
    let mut out = vec![0f32; x.len()];
    {
        let mut recv = unsafe { over(&comm, &mut out) };
        comm.all_gather(&owned, &mut recv).unwrap().wait().unwrap();
    }
    assert_eq!(out, x);
    drop(owned);
    assert_eq!(f.live()[ALLOCS], allocs, "the owned buffer alone was freed");
    drop(comm);
}

#[test]
fn borrowed_buffers_are_checked_like_owned_ones() {
    let (_g, f) = fake();
    let rt = f.runtime().unwrap();
    let a = NcclComm::init(&rt, &cfg(), &rt.unique_id().unwrap()).unwrap();
    let b = NcclComm::init(&rt, &cfg(), &rt.unique_id().unwrap()).unwrap();

    // A null address is refused unless the buffer is empty; sizes that
    // overflow are refused.
    let err = unsafe { DeviceBuffer::borrowed(&a, 0, DType::F32, 4) }.unwrap_err();
    assert!(err.to_string().contains("null"), "{err}");
    let empty = unsafe { DeviceBuffer::borrowed(&a, 0, DType::F32, 0) }.unwrap();
    assert!(empty.is_empty());
    let err = unsafe { DeviceBuffer::borrowed(&a, 8, DType::F64, usize::MAX / 2) }.unwrap_err();
    assert!(err.to_string().contains("overflows"), "{err}");

    // A borrowed buffer belongs to the world it was made for.
    let mut v = vec![1f32; 4];
    let mut w = vec![0f32; 4];
    {
        let send = unsafe { over(&a, &mut v) };
        let mut recv = unsafe { over(&b, &mut w) };
        let err = a.all_reduce(&send, &mut recv, ReduceOp::Sum).unwrap_err();
        assert!(err.to_string().contains("another communicator"), "{err}");
    }
    assert_eq!(w, vec![0f32; 4], "a refused operation wrote nothing");
    drop((a, b));
}
