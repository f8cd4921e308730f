//! The only code that touches registered memory.

use weft_transport::{Device, DeviceCopy, TransportError};

/// A span inside a live registration (checked by the caller under the
/// fabric lock).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Span {
    pub addr: u64,
    pub device: Device,
}

/// Copies `len` bytes from `src` to `dst`.
///
/// Callers guarantee (and check, under the fabric lock, immediately before
/// calling) that `[src.addr, src.addr+len)` lies inside a registration that
/// is still registered with the initiator NIC and `[dst.addr, dst.addr+len)`
/// inside one still registered with the target NIC, with the stated devices.
/// Deregistration takes the same lock, so neither can go away during the copy.
pub(crate) fn copy(
    dst: Span,
    src: Span,
    len: u64,
    device_copy: Option<&dyn DeviceCopy>,
    nic: impl Fn() -> String,
) -> Result<(), TransportError> {
    if len == 0 {
        return Ok(());
    }
    if dst.device != Device::Host || src.device != Device::Host {
        return match device_copy {
            Some(dc) => dc.copy(dst.addr, dst.device, src.addr, src.device, len),
            None => Err(TransportError::Unsupported {
                nic: nic(),
                what: "device memory copy without a DeviceCopy".into(),
            }),
        };
    }
    let n = usize::try_from(len).map_err(|_| TransportError::InvalidArgument {
        nic: nic(),
        what: format!("copy of {len} bytes exceeds the address space"),
    })?;
    let (Ok(s), Ok(d)) = (usize::try_from(src.addr), usize::try_from(dst.addr)) else {
        return Err(TransportError::InvalidArgument {
            nic: nic(),
            what: "address exceeds the address space".into(),
        });
    };
    // SAFETY: both spans lie inside host-memory registrations that are live
    // (checked by the caller under the fabric lock, which deregistration also
    // takes). `MemRegion::new`'s contract makes every registered byte valid
    // for reads and writes and not covered by Rust references assuming
    // exclusive/immutable access while registered. `ptr::copy` is a memmove,
    // so overlapping spans (the same memory registered twice) are fine.
    unsafe {
        std::ptr::copy(s as *const u8, d as *mut u8, n);
    }
    Ok(())
}
