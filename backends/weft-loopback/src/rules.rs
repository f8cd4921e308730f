//! Fault-injection rules: ordered, first match wins.

use crate::HostId;
use std::time::Duration;
use weft_transport::Imm;

/// The kind of an operation, as rules and the trace see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OpKind {
    /// A WRITE with payload (with or without immediate).
    Write,
    /// A zero-length WRITE carrying an immediate.
    ImmOnly,
    /// A two-sided SEND.
    Send,
}

/// Which operations a [`Rule`] applies to. `None` fields match anything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Matcher {
    /// Operation kind. [`OpKind::Write`] matches every WRITE (imm-only
    /// included); [`OpKind::ImmOnly`] only zero-length immediate WRITEs.
    pub kind: Option<OpKind>,
    /// Initiator host.
    pub src_host: Option<HostId>,
    /// Initiator NIC index.
    pub src_nic: Option<usize>,
    /// Target host.
    pub dst_host: Option<HostId>,
    /// Target NIC index.
    pub dst_nic: Option<usize>,
    /// Immediate value (operations without immediate never match).
    pub imm: Option<Imm>,
}

impl Matcher {
    pub(crate) fn matches(
        &self,
        kind: OpKind,
        src: (u32, u32),
        dst: Option<(u32, u32)>,
        imm: Option<Imm>,
    ) -> bool {
        let kind_ok = match self.kind {
            None => true,
            Some(OpKind::Write) => matches!(kind, OpKind::Write | OpKind::ImmOnly),
            Some(k) => k == kind,
        };
        let eq_host =
            |want: Option<HostId>, got: Option<u32>| want.is_none_or(|h| Some(h.0) == got);
        let eq_nic = |want: Option<usize>, got: Option<u32>| {
            want.is_none_or(|n| got.is_some_and(|g| usize::try_from(g).ok() == Some(n)))
        };
        kind_ok
            && eq_host(self.src_host, Some(src.0))
            && eq_nic(self.src_nic, Some(src.1))
            && eq_host(self.dst_host, dst.map(|d| d.0))
            && eq_nic(self.dst_nic, dst.map(|d| d.1))
            && self.imm.is_none_or(|want| imm == Some(want))
    }
}

/// What happens to an operation a [`Rule`] matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Deliver normally (useful to shield some traffic from later rules).
    Pass,
    /// Deliver, but this much later than the model says.
    Delay(Duration),
    /// Every chunk/message of the operation is lost once, then retransmitted
    /// after `retransmit_delay`; delivered exactly once.
    Drop,
    /// Every transmission is lost (a partition): nothing is delivered, and
    /// after `retry_limit` retransmissions the operation fails with
    /// `PeerUnreachable`.
    DropAll,
    /// Injected error completion on the initiator (`TransportError::Failed`):
    /// nothing written, no immediate, no receive consumed.
    Fail,
    /// Kill the target host when the rule matches (at post time); this
    /// operation and every other one pending to that host fail with
    /// `PeerUnreachable`.
    KillDst,
}

/// One fault-injection rule: a [`Matcher`], an [`Action`] and an optional
/// limit on how many operations it applies to.
///
/// Rules are evaluated in installation order when an operation is posted;
/// the first rule that matches (and whose limit is not used up) decides.
///
/// ```
/// use weft_loopback::{Action, HostId, OpKind, Rule};
/// // Fail the first two WRITEs to host 1 carrying immediate 7.
/// let r = Rule::new(Action::Fail).kind(OpKind::Write).to_host(HostId(1)).imm(7).first(2);
/// assert_eq!(r.limit, Some(2));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    /// Which operations it applies to.
    pub matcher: Matcher,
    /// What it does to them.
    pub action: Action,
    /// Apply only to the first `n` matching operations.
    pub limit: Option<u64>,
}

impl Rule {
    /// A rule matching every operation.
    pub fn new(action: Action) -> Self {
        Self {
            matcher: Matcher::default(),
            action,
            limit: None,
        }
    }

    /// Only operations of this kind.
    pub fn kind(mut self, kind: OpKind) -> Self {
        self.matcher.kind = Some(kind);
        self
    }

    /// Only operations posted by this host.
    pub fn from_host(mut self, host: HostId) -> Self {
        self.matcher.src_host = Some(host);
        self
    }

    /// Only operations posted by this NIC.
    pub fn from_nic(mut self, host: HostId, nic: usize) -> Self {
        self.matcher.src_host = Some(host);
        self.matcher.src_nic = Some(nic);
        self
    }

    /// Only operations to this host.
    pub fn to_host(mut self, host: HostId) -> Self {
        self.matcher.dst_host = Some(host);
        self
    }

    /// Only operations to this NIC.
    pub fn to_nic(mut self, host: HostId, nic: usize) -> Self {
        self.matcher.dst_host = Some(host);
        self.matcher.dst_nic = Some(nic);
        self
    }

    /// Only operations carrying this immediate.
    pub fn imm(mut self, imm: Imm) -> Self {
        self.matcher.imm = Some(imm);
        self
    }

    /// Only the first `n` matching operations.
    pub fn first(mut self, n: u64) -> Self {
        self.limit = Some(n);
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matcher_fields() {
        let any = Matcher::default();
        assert!(any.matches(OpKind::Send, (0, 0), None, None));
        let w = Rule::new(Action::Pass).kind(OpKind::Write).matcher;
        assert!(w.matches(OpKind::Write, (0, 0), Some((1, 0)), None));
        assert!(w.matches(OpKind::ImmOnly, (0, 0), Some((1, 0)), Some(1)));
        assert!(!w.matches(OpKind::Send, (0, 0), Some((1, 0)), None));
        let io = Rule::new(Action::Pass).kind(OpKind::ImmOnly).matcher;
        assert!(!io.matches(OpKind::Write, (0, 0), Some((1, 0)), Some(1)));
        let r = Rule::new(Action::Pass)
            .from_nic(HostId(2), 1)
            .to_nic(HostId(3), 0)
            .imm(9)
            .matcher;
        assert!(r.matches(OpKind::Write, (2, 1), Some((3, 0)), Some(9)));
        assert!(!r.matches(OpKind::Write, (2, 0), Some((3, 0)), Some(9)));
        assert!(!r.matches(OpKind::Write, (2, 1), Some((3, 1)), Some(9)));
        assert!(!r.matches(OpKind::Write, (2, 1), Some((4, 0)), Some(9)));
        assert!(!r.matches(OpKind::Write, (2, 1), Some((3, 0)), Some(8)));
        assert!(!r.matches(OpKind::Write, (2, 1), Some((3, 0)), None));
        assert!(!r.matches(OpKind::Write, (2, 1), None, Some(9)));
    }
}
