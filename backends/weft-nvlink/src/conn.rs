//! Connections as the operating system sees them: the initiator's connect
//! and hello (a new channel file and its doorbell), the target's accept
//! and answer (its doorbell and key table), and the sockets that tell each
//! side the other is gone.

use crate::inbound::Inbound;
use crate::keys::{RemoteKeys, TABLE_BYTES};
use crate::out::Outbound;
use crate::proto;
use crate::ring::{Ring, CONTROL};
use crate::sys::{self, Mapping, Packet};
use crate::Addr;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

/// Bytes of a connection's answer ring.
const BACK_RING: usize = 64 << 10;

/// The rings of a channel file (forward at the header's end, back after).
fn rings(map: &Mapping, fwd: usize) -> (Ring, Ring) {
    let base = map.base();
    // SAFETY: the mapping holds the header and both rings
    // (`proto::channel_len`, checked when it was created or opened), and
    // lives as long as the connection that owns these rings; each side
    // is the only producer of one ring and the only consumer of the other.
    #[allow(unsafe_code)]
    unsafe {
        let f = base.add(proto::CHANNEL_HEADER);
        let b = f.add(CONTROL + fwd);
        (Ring::new(f, fwd), Ring::new(b, BACK_RING))
    }
}

/// An outbound connection: its socket, channel, the target's doorbell
/// (once it answered) and the protocol state.
pub(crate) struct OutConn {
    pub(crate) sock: OwnedFd,
    _map: Mapping,
    pub(crate) bell: Option<OwnedFd>,
    pub(crate) core: Outbound,
}

impl OutConn {
    /// Connects to `to` and sends the hello; the error says why nobody
    /// answers there.
    /// `me` is the connecting domain's number (its address's `index`).
    pub(crate) fn connect(
        to: &Addr,
        me: u32,
        ring: usize,
        my_bell: RawFd,
    ) -> Result<OutConn, String> {
        let sock = sys::connect(&to.socket_name()).map_err(|e| format!("nobody listens ({e})"))?;
        let len = proto::channel_len(ring as u64, BACK_RING as u64);
        let map =
            Mapping::create("weft-nvlink-channel", len).map_err(|e| format!("channel: {e}"))?;
        let words = [proto::CHANNEL_MAGIC, ring as u64, BACK_RING as u64];
        for (i, w) in words.iter().enumerate() {
            // SAFETY: the first 24 bytes of a fresh mapping nobody else
            // has seen yet.
            #[allow(unsafe_code)]
            unsafe {
                std::ptr::write(map.base().add(8 * i) as *mut u64, *w)
            };
        }
        let hello = proto::hello(std::process::id(), me, ring as u64, BACK_RING as u64);
        sys::send_fds(sock.as_raw_fd(), &hello, &[map.fd(), my_bell])
            .map_err(|e| format!("hello: {e}"))?;
        let (tx, rx) = rings(&map, ring);
        Ok(OutConn {
            sock,
            _map: map,
            bell: None,
            core: Outbound::new(tx, rx),
        })
    }

    /// Reads the socket: `Ok(true)` when the target's answer arrived now,
    /// `Err` when the target is gone or broke the hand-shake.
    pub(crate) fn read_socket(&mut self) -> Result<bool, String> {
        let mut answered = false;
        loop {
            match sys::recv_fds(self.sock.as_raw_fd()) {
                Ok(Packet::Empty) => return Ok(answered),
                Ok(Packet::Closed) => {
                    return Err("the peer closed its connection (process gone)".into())
                }
                Err(e) => return Err(format!("connection: {e}")),
                Ok(Packet::Data(b, mut fds)) => {
                    let pid = proto::parse_hello_ack(&b);
                    if self.bell.is_some() || pid.is_none() || fds.len() != 2 {
                        return Err("unexpected packet from the peer".into());
                    }
                    let table = fds.pop().expect("two descriptors");
                    let bell = fds.pop().expect("two descriptors");
                    let map =
                        Mapping::open(table, TABLE_BYTES).map_err(|e| format!("key table: {e}"))?;
                    self.core.keys = Some(RemoteKeys::new(map));
                    self.core.target_pid = pid;
                    self.bell = Some(bell);
                    answered = true;
                }
            }
        }
    }

    pub(crate) fn ring(&self) {
        if let Some(b) = &self.bell {
            sys::ring_bell(b.as_raw_fd());
        }
    }
}

/// An inbound connection, accepted and greeted.
pub(crate) struct InConn {
    pub(crate) sock: OwnedFd,
    _map: Mapping,
    bell: OwnedFd,
    pub(crate) core: Inbound,
}

impl InConn {
    /// Reads a hello from an accepted socket and answers it: `Ok(None)`
    /// while it has not arrived.
    pub(crate) fn greet(
        sock: &OwnedFd,
        my_bell: RawFd,
        table: RawFd,
    ) -> Result<Option<(Mapping, OwnedFd, proto::Hello)>, String> {
        let (b, mut fds) = match sys::recv_fds(sock.as_raw_fd()) {
            Ok(Packet::Empty) => return Ok(None),
            Ok(Packet::Closed) => return Err("closed before its hello".into()),
            Err(e) => return Err(e.to_string()),
            Ok(Packet::Data(b, fds)) => (b, fds),
        };
        let h = proto::parse_hello(&b).ok_or("not a hello")?;
        let (fwd, back) = (h.fwd, h.back);
        // The pid names the initiator (its address); the kernel says who
        // is really at the other end of the socket.
        let real = sys::peer_pid(sock.as_raw_fd()).map_err(|e| format!("SO_PEERCRED: {e}"))?;
        if real != h.pid {
            return Err(format!(
                "hello names pid {}, the socket's peer is pid {real}",
                h.pid
            ));
        }
        if fds.len() != 2 || !proto::valid_cap(fwd) || back != BACK_RING as u64 {
            return Err(format!(
                "hello with {} descriptors, rings {fwd}/{back}",
                fds.len()
            ));
        }
        let bell = fds.pop().expect("two descriptors");
        let map = Mapping::open(
            fds.pop().expect("two descriptors"),
            proto::channel_len(fwd, back),
        )
        .map_err(|e| format!("channel: {e}"))?;
        // SAFETY: the first 24 bytes of the mapping (it holds more).
        #[allow(unsafe_code)]
        let words: [u64; 3] = unsafe {
            std::array::from_fn(|i| std::ptr::read_volatile(map.base().add(8 * i) as *const u64))
        };
        if words != [proto::CHANNEL_MAGIC, fwd, back] {
            return Err("channel header does not match its hello".into());
        }
        sys::send_fds(
            sock.as_raw_fd(),
            &proto::hello_ack(std::process::id()),
            &[my_bell, table],
        )
        .map_err(|e| format!("answer: {e}"))?;
        Ok(Some((map, bell, h)))
    }

    /// `from`: the initiator's address (what its messages say they came
    /// from).
    pub(crate) fn new(
        sock: OwnedFd,
        map: Mapping,
        bell: OwnedFd,
        fwd: usize,
        from: weft_transport::NetAddr,
    ) -> InConn {
        let (rx, tx) = rings(&map, fwd);
        InConn {
            sock,
            _map: map,
            bell,
            core: Inbound::new(rx, tx, from),
        }
    }

    /// `false` once the initiator is gone.
    pub(crate) fn alive(&self) -> bool {
        !matches!(
            sys::recv_fds(self.sock.as_raw_fd()),
            Ok(Packet::Closed) | Err(_)
        )
    }

    pub(crate) fn ring(&self) {
        sys::ring_bell(self.bell.as_raw_fd());
    }
}
