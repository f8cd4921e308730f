//! Conformance of a backend's [`Domain::data_path`]: the description
//! agrees with the domain's [`weft_transport::Capabilities`], and a path
//! that says GPU memory is unsupported really refuses it.

use weft_transport::{
    Access, DataPath, DeviceMemoryPath, Domain, MemRegion, ProgressMode, TransportError,
};

/// Checks `domain`'s data path against its capabilities; `provider` is
/// what [`DataPath::provider`] must start with (`loopback`,
/// `libfabric:tcp`, `verbs`). Returns the path for further checks.
pub fn check(domain: &dyn Domain, provider: &str) -> Result<DataPath, String> {
    let p = domain.data_path();
    let c = domain.capabilities();
    let nic = &domain.info().name;
    let fail = |what: String| Err(format!("NIC {nic}: data path {p}: {what}"));
    if !p.provider.starts_with(provider) {
        return fail(format!("provider should start with {provider:?}"));
    }
    if p.fabric.is_empty() {
        return fail("no fabric named".into());
    }
    if p.max_write_len != c.max_write_len || p.max_send_len != c.max_send_len {
        return fail(format!(
            "limits differ from the capabilities ({} / {})",
            c.max_write_len, c.max_send_len
        ));
    }
    let progress = if c.software_progress {
        ProgressMode::Software
    } else {
        ProgressMode::Hardware
    };
    if p.progress != progress || p.ordered != c.ordered {
        return fail("progress mode or ordering differs from the capabilities".into());
    }
    let unsupported = p.device_memory == DeviceMemoryPath::Unsupported;
    if unsupported == c.device_memory {
        return fail(format!(
            "GPU memory path disagrees with capabilities.device_memory = {}",
            c.device_memory
        ));
    }
    Ok(p)
}

/// If `domain`'s path says GPU memory is unsupported, registering
/// `device_region` (a region on a CUDA device) must fail with
/// [`TransportError::Unsupported`]. A path that claims support is not
/// exercised here (that needs a GPU).
pub fn check_refusal(domain: &mut dyn Domain, device_region: &MemRegion) -> Result<(), String> {
    if domain.data_path().device_memory != DeviceMemoryPath::Unsupported {
        return Ok(());
    }
    match domain.register(device_region, Access::RemoteWrite) {
        Err(TransportError::Unsupported { .. }) => Ok(()),
        Err(e) => Err(format!("GPU memory refused, but not as Unsupported: {e}")),
        Ok(mr) => {
            let _ = domain.deregister(mr.key);
            Err("the path says GPU memory is unsupported, yet it registered".into())
        }
    }
}
