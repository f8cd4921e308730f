//! Mapping libfabric errors (post-time return codes and CQ error entries)
//! to typed transport errors.

use weft_transport::{NetAddr, PeerId, RemoteAccessReason, TransportError};

use super::slots::SlotUse;
use super::LibfabricDomain;
use crate::ffi;

impl LibfabricDomain {
    /// Maps a failed operation to a typed error. `prov_errno` is the CQ
    /// error entry's provider errno (0 for post-time errors).
    pub(super) fn op_error(
        &self,
        slot: SlotUse,
        err: i64,
        prov_errno: i64,
        message: String,
        olen: usize,
    ) -> TransportError {
        let nic = self.nic_name();
        let errno = err.unsigned_abs() as i32;
        let (peer, op): (Option<PeerId>, &'static str) = match slot {
            SlotUse::Write { peer, .. } => (Some(peer), "fi_writemsg"),
            SlotUse::Send { peer, .. } => (Some(peer), "fi_send"),
            SlotUse::Ack { peer } => (Some(peer), "fi_send"),
            SlotUse::Bounce { .. } => (None, "fi_recv"),
            SlotUse::Free | SlotUse::Zombie => (None, "completion"),
        };
        let peer_addr = peer.map(|p| self.peer_addr(p));
        // We never cancel operations ourselves (closing the domain drops
        // them unreported). tcp;ofi_rxm cancels (ECANCELED) the operations
        // of a connection that broke: the one the target rejected (bad key
        // or out of bounds: provider errno ENOENT or another access errno)
        // is a remote access error; the others carry the socket error
        // (ENOTCONN, EPIPE, ECONNRESET, or none): the peer is gone (e.g.
        // its process was killed mid-transfer) or the pair is unusable.
        let prov = i32::try_from(prov_errno.unsigned_abs()).unwrap_or(0);
        let rejected = !self.prov_errno_is_errno || prov == libc::ENOENT || is_remote_access(prov);
        let canceled = errno == libc::ECANCELED && peer.is_some();
        if is_unreachable(errno) || (canceled && !rejected) {
            if let Some(peer) = peer_addr {
                return TransportError::PeerUnreachable {
                    nic,
                    peer,
                    reason: message,
                };
            }
        }
        let canceled_write = errno == libc::ECANCELED && matches!(slot, SlotUse::Write { .. });
        if errno == libc::ECANCELED && !canceled_write {
            return TransportError::Canceled { nic };
        }
        match slot {
            SlotUse::Write {
                rkey, raddr, len, ..
            } if canceled_write || is_remote_access(errno) => TransportError::RemoteAccess {
                nic,
                peer: peer_addr.unwrap_or(NetAddr(Vec::new())),
                rkey,
                addr: raddr,
                len,
                reason: if errno == libc::EKEYREJECTED || errno == libc::ENOKEY {
                    RemoteAccessReason::UnknownKey
                } else if errno == libc::ERANGE || errno == libc::EFAULT {
                    RemoteAccessReason::OutOfBounds
                } else {
                    // tcp/shm report every key or bounds violation as
                    // EINVAL/EACCES: the cause is not distinguishable.
                    RemoteAccessReason::UnknownKey
                },
            },
            SlotUse::Send { len, .. } if i64::from(errno) == ffi::FI_ETRUNC => {
                TransportError::MessageTooLong {
                    nic,
                    peer: peer_addr.unwrap_or(NetAddr(Vec::new())),
                    len,
                    capacity: len.saturating_sub(olen as u64),
                }
            }
            _ => TransportError::Provider {
                nic,
                op,
                code: -i64::from(errno),
                message,
            },
        }
    }

    /// The error of a post that returned `rc`.
    pub(super) fn post_error(&self, slot: SlotUse, rc: i64) -> TransportError {
        self.op_error(slot, rc, 0, self.lib.strerror(rc), 0)
    }
}

/// Socket errnos that mean the peer cannot be reached.
fn is_unreachable(errno: i32) -> bool {
    matches!(
        errno,
        libc::ECONNREFUSED
            | libc::ECONNRESET
            | libc::ECONNABORTED
            | libc::EHOSTUNREACH
            | libc::EHOSTDOWN
            | libc::ENETUNREACH
            | libc::ENETDOWN
            | libc::ENOTCONN
            | libc::ETIMEDOUT
            | libc::EPIPE
            | libc::ESHUTDOWN
            | libc::EADDRNOTAVAIL
    )
}

/// Errnos with which providers report a rejected remote access.
fn is_remote_access(errno: i32) -> bool {
    matches!(
        errno,
        libc::EACCES
            | libc::EPERM
            | libc::EKEYREJECTED
            | libc::ENOKEY
            | libc::EINVAL
            | libc::EFAULT
            | libc::ERANGE
            | libc::EREMOTEIO
    )
}
