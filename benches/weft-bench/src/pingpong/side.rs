//! One side of a ping-pong: its engines and buffers, and the server's loop.

use super::{Ctl, Msg, Op, BUF_LEN, MAX_MSG, RECV_BUFS};
use crate::cpu::CpuSample;
use crate::engines::{bench_config, wait_until, Shutdown};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use weft::{
    DomainGroupSpec, GroupAddress, HostBuffer, MrDesc, MrHandle, OnDone, Provider, RecvQueue,
    TransferEngine,
};

/// One side: an engine with a source and a destination region, an
/// immediate value it expects and a receive pool that counts messages.
pub(super) struct Side {
    pub(super) eng: Shutdown,
    /// A second engine whose receive pool is a `RecvQueue` (an engine's
    /// SENDs land in whichever of its pools' buffers is posted next, so
    /// the two receive styles need an engine each).
    pub(super) qeng: Shutdown,
    pub(super) queue: RecvQueue,
    pub(super) src: MrHandle,
    pub(super) desc: MrDesc,
    pub(super) imm: u32,
    pub(super) recvd: Arc<AtomicU64>,
    pub(super) recv_err: Arc<AtomicU64>,
    pub(super) msg: Vec<u8>,
    pub(super) _bufs: (HostBuffer, HostBuffer),
}

pub(super) fn e2s(e: impl std::fmt::Display) -> String {
    e.to_string()
}

impl Side {
    /// `host` serves the main engine, `qhost` the polled one (a host of
    /// its own: the simulated fabric opens a NIC once).
    pub(super) fn new(host: Arc<dyn Provider>, qhost: Arc<dyn Provider>) -> Result<Side, String> {
        let eng = TransferEngine::builder()
            .group(DomainGroupSpec::new(host, vec![0]))
            .config(bench_config())
            .build()
            .map_err(e2s)?;
        let eng = Shutdown(eng);
        let a = HostBuffer::new(BUF_LEN as usize).map_err(e2s)?;
        let b = HostBuffer::new(BUF_LEN as usize).map_err(e2s)?;
        let (src, _) = eng.reg_mr(a.region()).map_err(e2s)?;
        let (_, desc) = eng.reg_mr(b.region()).map_err(e2s)?;
        let imm = eng.alloc_imm().map_err(e2s)?;
        let recvd = Arc::new(AtomicU64::new(0));
        let recv_err = Arc::new(AtomicU64::new(0));
        let (r, e) = (Arc::clone(&recvd), Arc::clone(&recv_err));
        eng.submit_recvs(MAX_MSG, RECV_BUFS, move |m| {
            match m {
                Ok(_) => r.fetch_add(1, Ordering::Release),
                Err(_) => e.fetch_add(1, Ordering::Release),
            };
        })
        .map_err(e2s)?;
        let qeng = TransferEngine::builder()
            .group(DomainGroupSpec::new(qhost, vec![0]))
            .config(bench_config())
            .build()
            .map_err(e2s)?;
        let qeng = Shutdown(qeng);
        let queue = qeng.recv_queue(MAX_MSG, RECV_BUFS).map_err(e2s)?;
        Ok(Side {
            eng,
            qeng,
            queue,
            src,
            desc,
            imm,
            recvd,
            recv_err,
            msg: vec![0x5a; MAX_MSG as usize],
            _bufs: (a, b),
        })
    }

    pub(super) fn hello(&self) -> Msg {
        Msg::Hello {
            addr: self.eng.main_address(),
            qaddr: self.qeng.main_address(),
            desc: self.desc.clone(),
            imm: self.imm,
        }
    }

    pub(super) fn wait_recv(&self, n: u64) -> Result<(), String> {
        wait_until(|| {
            self.recvd.load(Ordering::Acquire) >= n || self.recv_err.load(Ordering::Acquire) > 0
        })?;
        if self.recv_err.load(Ordering::Acquire) > 0 {
            return Err("a receive failed".into());
        }
        Ok(())
    }

    /// Takes the next message from the polled pool.
    pub(super) fn take_queued(&self) -> Result<(), String> {
        let mut r = None;
        wait_until(|| {
            r = self.queue.try_recv();
            r.is_some()
        })?;
        match r {
            Some(Ok(_)) => Ok(()),
            Some(Err(e)) => Err(format!("a receive failed: {e}")),
            None => Err("no message".into()),
        }
    }

    pub(super) fn send_queued(&self, peer: &Peer, size: u64) -> Result<(), String> {
        self.qeng
            .submit_send(&peer.qaddr, &self.msg[..size as usize], OnDone::Ignore)
            .map(|_| ())
            .map_err(e2s)
    }

    pub(super) fn arm(&self, size: u64) -> Result<Arc<weft::DoneFlag>, String> {
        let n = self.eng.imm_counts(0).map_err(e2s)?.single_write(size);
        let (od, flag) = OnDone::flag();
        self.eng
            .expect_imm_count_with(self.imm, n, od)
            .map_err(e2s)?;
        Ok(flag)
    }

    pub(super) fn wait_flag(flag: &weft::DoneFlag) -> Result<(), String> {
        wait_until(|| flag.is_done())?;
        match flag.result() {
            Some(Ok(())) => Ok(()),
            Some(Err(e)) => Err(format!("immediate round failed: {e}")),
            None => Err("round not resolved".into()),
        }
    }

    pub(super) fn write(
        &self,
        peer: &Peer,
        size: u64,
        imm: Option<u32>,
        od: OnDone,
    ) -> Result<(), String> {
        self.eng
            .submit_single_write(size, imm, (&self.src, 0), (&peer.desc, 0), od)
            .map(|_| ())
            .map_err(e2s)
    }

    pub(super) fn send(&self, peer: &Peer, size: u64) -> Result<(), String> {
        self.eng
            .submit_send(&peer.addr, &self.msg[..size as usize], OnDone::Ignore)
            .map(|_| ())
            .map_err(e2s)
    }

    /// The server's part of one `Run` (it has sent nothing yet).
    pub(super) fn serve_run(
        &self,
        peer: &Peer,
        op: Op,
        size: u64,
        iters: u64,
        ctl: &mut dyn Ctl,
    ) -> Result<(), String> {
        let cpu = CpuSample::now();
        let r = match op {
            Op::SendRecv => {
                let base = self.recvd.load(Ordering::Acquire);
                ctl.send(&Msg::Ready)?;
                (1..=iters).try_for_each(|i| {
                    self.wait_recv(base + i)?;
                    self.send(peer, size)
                })
            }
            Op::SendQueue => {
                ctl.send(&Msg::Ready)?;
                (1..=iters).try_for_each(|_| {
                    self.take_queued()?;
                    self.send_queued(peer, size)
                })
            }
            Op::WriteImm => {
                let mut flag = self.arm(size)?;
                ctl.send(&Msg::Ready)?;
                (0..iters).try_for_each(|i| {
                    Side::wait_flag(&flag)?;
                    if i + 1 < iters {
                        flag = self.arm(size)?;
                    }
                    self.write(peer, size, Some(peer.imm), OnDone::Ignore)
                })
            }
            Op::Stream => {
                ctl.send(&Msg::Ready)?;
                match ctl.recv()? {
                    Msg::End => Ok(()),
                    m => Err(format!("expected End, got {m:?}")),
                }
            }
        };
        let used = cpu.since();
        ctl.send(&Msg::Done {
            cpu_ns: used.process_ns,
            engine_ns: used.engine_ns,
            err: r.err(),
        })
    }
}

/// What a side knows of the other.
pub(super) struct Peer {
    pub(super) addr: GroupAddress,
    pub(super) qaddr: GroupAddress,
    pub(super) desc: MrDesc,
    pub(super) imm: u32,
}

pub(super) fn peer_from(m: Msg) -> Result<Peer, String> {
    match m {
        Msg::Hello {
            addr,
            qaddr,
            desc,
            imm,
        } => Ok(Peer {
            addr,
            qaddr,
            desc,
            imm,
        }),
        m => Err(format!("expected Hello, got {m:?}")),
    }
}

/// The server side: hello, then `Run`s until `Quit`.
pub(super) fn serve(side: &Side, ctl: &mut dyn Ctl) -> Result<(), String> {
    ctl.send(&side.hello())?;
    let peer = peer_from(ctl.recv()?)?;
    loop {
        match ctl.recv()? {
            Msg::Run { op, size, iters } => side.serve_run(&peer, op, size, iters, ctl)?,
            Msg::Quit => return Ok(()),
            m => return Err(format!("unexpected {m:?}")),
        }
    }
}
