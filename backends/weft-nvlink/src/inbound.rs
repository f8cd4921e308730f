//! The target's side of one connection: frames from the forward ring are
//! checked against this domain's registrations and receive buffers, their
//! bytes copied into place, and each finished operation answered on the
//! back ring. The initiator is untrusted: a frame that breaks the protocol
//! ends the connection (`RingError`); one that names memory it may not
//! write is answered with a remote-access error and writes nothing.

use crate::keys::Keys;
use crate::proto::{self, Status};
use crate::ring::{Frame, Ring, RingError};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};
use weft_transport::{
    Access, Completion, Device, PeerMemory, RemoteAccessReason, TransportError, WrId,
};

/// A posted receive buffer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RecvBuf {
    pub(crate) wr: WrId,
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) dev: Device,
}

#[derive(Debug)]
enum Cur {
    Write {
        op: u64,
        rkey: u64,
        addr: u64,
        total: u64,
        got: u64,
        err: Option<RemoteAccessReason>,
        imm: Option<u32>,
    },
    Send {
        op: u64,
        total: u64,
        got: u64,
        dst: Option<RecvBuf>,
        err: Option<Status>,
    },
}

/// What the domain lends a connection while it is progressed.
pub(crate) struct Target<'a> {
    pub(crate) keys: &'a Keys,
    pub(crate) recvs: &'a mut VecDeque<RecvBuf>,
    pub(crate) out: &'a mut Vec<Completion>,
    pub(crate) pm: Option<&'a Arc<dyn PeerMemory>>,
    pub(crate) now: Instant,
    pub(crate) rnr: Duration,
    pub(crate) nic: &'a str,
}

/// One inbound connection's protocol state.
pub(crate) struct Inbound {
    pub(crate) rx: Ring,
    pub(crate) tx: Ring,
    cur: Option<Cur>,
    pending_ack: Option<(u64, Status)>,
    blocked_since: Option<Instant>,
    /// The initiator's address: where its messages came from.
    from: weft_transport::NetAddr,
}

/// Frames handled per connection per poll, so one busy initiator cannot
/// starve the rest.
const BUDGET: usize = 64;

impl Inbound {
    pub(crate) fn new(rx: Ring, tx: Ring, from: weft_transport::NetAddr) -> Inbound {
        Inbound {
            rx,
            tx,
            cur: None,
            pending_ack: None,
            blocked_since: None,
            from,
        }
    }

    /// The receive buffer of a SEND still arriving, when the connection is
    /// given up (it was taken but never reported).
    pub(crate) fn abandon(self) -> Option<RecvBuf> {
        match self.cur {
            Some(Cur::Send { dst, .. }) => dst,
            _ => None,
        }
    }

    /// Whether a SEND waits for a receive buffer (the domain must keep
    /// polling to time it out).
    pub(crate) fn blocked(&self) -> bool {
        self.blocked_since.is_some() || self.pending_ack.is_some()
    }

    /// Handles frames; `Ok(true)` when the initiator should be woken.
    pub(crate) fn progress(&mut self, t: &mut Target<'_>) -> Result<bool, RingError> {
        let mut acked = false;
        for _ in 0..BUDGET {
            if let Some((op, st)) = self.pending_ack {
                let (w, x) = st.encode();
                if !self
                    .tx
                    .push(proto::ACK, &proto::words([op, w, x]), 0, |_| {})
                {
                    break;
                }
                acked = true;
                self.pending_ack = None;
            }
            let Some(f) = self.rx.peek()? else { break };
            let done = match f.kind {
                proto::WRITE => self.write(&f, t)?,
                proto::SEND => match self.send(&f, t)? {
                    Some(done) => done,
                    None => break,
                },
                proto::LANDED => {
                    proto::need(&f, 2).ok_or_else(|| RingError("short LANDED".into()))?;
                    t.out.push(Completion::Imm {
                        imm: f.u64_at(1) as u32,
                    });
                    None
                }
                k => return Err(RingError(format!("frame kind {k} on the forward ring"))),
            };
            self.rx.consume(&f);
            self.pending_ack = done;
        }
        if let Some((op, st)) = self.pending_ack {
            let (w, x) = st.encode();
            if self
                .tx
                .push(proto::ACK, &proto::words([op, w, x]), 0, |_| {})
            {
                acked = true;
                self.pending_ack = None;
            }
        }
        Ok(acked && self.tx.wants_bell())
    }

    /// A WRITE chunk; `Some` answer when it was the last.
    fn write(&mut self, f: &Frame, t: &mut Target<'_>) -> Result<Option<(u64, Status)>, RingError> {
        proto::need(f, 6).ok_or_else(|| RingError("short WRITE".into()))?;
        let (op, rkey, addr, total, at, flags) = (
            f.u64_at(0),
            f.u64_at(1),
            f.u64_at(2),
            f.u64_at(3),
            f.u64_at(4),
            f.u64_at(5),
        );
        if at == 0 {
            if self.cur.is_some() {
                return Err(RingError(format!(
                    "WRITE {op} starts inside another operation"
                )));
            }
            let err = match t.keys.get(rkey) {
                None => Some(RemoteAccessReason::UnknownKey),
                Some(r) if r.access != Access::RemoteWrite => Some(RemoteAccessReason::NotWritable),
                Some(r) if !r.holds(addr, total) => Some(RemoteAccessReason::OutOfBounds),
                Some(_) => None,
            };
            let imm = (flags & proto::F_IMM != 0).then_some((flags >> 32) as u32);
            self.cur = Some(Cur::Write {
                op,
                rkey,
                addr,
                total,
                got: 0,
                err,
                imm,
            });
        }
        let Some(Cur::Write {
            op: cop,
            rkey: ck,
            addr: ca,
            total: ct,
            got,
            err,
            imm,
        }) = &mut self.cur
        else {
            return Err(RingError(format!(
                "WRITE {op} chunk at {at} without its start"
            )));
        };
        let n = f.payload_len as u64;
        let last = flags & proto::F_LAST != 0;
        if (*cop, *ck, *ca, *ct, *got) != (op, rkey, addr, total, at)
            || n > total - at
            || last != (at + n == total)
        {
            return Err(RingError(format!(
                "WRITE {op} chunk at {at} of {n} bytes out of sequence"
            )));
        }
        if err.is_none() && n > 0 {
            // Checked per chunk: the region may have been deregistered since.
            match t.keys.get(rkey) {
                Some(r) if r.holds(addr + at, n) => {
                    if let Err(e) = place(r.device, addr + at, f, t.pm) {
                        tracing::warn!(%e, nic = t.nic, "nvlink: copying a WRITE into place failed");
                        *err = Some(RemoteAccessReason::Unspecified);
                    }
                }
                _ => *err = Some(RemoteAccessReason::UnknownKey),
            }
        }
        *got += n;
        if !last {
            return Ok(None);
        }
        let (err, imm) = (*err, *imm);
        self.cur = None;
        Ok(Some(match err {
            None => {
                if let Some(imm) = imm {
                    t.out.push(Completion::Imm { imm });
                }
                (op, Status::Ok)
            }
            Some(r) => (op, Status::RemoteAccess(r)),
        }))
    }

    /// A SEND chunk: `None` while its first chunk waits for a receive
    /// buffer, `Some(answer)` once handled (`Some(None)` mid-message).
    #[allow(clippy::type_complexity)]
    fn send(
        &mut self,
        f: &Frame,
        t: &mut Target<'_>,
    ) -> Result<Option<Option<(u64, Status)>>, RingError> {
        proto::need(f, 3).ok_or_else(|| RingError("short SEND".into()))?;
        let (op, total, word) = (f.u64_at(0), f.u64_at(1), f.u64_at(2));
        let (at, last) = (word & !proto::LAST_BIT, word & proto::LAST_BIT != 0);
        if at == 0 {
            if self.cur.is_some() {
                return Err(RingError(format!(
                    "SEND {op} starts inside another operation"
                )));
            }
            let (dst, err) = match t.recvs.pop_front() {
                None => {
                    let since = *self.blocked_since.get_or_insert(t.now);
                    if t.now.duration_since(since) < t.rnr {
                        return Ok(None);
                    }
                    (None, Some(Status::NotReady))
                }
                Some(b) if b.len < total => {
                    t.out.push(Completion::Recv {
                        wr: b.wr,
                        result: Err(TransportError::MessageTooLong {
                            nic: t.nic.to_string(),
                            peer: weft_transport::NetAddr(Vec::new()),
                            len: total,
                            capacity: b.len,
                        }),
                        from: None,
                    });
                    (None, Some(Status::TooLong { capacity: b.len }))
                }
                Some(b) => (Some(b), None),
            };
            self.blocked_since = None;
            self.cur = Some(Cur::Send {
                op,
                total,
                got: 0,
                dst,
                err,
            });
        }
        let Some(Cur::Send {
            op: cop,
            total: ct,
            got,
            dst,
            err,
        }) = &mut self.cur
        else {
            return Err(RingError(format!(
                "SEND {op} chunk at {at} without its start"
            )));
        };
        let n = f.payload_len as u64;
        if (*cop, *ct, *got) != (op, total, at) || n > total - at || last != (at + n == total) {
            return Err(RingError(format!(
                "SEND {op} chunk at {at} of {n} bytes out of sequence"
            )));
        }
        if let (Some(b), None) = (dst.as_ref(), *err) {
            if n > 0 {
                if let Err(e) = place(b.dev, b.addr + at, f, t.pm) {
                    tracing::warn!(%e, nic = t.nic, "nvlink: copying a SEND into its buffer failed");
                    *err = Some(Status::RemoteAccess(RemoteAccessReason::Unspecified));
                }
            }
        }
        *got += n;
        if !last {
            return Ok(Some(None));
        }
        let (dst, err) = (*dst, *err);
        self.cur = None;
        if let Some(b) = dst {
            let from = err.is_none().then(|| self.from.clone());
            let result = match err {
                None => Ok(total),
                Some(_) => Err(TransportError::Failed {
                    nic: t.nic.to_string(),
                    wr: Some(b.wr),
                    what: "the message could not be copied into the buffer".into(),
                }),
            };
            t.out.push(Completion::Recv {
                wr: b.wr,
                result,
                from,
            });
        }
        Ok(Some(Some((op, err.unwrap_or(Status::Ok)))))
    }
}

/// Copies a frame's payload to `dst` (memory of `dev` in this process).
fn place(
    dev: Device,
    dst: u64,
    f: &Frame,
    pm: Option<&Arc<dyn PeerMemory>>,
) -> Result<(), TransportError> {
    let n = f.payload_len;
    match dev {
        Device::Host => {
            // SAFETY: `dst .. dst+n` lies inside a registered host region
            // (checked by the caller against the live registration; the
            // registrant promised it stays valid while registered), and the
            // payload lies inside the frame. The peer may change the payload
            // while it is copied: that garbles only its own bytes.
            #[allow(unsafe_code)]
            unsafe {
                std::ptr::copy_nonoverlapping(f.payload, dst as *mut u8, n)
            };
            Ok(())
        }
        _ => match pm {
            Some(pm) => pm.copy(dst, dev, f.payload as u64, Device::Host, n as u64),
            None => Err(TransportError::Unsupported {
                nic: String::new(),
                what: format!("{dev} memory without a copier"),
            }),
        },
    }
}

#[cfg(test)]
#[allow(unsafe_code)]
mod tests {
    //! The target's protocol core driven frame by frame from a hostile
    //! initiator: rings over heap memory, no sockets.
    use super::*;
    use crate::keys::TABLE_BYTES;
    use crate::ring::CONTROL;
    use crate::sys::Mapping;

    const CAP: usize = 1 << 16;

    struct Rig {
        _mem: Vec<u64>,
        /// The initiator's ends: forward producer, back consumer.
        fwd: Ring,
        back: Ring,
        inb: Inbound,
        keys: Keys,
        recvs: VecDeque<RecvBuf>,
        out: Vec<Completion>,
        mem: Vec<u8>,
    }

    fn rig() -> Rig {
        let mut mem = vec![0u64; (2 * (CONTROL + CAP) + 64) / 8];
        let base = (mem.as_mut_ptr() as usize).next_multiple_of(64) as *mut u8;
        // SAFETY: both rings lie inside `mem`, which the rig keeps alive.
        let (f1, f2, b1, b2) = unsafe {
            let b = base.add(CONTROL + CAP);
            (
                Ring::new(base, CAP),
                Ring::new(base, CAP),
                Ring::new(b, CAP),
                Ring::new(b, CAP),
            )
        };
        Rig {
            _mem: mem,
            fwd: f1,
            back: b2,
            inb: Inbound::new(f2, b1, weft_transport::NetAddr(b"peer".to_vec())),
            keys: Keys::new(Mapping::create("t", TABLE_BYTES).unwrap(), 99),
            recvs: VecDeque::new(),
            out: Vec::new(),
            mem: vec![0u8; 4096],
        }
    }

    impl Rig {
        fn reg(&mut self, access: Access) -> (u64, u64) {
            let base = self.mem.as_ptr() as u64;
            (
                self.keys.insert(base, 4096, access, Device::Host, None),
                base,
            )
        }
        fn push(&mut self, kind: u16, hdr: &[u64], payload: &[u8]) {
            let h = proto::words::<6>(std::array::from_fn(|i| hdr.get(i).copied().unwrap_or(0)));
            let h = &h[..hdr.len() * 8];
            // SAFETY: writes exactly `payload.len()` bytes into the frame.
            assert!(self.fwd.push(kind, h, payload.len(), |p| unsafe {
                std::ptr::copy_nonoverlapping(payload.as_ptr(), p, payload.len())
            }));
        }
        fn run(&mut self, now: Instant) -> Result<bool, RingError> {
            let mut t = Target {
                keys: &self.keys,
                recvs: &mut self.recvs,
                out: &mut self.out,
                pm: None,
                now,
                rnr: Duration::from_millis(100),
                nic: "t",
            };
            self.inb.progress(&mut t)
        }
        fn acks(&mut self) -> Vec<(u64, Status)> {
            let mut v = Vec::new();
            while let Some(f) = self.back.peek().unwrap() {
                v.push((
                    f.u64_at(0),
                    Status::decode(f.u64_at(1), f.u64_at(2)).unwrap(),
                ));
                self.back.consume(&f);
            }
            v
        }
    }

    fn write_hdr(
        op: u64,
        rkey: u64,
        addr: u64,
        total: u64,
        at: u64,
        last: bool,
        imm: Option<u32>,
    ) -> [u64; 6] {
        let flags = imm.map_or(0, |i| proto::F_IMM | (i as u64) << 32)
            | if last { proto::F_LAST } else { 0 };
        [op, rkey, addr, total, at, flags]
    }

    #[test]
    fn refused_writes_write_nothing_and_report_no_immediate() {
        let mut r = rig();
        let (rw, base) = r.reg(Access::RemoteWrite);
        let (ro, _) = r.reg(Access::LocalOnly);
        let cases = [
            (1, rw ^ 0x1000, base, RemoteAccessReason::UnknownKey),
            (2, ro, base, RemoteAccessReason::NotWritable),
            (3, rw, base + 4090, RemoteAccessReason::OutOfBounds),
            (4, rw, u64::MAX - 3, RemoteAccessReason::OutOfBounds),
        ];
        for (op, key, addr, _) in cases {
            r.push(
                proto::WRITE,
                &write_hdr(op, key, addr, 8, 0, true, Some(7)),
                &[0xaa; 8],
            );
        }
        r.run(Instant::now()).unwrap();
        let want: Vec<_> = cases
            .iter()
            .map(|c| (c.0, Status::RemoteAccess(c.3)))
            .collect();
        assert_eq!(r.acks(), want);
        assert!(
            r.out.is_empty(),
            "no immediate for a refused write: {:?}",
            r.out
        );
        assert!(r.mem.iter().all(|&b| b == 0));
    }

    #[test]
    fn chunked_write_lands_and_its_immediate_follows_the_last_chunk() {
        let mut r = rig();
        let (k, base) = r.reg(Access::RemoteWrite);
        r.push(
            proto::WRITE,
            &write_hdr(9, k, base + 100, 16, 0, false, Some(5)),
            &[1; 8],
        );
        r.run(Instant::now()).unwrap();
        assert!(
            r.out.is_empty() && r.acks().is_empty(),
            "nothing before the last chunk"
        );
        r.push(
            proto::WRITE,
            &write_hdr(9, k, base + 100, 16, 8, true, Some(5)),
            &[2; 8],
        );
        r.run(Instant::now()).unwrap();
        assert_eq!(r.out, vec![Completion::Imm { imm: 5 }]);
        assert_eq!(r.acks(), vec![(9, Status::Ok)]);
        assert_eq!(
            &r.mem[100..116],
            &[1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2]
        );
    }

    #[test]
    fn deregistration_mid_write_stops_the_bytes_and_the_immediate() {
        let mut r = rig();
        let (k, base) = r.reg(Access::RemoteWrite);
        r.push(
            proto::WRITE,
            &write_hdr(1, k, base, 16, 0, false, Some(5)),
            &[1; 8],
        );
        r.run(Instant::now()).unwrap();
        r.keys.remove(k).unwrap();
        r.push(
            proto::WRITE,
            &write_hdr(1, k, base, 16, 8, true, Some(5)),
            &[2; 8],
        );
        r.run(Instant::now()).unwrap();
        assert!(r.out.is_empty());
        assert_eq!(
            r.acks(),
            vec![(1, Status::RemoteAccess(RemoteAccessReason::UnknownKey))]
        );
        assert!(r.mem[8..16].iter().all(|&b| b == 0));
    }

    #[test]
    fn protocol_violations_end_the_connection() {
        let (k, base);
        // An unknown kind, and each kind with too short a header.
        for (kind, hdr) in [
            (77, &[1u64][..]),
            (proto::WRITE, &[1, 2]),
            (proto::SEND, &[1]),
            (proto::LANDED, &[1]),
        ] {
            let mut r = rig();
            r.push(kind, hdr, &[]);
            assert!(r.run(Instant::now()).is_err());
        }
        // A chunk that does not continue the write in progress.
        let mut r = rig();
        (k, base) = r.reg(Access::RemoteWrite);
        r.push(
            proto::WRITE,
            &write_hdr(1, k, base, 16, 0, false, None),
            &[1; 8],
        );
        r.push(
            proto::WRITE,
            &write_hdr(1, k, base, 16, 4, true, None),
            &[1; 12],
        );
        assert!(r.run(Instant::now()).is_err());
        // A "last" chunk that is not the end, and a payload past the total.
        let mut r = rig();
        r.push(
            proto::WRITE,
            &write_hdr(1, k, base, 16, 0, true, None),
            &[1; 8],
        );
        assert!(r.run(Instant::now()).is_err());
        let mut r = rig();
        r.push(
            proto::WRITE,
            &write_hdr(1, k, base, 4, 0, true, None),
            &[1; 8],
        );
        assert!(r.run(Instant::now()).is_err());
        // A new write starting inside another.
        let mut r = rig();
        let (k2, b2) = r.reg(Access::RemoteWrite);
        r.push(
            proto::WRITE,
            &write_hdr(1, k2, b2, 16, 0, false, None),
            &[1; 8],
        );
        r.push(
            proto::WRITE,
            &write_hdr(2, k2, b2, 8, 0, true, None),
            &[1; 8],
        );
        assert!(r.run(Instant::now()).is_err());
    }

    #[test]
    fn an_abandoned_send_gives_its_buffer_back() {
        let mut r = rig();
        let (_, base) = r.reg(Access::LocalOnly);
        r.recvs.push_back(RecvBuf {
            wr: WrId(7),
            addr: base,
            len: 64,
            dev: Device::Host,
        });
        r.push(proto::SEND, &[1, 16, 0], &[1; 8]);
        r.run(Instant::now()).unwrap();
        assert!(
            r.recvs.is_empty() && r.out.is_empty(),
            "taken, not reported"
        );
        let b = r.inb.abandon().expect("the taken buffer");
        assert_eq!((b.wr, b.len), (WrId(7), 64));
    }

    #[test]
    fn send_waits_for_a_buffer_then_times_out() {
        let mut r = rig();
        let t0 = Instant::now();
        r.push(proto::SEND, &[1, 4, proto::LAST_BIT], &[3; 4]);
        r.run(t0).unwrap();
        assert!(
            r.acks().is_empty() && r.inb.blocked(),
            "waits for a receive buffer"
        );
        r.run(t0 + Duration::from_millis(150)).unwrap();
        assert_eq!(r.acks(), vec![(1, Status::NotReady)]);
        // Then a buffer too small, then one that fits.
        let (k, base) = r.reg(Access::LocalOnly);
        let _ = k;
        r.recvs.push_back(RecvBuf {
            wr: WrId(1),
            addr: base,
            len: 2,
            dev: Device::Host,
        });
        r.recvs.push_back(RecvBuf {
            wr: WrId(2),
            addr: base + 8,
            len: 8,
            dev: Device::Host,
        });
        r.push(proto::SEND, &[2, 4, proto::LAST_BIT], &[4; 4]);
        r.push(proto::SEND, &[3, 4, proto::LAST_BIT], &[5; 4]);
        r.run(t0).unwrap();
        assert_eq!(
            r.acks(),
            vec![(2, Status::TooLong { capacity: 2 }), (3, Status::Ok)]
        );
        assert!(matches!(
            r.out[0],
            Completion::Recv {
                wr: WrId(1),
                result: Err(_),
                from: None
            }
        ));
        assert_eq!(
            r.out[1],
            Completion::Recv {
                wr: WrId(2),
                result: Ok(4),
                from: Some(weft_transport::NetAddr(b"peer".to_vec()))
            }
        );
        assert_eq!(&r.mem[..12], &[0, 0, 0, 0, 0, 0, 0, 0, 5, 5, 5, 5]);
    }
}
