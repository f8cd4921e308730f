//! The data-path report: what each NIC of the engine really does with
//! GPU memory, its limits and progress mode; per registration, whether
//! the NICs reach it directly; and registration that refuses a staged or
//! unsupported path ([`TransferEngine::reg_mr_direct`]).

use std::fmt;

use weft_transport::{DataPath, Device, DeviceMemoryPath, MemRegion, MrDesc};

use super::TransferEngine;
use crate::{EngineError, MrHandle};

/// One NIC's line of a [`DataPathReport`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct NicReport {
    /// Domain group index.
    pub group: usize,
    /// NIC index inside the group.
    pub nic: usize,
    /// The NIC's name.
    pub name: String,
    /// Its data path, as its backend describes it.
    pub path: DataPath,
}

/// Every NIC's data path (see [`TransferEngine::data_path_report`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DataPathReport {
    /// One entry per NIC, by group then NIC.
    pub nics: Vec<NicReport>,
}

impl fmt::Display for DataPathReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for n in &self.nics {
            writeln!(
                f,
                "group {} NIC {} ({}): {}",
                n.group, n.nic, n.name, n.path
            )?;
        }
        Ok(())
    }
}

/// How one NIC reaches one registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Reach {
    /// The NIC accesses the memory itself (host memory, or GPU memory with
    /// a direct path).
    Direct,
    /// The memory's bytes go through host copies.
    Staged,
}

impl TransferEngine {
    /// Each NIC's data path: provider and fabric, whether GPU memory is
    /// registered directly (GPUDirect / FI_HMEM / dma-buf), staged or not at
    /// all, message size limits and progress mode. The same facts are
    /// logged at info level when the engine starts (`weft data path`).
    pub fn data_path_report(&self) -> DataPathReport {
        let mut nics = Vec::new();
        for g in 0..self.groups() {
            let Ok(info) = self.info(g) else { continue };
            for (i, (name, path)) in info.names.iter().zip(&info.paths).enumerate() {
                nics.push(NicReport {
                    group: g,
                    nic: i,
                    name: name.clone(),
                    path: path.clone(),
                });
            }
        }
        DataPathReport { nics }
    }

    /// The NICs of group `g` that WRITEs to `dst` take, with their data
    /// paths: in a group with a same-host NIC
    /// ([`DomainGroupSpec::same_host`](crate::DomainGroupSpec::same_host))
    /// that NIC alone for a peer on this host, the others for the rest;
    /// otherwise every NIC the descriptor has a key for.
    pub fn paths_to(&self, g: usize, dst: &MrDesc) -> Result<Vec<NicReport>, EngineError> {
        let gs = self.group(g)?;
        let dst = dst.clone();
        let nics = self.control(gs, |reply| crate::core::Control::Lanes { dst, reply })?;
        let info = self.info(g)?;
        Ok(nics
            .into_iter()
            .filter_map(|i| {
                Some(NicReport {
                    group: g,
                    nic: i,
                    name: info.names.get(i)?.clone(),
                    path: info.paths.get(i)?.clone(),
                })
            })
            .collect())
    }

    /// How each NIC of its group reaches registration `h`, in NIC order.
    pub fn reach(&self, h: &MrHandle) -> Result<Vec<Reach>, EngineError> {
        let info = self.info(self.own_group_index(h)?)?;
        Ok(info
            .paths
            .iter()
            .map(|p| match (h.device, &p.device_memory) {
                (Device::Host, _) | (_, DeviceMemoryPath::Direct(_)) => Reach::Direct,
                _ => Reach::Staged,
            })
            .collect())
    }

    /// [`TransferEngine::reg_mr`], but GPU memory is refused with
    /// [`EngineError::NotDirect`] (registering nothing) unless every NIC
    /// of its group accesses it directly: "direct GPU memory or fail",
    /// instead of a silent staged path.
    pub fn reg_mr_direct(&self, region: MemRegion) -> Result<(MrHandle, MrDesc), EngineError> {
        let g = self.group_for(region.device())?;
        if region.device() != Device::Host {
            let info = self.info(g)?;
            for (i, (name, p)) in info.names.iter().zip(&info.paths).enumerate() {
                if !p.device_memory_direct() {
                    return Err(EngineError::NotDirect {
                        group: g,
                        nic: i,
                        name: name.clone(),
                        device: region.device(),
                        path: p.device_memory.clone(),
                    });
                }
            }
        }
        self.reg_mr_on(g, region)
    }

    fn own_group_index(&self, h: &MrHandle) -> Result<usize, EngineError> {
        self.own_group(h)?;
        Ok(h.group as usize)
    }
}
