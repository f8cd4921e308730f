//! The loopback domain's data path (conformance check), and the engine's
//! report over it: host memory direct, GPU memory staged through the
//! fabric's DeviceCopy, and `reg_mr_direct` refusing the staged path.

use std::sync::Arc;

use weft_engine::{DomainGroupSpec, EngineError, Reach, TransferEngine};
use weft_loopback::{Fabric, FabricConfig};
use weft_testkit::mem;
use weft_transport::{
    Device, DeviceCopy, DeviceMemoryPath, MemRegion, ProgressMode, Provider, TransportError,
};

/// Treats "CUDA" memory as host memory (the test buffers are host memory).
struct HostAsCuda;

impl DeviceCopy for HostAsCuda {
    fn copy(
        &self,
        dst: u64,
        _: Device,
        src: u64,
        _: Device,
        len: u64,
    ) -> Result<(), TransportError> {
        // SAFETY: the fabric passes spans inside live registrations; here
        // those are `HostBuffer`s owned by the test.
        unsafe {
            std::ptr::copy(
                src as usize as *const u8,
                dst as usize as *mut u8,
                len as usize,
            )
        };
        Ok(())
    }
}

#[test]
fn domain_data_path_conforms() {
    let fabric = Fabric::new(FabricConfig::adversarial(1));
    let h = fabric.add_host(1);
    let mut d = fabric.provider(h).open(0).unwrap();
    let p = weft_conformance::data_path::check(d.as_ref(), "loopback").unwrap();
    assert_eq!(p.device_memory, DeviceMemoryPath::Unsupported);
    assert_eq!(p.progress, ProgressMode::Hardware);
    let gpu = mem::zeroed(4096);
    // SAFETY: `gpu` owns the memory and outlives the domain.
    let region = unsafe { MemRegion::new(gpu.region().ptr(), 4096, Device::Cuda(0)) };
    weft_conformance::data_path::check_refusal(d.as_mut(), &region).unwrap();
    // With a DeviceCopy, a domain opened afterwards shows the staged path.
    fabric.set_device_copy(Arc::new(HostAsCuda));
    let h2 = fabric.add_host(1);
    let d2 = fabric.provider(h2).open(0).unwrap();
    let p = weft_conformance::data_path::check(d2.as_ref(), "loopback").unwrap();
    assert!(
        matches!(p.device_memory, DeviceMemoryPath::Staged { .. }),
        "{p}"
    );
}

#[test]
fn engine_reports_paths_and_refuses_staged_gpu_memory_when_asked() {
    let fabric = Fabric::new_realtime(FabricConfig::adversarial(2));
    fabric.set_device_copy(Arc::new(HostAsCuda));
    let h = fabric.add_host(2);
    let p = Arc::new(fabric.provider(h));
    let engine = TransferEngine::builder()
        .group(DomainGroupSpec::new(p.clone(), vec![0]))
        .group(DomainGroupSpec::new(p, vec![1]).device(Device::Cuda(0)))
        .build()
        .unwrap();
    let report = engine.data_path_report();
    assert_eq!(report.nics.len(), 2);
    assert_eq!((report.nics[1].group, report.nics[1].nic), (1, 0));
    let text = report.to_string();
    assert!(
        text.contains("provider loopback fabric simulated") && text.contains("staged"),
        "{text}"
    );

    let host = mem::zeroed(4096);
    let (hh, _) = engine.reg_mr_direct(host.region()).unwrap();
    assert_eq!(engine.reach(&hh).unwrap(), vec![Reach::Direct]);

    let gpu = mem::zeroed(4096);
    // SAFETY: `gpu` owns the memory and outlives the engine's registrations.
    let region = unsafe { MemRegion::new(gpu.region().ptr(), 4096, Device::Cuda(0)) };
    match engine.reg_mr_direct(region) {
        Err(EngineError::NotDirect {
            group: 1,
            nic: 0,
            device: Device::Cuda(0),
            path: DeviceMemoryPath::Staged { .. },
            ..
        }) => {}
        other => panic!("expected NotDirect, got {other:?}"),
    }
    // Without the requirement the staged path is taken, and said so.
    let (gh, _) = engine.reg_mr(region).unwrap();
    assert_eq!(engine.reach(&gh).unwrap(), vec![Reach::Staged]);
    engine.unreg_mr(gh).unwrap();
    engine.shutdown();
}
