//! The libfabric domain's data path over tcp (on `lo`) and shm:
//! conformance check, software progress on both, and GPU memory refused
//! as the path says (these providers are opened without FI_HMEM).

use weft_libfabric::{LibfabricConfig, LibfabricProvider};
use weft_testkit::mem;
use weft_transport::{Device, DeviceMemoryPath, MemRegion, Provider};

fn check(name: &str, cfg: LibfabricConfig) {
    let p = match LibfabricProvider::with_config(cfg) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("SKIP: libfabric {name} unavailable: {e}");
            return;
        }
    };
    let mut d = p.open(0).unwrap();
    let path =
        weft_conformance::data_path::check(d.as_ref(), &format!("libfabric:{name}")).unwrap();
    assert_eq!(path.device_memory, DeviceMemoryPath::Unsupported, "{path}");
    let gpu = mem::zeroed(4096);
    // SAFETY: `gpu` owns the memory and outlives the domain.
    let region = unsafe { MemRegion::new(gpu.region().ptr(), 4096, Device::Cuda(0)) };
    weft_conformance::data_path::check_refusal(d.as_mut(), &region).unwrap();
}

#[test]
fn tcp_data_path_conforms() {
    check("tcp", LibfabricConfig::new("tcp").with_domains(["lo"]));
}

#[test]
fn shm_data_path_conforms() {
    check("shm", LibfabricConfig::new("shm"));
}
