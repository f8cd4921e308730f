//! Ranks finding each other through a rendezvous store
//! (`weft::rendezvous`) instead of an out-of-band exchange: each rank
//! publishes its [`RankInfo`] under its session's lease and gathers every
//! rank's before [`MoeRank::connect`](crate::MoeRank::connect).
//!
//! Keys: `weft/<namespace>/app/moe-ranks/rank<r>`. Use one namespace per
//! job: a rank's record stays until its session closes or its lease runs
//! out, so a namespace reused too soon can still hold a previous job's
//! ranks (their `config_hash` may even match; `connect` would then fail on
//! the dead addresses, never silently).
//!
//! ```
//! # use std::{sync::Arc, time::Duration};
//! # use weft::rendezvous::{MemStore, Session, Store};
//! # use weft_moe::{MoeConfig, MoeRank, MoeRendezvous};
//! # fn f(engine: Arc<weft::TransferEngine>, cfg: &MoeConfig, rank: u32) -> Result<(), Box<dyn std::error::Error>> {
//! let store: Arc<dyn Store> = weft::rendezvous::open(&"dir:/tmp/job-42".parse()?)?;
//! let session = Session::new(store.clone(), Duration::from_secs(10))?;
//! let rdv = MoeRendezvous::new(store, "job-42");
//! let (mut moe, info) = MoeRank::prepare(engine, cfg, rank)?;
//! rdv.publish(&session, &info)?;
//! let all = rdv.gather(cfg.ranks, Duration::from_secs(60))?;
//! moe.connect(&all)?;
//! # Ok(()) }
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use weft::rendezvous::{Namespace, Records, Session, Store};

use crate::{MoeError, RankInfo};

/// The record kind ranks publish their [`RankInfo`] under.
pub const RANKS: &str = "moe-ranks";

/// The MoE ranks of one namespace of a store.
#[derive(Debug, Clone)]
pub struct MoeRendezvous {
    recs: Records<RankInfo>,
}

fn name(rank: u32) -> String {
    format!("rank{rank}")
}

impl MoeRendezvous {
    /// The ranks of namespace `namespace` in `store`.
    pub fn new(store: Arc<dyn Store>, namespace: &str) -> Self {
        MoeRendezvous {
            recs: Records::new(&Namespace::new(store, namespace), RANKS),
        }
    }

    fn err(&self, rank: u32, what: String) -> MoeError {
        MoeError::Rendezvous {
            store: self.recs.namespace().store().endpoint().to_string(),
            rank,
            what,
        }
    }

    /// Publishes this rank's `info` (from [`MoeRank::prepare`](crate::MoeRank::prepare))
    /// under `session`'s lease.
    pub fn publish(&self, session: &Session, info: &RankInfo) -> Result<(), MoeError> {
        self.recs
            .publish(session, &name(info.rank), info)
            .map_err(|e| self.err(info.rank, format!("publish: {e}")))
    }

    /// Every rank's info, `0..ranks` in order, waiting up to `timeout` in
    /// all for ranks that have not published yet. With masked ranks, infos
    /// name the active ranks by their index among them: gather
    /// `Dims::ranks` (the active count) in a namespace of their own, not
    /// the one the whole group used.
    pub fn gather(&self, ranks: u32, timeout: Duration) -> Result<Vec<RankInfo>, MoeError> {
        let deadline = Instant::now() + timeout;
        (0..ranks)
            .map(|r| {
                let info = self
                    .recs
                    .wait(&name(r), deadline.saturating_duration_since(Instant::now()))
                    .map_err(|e| self.err(r, format!("gather: {e}")))?;
                if info.rank != r {
                    return Err(self.err(r, format!("the record says rank {}", info.rank)));
                }
                Ok(info)
            })
            .collect()
    }
}
