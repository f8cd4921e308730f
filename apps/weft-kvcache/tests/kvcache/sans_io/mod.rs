//! Fixtures for stepping the cores by hand: a layout, addresses, the
//! frames the cores emit, and the handshake that makes a decoder and a
//! prefiller believe each other.

#![allow(dead_code)]

use std::time::{Duration, Instant};
use weft::{GroupAddress, ImmCounts, MrDesc, NetAddr, ShardConfig};
use weft_kvcache::{
    Auth, DecAction, DecoderCore, HeadOrder, Heartbeat, KvError, KvLayout, Msg, PreAction,
    PrefillerCore, TaskKey, Write,
};

pub const LAYOUT: KvLayout = KvLayout {
    layers: 4,
    kv_heads: 2,
    page_len: 4096,
    tail_len: 1000,
    num_pages: 16,
    tail_slots: 4,
    order: HeadOrder::HeadsBeforePages,
};

pub const HB: Heartbeat = Heartbeat {
    interval: Duration::from_millis(10),
    timeout: Duration::from_millis(100),
};

/// A one-NIC address, incarnation 0.
pub fn addr(b: u8) -> GroupAddress {
    GroupAddress {
        nics: vec![NetAddr(vec![b])],
        incarnation: Default::default(),
    }
}

pub fn desc() -> MrDesc {
    MrDesc {
        addr: 0,
        len: 1 << 30,
        rkeys: Vec::new(),
        incarnation: Default::default(),
    }
}

pub fn counts() -> ImmCounts {
    ImmCounts {
        nics: 1,
        max_write_len: 1 << 30,
        shard: ShardConfig::default(),
    }
}

/// A frame a core sends: destination, auth, message.
pub type Frame = (GroupAddress, Auth, Msg);

/// The decoder's sends, without their auth.
pub fn sends(a: &[DecAction]) -> Vec<(GroupAddress, Msg)> {
    frames(a).into_iter().map(|(to, _, m)| (to, m)).collect()
}

/// The decoder's sends.
pub fn frames(a: &[DecAction]) -> Vec<Frame> {
    a.iter()
        .filter_map(|a| match a {
            DecAction::Send { to, auth, msg } => Some((to.clone(), *auth, msg.clone())),
            _ => None,
        })
        .collect()
}

pub fn finishes(a: &[DecAction]) -> Vec<(u64, Result<(), KvError>)> {
    a.iter()
        .filter_map(|a| match a {
            DecAction::Finish { id, result, .. } => Some((*id, result.clone())),
            _ => None,
        })
        .collect()
}

pub fn posts(a: &[PreAction]) -> Vec<(TaskKey, u32, Write)> {
    a.iter()
        .filter_map(|a| match a {
            PreAction::Post { key, step, write } => Some((key.clone(), *step, write.clone())),
            _ => None,
        })
        .collect()
}

/// The prefiller's sends, without their auth.
pub fn pre_sends(a: &[PreAction]) -> Vec<(GroupAddress, Msg)> {
    pre_frames(a)
        .into_iter()
        .map(|(to, _, m)| (to, m))
        .collect()
}

/// The prefiller's sends.
pub fn pre_frames(a: &[PreAction]) -> Vec<Frame> {
    a.iter()
        .filter_map(|a| match a {
            PreAction::Send { to, auth, msg } => Some((to.clone(), *auth, msg.clone())),
            _ => None,
        })
        .collect()
}

pub fn pre_finish(a: &[PreAction]) -> Option<Result<(), KvError>> {
    a.iter().find_map(|a| match a {
        PreAction::Finish { result, .. } => Some(result.clone()),
        _ => None,
    })
}

/// Delivers `first` (the decoder's actions, e.g. its `Hello`) and every
/// frame the two cores answer with, until neither sends; `pre_addr` is the
/// prefiller's address. Returns the prefiller's non-send actions.
pub fn pump(
    dec: &mut DecoderCore,
    pre: &mut PrefillerCore,
    pre_addr: &GroupAddress,
    first: Vec<DecAction>,
    t: Instant,
) -> Vec<PreAction> {
    let me = dec.address().clone();
    let mut to_pre: Vec<Frame> = frames(&first);
    let mut rest = Vec::new();
    for _ in 0..16 {
        let mut to_dec = Vec::new();
        for (to, auth, msg) in to_pre.drain(..) {
            assert_eq!(&to, pre_addr, "a frame for someone else");
            let a = pre.on_msg(&me, auth, msg, t);
            to_dec.extend(pre_frames(&a));
            rest.extend(
                a.into_iter()
                    .filter(|x| !matches!(x, PreAction::Send { .. })),
            );
        }
        for (to, auth, msg) in to_dec {
            assert_eq!(to, me, "a frame for someone else");
            to_pre.extend(frames(&dec.on_msg(pre_addr, auth, msg, t)));
        }
        if to_pre.is_empty() {
            return rest;
        }
    }
    panic!("the cores never stop talking");
}

/// Plays a prefiller at `pre_addr` to `dec`, whose `hello` (from
/// `add_prefiller`) was sent to it: answers it, and returns the auth its
/// later frames to `dec` carry.
pub fn fake_prefiller(
    dec: &mut DecoderCore,
    hello: &[DecAction],
    pre_addr: &GroupAddress,
    t: Instant,
) -> Auth {
    let (_, h, _) = frames(hello).remove(0);
    let auth = Auth {
        proof: h.grant,
        grant: 0x5eed,
    };
    dec.on_msg(pre_addr, auth, Msg::Hello, t);
    auth
}

/// Plays a decoder at `from` to `pre`: greets it, proves itself, and
/// returns the auth its frames carry (whether the prefiller kept it as a
/// decoder is up to the prefiller's bounds).
pub fn join(pre: &mut PrefillerCore, from: &GroupAddress, t: Instant) -> Auth {
    let mine = 0x0dec;
    let hello = Auth {
        proof: 0,
        grant: mine,
    };
    let reply = pre_frames(&pre.on_msg(from, hello, Msg::Hello, t));
    let (to, a, m) = reply.into_iter().next().expect("no answer to a hello");
    assert_eq!((&to, a.proof, &m), (from, mine, &Msg::Hello));
    let auth = Auth {
        proof: a.grant,
        grant: mine,
    };
    pre.on_msg(from, auth, Msg::Hello, t);
    auth
}
