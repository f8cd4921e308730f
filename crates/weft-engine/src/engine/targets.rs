//! Scatter destinations checked and matched to their peer group members
//! once ([`ScatterTargets`]), then submitted many times with only each
//! destination's bytes ([`ScatterSlice`]).
//!
//! [`TransferEngine::submit_scatter`] checks every destination descriptor
//! and matches its NIC addresses to its member's on every call: ~217
//! instructions per destination on the calling thread, plus the descriptor
//! clones an application makes to build its [`ScatterDst`]s. A MoE dispatch
//! or combine writes into the same receive buffers every step, only the
//! offsets and lengths change: [`TransferEngine::scatter_targets`] does the
//! descriptor work once, and [`TransferEngine::submit_scatter_to`] checks
//! the bounds of each slice and hands the worker the request
//! [`TransferEngine::submit_scatter`] would have built.

use super::{no_group, PeerGroupHandle, TransferEngine};
use crate::error::{check_range, EngineError, TransferId};
use crate::mem::MrHandle;
use crate::ondone::OnDone;
use crate::request::{routed_dsts, Body, Dsts, Routed};
use crate::shard::ScatterMode;
use crate::MAX_NICS;
use std::sync::Arc;
use weft_transport::{Imm, MrDesc, ScatterDst};

/// The bytes one scatter moves to one destination of a [`ScatterTargets`]:
/// `len` bytes from `src_offset` in the source registration to
/// `dst_offset` in the destination region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ScatterSlice {
    /// Offset in the source registration.
    pub src_offset: u64,
    /// Offset in the destination region.
    pub dst_offset: u64,
    /// Bytes to write; 0 is valid (the WRITE still carries the scatter's
    /// immediate, if it has one).
    pub len: u64,
}

impl From<&ScatterDst> for ScatterSlice {
    /// The bytes `d` moves, without its descriptor (the descriptor goes
    /// into [`TransferEngine::scatter_targets`] once).
    fn from(d: &ScatterDst) -> Self {
        ScatterSlice {
            src_offset: d.src_offset,
            dst_offset: d.dst_offset,
            len: d.len,
        }
    }
}

/// The destinations of scatters to one peer group, one memory descriptor
/// per member, checked and matched to the members once by
/// [`TransferEngine::scatter_targets`]; submit with
/// [`TransferEngine::submit_scatter_to`]. Cheap to clone (the matched
/// destinations are shared).
///
/// Targets copy the descriptors: a destination region registered again
/// (new rkeys) needs new targets. They hold the [`PeerGroupHandle`] they
/// were made for: after a member is removed
/// ([`TransferEngine::remove_peer`]) a scatter to them resolves with
/// [`EngineError::PeerRemoved`] and writes nothing, as
/// [`TransferEngine::submit_scatter`] to that group does. Descriptors whose
/// NIC addresses are not their member's (a region registered by another
/// engine than the member) are kept as given and resolved by address on
/// every submit, as [`TransferEngine::submit_scatter`] does; only matched
/// destinations save the per-submit work.
#[derive(Debug, Clone)]
pub struct ScatterTargets {
    peers: PeerGroupHandle,
    /// The rkey count of every destination.
    nics: usize,
    dsts: Arc<Prepared>,
}

#[derive(Debug)]
enum Prepared {
    /// Every descriptor matched its member: the request's destinations,
    /// with lengths and offsets left at 0.
    Routed(Routed),
    /// Some descriptor did not match: resolved by address per submit.
    Described(Vec<MrDesc>),
}

impl ScatterTargets {
    /// Number of destinations (the peer group's member count).
    pub fn len(&self) -> usize {
        self.peers.len()
    }

    /// Whether there are no destinations.
    pub fn is_empty(&self) -> bool {
        self.peers.is_empty()
    }

    /// The peer group the targets were made for.
    pub fn peer_group(&self) -> &PeerGroupHandle {
        &self.peers
    }

    /// How many NICs (rkeys) every destination has (0 for an empty group):
    /// a source registration must belong to a group with as many.
    pub fn nics(&self) -> usize {
        self.nics
    }

    /// Whether every destination matched its member, so that a submit does
    /// no per-destination look-up.
    pub fn matched(&self) -> bool {
        matches!(*self.dsts, Prepared::Routed(_))
    }
}

impl TransferEngine {
    /// Checks scatter destinations `dsts` (`dsts[j]`: a region of member
    /// `j` of `peers`) once, for any number of
    /// [`TransferEngine::submit_scatter_to`] calls.
    ///
    /// Errors ([`EngineError::InvalidArgument`]): `peers` from another engine
    /// or of another size than `dsts`, a descriptor without rkeys or with
    /// more than [`MAX_NICS`](crate::MAX_NICS), descriptors with different
    /// rkey counts. The last two could never be submitted
    /// ([`TransferEngine::submit_scatter`] refuses them at every call, with
    /// [`EngineError::NicCountMismatch`]); here they are refused once.
    pub fn scatter_targets(
        &self,
        peers: &PeerGroupHandle,
        dsts: &[MrDesc],
    ) -> Result<ScatterTargets, EngineError> {
        self.check_peer_group(peers, dsts.len())?;
        let mut nics = None;
        for (j, d) in dsts.iter().enumerate() {
            Self::check_dst(d, format_args!("scatter destination {j}"), 0, 0)?;
            if d.rkeys.len() > MAX_NICS {
                return Err(EngineError::InvalidArgument {
                    what: format!(
                        "scatter destination {j} has {} rkeys, more than {MAX_NICS} NICs",
                        d.rkeys.len()
                    ),
                });
            }
            match nics {
                None => nics = Some((j, d.rkeys.len())),
                Some((i, n)) if n != d.rkeys.len() => {
                    return Err(EngineError::InvalidArgument {
                        what: format!(
                            "scatter destinations {i} and {j} have {n} and {} rkeys: \
                             every destination needs one per NIC of the source's group",
                            d.rkeys.len()
                        ),
                    })
                }
                Some(_) => {}
            }
        }
        let nics = nics.map_or(0, |(_, n)| n);
        let prepared = match routed_dsts(&peers.members, nics, dsts.iter().map(|d| (d, 0, 0, 0))) {
            Some(Dsts::Routed(r)) => Prepared::Routed(r),
            _ => Prepared::Described(dsts.to_vec()),
        };
        Ok(ScatterTargets {
            peers: peers.clone(),
            nics,
            dsts: Arc::new(prepared),
        })
    }

    /// One WRITE per destination of `targets` (`slices[j]` to destination
    /// `j`), spread by the configured [`ScatterMode`]: what
    /// [`TransferEngine::submit_scatter`] does with the same destinations,
    /// offsets and lengths, without checking and matching the descriptors
    /// again.
    ///
    /// Errors as [`TransferEngine::submit_scatter`], checked in its order:
    /// `targets` of another engine or a slice count other than the
    /// targets' ([`EngineError::InvalidArgument`]); slice by slice, its
    /// source range outside the source registration, then its destination
    /// range outside its region ([`EngineError::OutOfBounds`]); a source
    /// group with another NIC count than the destinations'
    /// ([`EngineError::NicCountMismatch`]); then the queue errors.
    pub fn submit_scatter_to(
        &self,
        targets: &ScatterTargets,
        on_done: OnDone,
        imm: Option<Imm>,
        src: &MrHandle,
        slices: &[ScatterSlice],
    ) -> Result<TransferId, EngineError> {
        self.submit_scatter_to_mode(
            targets,
            on_done,
            imm,
            src,
            slices,
            self.inner.config.scatter_mode,
        )
    }

    /// [`TransferEngine::submit_scatter_to`] with an explicit mode.
    pub fn submit_scatter_to_mode(
        &self,
        targets: &ScatterTargets,
        on_done: OnDone,
        imm: Option<Imm>,
        src: &MrHandle,
        slices: &[ScatterSlice],
        mode: ScatterMode,
    ) -> Result<TransferId, EngineError> {
        let gs = self.own_group(src)?;
        self.check_peer_group(&targets.peers, targets.len())?;
        if slices.len() != targets.len() {
            return Err(EngineError::InvalidArgument {
                what: format!(
                    "{} scatter slices for {} destinations",
                    slices.len(),
                    targets.len()
                ),
            });
        }
        // The checks of `submit_scatter_mode`, in its order: source and
        // destination bounds slice by slice, then the NIC count.
        let dsts = match &*targets.dsts {
            Prepared::Routed(template) => {
                let mut r = template.clone();
                for (j, (d, s)) in r.dsts.iter_mut().zip(slices).enumerate() {
                    src.check(format_args!("scatter source {j}"), s.src_offset, s.len)?;
                    check_range(
                        format_args!("scatter destination {j}"),
                        s.dst_offset,
                        s.len,
                        d.region_len,
                    )?;
                    d.len = s.len;
                    d.src_offset = s.src_offset;
                    d.dst_offset = s.dst_offset;
                }
                Dsts::Routed(r)
            }
            Prepared::Described(descs) => {
                let mut v = Vec::with_capacity(descs.len());
                for (j, (d, s)) in descs.iter().zip(slices).enumerate() {
                    src.check(format_args!("scatter source {j}"), s.src_offset, s.len)?;
                    Self::check_dst(
                        d,
                        format_args!("scatter destination {j}"),
                        s.dst_offset,
                        s.len,
                    )?;
                    v.push(ScatterDst {
                        len: s.len,
                        src_offset: s.src_offset,
                        dst: d.clone(),
                        dst_offset: s.dst_offset,
                    });
                }
                Dsts::Described(v)
            }
        };
        let g = src.group as usize;
        let local = self.nic_count(g)?;
        if targets.nics != local && !targets.is_empty() {
            return Err(EngineError::NicCountMismatch {
                group: g,
                local,
                remote: targets.nics,
            });
        }
        let pg = *targets.peers.ids.get(g).ok_or_else(|| no_group(g))?;
        let req = self.new_req(
            on_done,
            Body::Scatter {
                imm,
                src: src.key(),
                peers: pg,
                dsts,
                mode,
            },
        );
        self.enqueue(gs, req)
    }
}
