//! The SEND layer's frame: every SEND an engine makes is one frame, a
//! fixed header followed by the user's message, and every message a
//! receive pool hands to its callback came in a frame this engine accepted.
//!
//! | bytes | field |
//! |---|---|
//! | `0..2` | magic, `b"wS"` |
//! | `2` | version, [`VERSION`] (1) |
//! | `3` | flags, 0 (version 1 defines none; anything else is refused) |
//! | `4..12` | target incarnation, `u64` little-endian: the incarnation of the receiving engine the sender means (its `GroupAddress::incarnation`; 0 for an address built by hand, which names none) |
//! | `12..20` | sender incarnation, `u64` little-endian (for logs only: nothing is decided on it) |
//! | `20..` | the message |
//!
//! The receiver accepts a frame ([`accept`]) only when the header is
//! well formed, of this version, and its target is the receiver's own
//! incarnation (or 0). A frame meant for another incarnation — normally
//! the process that answered at the same NIC addresses before this one
//! restarted there — is dropped and counted in `GroupStats::recv_stale`;
//! a frame that is too short, of another magic, version or flags, in
//! `GroupStats::recv_malformed`. Neither reaches a receive callback.
//! A frame's length is only ever the length the transport reported,
//! checked against the receive buffer: nothing in the header is a length.

use weft_transport::Incarnation;

/// Bytes of the header in front of every message.
pub(crate) const HEADER_LEN: usize = 20;
/// The first two bytes of every frame.
pub(crate) const MAGIC: [u8; 2] = *b"wS";
/// The frame version this engine writes and reads.
pub(crate) const VERSION: u8 = 1;

/// The header of a frame from an engine of incarnation `from` to the
/// engine of incarnation `to` (0: any).
pub(crate) fn header(to: Incarnation, from: Incarnation) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..2].copy_from_slice(&MAGIC);
    h[2] = VERSION;
    h[3] = 0;
    h[4..12].copy_from_slice(&to.0.to_le_bytes());
    h[12..20].copy_from_slice(&from.0.to_le_bytes());
    h
}

/// Why a received frame was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rejected {
    /// Shorter than a header.
    Short {
        /// The frame's length.
        len: usize,
    },
    /// Not a weft SEND frame.
    Magic,
    /// A frame version this engine does not read.
    Version(u8),
    /// Flags version 1 does not define.
    Flags(u8),
    /// Meant for another incarnation than the receiver's.
    Stale {
        /// The incarnation the sender meant.
        to: Incarnation,
        /// The incarnation the sender says it is.
        from: Incarnation,
    },
}

impl Rejected {
    /// Whether the frame was well formed but meant for another
    /// incarnation (counted apart from malformed frames).
    pub(crate) fn is_stale(&self) -> bool {
        matches!(self, Rejected::Stale { .. })
    }
}

impl std::fmt::Display for Rejected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Rejected::Short { len } => write!(f, "{len} bytes, shorter than a frame header"),
            Rejected::Magic => write!(f, "not a weft SEND frame"),
            Rejected::Version(v) => write!(f, "frame version {v}, this engine reads {VERSION}"),
            Rejected::Flags(x) => write!(f, "unknown frame flags {x:#04x}"),
            Rejected::Stale { to, from } => {
                write!(f, "meant for incarnation {to} (sent by incarnation {from})")
            }
        }
    }
}

/// The message of `frame` if a receiver of incarnation `own` accepts it
/// (see the module docs). Never panics, never allocates.
pub(crate) fn accept(frame: &[u8], own: Incarnation) -> Result<&[u8], Rejected> {
    let Some((h, msg)) = frame.split_first_chunk::<HEADER_LEN>() else {
        return Err(Rejected::Short { len: frame.len() });
    };
    if h[0..2] != MAGIC {
        return Err(Rejected::Magic);
    }
    if h[2] != VERSION {
        return Err(Rejected::Version(h[2]));
    }
    if h[3] != 0 {
        return Err(Rejected::Flags(h[3]));
    }
    let word = |at: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&h[at..at + 8]);
        Incarnation(u64::from_le_bytes(b))
    };
    let (to, from) = (word(4), word(12));
    if to != Incarnation(0) && to != own {
        return Err(Rejected::Stale { to, from });
    }
    Ok(msg)
}

/// The sender incarnation a frame [`accept`] took names (0 when it is
/// too short to hold one).
pub(crate) fn sender(frame: &[u8]) -> Incarnation {
    frame
        .get(12..20)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map_or(Incarnation(0), |b| Incarnation(u64::from_le_bytes(b)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const OWN: Incarnation = Incarnation(0x1234_5678_9abc_def0);

    fn frame(to: Incarnation, from: Incarnation, msg: &[u8]) -> Vec<u8> {
        let mut v = header(to, from).to_vec();
        v.extend_from_slice(msg);
        v
    }

    /// A frame to this incarnation or to 0 is accepted with its message;
    /// one to another incarnation is stale; a short one, another magic,
    /// version or flags are malformed.
    #[test]
    fn accepts_own_and_wildcard_frames_only() {
        let f = frame(OWN, Incarnation(7), b"hello");
        assert_eq!(accept(&f, OWN), Ok(&b"hello"[..]));
        assert_eq!(sender(&f), Incarnation(7));
        assert_eq!(sender(&f[..19]), Incarnation(0));
        let any = frame(Incarnation(0), Incarnation(7), b"");
        assert_eq!(accept(&any, OWN), Ok(&[][..]));
        for to in [OWN.0 - 1, OWN.0 + 1, u64::MAX, 1] {
            let f = frame(Incarnation(to), Incarnation(7), b"x");
            let r = accept(&f, OWN);
            assert_eq!(
                r,
                Err(Rejected::Stale {
                    to: Incarnation(to),
                    from: Incarnation(7)
                })
            );
            assert!(r.unwrap_err().is_stale());
        }
        assert_eq!(accept(&f[..19], OWN), Err(Rejected::Short { len: 19 }));
        assert_eq!(accept(&[], OWN), Err(Rejected::Short { len: 0 }));
        for (at, v, want) in [
            (0, b'x', Rejected::Magic),
            (2, 2, Rejected::Version(2)),
            (2, 0, Rejected::Version(0)),
            (3, 1, Rejected::Flags(1)),
        ] {
            let mut bad = f.clone();
            bad[at] = v;
            assert_eq!(accept(&bad, OWN), Err(want));
            assert!(!want.is_stale());
        }
    }

    /// Cases per fuzz property (a few seconds each on 2 loaded cores;
    /// `WEFT_FUZZ_CASES` overrides it).
    const CASES: u32 = 1_000_000;

    /// One of a few incarnations, so that targets do match now and then.
    fn inc() -> impl Strategy<Value = Incarnation> {
        prop_oneof![
            Just(OWN),
            Just(Incarnation(0)),
            Just(Incarnation(OWN.0 + 1)),
            any::<u64>().prop_map(Incarnation),
        ]
    }

    proptest! {
        #![proptest_config(weft_testkit::fuzz::config(CASES))]

        /// Arbitrary bytes: no panic; whatever is accepted is exactly
        /// the bytes after a well-formed header addressed to this
        /// incarnation or to none.
        #[test]
        fn arbitrary_bytes_never_forge_a_frame(bytes in proptest::collection::vec(any::<u8>(), 0..96)) {
            if let Ok(msg) = accept(&bytes, OWN) {
                prop_assert!(bytes.len() >= HEADER_LEN);
                prop_assert_eq!(&bytes[..4], &[b'w', b'S', VERSION, 0][..]);
                let to = u64::from_le_bytes(bytes[4..12].try_into().unwrap());
                prop_assert!(to == 0 || to == OWN.0);
                prop_assert_eq!(msg, &bytes[HEADER_LEN..]);
            }
        }

        /// Valid frames, then mutated (bytes flipped, cut, appended): no
        /// panic; a mutated frame is accepted only if its header still
        /// names this incarnation (or none), and then with exactly the
        /// bytes after it.
        #[test]
        fn mutated_frames_are_accepted_only_for_this_incarnation(
            to in inc(),
            from in inc(),
            msg in proptest::collection::vec(any::<u8>(), 0..64),
            flips in proptest::collection::vec((any::<prop::sample::Index>(), 1u8..), 0..4),
            cut in any::<prop::sample::Index>(),
            do_cut in any::<bool>(),
            tail in proptest::collection::vec(any::<u8>(), 0..8),
        ) {
            let good = frame(to, from, &msg);
            let fits = to == OWN || to == Incarnation(0);
            prop_assert_eq!(accept(&good, OWN).is_ok(), fits);
            if fits {
                prop_assert_eq!(accept(&good, OWN), Ok(&msg[..]));
            } else {
                prop_assert_eq!(accept(&good, OWN), Err(Rejected::Stale { to, from }));
            }
            let mut bad = good.clone();
            for (i, x) in &flips {
                let i = i.index(bad.len());
                bad[i] ^= x;
            }
            if do_cut {
                bad.truncate(cut.index(bad.len() + 1));
            }
            bad.extend_from_slice(&tail);
            if let Ok(m) = accept(&bad, OWN) {
                let t = u64::from_le_bytes(bad[4..12].try_into().unwrap());
                prop_assert!(t == 0 || t == OWN.0, "accepted a frame for {}", t);
                prop_assert_eq!(m, &bad[HEADER_LEN..]);
            }
        }
    }
}
