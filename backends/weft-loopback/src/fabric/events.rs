//! The event queue and simulated time: events in (time, sequence) order,
//! stepping and advancing time, dispatching each event, and the initiator's
//! completions (`finish` schedules the ack, `complete` reports it).

use super::op::{Body, Op, Phase};
use super::state::State;
use super::{nic_name, trace_error};
use crate::addr;
use crate::trace::TraceKind;
use std::cmp::Ordering;
use std::collections::BinaryHeap;
use weft_transport::{Completion, TransportError};

#[derive(Debug, Clone, Copy)]
pub(super) enum FailReason {
    Injected(usize),
    Partition,
}

#[derive(Debug, Clone, Copy)]
pub(super) enum EvKind {
    Chunk { op: u64, idx: u32, attempt: u32 },
    SendArrive { op: u64, attempt: u32 },
    Ack { op: u64 },
    RnrTimeout { op: u64 },
    Fail { op: u64, why: FailReason },
}

#[derive(Debug)]
struct Event {
    time: u64,
    seq: u64,
    kind: EvKind,
}

impl PartialEq for Event {
    fn eq(&self, o: &Self) -> bool {
        (self.time, self.seq) == (o.time, o.seq)
    }
}
impl Eq for Event {}
impl PartialOrd for Event {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Event {
    /// Reversed, so the `BinaryHeap` pops the earliest (time, seq) first.
    fn cmp(&self, o: &Self) -> Ordering {
        (o.time, o.seq).cmp(&(self.time, self.seq))
    }
}

/// The pending events. Pops the earliest (time, seq) first; `seq` counts
/// every event ever scheduled, so events due at the same time run in the
/// order they were scheduled.
#[derive(Default)]
pub(super) struct EventQueue {
    seq: u64,
    heap: BinaryHeap<Event>,
}

impl EventQueue {
    fn push(&mut self, time: u64, kind: EvKind) {
        let seq = self.seq;
        self.seq += 1;
        self.heap.push(Event { time, seq, kind });
    }

    fn pop(&mut self) -> Option<Event> {
        self.heap.pop()
    }

    /// The time of the next event, if any.
    pub(super) fn next_time(&self) -> Option<u64> {
        self.heap.peek().map(|e| e.time)
    }

    /// Number of events queued.
    pub(super) fn len(&self) -> usize {
        self.heap.len()
    }
}

impl State {
    pub(super) fn schedule(&mut self, time: u64, kind: EvKind) {
        self.events.push(time, kind);
    }

    // --- time -------------------------------------------------------------

    pub(super) fn step(&mut self) -> bool {
        let Some(ev) = self.events.pop() else {
            return false;
        };
        self.now = self.now.max(ev.time);
        self.handle(ev.kind);
        true
    }

    pub(crate) fn process_due(&mut self) {
        while self.events.next_time().is_some_and(|t| t <= self.now) {
            self.step();
        }
    }

    pub(super) fn advance_to(&mut self, t: u64) {
        while self.events.next_time().is_some_and(|next| next <= t) {
            self.step();
        }
        self.now = self.now.max(t);
    }

    // --- completion -------------------------------------------------------

    /// Generates the initiator's completion for `id` and forgets the op.
    pub(super) fn complete(&mut self, id: u64, result: Result<(), TransportError>) {
        let Some(op) = self.ops.remove(&id) else {
            return;
        };
        if result.is_ok() {
            self.stats.completed_ok += 1;
        } else {
            self.stats.completed_err += 1;
        }
        if self.cfg.trace {
            let error = result.as_ref().err().map(trace_error);
            self.record(TraceKind::Completed { op: id, error });
        }
        if let Err(e) = &result {
            tracing::debug!(op = id, wr = op.wr.0, error = %e, "loopback op failed");
        }
        if let Some(n) = self.nic_mut(op.src) {
            if n.alive && n.open {
                n.cq.push(match op.body {
                    Body::Send { .. } => Completion::Send { wr: op.wr, result },
                    Body::Write { .. } => Completion::Write { wr: op.wr, result },
                });
                self.mark_ready(op.src);
            }
        }
    }

    /// Marks `id` finished with `result`; the initiator learns it one
    /// (ack) latency later.
    pub(super) fn finish(&mut self, id: u64, result: Result<(), TransportError>) {
        let Some(op) = self.ops.get_mut(&id) else {
            return;
        };
        op.phase = Phase::Acking(result);
        let (src, dst) = (op.src, op.dst);
        let t = self.now.saturating_add(self.one_way(dst, src));
        self.schedule(t, EvKind::Ack { op: id });
    }

    // --- event handling ---------------------------------------------------

    fn handle(&mut self, ev: EvKind) {
        self.stats.events += 1;
        match ev {
            EvKind::Chunk { op, idx, attempt } => self.on_chunk(op, idx, attempt),
            EvKind::SendArrive { op, attempt } => self.on_send(op, attempt),
            EvKind::Ack { op } => {
                let r = match self.ops.get(&op) {
                    Some(Op {
                        phase: Phase::Acking(r),
                        ..
                    }) => r.clone(),
                    _ => return,
                };
                self.complete(op, r);
            }
            EvKind::RnrTimeout { op } => {
                let Some(o) = self.ops.get(&op) else { return };
                let (src, dst) = (o.src, o.dst);
                if !matches!(
                    (&o.phase, o.body),
                    (Phase::InFlight, Body::Send { waiting: true, .. })
                ) {
                    return;
                }
                if let Some(n) = self.nic_mut(dst) {
                    n.rnr_wait.retain(|&w| w != op);
                }
                self.stats.rnr_timeouts += 1;
                let e = TransportError::ReceiverNotReady {
                    nic: nic_name(src),
                    peer: addr::encode(dst.0, dst.1),
                };
                self.finish(op, Err(e));
            }
            EvKind::Fail { op, why } => {
                let Some(o) = self.ops.get(&op) else { return };
                if !matches!(o.phase, Phase::InFlight) {
                    return;
                }
                let (src, dst, wr) = (o.src, o.dst, o.wr);
                let e = match why {
                    FailReason::Injected(rule) => TransportError::Failed {
                        nic: nic_name(src),
                        wr: Some(wr),
                        what: format!("error injected by loopback rule #{rule}"),
                    },
                    FailReason::Partition => self.unreachable(
                        src,
                        dst,
                        &format!(
                            "retry limit ({}) exceeded: every transmission lost",
                            self.cfg.retry_limit
                        ),
                    ),
                };
                self.complete(op, Err(e));
            }
        }
    }
}
