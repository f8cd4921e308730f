//! # weft-kvcache: disaggregated prefill/decode KvCache transfer
//!
//! A [`Decoder`] registers the serving stack's own paged KV cache (host or
//! `Device::Cuda` memory, given as [`CacheRegions`]) and describes it with a
//! [`KvLayout`] (layers, KV heads on this rank, page bytes, tail bytes, head
//! order). Per prompt the stack takes pages ([`Decoder::alloc`] →
//! [`PageLease`]), picks its prefillers ([`Route`]: one for matching TP, a
//! [`TpShape::plan`] for TP mismatch or MLA) and calls [`Decoder::request`].
//! The decoder arms the engine's immediate count with exactly the number of
//! immediates the prefillers' writes produce and sends each prefiller a
//! [`KvRequest`] (versioned postcard, [`wire`]); the [`RequestHandle`]
//! completes — flag, blocking wait, callback or future — when the count says
//! every byte is in place.
//!
//! A [`Prefiller`] registers its own cache (the source) and hands each
//! request to the application as an [`Incoming`]; the application
//! [accepts](Prefiller::accept) it with the pages its prompt occupies and
//! then reports layers as they are computed, by calls
//! ([`Serve::layer_ready`]) or through a UVM watcher word a CUDA kernel bumps
//! ([`Serve::watch`]). Each layer becomes one paged write of all its heads
//! and pages; the tail (logits / hidden state) goes last.
//!
//! ## What a serving stack writes
//!
//! ```no_run
//! use std::sync::Arc;
//! use weft::TransferEngine;
//! use weft_kvcache::{CacheRegions, Decoder, KvConfig, KvLayout, Prefiller, Route};
//! # fn f(engine: Arc<TransferEngine>, layout: KvLayout, cache: CacheRegions,
//! #      prefiller_addr: weft::GroupAddress, prompt_id: u64, kernel: &dyn Fn(*mut u64))
//! #      -> Result<(), weft_kvcache::KvError> {
//! // Decode rank: its own KV cache (host or GPU MemRegions), registered once.
//! let dec = Decoder::new(engine.clone(), layout, cache.clone(), KvConfig::default())?;
//! let p = dec.add_prefiller(prefiller_addr);          // heartbeats start
//! let lease = dec.alloc(32)?;                         // 32 pages + a tail slot
//! let h = dec.request(&Route::single(p, layout.kv_heads), &lease, &prompt_id.to_le_bytes())?;
//! h.wait()?;                                          // or h.future().await / h.on_complete(..)
//! // ... decode from lease.pages(), then:
//! dec.free(lease);
//!
//! // Prefill rank: serves what decoders ask for from its own cache.
//! let pre = Prefiller::new(engine, layout, cache, KvConfig::default())?;
//! let inc = pre.next_request()?;                      // inc.meta: the prompt id
//! let serve = pre.accept(&inc, &[0, 1, 2], 0)?;       // where the prompt's KV is
//! let word = serve.watch();                           // a kernel bumps it per layer...
//! kernel(word.ptr().as_ptr().cast());
//! // ...or, from host code: serve.layer_ready(l)?; then serve.tail_ready()?;
//! serve.wait()?;                                      // all writes delivered
//! # Ok(()) }
//! ```
//!
//! ## Finding each other through a rendezvous store
//! [`KvRendezvous`] (module [`rendezvous`]): each process announces its role
//! in a `weft::rendezvous` store under its session's lease; a decoder
//! follows the prefillers (adding each that joins, failing the requests of
//! each that leaves), a prefiller follows the decoders (dropping the work of
//! each that leaves). A record leaves on a clean leave or when the process
//! dies and its lease runs out.
//!
//! ```no_run
//! # use std::{sync::Arc, time::Duration};
//! # use weft_kvcache::{Decoder, KvRendezvous, Route};
//! # fn f(dec: Arc<Decoder>) -> Result<(), Box<dyn std::error::Error>> {
//! use weft::rendezvous::{self, Session};
//! let store = rendezvous::open(&"dir:/run/weft".parse()?)?;
//! let session = Session::new(store.clone(), Duration::from_secs(5))?;
//! let rdv = KvRendezvous::new(store, "prod-kv");
//! let prefillers = rdv.follow_prefillers(&dec)?;     // joins and leaves, from now on
//! prefillers.wait_until(Duration::from_secs(30), |m| !m.is_empty());
//! rdv.announce_decoder(&session, "decode-0", &dec, 1)?;
//! let p = prefillers.members()[0].prefiller.unwrap();
//! let route = Route::single(p, dec.layout().kv_heads);
//! // ... requests; then a clean leave:
//! rdv.withdraw_decoder(&session, "decode-0")?;       // routers stop sending here
//! // drain (dec.pending() == 0), then
//! session.close()?;
//! # let _ = route; Ok(()) }
//! ```
//!
//! ## Structure
//! - [`layout`]: offsets, per-layer page sets, immediate counts.
//! - [`tp`]: heads per rank, TP split/merge and MLA's seeded matching.
//! - [`wire`]: the protocol.
//! - [`PagePool`]: page allocation.
//! - [`DecoderCore`] / [`PrefillerCore`]: the request state machines,
//!   clock-free (every event takes `now`, actions come out); the drivers
//!   [`Decoder`] / [`Prefiller`] run them on the engine.
//!
//! ## Cancellation and liveness
//! [`Decoder::cancel`] (or freeing a lease in flight) sends a cancel; the
//! request's pages stay reserved until every prefiller confirmed that no
//! write can land any more (it answers only after every posted write
//! completed). A cancel that overtakes its request (delivery is unordered)
//! is confirmed at once and remembered, so the request, when it comes, is
//! answered as cancelled and never served. Both sides heartbeat; a
//! prefiller found dead (silence past [`Heartbeat::timeout`], or a failed
//! SEND) fails its requests with [`KvError::PrefillerDead`] — a dead
//! peer's pending writes are dropped (weft's peer-death contract) — and a
//! dead decoder makes the prefiller drop its work ([`KvError::DecoderDead`]
//! on the [`Serve`]).
//!
//! ## Who may say what
//! Delivery is reliable but unordered, and any process that can reach an
//! engine may send it anything. The rule: a message is taken only from the
//! peer that owns the request or lease it names, and then only if it still
//! means something; cancels before requests, duplicates, replays and
//! messages from strangers are harmless, and every request taken ends
//! exactly once on each side.
//!
//! - *Sender identity.* The engine's receive reports the bytes of a
//!   message, not the transport's sender, so a frame's `from` is only a
//!   claim. Identity is bound to what the transport does guarantee: a SEND
//!   to an address reaches only the engine that holds it. Each side derives
//!   a secret grant per peer address (a keyed hash) and sends it only
//!   there; a frame counts only if its [`Auth`] proof is the receiver's
//!   grant for its claimed sender. An unproven `Hello` gets an echo (so
//!   the real holder of the address can prove itself), anything else
//!   unproven is dropped. A decoder sends a prefiller nothing but `Hello`
//!   before it proved itself; what it has waits.
//! - *Incarnations.* A claim to be a live decoder's next incarnation (same
//!   NICs, another incarnation) is not answered while that decoder lives:
//!   a send naming the newer incarnation would make the engine drop the
//!   live one. It is believed once the older one is found dead.
//! - *Requests* are keyed by their decoder and its id; a prefiller keeps a
//!   bounded window of each decoder's ids ([`ID_WINDOW`]): a request whose
//!   id it took already (a duplicate or replay) is dropped, one cancelled
//!   before it came is answered `CancelAck`, one below the window is
//!   refused [`Refusal::Stale`], one whose pages do not map is refused
//!   [`Refusal::BadPages`]; the window goes with the decoder's entry.
//! - *Answers* (`CancelAck`, `Failed`) count at the decoder only from a
//!   prefiller the request was sent to, for its part not yet ended.
//! - *Leases* are bound to the decoder that handed them out
//!   ([`PagePool`], [`ForeignLease`]); a request writes the pages the pool
//!   holds for its lease.
//!
//! `tests/model.rs` checks this with the real cores over every order of
//! two decoders and two prefillers (with duplicates, replays, forged
//! frames, crashes); `tests/hostile.rs` has the regression tests.

#![deny(unsafe_code)]

mod auth;
mod completion;
mod decoder;
mod error;
pub mod layout;
mod liveness;
pub mod metrics;
mod offers;
mod pages;
mod prefiller;
mod regions;
pub mod rendezvous;
mod send;
mod timer;
pub mod tp;
pub mod wire;

pub use completion::{Completion, CompletionFuture};
pub use decoder::{
    Completed, DecAction, Decoder, DecoderCore, KvConfig, Outcome, PrefillerId, RequestHandle,
    Route, Source, Started,
};
pub use error::{KvError, PeerLoss, Refusal};
pub use layout::{HeadMap, HeadOrder, KvLayout};
pub use liveness::Heartbeat;
pub use metrics::Outcomes;
pub use offers::{request_meta, OfferDone, Offers};
pub use pages::{ForeignLease, PageLease, PagePool};
pub use prefiller::{
    Incoming, LayerWatch, PreAction, PrefillStats, Prefiller, PrefillerCore, Serve, ServeOutcome,
    TaskKey, Write, ID_WINDOW,
};
pub use regions::{layer_region, CacheRegions};
pub use rendezvous::{Follower, KvPeer, KvRendezvous, Member};
pub use tp::{RankSource, TpShape};
pub use wire::{Auth, KvRequest, Msg};
