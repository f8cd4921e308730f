//! The application's cache memory ([`CacheRegions`]) and its registration,
//! alike for both sides.

use crate::{KvError, KvLayout};
use weft::{MemRegion, MrDesc, MrHandle, Pages, Registration, TransferEngine};

/// The application's KV cache memory, host or GPU: the KV pages, as one
/// region holding every layer (`layout.kv_bytes()` bytes) or as one region
/// per layer (`layout.layer_bytes()` bytes each — one tensor per layer, as
/// vLLM and SGLang allocate them), and an optional tail region
/// (`layout.tail_bytes()`, needed when the layout has a tail).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheRegions {
    /// KV pages: one region (every layer) or one per layer.
    pub kv: Vec<MemRegion>,
    /// Tail slots; `None` when the layout has no tail.
    pub tail: Option<MemRegion>,
}

impl CacheRegions {
    /// One region holding every layer, plus the tail region.
    pub fn whole(kv: MemRegion, tail: MemRegion) -> Self {
        Self {
            kv: vec![kv],
            tail: Some(tail),
        }
    }

    /// One region per layer, in layer order, and no tail.
    pub fn per_layer(layers: Vec<MemRegion>) -> Self {
        Self {
            kv: layers,
            tail: None,
        }
    }

    /// The same regions with a tail region.
    pub fn with_tail(mut self, tail: MemRegion) -> Self {
        self.tail = Some(tail);
        self
    }

    /// Checks the regions against `layout`: one KV region of the whole
    /// cache or one of each layer's size, and a tail region when the
    /// layout has a tail.
    pub fn check(&self, layout: &KvLayout) -> Result<(), KvError> {
        layout.validate()?;
        let per_layer = match self.kv.len() {
            1 => false,
            n if n as u64 == u64::from(layout.layers) => true,
            n => {
                return Err(KvError::Layout {
                    what: format!(
                        "{n} KV regions for {} layers: give one region or one per layer",
                        layout.layers
                    ),
                })
            }
        };
        let need = if per_layer {
            layout.layer_bytes()?
        } else {
            layout.kv_bytes()?
        };
        for (i, r) in self.kv.iter().enumerate() {
            size(r, need, &format!("kv region {i}"))?;
            if r.device() != self.kv[0].device() {
                return Err(KvError::Layout {
                    what: format!(
                        "kv region {i} is on {:?}, region 0 on {:?}",
                        r.device(),
                        self.kv[0].device()
                    ),
                });
            }
        }
        if layout.tail_len > 0 {
            let Some(t) = &self.tail else {
                return Err(KvError::Layout {
                    what: "the layout has a tail but no tail region was given".into(),
                });
            };
            size(t, layout.tail_bytes()?, "tail region")?;
        }
        Ok(())
    }
}

fn size(r: &MemRegion, need: u64, what: &str) -> Result<(), KvError> {
    if (r.len() as u64) < need {
        return Err(KvError::Layout {
            what: format!("{what} has {} bytes, the layout needs {need}", r.len()),
        });
    }
    Ok(())
}

/// Registered cache regions (deregistered on drop).
pub(crate) struct Registered {
    /// The KV regions, as given.
    pub kv: Vec<Registration>,
    /// The tail region (only when the layout has a tail).
    pub tail: Option<Registration>,
}

impl Registered {
    /// Checks `regions` against `layout` and registers them with `engine`.
    pub fn new(
        engine: &TransferEngine,
        layout: &KvLayout,
        regions: &CacheRegions,
    ) -> Result<Self, KvError> {
        regions.check(layout)?;
        let kv = regions
            .kv
            .iter()
            .map(|r| engine.register(*r).map_err(KvError::engine("register kv")))
            .collect::<Result<Vec<_>, _>>()?;
        let tail = match (&regions.tail, layout.tail_len > 0) {
            (Some(t), true) => Some(
                engine
                    .register(*t)
                    .map_err(KvError::engine("register tail"))?,
            ),
            _ => None,
        };
        Ok(Self { kv, tail })
    }

    /// The descriptors peers write with.
    pub fn descs(&self) -> (Vec<MrDesc>, Option<MrDesc>) {
        (
            self.kv.iter().map(|r| r.desc().clone()).collect(),
            self.tail.as_ref().map(|r| r.desc().clone()),
        )
    }

    /// The local handles.
    pub fn handles(&self) -> (Vec<MrHandle>, Option<MrHandle>) {
        (
            self.kv.iter().map(|r| r.handle()).collect(),
            self.tail.as_ref().map(|r| r.handle()),
        )
    }

    /// Every registration (to release at shutdown).
    pub fn into_vec(self) -> Vec<Registration> {
        self.kv.into_iter().chain(self.tail).collect()
    }
}

/// The region of `layer` among `regions` (one for the whole cache, or one
/// per layer) and `pages` made relative to it: a whole-cache region keeps
/// the layer's offset, a per-layer region starts at the layer.
pub fn layer_region<T: Clone>(regions: &[T], layer: u32, pages: Pages) -> Option<(T, Pages)> {
    match regions {
        [one] => Some((one.clone(), pages)),
        many => Some((
            many.get(layer as usize)?.clone(),
            Pages { offset: 0, ..pages },
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_region_picks_and_rebases() {
        let p = Pages {
            indices: vec![1, 2],
            stride: 16,
            offset: 320,
        };
        assert_eq!(
            layer_region(&["all"], 2, p.clone()),
            Some(("all", p.clone()))
        );
        let (r, q) = layer_region(&["l0", "l1", "l2"], 2, p.clone()).unwrap();
        assert_eq!((r, q.offset, q.indices), ("l2", 0, vec![1, 2]));
        assert_eq!(layer_region(&["l0", "l1"], 2, p), None);
    }
}
