//! The operating-system calls of the backend: shared mappings of memfds,
//! Unix sequenced-packet sockets in the abstract namespace that carry file
//! descriptors, eventfd doorbells and an epoll set. Everything `unsafe` of
//! the crate that is not a ring access lives here.

#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;

fn cvt(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// A `MAP_SHARED` mapping of a whole memfd, unmapped on drop.
#[derive(Debug)]
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    fd: OwnedFd,
}

// SAFETY: the mapping is plain shared memory; every access to it goes
// through atomics or through copies whose races only garble bytes (see
// `ring`), never through references that assume exclusivity.
unsafe impl Send for Mapping {}

impl Mapping {
    /// A new zeroed memfd of `len` bytes, sealed against resizing, mapped.
    pub(crate) fn create(name: &str, len: usize) -> io::Result<Mapping> {
        let cname = std::ffi::CString::new(name).map_err(io::Error::other)?;
        // SAFETY: a valid NUL-terminated name; the result is checked.
        let fd = cvt(unsafe {
            libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        })?;
        // SAFETY: `fd` was just created and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: a valid descriptor; the result is checked.
        cvt(unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) })?;
        // Sealed: the peer that maps it can rely on its size (a file shrunk
        // under a mapping faults the process that touches it).
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: a valid memfd created with sealing allowed.
        cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) })?;
        Self::map(fd, len)
    }

    /// Maps a memfd a peer sent, checking that it holds `len` bytes and is
    /// sealed against shrinking (a file shrunk under the mapping would
    /// fault this process on access).
    pub(crate) fn open(fd: OwnedFd, len: usize) -> io::Result<Mapping> {
        // SAFETY: a valid descriptor; the result is checked.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "shared file not sealed against shrinking",
            ));
        }
        // SAFETY: `st` is a valid out-parameter for fstat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: a valid descriptor and out-parameter.
        cvt(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) })?;
        if (st.st_size as u64) < len as u64 || st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("shared file of {} bytes, need {len}", st.st_size),
            ));
        }
        Self::map(fd, len)
    }

    fn map(fd: OwnedFd, len: usize) -> io::Result<Mapping> {
        // SAFETY: a fresh shared mapping of a file of at least `len` bytes;
        // the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(p.cast()).ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(Mapping { ptr, len, fd })
    }

    pub(crate) fn base(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub(crate) fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping `map` made; nothing refers to
        // it any more (its owners hold the `Mapping`).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// A sockaddr for the abstract Unix name `name` (no file, gone with its
/// process).
fn abstract_addr(name: &str) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    // SAFETY: sockaddr_un is plain data; all-zero is valid.
    let mut a: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    a.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let b = name.as_bytes();
    if b.len() + 1 > a.sun_path.len() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "name too long"));
    }
    for (i, c) in b.iter().enumerate() {
        a.sun_path[i + 1] = *c as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + 1 + b.len();
    Ok((a, len as libc::socklen_t))
}

fn seqpacket() -> io::Result<OwnedFd> {
    // SAFETY: plain socket creation; the result is checked.
    let fd = cvt(unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    })?;
    // SAFETY: just created, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A listening socket at the abstract name `name`.
pub(crate) fn listen(name: &str) -> io::Result<OwnedFd> {
    let s = seqpacket()?;
    let (a, len) = abstract_addr(name)?;
    // SAFETY: `a` is a valid sockaddr_un of `len` bytes.
    cvt(unsafe { libc::bind(s.as_raw_fd(), (&a as *const libc::sockaddr_un).cast(), len) })?;
    // SAFETY: a bound socket.
    cvt(unsafe { libc::listen(s.as_raw_fd(), 256) })?;
    Ok(s)
}

/// Connects to the abstract name `name` (non-blocking; a Unix connect
/// completes at once or fails).
pub(crate) fn connect(name: &str) -> io::Result<OwnedFd> {
    let s = seqpacket()?;
    let (a, len) = abstract_addr(name)?;
    // SAFETY: `a` is a valid sockaddr_un of `len` bytes.
    cvt(unsafe { libc::connect(s.as_raw_fd(), (&a as *const libc::sockaddr_un).cast(), len) })?;
    Ok(s)
}

/// Accepts one pending connection, `None` when there is none.
pub(crate) fn accept(listener: RawFd) -> io::Result<Option<OwnedFd>> {
    // SAFETY: null address out-parameters are allowed; the result is checked.
    let rc = unsafe {
        libc::accept4(
            listener,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
        )
    };
    if rc < 0 {
        let e = io::Error::last_os_error();
        return match e.kind() {
            io::ErrorKind::WouldBlock => Ok(None),
            _ if e.raw_os_error() == Some(libc::ECONNABORTED) => Ok(None),
            _ => Err(e),
        };
    }
    // SAFETY: a new descriptor we own.
    Ok(Some(unsafe { OwnedFd::from_raw_fd(rc) }))
}

const MAX_FDS: usize = 2;

/// Sends one packet with up to two descriptors.
pub(crate) fn send_fds(sock: RawFd, data: &[u8], fds: &[RawFd]) -> io::Result<()> {
    assert!(fds.len() <= MAX_FDS);
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    let mut cbuf = [0u64; 8];
    // SAFETY: msghdr is plain data; all-zero is valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        let bytes = std::mem::size_of_val(fds) as u32;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        // SAFETY: CMSG_SPACE is a pure size computation.
        msg.msg_controllen = unsafe { libc::CMSG_SPACE(bytes) } as _;
        // SAFETY: the control buffer is large enough for one cmsg of
        // `bytes` (64 bytes ≥ CMSG_SPACE(8)); CMSG_FIRSTHDR points into it.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(bytes) as _;
            std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c).cast(), fds.len());
        }
    }
    // SAFETY: `msg` describes valid buffers for the call's duration.
    let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// What [`recv_fds`] read.
pub(crate) enum Packet {
    /// A packet: its bytes (at most the buffer) and its descriptors.
    Data(Vec<u8>, Vec<OwnedFd>),
    /// Nothing to read now.
    Empty,
    /// The peer closed the connection (or died).
    Closed,
}

/// Receives one packet (at most 256 bytes) and the descriptors it carries.
pub(crate) fn recv_fds(sock: RawFd) -> io::Result<Packet> {
    let mut buf = [0u8; 256];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut cbuf = [0u64; 8];
    // SAFETY: msghdr is plain data; all-zero is valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&cbuf) as _;
    // SAFETY: `msg` describes valid buffers for the call's duration.
    let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return match e.kind() {
            io::ErrorKind::WouldBlock => Ok(Packet::Empty),
            io::ErrorKind::ConnectionReset => Ok(Packet::Closed),
            _ => Err(e),
        };
    }
    let mut fds = Vec::new();
    // SAFETY: walks the control messages the kernel filled in, within
    // `msg_controllen`; SCM_RIGHTS payloads are arrays of ints, each a new
    // descriptor this process now owns.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c) as *const RawFd;
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize)
                    / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if n == 0 && fds.is_empty() {
        return Ok(Packet::Closed);
    }
    Ok(Packet::Data(buf[..n as usize].to_vec(), fds))
}

/// A non-blocking eventfd.
pub(crate) fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: plain eventfd creation; the result is checked.
    let fd = cvt(unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) })?;
    // SAFETY: just created, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Rings an eventfd (a full counter is as good as a ring).
pub(crate) fn ring_bell(fd: RawFd) {
    let one = 1u64;
    // SAFETY: writes 8 bytes from a valid u64 to a descriptor we hold.
    let _ = unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
}

/// Drains an eventfd.
pub(crate) fn drain_bell(fd: RawFd) {
    let mut v = 0u64;
    // SAFETY: reads 8 bytes into a valid u64.
    let _ = unsafe { libc::read(fd, (&mut v as *mut u64).cast(), 8) };
}

/// An epoll set.
pub(crate) fn epoll() -> io::Result<OwnedFd> {
    // SAFETY: plain epoll creation; the result is checked.
    let fd = cvt(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })?;
    // SAFETY: just created, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Adds `fd` to `ep` for readability and hang-up, tagged `tag`.
pub(crate) fn epoll_add(ep: RawFd, fd: RawFd, tag: u64) -> io::Result<()> {
    let mut ev = libc::epoll_event {
        events: (libc::EPOLLIN | libc::EPOLLRDHUP) as u32,
        u64: tag,
    };
    // SAFETY: valid descriptors and event.
    cvt(unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev) }).map(drop)
}

/// Removes `fd` from `ep` (a descriptor already closed is gone anyway).
pub(crate) fn epoll_del(ep: RawFd, fd: RawFd) {
    // SAFETY: valid descriptors; a null event is allowed for DEL.
    let _ = unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_DEL, fd, std::ptr::null_mut()) };
}

/// The tags of the ready descriptors of `ep`, without waiting.
pub(crate) fn epoll_ready(ep: RawFd, out: &mut Vec<u64>) {
    out.clear();
    // SAFETY: epoll_event is plain data; all-zero is valid.
    let mut evs: [libc::epoll_event; 32] = unsafe { std::mem::zeroed() };
    // SAFETY: `evs` holds 32 events.
    let n = unsafe { libc::epoll_wait(ep, evs.as_mut_ptr(), 32, 0) };
    for e in evs.iter().take(n.max(0) as usize) {
        let tag = e.u64;
        out.push(tag);
    }
}

/// The pid of the process at the other end of a Unix socket, as the kernel
/// recorded it when the connection was made (`SO_PEERCRED`).
pub(crate) fn peer_pid(sock: RawFd) -> io::Result<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` is a writable ucred of `len` bytes; the result is
    // checked.
    cvt(unsafe {
        libc::getsockopt(
            sock,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    })?;
    u32::try_from(cred.pid).map_err(|_| io::Error::other("SO_PEERCRED gave no pid"))
}

/// This host's identity: the kernel's boot id (16 bytes), shared by every
/// process of one boot of one machine (read once).
pub(crate) fn host_id() -> [u8; 16] {
    static ID: std::sync::OnceLock<[u8; 16]> = std::sync::OnceLock::new();
    *ID.get_or_init(read_boot_id)
}

fn read_boot_id() -> [u8; 16] {
    let mut id = [0u8; 16];
    if let Ok(s) = std::fs::read_to_string("/proc/sys/kernel/random/boot_id") {
        let hex: Vec<u8> = s
            .bytes()
            .filter(u8::is_ascii_hexdigit)
            .map(|c| (c as char).to_digit(16).unwrap_or(0) as u8)
            .collect();
        for (i, pair) in hex.chunks(2).take(16).enumerate() {
            id[i] = pair[0] << 4 | pair.get(1).copied().unwrap_or(0);
        }
    }
    id
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_sealed_files_of_the_right_size_are_mapped() {
        let m = Mapping::create("t", 8192).unwrap();
        let dup = || {
            // SAFETY: the mapping's descriptor is open for the whole test.
            unsafe { std::os::fd::BorrowedFd::borrow_raw(m.fd()) }
                .try_clone_to_owned()
                .unwrap()
        };
        assert!(Mapping::open(dup(), 8192).is_ok());
        assert!(Mapping::open(dup(), 8193).is_err(), "longer than the file");
        // SAFETY: plain memfd creation; the result is checked.
        let raw = unsafe { libc::memfd_create(c"u".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0);
        // SAFETY: just created, owned by nobody else.
        let unsealed = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: a valid descriptor.
        assert_eq!(unsafe { libc::ftruncate(unsealed.as_raw_fd(), 8192) }, 0);
        assert!(
            Mapping::open(unsealed, 8192).is_err(),
            "a peer could shrink it under us"
        );
    }
}
