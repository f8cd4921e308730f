//! Wire types of the domain proxy protocol (postcard frames over a Unix
//! socket): requests, replies, and lossless mirrors of the transport types.

use serde::{Deserialize, Serialize};
use weft_transport::{
    Completion, LocalSlice, MrKey, NetAddr, PeerId, RemoteAccessReason, RemoteSlice, Rkey,
    TransportError, WrId, WriteWr,
};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(crate) enum ErrW {
    PeerUnreachable {
        nic: String,
        peer: Vec<u8>,
        reason: String,
    },
    RemoteAccess {
        nic: String,
        peer: Vec<u8>,
        rkey: u64,
        addr: u64,
        len: u64,
        reason: u8,
    },
    LocalAccess {
        nic: String,
        what: String,
    },
    ReceiverNotReady {
        nic: String,
        peer: Vec<u8>,
    },
    MessageTooLong {
        nic: String,
        peer: Vec<u8>,
        len: u64,
        capacity: u64,
    },
    QueueFull {
        nic: String,
    },
    InvalidArgument {
        nic: String,
        what: String,
    },
    Unsupported {
        nic: String,
        what: String,
    },
    LibraryUnavailable {
        library: String,
        reason: String,
    },
    NoDevice {
        what: String,
    },
    Provider {
        nic: String,
        op: String,
        code: i64,
        message: String,
    },
    Failed {
        nic: String,
        wr: Option<u64>,
        what: String,
    },
    NicDown {
        nic: String,
    },
    Canceled {
        nic: String,
    },
    Other {
        text: String,
    },
    PeerRemoved {
        nic: String,
        peer: Vec<u8>,
    },
}

pub(crate) fn leak_op(op: String) -> &'static str {
    // Provider op names are a small fixed set of libfabric call names.
    const KNOWN: &[&str] = &[
        "fi_writemsg",
        "fi_send",
        "fi_recv",
        "completion",
        "fi_mr_reg",
        "fi_mr_regattr",
        "fi_mr_bind",
        "fi_mr_enable",
        "fi_close(mr)",
        "fi_cq_read",
        "fi_cq_readerr",
        "fi_av_insert",
        "fi_getname",
    ];
    KNOWN
        .iter()
        .copied()
        .find(|k| *k == op)
        .unwrap_or("libfabric (remote)")
}

impl From<&TransportError> for ErrW {
    fn from(e: &TransportError) -> Self {
        use TransportError as T;
        match e.clone() {
            T::PeerUnreachable { nic, peer, reason } => ErrW::PeerUnreachable {
                nic,
                peer: peer.0,
                reason,
            },
            T::RemoteAccess {
                nic,
                peer,
                rkey,
                addr,
                len,
                reason,
            } => ErrW::RemoteAccess {
                nic,
                peer: peer.0,
                rkey,
                addr,
                len,
                reason: match reason {
                    RemoteAccessReason::UnknownKey => 0,
                    RemoteAccessReason::NotWritable => 1,
                    RemoteAccessReason::OutOfBounds => 2,
                    _ => 0,
                },
            },
            T::LocalAccess { nic, what } => ErrW::LocalAccess { nic, what },
            T::ReceiverNotReady { nic, peer } => ErrW::ReceiverNotReady { nic, peer: peer.0 },
            T::MessageTooLong {
                nic,
                peer,
                len,
                capacity,
            } => ErrW::MessageTooLong {
                nic,
                peer: peer.0,
                len,
                capacity,
            },
            T::QueueFull { nic } => ErrW::QueueFull { nic },
            T::InvalidArgument { nic, what } => ErrW::InvalidArgument { nic, what },
            T::Unsupported { nic, what } => ErrW::Unsupported { nic, what },
            T::LibraryUnavailable { library, reason } => {
                ErrW::LibraryUnavailable { library, reason }
            }
            T::NoDevice { what } => ErrW::NoDevice { what },
            T::Provider {
                nic,
                op,
                code,
                message,
            } => ErrW::Provider {
                nic,
                op: op.to_string(),
                code,
                message,
            },
            T::Failed { nic, wr, what } => ErrW::Failed {
                nic,
                wr: wr.map(|w| w.0),
                what,
            },
            T::NicDown { nic } => ErrW::NicDown { nic },
            T::Canceled { nic } => ErrW::Canceled { nic },
            T::PeerRemoved { nic, peer } => ErrW::PeerRemoved { nic, peer: peer.0 },
            other => ErrW::Other {
                text: other.to_string(),
            },
        }
    }
}

impl From<ErrW> for TransportError {
    fn from(e: ErrW) -> Self {
        use TransportError as T;
        match e {
            ErrW::PeerUnreachable { nic, peer, reason } => T::PeerUnreachable {
                nic,
                peer: NetAddr(peer),
                reason,
            },
            ErrW::PeerRemoved { nic, peer } => T::PeerRemoved {
                nic,
                peer: NetAddr(peer),
            },
            ErrW::RemoteAccess {
                nic,
                peer,
                rkey,
                addr,
                len,
                reason,
            } => T::RemoteAccess {
                nic,
                peer: NetAddr(peer),
                rkey,
                addr,
                len,
                reason: match reason {
                    1 => RemoteAccessReason::NotWritable,
                    2 => RemoteAccessReason::OutOfBounds,
                    _ => RemoteAccessReason::UnknownKey,
                },
            },
            ErrW::LocalAccess { nic, what } => T::LocalAccess { nic, what },
            ErrW::ReceiverNotReady { nic, peer } => T::ReceiverNotReady {
                nic,
                peer: NetAddr(peer),
            },
            ErrW::MessageTooLong {
                nic,
                peer,
                len,
                capacity,
            } => T::MessageTooLong {
                nic,
                peer: NetAddr(peer),
                len,
                capacity,
            },
            ErrW::QueueFull { nic } => T::QueueFull { nic },
            ErrW::InvalidArgument { nic, what } => T::InvalidArgument { nic, what },
            ErrW::Unsupported { nic, what } => T::Unsupported { nic, what },
            ErrW::LibraryUnavailable { library, reason } => {
                T::LibraryUnavailable { library, reason }
            }
            ErrW::NoDevice { what } => T::NoDevice { what },
            ErrW::Provider {
                nic,
                op,
                code,
                message,
            } => T::Provider {
                nic,
                op: leak_op(op),
                code,
                message,
            },
            ErrW::Failed { nic, wr, what } => T::Failed {
                nic,
                wr: wr.map(WrId),
                what,
            },
            ErrW::NicDown { nic } => T::NicDown { nic },
            ErrW::Canceled { nic } => T::Canceled { nic },
            ErrW::Other { text } => T::Failed {
                nic: "remote".into(),
                wr: None,
                what: text,
            },
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub(crate) struct SliceW {
    pub(crate) mr: u64,
    pub(crate) addr: u64,
    pub(crate) len: u64,
}

impl From<LocalSlice> for SliceW {
    fn from(s: LocalSlice) -> Self {
        SliceW {
            mr: s.mr.0,
            addr: s.addr,
            len: s.len,
        }
    }
}
impl From<SliceW> for LocalSlice {
    fn from(s: SliceW) -> Self {
        LocalSlice {
            mr: MrKey(s.mr),
            addr: s.addr,
            len: s.len,
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub(crate) struct WriteW {
    pub(crate) wr: u64,
    pub(crate) peer: u32,
    pub(crate) src: SliceW,
    pub(crate) base: u64,
    pub(crate) offset: u64,
    pub(crate) rkey: u64,
    pub(crate) imm: Option<u32>,
}

impl From<&WriteWr> for WriteW {
    fn from(w: &WriteWr) -> Self {
        WriteW {
            wr: w.wr.0,
            peer: w.peer.0,
            src: w.src.into(),
            base: w.dst.base,
            offset: w.dst.offset,
            rkey: w.dst.rkey.0,
            imm: w.imm,
        }
    }
}
impl From<WriteW> for WriteWr {
    fn from(w: WriteW) -> Self {
        WriteWr {
            wr: WrId(w.wr),
            peer: PeerId(w.peer),
            src: w.src.into(),
            dst: RemoteSlice {
                base: w.base,
                offset: w.offset,
                rkey: Rkey(w.rkey),
            },
            imm: w.imm,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(crate) enum CompW {
    Send(u64, Result<(), ErrW>),
    Recv(u64, Result<u64, ErrW>, Option<Vec<u8>>),
    Write(u64, Result<(), ErrW>),
    Imm(u32),
}

impl From<&Completion> for CompW {
    fn from(c: &Completion) -> Self {
        match c {
            Completion::Send { wr, result } => {
                CompW::Send(wr.0, result.as_ref().map(|_| ()).map_err(ErrW::from))
            }
            Completion::Recv { wr, result, from } => CompW::Recv(
                wr.0,
                result.as_ref().map(|n| *n).map_err(ErrW::from),
                from.as_ref().map(|a| a.0.clone()),
            ),
            Completion::Write { wr, result } => {
                CompW::Write(wr.0, result.as_ref().map(|_| ()).map_err(ErrW::from))
            }
            Completion::Imm { imm } => CompW::Imm(*imm),
        }
    }
}
impl From<CompW> for Completion {
    fn from(c: CompW) -> Self {
        match c {
            CompW::Send(wr, r) => Completion::Send {
                wr: WrId(wr),
                result: r.map_err(Into::into),
            },
            CompW::Recv(wr, r, from) => Completion::Recv {
                wr: WrId(wr),
                result: r.map_err(Into::into),
                from: from.map(NetAddr),
            },
            CompW::Write(wr, r) => Completion::Write {
                wr: WrId(wr),
                result: r.map_err(Into::into),
            },
            CompW::Imm(imm) => Completion::Imm { imm },
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(crate) struct InfoW {
    pub(crate) name: String,
    pub(crate) addr: Vec<u8>,
    pub(crate) numa: Option<u32>,
    pub(crate) link: Option<f64>,
    pub(crate) max_write_len: u64,
    pub(crate) max_send_len: u64,
    pub(crate) max_inflight: u64,
    pub(crate) max_recvs: u64,
    pub(crate) max_batch: u64,
    pub(crate) ordered: bool,
    pub(crate) device_memory: bool,
    pub(crate) software_progress: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(crate) enum Req {
    Info(u32),
    Alloc(u64),
    WriteMem {
        buf: u64,
        offset: u64,
        data: Vec<u8>,
    },
    ReadMem {
        buf: u64,
        offset: u64,
        len: u64,
    },
    Register {
        nic: u32,
        buf: u64,
        start: u64,
        end: u64,
        remote: bool,
    },
    Deregister {
        nic: u32,
        key: u64,
    },
    AddPeer {
        nic: u32,
        addr: Vec<u8>,
    },
    PostSend {
        nic: u32,
        wr: u64,
        peer: u32,
        src: SliceW,
    },
    PostRecv {
        nic: u32,
        wr: u64,
        buf: SliceW,
    },
    PostWrites {
        nic: u32,
        wrs: Vec<WriteW>,
    },
    Poll(u32),
    RemovePeer {
        nic: u32,
        peer: u32,
    },
    /// Stop calling into the provider for good and answer
    /// `Unit(Ok(()))`: the child is about to be killed (see `serve`).
    Freeze,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(crate) enum Resp {
    Info(InfoW),
    Buf(Result<u64, String>),
    Unit(Result<(), String>),
    Bytes(Result<Vec<u8>, String>),
    Mr(Result<(u64, u64, u64, u64), ErrW>),
    Done(Result<(), ErrW>),
    Peer(Result<u32, ErrW>),
    Posted(Result<u64, (u64, ErrW)>),
    Polled(Result<Vec<CompW>, ErrW>),
}
