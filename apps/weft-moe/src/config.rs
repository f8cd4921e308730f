//! [`MoeConfig`] (what the user chooses) and [`Dims`] (everything derived
//! from it, validated once: slot sizes, the receive bound, buffer lengths).

use crate::error::ConfigError;
use crate::mask::RankMask;
use std::time::Duration;

/// Element type of the expert outputs and of the combined tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum OutDtype {
    /// IEEE single precision, little-endian.
    F32,
    /// bfloat16 (the upper half of an f32), little-endian.
    Bf16,
}

/// What dispatch does to a token on its way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum DispatchFormat {
    /// The caller's `token_bytes` bytes go as they are.
    #[default]
    Raw,
    /// DeepEP's low-latency fp8: the caller passes bf16 tokens of `hidden`
    /// elements (`2 · hidden` bytes each, `hidden % 128 == 0`); the sender
    /// quantises each to e4m3 with one f32 scale per 128 columns
    /// ([`crate::quant`]), and the experts receive `hidden` e4m3 bytes
    /// followed by `hidden / 128` little-endian f32 scales (`token_bytes`
    /// must be `hidden + hidden / 32`).
    Fp8 {
        /// Round each scale up to a power of two (DeepEP's `round_scale`).
        round_scale: bool,
    },
}

impl DispatchFormat {
    /// A small number naming the format, for the group's config hash.
    pub(crate) fn code(self) -> u64 {
        match self {
            DispatchFormat::Raw => 0,
            DispatchFormat::Fp8 { round_scale: false } => 1,
            DispatchFormat::Fp8 { round_scale: true } => 2,
        }
    }
}

impl OutDtype {
    /// Bytes per element.
    pub fn size(self) -> u32 {
        match self {
            OutDtype::F32 => 4,
            OutDtype::Bf16 => 2,
        }
    }
}

/// The shape of one MoE group. Every rank of the group must use the same
/// values (they determine offsets and immediate counts on both sides).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoeConfig {
    /// Ranks (EP degree, N).
    pub ranks: u32,
    /// Experts (E), `E % N == 0`; rank d hosts experts `d·E/N .. (d+1)·E/N`.
    pub experts: u32,
    /// Experts per token (R, top-k).
    pub topk: u32,
    /// Most tokens a rank dispatches per step (T).
    pub max_tokens: u32,
    /// Bytes of one dispatched token (data and scales).
    pub token_bytes: u32,
    /// Elements of one expert output row and of one combined token.
    pub hidden: u32,
    /// Element type of expert outputs and combined tokens.
    pub out_dtype: OutDtype,
    /// What dispatch does to a token ([`DispatchFormat::Raw`] by default).
    pub dispatch: DispatchFormat,
    /// Speculative private slots per (source, destination) (P), at most
    /// `max_tokens · topk`; `Some(0)` turns speculation off. `None` (the
    /// default): `min(32, max_tokens · topk)`, derived when the config is
    /// used, so it follows later edits of `max_tokens` and `topk`.
    pub private_tokens: Option<u32>,
    /// Index of this MoE group on its engine (each instance reserves five
    /// immediate values from the top of the engine's range).
    pub instance: u32,
    /// How long a round may take before a step reports a timeout.
    pub step_timeout: Duration,
    /// Upper bound for each of the send and receive buffers, in bytes.
    pub max_buffer_bytes: u64,
    /// Ranks the group goes on without (distinct, each `< ranks`, at least
    /// one rank left): the protocol runs over the others, and a pair whose
    /// expert sits on a masked rank is dropped ([`crate::mask`]). Every
    /// active rank must be given the same list.
    pub masked: Vec<u32>,
}

impl MoeConfig {
    /// A config with the given shape and defaults elsewhere: bf16 outputs,
    /// derived `private_tokens` (`min(32, max_tokens·topk)`), instance 0, a
    /// 10 s step timeout and a 4 GiB buffer limit.
    pub fn new(
        ranks: u32,
        experts: u32,
        topk: u32,
        max_tokens: u32,
        token_bytes: u32,
        hidden: u32,
    ) -> Self {
        Self {
            ranks,
            experts,
            topk,
            max_tokens,
            token_bytes,
            hidden,
            out_dtype: OutDtype::Bf16,
            dispatch: DispatchFormat::Raw,
            private_tokens: None,
            instance: 0,
            step_timeout: Duration::from_secs(10),
            max_buffer_bytes: 4 << 30,
            masked: Vec::new(),
        }
    }

    /// The speculative private slots in effect: `private_tokens`, or when
    /// unset `min(32, max_tokens · topk)`.
    pub fn private(&self) -> u32 {
        self.private_tokens.unwrap_or_else(|| {
            u64::from(self.max_tokens)
                .saturating_mul(u64::from(self.topk))
                .min(32) as u32
        })
    }

    /// Checks the config and derives the [`Dims`] every other part uses.
    pub fn validate(&self) -> Result<Dims, ConfigError> {
        for (v, name) in [
            (self.ranks, "ranks"),
            (self.experts, "experts"),
            (self.topk, "topk"),
            (self.max_tokens, "max_tokens"),
            (self.token_bytes, "token_bytes"),
            (self.hidden, "hidden"),
        ] {
            if v == 0 {
                return Err(ConfigError::Zero(name));
            }
        }
        if !self.experts.is_multiple_of(self.ranks) {
            return Err(ConfigError::ExpertsNotDivisible {
                experts: self.experts,
                ranks: self.ranks,
            });
        }
        let local = self.experts / self.ranks;
        let mut masked = self.masked.clone();
        masked.sort_unstable();
        for w in masked.windows(2) {
            if w[0] == w[1] {
                return Err(ConfigError::BadMask {
                    rank: w[0],
                    why: "masked twice",
                });
            }
        }
        if let Some(&m) = masked.iter().find(|&&m| m >= self.ranks) {
            return Err(ConfigError::BadMask {
                rank: m,
                why: "not a rank of the group",
            });
        }
        if masked.len() as u64 >= u64::from(self.ranks) {
            return Err(ConfigError::BadMask {
                rank: self.ranks - 1,
                why: "no rank would be left",
            });
        }
        let mask = RankMask::new(self.ranks, masked);
        // The protocol's group: the active ranks and their experts.
        let ranks = mask.active();
        let experts = ranks * local;
        let n = u64::from(ranks);
        let t = u64::from(self.max_tokens);
        let r = u64::from(self.topk);
        let max_pairs = t * r; // both < 2^32: no overflow
        let p = u64::from(self.private());
        if p > max_pairs {
            return Err(ConfigError::PrivateTooLarge {
                p: self.private(),
                max: max_pairs,
            });
        }
        if let DispatchFormat::Fp8 { .. } = self.dispatch {
            let h = u64::from(self.hidden);
            if !h.is_multiple_of(128) || u64::from(self.token_bytes) != h + h / 32 {
                return Err(ConfigError::Fp8Shape {
                    hidden: self.hidden,
                    token_bytes: self.token_bytes,
                });
            }
        }
        let b_in = round16(u64::from(self.token_bytes) + ORIGIN_BYTES);
        let b_out = round16(u64::from(self.hidden) * u64::from(self.out_dtype.size()));
        // The paper's receive bound: N·T·max(R, E/N) slots.
        let contig = mul(&[n, t, r.max(u64::from(local))], "contiguous region")?;
        let private = n * p;
        let slots = private
            .checked_add(contig)
            .ok_or(ConfigError::TooManySlots { slots: u64::MAX })?;
        if slots > u64::from(u32::MAX) || max_pairs > u64::from(u32::MAX) {
            return Err(ConfigError::TooManySlots { slots });
        }
        let recv_dispatch = mul(&[slots, b_in], "receive buffer")?;
        let recv_combine = mul(&[max_pairs, b_out], "receive buffer")?;
        let recv = recv_dispatch.max(recv_combine);
        let send =
            mul(&[max_pairs, b_in], "send buffer")?.max(mul(&[contig, b_out], "send buffer")?);
        for (bytes, what) in [(recv, "receive buffer"), (send, "send buffer")] {
            if bytes > self.max_buffer_bytes || usize::try_from(bytes).is_err() {
                return Err(ConfigError::BufferTooLarge {
                    what,
                    bytes,
                    max: self.max_buffer_bytes,
                });
            }
        }
        Ok(Dims {
            ranks,
            experts,
            local,
            topk: self.topk,
            max_tokens: self.max_tokens,
            private: self.private(),
            token_bytes: self.token_bytes,
            hidden: self.hidden,
            out_dtype: self.out_dtype,
            dispatch: self.dispatch,
            b_in,
            b_out,
            contig_slots: contig,
            recv_buf_len: recv,
            send_buf_len: send,
            instance: self.instance,
            mask,
        })
    }
}

/// Bytes after the token in every dispatch slot: the pair index
/// `t · topk + k` at the source, a little-endian `u32`, which gives each
/// received row its (token, k) origin ([`crate::ExpertTokens::origin`]).
pub const ORIGIN_BYTES: u64 = 4;

fn round16(v: u64) -> u64 {
    v.div_ceil(16) * 16
}

fn mul(factors: &[u64], what: &'static str) -> Result<u64, ConfigError> {
    factors
        .iter()
        .try_fold(1u64, |acc, &f| acc.checked_mul(f))
        .ok_or(ConfigError::BufferTooLarge {
            what,
            bytes: u64::MAX,
            max: u64::MAX,
        })
}

/// The validated, derived shape of a MoE group (from
/// [`MoeConfig::validate`]). All slot counts fit in `u32` and all buffer
/// lengths in `usize`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dims {
    /// Ranks (N).
    pub ranks: u32,
    /// Experts (E).
    pub experts: u32,
    /// Experts per rank (L = E/N).
    pub local: u32,
    /// Experts per token (R).
    pub topk: u32,
    /// Most tokens per rank and step (T).
    pub max_tokens: u32,
    /// Private slots per (source, destination) (P).
    pub private: u32,
    /// Bytes of one token as the caller passes it.
    pub token_bytes: u32,
    /// Elements per output row.
    pub hidden: u32,
    /// Output element type.
    pub out_dtype: OutDtype,
    /// What dispatch does to a token.
    pub dispatch: DispatchFormat,
    /// Dispatch slot bytes (B_in): the token, then its pair index at the
    /// source (`t · topk + k`, [`ORIGIN_BYTES`] little-endian bytes at
    /// offset `token_bytes`), rounded up to 16.
    pub b_in: u64,
    /// Combine slot bytes (B_out): `hidden · size(out_dtype)` rounded up to 16.
    pub b_out: u64,
    /// Contiguous-region slots (C = N·T·max(R, L)).
    pub contig_slots: u64,
    /// Receive buffer bytes: `max(N·P·B_in + C·B_in, T·R·B_out)`.
    pub recv_buf_len: u64,
    /// Send buffer bytes: `max(T·R·B_in, C·B_out)`.
    pub send_buf_len: u64,
    /// Instance index (selects the reserved immediates).
    pub instance: u32,
    /// The masked ranks of the whole group: `ranks` and `experts` above
    /// count the active ones only.
    pub mask: RankMask,
}

impl Dims {
    /// Most (token, k) pairs one rank sends per step (T·R).
    pub fn max_pairs(&self) -> u64 {
        u64::from(self.max_tokens) * u64::from(self.topk)
    }

    /// The rank hosting expert `e` (`e < experts`).
    pub fn rank_of_expert(&self, e: u32) -> u32 {
        e / self.local
    }

    /// Bytes of one output row as the caller sees it (`hidden · size`).
    pub fn out_row_bytes(&self) -> u64 {
        u64::from(self.hidden) * u64::from(self.out_dtype.size())
    }

    /// Bytes of one token as the caller passes it to dispatch:
    /// `token_bytes`, or `2 · hidden` (bf16) with fp8 dispatch.
    pub fn in_row_bytes(&self) -> u64 {
        match self.dispatch {
            DispatchFormat::Raw => u64::from(self.token_bytes),
            DispatchFormat::Fp8 { .. } => 2 * u64::from(self.hidden),
        }
    }

    /// Byte offset of source `s`'s private region in the receive buffer.
    pub fn private_offset(&self, s: u32) -> u64 {
        u64::from(s) * u64::from(self.private) * self.b_in
    }

    /// Byte offset of the contiguous region in the receive buffer (N·P·B_in).
    pub fn contig_offset(&self) -> u64 {
        u64::from(self.ranks) * u64::from(self.private) * self.b_in
    }

    /// Bytes of the route buffer: N rows of E little-endian `u32` counts.
    pub fn route_buf_len(&self) -> u64 {
        u64::from(self.ranks) * u64::from(self.experts) * 4
    }

    /// Bytes of one route row (E · 4).
    pub fn route_row_len(&self) -> u64 {
        u64::from(self.experts) * 4
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deepseek(ranks: u32) -> MoeConfig {
        MoeConfig::new(ranks, 256, 8, 128, 7168 + 56 * 4, 7168)
    }

    #[test]
    fn deepseek_ep64_numbers() {
        let d = deepseek(64).validate().unwrap();
        assert_eq!(d.local, 4);
        assert_eq!(d.b_in, 7408);
        assert_eq!(d.b_out, 14336);
        assert_eq!(d.contig_slots, 65_536);
        assert_eq!(d.recv_buf_len, (64 * 32 + 65_536) * 7408);
        assert_eq!(d.send_buf_len, 65_536 * 14336);
        assert_eq!(d.contig_offset(), 64 * 32 * 7408);
    }

    #[test]
    fn bound_uses_local_experts_when_larger() {
        let mut c = deepseek(8); // L = 32 > R = 8
        c.max_buffer_bytes = u64::MAX;
        let d = c.validate().unwrap();
        assert_eq!(d.contig_slots, 8 * 128 * 32);
        c.experts = 8; // L = 1 < R
        let d = c.validate().unwrap();
        assert_eq!(d.contig_slots, 8 * 128 * 8);
    }

    #[test]
    fn impossible_configs_are_rejected() {
        let mut c = deepseek(8);
        c.ranks = 0;
        assert_eq!(c.validate(), Err(ConfigError::Zero("ranks")));
        let mut c = deepseek(8);
        c.hidden = 0;
        assert_eq!(c.validate(), Err(ConfigError::Zero("hidden")));
        let mut c = deepseek(8);
        c.experts = 250;
        assert!(matches!(
            c.validate(),
            Err(ConfigError::ExpertsNotDivisible {
                experts: 250,
                ranks: 8
            })
        ));
        let mut c = deepseek(8);
        c.private_tokens = Some(128 * 8 + 1);
        assert!(matches!(
            c.validate(),
            Err(ConfigError::PrivateTooLarge { max: 1024, .. })
        ));
        c.private_tokens = Some(128 * 8);
        c.max_buffer_bytes = u64::MAX;
        assert!(c.validate().is_ok());
        let mut c = deepseek(64);
        c.max_buffer_bytes = 1 << 20;
        assert!(matches!(
            c.validate(),
            Err(ConfigError::BufferTooLarge { .. })
        ));
        let mut c = MoeConfig::new(u32::MAX, u32::MAX, u32::MAX, u32::MAX, 1, 1);
        c.max_buffer_bytes = u64::MAX;
        assert!(c.validate().is_err());
    }

    /// The derived `private_tokens` follows edits made after `new`: a
    /// smaller `max_tokens` or `topk` lowers it instead of failing.
    #[test]
    fn derived_private_tokens_follow_later_edits() {
        let mut c = deepseek(8);
        assert_eq!(c.private(), 32);
        c.max_tokens = 2;
        c.topk = 4;
        assert_eq!(c.private(), 8);
        assert_eq!(c.validate().map(|d| d.private), Ok(8));
        c.private_tokens = Some(0);
        assert_eq!(c.validate().map(|d| d.private), Ok(0));
        c.private_tokens = Some(9);
        assert!(matches!(
            c.validate(),
            Err(ConfigError::PrivateTooLarge { p: 9, max: 8 })
        ));
    }

    #[test]
    fn slot_sizes_round_to_16() {
        let mut c = MoeConfig::new(2, 4, 2, 4, 1, 3);
        c.out_dtype = OutDtype::F32;
        let d = c.validate().unwrap();
        assert_eq!(d.b_in, 16);
        c.token_bytes = 12;
        assert_eq!(c.validate().unwrap().b_in, 16);
        c.token_bytes = 13;
        assert_eq!(c.validate().unwrap().b_in, 32);
        assert_eq!(d.b_out, 16);
        assert_eq!(d.out_row_bytes(), 12);
    }
}
