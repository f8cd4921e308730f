//! Port attributes: choosing the GID and the link speed a port reports.

use super::VerbsConfig;
use crate::ops::*;
use weft_transport::TransportError;

pub(super) fn link_gbps(width: u8, speed: u8) -> Option<f64> {
    let lanes = match width {
        1 => 1.0,
        2 => 4.0,
        4 => 8.0,
        8 => 12.0,
        16 => 2.0,
        _ => return None,
    };
    let per_lane = match speed {
        1 => 2.5,
        2 => 5.0,
        4 | 8 => 10.0,
        16 => 14.0625,
        32 => 25.78125,
        64 => 53.125,
        128 => 106.25,
        _ => return None,
    };
    Some(lanes * per_lane)
}

/// Picks the GID: the configured index (validated), or the best one by type:
/// on Ethernet an IPv4-mapped RoCE v2 GID, else any RoCE v2 GID; on IB the
/// first non-zero IB GID. Never silently index 0: when nothing fits it fails.
pub(super) fn select_gid<O: VerbsOps>(
    ops: &mut O,
    cfg: &VerbsConfig,
    port: &PortAttr,
    nic: &str,
) -> Result<(u32, Gid), TransportError> {
    if let Some(i) = cfg.gid_index {
        let e = ops
            .query_gid(cfg.port, i)
            .map_err(|e| e.into_transport(nic))?;
        if e.gid.is_zero() {
            return Err(TransportError::InvalidArgument {
                nic: nic.to_string(),
                what: format!("configured GID index {i} is empty"),
            });
        }
        return Ok((i, e.gid));
    }
    let n = port.gid_tbl_len.min(256);
    let mut entries = Vec::new();
    for i in 0..n {
        if let Ok(e) = ops.query_gid(cfg.port, i) {
            if !e.gid.is_zero() {
                entries.push((i, e));
            }
        }
    }
    let pick = if port.link_layer == LinkLayer::Ethernet {
        entries
            .iter()
            .find(|(_, e)| e.gid_type == Some(GidType::RoceV2) && e.gid.is_ipv4_mapped())
            .or_else(|| {
                entries
                    .iter()
                    .find(|(_, e)| e.gid_type == Some(GidType::RoceV2))
            })
    } else {
        entries
            .iter()
            .find(|(_, e)| matches!(e.gid_type, Some(GidType::Ib) | None))
    };
    match pick {
        Some((i, e)) => Ok((*i, e.gid)),
        None => Err(TransportError::NoDevice {
            what: format!(
                "usable GID on {nic} ({} entries, link layer {:?}); set WEFT_VERBS_GID_INDEX",
                entries.len(),
                port.link_layer
            ),
        }),
    }
}
