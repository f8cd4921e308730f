//! The verbs domain's data path on the simulated device: conformance
//! check; without a peer-memory client or a dma-buf exporter GPU memory is
//! unsupported and refused.

use crate::common::*;
use weft_transport::{Device, DeviceMemoryPath, Domain, MemRegion, ProgressMode};

#[test]
fn verbs_data_path_conforms() {
    with_seed(3, |seed| {
        let mut sim = Sim::new(seed, 1);
        let d: &mut dyn Domain = &mut sim.hosts[0];
        let p = weft_conformance::data_path::check(d, "verbs").unwrap();
        assert_eq!(p.fabric, "sim0:1"); // device:port
        assert_eq!(p.progress, ProgressMode::Hardware);
        assert!(p.ordered);
        assert_eq!(p.device_memory, DeviceMemoryPath::Unsupported);
        let gpu = mem::zeroed(4096);
        // SAFETY: `gpu` owns the memory and outlives the domain.
        let region = unsafe { MemRegion::new(gpu.region().ptr(), 4096, Device::Cuda(0)) };
        weft_conformance::data_path::check_refusal(d, &region).unwrap();
    });
}
