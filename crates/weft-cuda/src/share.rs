//! What one process tells another so that it can map the first one's device
//! memory: [`SharedMemory`], with its byte encoding. Available without the
//! `cuda` feature (a process may carry descriptions it never opens), and
//! parsed as untrusted input: a peer may send anything.

use crate::CudaError;

/// How the exporting process made an allocation openable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum ShareKind {
    /// A legacy CUDA IPC handle (`cuIpcGetMemHandle`) of a `cuMemAlloc`
    /// allocation (what torch's caching allocator hands out by default).
    Legacy {
        /// The opaque `CUipcMemHandle`.
        handle: [u8; 64],
    },
    /// A virtual-memory allocation (`cuMemCreate` with POSIX file
    /// descriptor handles, as torch's expandable segments make): the
    /// exporter keeps the descriptor open and the importer takes a copy with
    /// `pidfd_getfd`.
    PosixFd {
        /// The exporting process.
        pid: i32,
        /// The descriptor's number in the exporting process.
        fd: i32,
        /// The size of the physical allocation.
        size: u64,
    },
}

/// A range of device memory another process can map: which allocation (and
/// how to open it), where the range starts in it, how long it is, and on
/// which GPU it lives.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SharedMemory {
    /// The allocation and how to open it.
    pub kind: ShareKind,
    /// Offset of the range from the allocation's first byte.
    pub offset: u64,
    /// Length of the range in bytes (not 0).
    pub len: u64,
    /// The UUID of the GPU the memory is on; an import on another GPU is
    /// refused.
    pub device_uuid: [u8; 16],
}

const MAGIC: [u8; 4] = *b"WSHM";
const VERSION: u8 = 1;
const TAG_LEGACY: u8 = 1;
const TAG_FD: u8 = 2;
/// Magic, version, tag, offset, len, uuid.
const FIXED: usize = 4 + 1 + 1 + 8 + 8 + 16;

impl SharedMemory {
    /// The allocation's identity: two descriptions with the same key name
    /// the same allocation of the same exporter (an importer maps it once).
    pub fn allocation(&self) -> (ShareKind, [u8; 16]) {
        (self.kind, self.device_uuid)
    }

    /// The encoding [`SharedMemory::from_bytes`] reads.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(FIXED + 64);
        v.extend_from_slice(&MAGIC);
        v.push(VERSION);
        match self.kind {
            ShareKind::Legacy { .. } => v.push(TAG_LEGACY),
            ShareKind::PosixFd { .. } => v.push(TAG_FD),
        }
        v.extend_from_slice(&self.offset.to_le_bytes());
        v.extend_from_slice(&self.len.to_le_bytes());
        v.extend_from_slice(&self.device_uuid);
        match self.kind {
            ShareKind::Legacy { handle } => v.extend_from_slice(&handle),
            ShareKind::PosixFd { pid, fd, size } => {
                v.extend_from_slice(&pid.to_le_bytes());
                v.extend_from_slice(&fd.to_le_bytes());
                v.extend_from_slice(&size.to_le_bytes());
            }
        }
        v
    }

    /// Parses [`SharedMemory::to_bytes`]' encoding. Anything else (another
    /// version, a truncated or padded buffer, a zero length, a range that
    /// overflows or lies outside a described allocation, a negative pid or
    /// descriptor) is an [`CudaError::InvalidArgument`].
    pub fn from_bytes(b: &[u8]) -> Result<SharedMemory, CudaError> {
        let bad = |what: &str| CudaError::InvalidArgument {
            device: "cuda-ipc".into(),
            what: format!("shared-memory description: {what}"),
        };
        if b.len() < FIXED {
            return Err(bad("too short"));
        }
        if b[..4] != MAGIC {
            return Err(bad("not a weft shared-memory description"));
        }
        if b[4] != VERSION {
            return Err(bad(&format!(
                "version {} (this build reads {VERSION})",
                b[4]
            )));
        }
        let u64_at = |at: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[at..at + 8]);
            u64::from_le_bytes(x)
        };
        let offset = u64_at(6);
        let len = u64_at(14);
        let mut device_uuid = [0u8; 16];
        device_uuid.copy_from_slice(&b[22..38]);
        let rest = &b[FIXED..];
        let kind = match b[5] {
            TAG_LEGACY => {
                let handle: [u8; 64] = rest.try_into().map_err(|_| bad("legacy handle length"))?;
                ShareKind::Legacy { handle }
            }
            TAG_FD => {
                if rest.len() != 16 {
                    return Err(bad("descriptor part length"));
                }
                let i32_at = |at: usize| {
                    let mut x = [0u8; 4];
                    x.copy_from_slice(&rest[at..at + 4]);
                    i32::from_le_bytes(x)
                };
                let (pid, fd) = (i32_at(0), i32_at(4));
                let mut s = [0u8; 8];
                s.copy_from_slice(&rest[8..16]);
                let size = u64::from_le_bytes(s);
                if pid <= 0 || fd < 0 {
                    return Err(bad("pid or descriptor out of range"));
                }
                let inside = offset.checked_add(len).is_some_and(|end| end <= size);
                if !inside {
                    return Err(bad("range outside the allocation"));
                }
                ShareKind::PosixFd { pid, fd, size }
            }
            t => return Err(bad(&format!("unknown kind {t}"))),
        };
        if len == 0 {
            return Err(bad("zero length"));
        }
        if offset.checked_add(len).is_none() {
            return Err(bad("range overflows"));
        }
        Ok(SharedMemory {
            kind,
            offset,
            len,
            device_uuid,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples() -> Vec<SharedMemory> {
        vec![
            SharedMemory {
                kind: ShareKind::Legacy { handle: [7; 64] },
                offset: 4096,
                len: 1 << 20,
                device_uuid: [1; 16],
            },
            SharedMemory {
                kind: ShareKind::PosixFd {
                    pid: 1234,
                    fd: 17,
                    size: 2 << 20,
                },
                offset: 0,
                len: 2 << 20,
                device_uuid: [2; 16],
            },
        ]
    }

    #[test]
    fn round_trip() {
        for s in samples() {
            assert_eq!(SharedMemory::from_bytes(&s.to_bytes()).unwrap(), s);
        }
    }

    #[test]
    fn every_truncation_and_extension_is_refused() {
        for s in samples() {
            let b = s.to_bytes();
            for n in 0..b.len() {
                assert!(SharedMemory::from_bytes(&b[..n]).is_err(), "{n} bytes");
            }
            let mut long = b.clone();
            long.push(0);
            assert!(SharedMemory::from_bytes(&long).is_err());
        }
    }

    #[test]
    fn every_byte_flip_parses_or_fails_cleanly() {
        for s in samples() {
            let b = s.to_bytes();
            for i in 0..b.len() {
                for bit in 0..8 {
                    let mut m = b.clone();
                    m[i] ^= 1 << bit;
                    if let Ok(p) = SharedMemory::from_bytes(&m) {
                        assert!(p.len > 0 && p.offset.checked_add(p.len).is_some());
                    }
                }
            }
        }
    }

    #[test]
    fn hostile_ranges_are_refused() {
        let mut s = samples().remove(1);
        s.offset = 1;
        assert!(
            SharedMemory::from_bytes(&s.to_bytes()).is_err(),
            "past the allocation"
        );
        let mut s = samples().remove(0);
        s.offset = u64::MAX;
        assert!(SharedMemory::from_bytes(&s.to_bytes()).is_err(), "overflow");
        let mut s = samples().remove(0);
        s.len = 0;
        assert!(SharedMemory::from_bytes(&s.to_bytes()).is_err(), "empty");
        let mut s = samples().remove(1);
        s.kind = ShareKind::PosixFd {
            pid: -1,
            fd: 3,
            size: 1 << 30,
        };
        assert!(SharedMemory::from_bytes(&s.to_bytes()).is_err(), "pid");
    }
}
