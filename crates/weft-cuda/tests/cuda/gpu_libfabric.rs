//! libfabric with device memory: a provider that advertises FI_HMEM must
//! either register CUDA memory or refuse it with a typed `Unsupported` that
//! says why (the distro libfabric of the GPU machine advertises FI_HMEM on
//! shm but was built without CUDA), and its data-path report must then say
//! device memory is unsupported. Skips without a GPU or without libfabric.

#![cfg(feature = "cuda")]

use crate::common::gpu;
use weft_libfabric::{LibfabricConfig, LibfabricProvider};
use weft_transport::{Access, DeviceMemoryPath, Provider, TransportError};

#[test]
fn hmem_without_cuda_support_is_a_typed_refusal() {
    let Some(g) = gpu("hmem_without_cuda_support_is_a_typed_refusal") else {
        return;
    };
    let p = match LibfabricProvider::with_config(LibfabricConfig::new("shm").with_hmem(true)) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("SKIP: libfabric shm unavailable: {e}");
            return;
        }
    };
    let mut d = p.open(0).expect("open shm with hmem");
    let before = d.data_path().device_memory.clone();
    eprintln!(
        "libfabric {:?}: shm device memory before: {before:?}",
        weft_libfabric::library_version()
    );
    let buf = g.alloc(1 << 20).unwrap();
    // SAFETY: `buf` outlives the registration (deregistered or refused
    // below, before `buf` drops).
    let region = unsafe { buf.region() };
    match d.register(&region, Access::RemoteWrite) {
        Ok(mr) => {
            eprintln!("this libfabric registers CUDA memory on shm");
            assert_ne!(d.data_path().device_memory, DeviceMemoryPath::Unsupported);
            d.deregister(mr.key).unwrap();
        }
        Err(TransportError::Unsupported { what, .. }) => {
            eprintln!("refused: {what}");
            assert!(what.contains("cuda:0"), "{what}");
            assert_eq!(
                d.data_path().device_memory,
                DeviceMemoryPath::Unsupported,
                "the report must follow the refusal"
            );
        }
        Err(e) => panic!("registering CUDA memory on shm: not a typed refusal: {e:?}"),
    }
}
