//! # weft-kvcache: disaggregated prefill/decode KvCache transfer
//!
//! A [`Decoder`] owns a paged KvCache (host memory standing in for GPU
//! memory), registered once with its engine. For each request it takes free
//! pages and a tail slot, arms `expect_imm_count` with the exact number of
//! immediates the prefiller's submits produce (computed with
//! [`weft_engine::ImmCounts`], not guessed) and SENDs the [`Prefiller`] a
//! postcard-encoded [`KvRequest`] (its [`MrDesc`](weft_engine::MrDesc)s,
//! page indices, imm).
//!
//! The prefiller "computes" each layer on a thread (writes pattern data into
//! its source buffer), then bumps a UVM watcher word
//! ([`TransferEngine::alloc_uvm_watcher`](weft_engine::TransferEngine::alloc_uvm_watcher));
//! the watcher callback posts that layer's paged WRITEs (one
//! `submit_paged_writes` per layer over all heads) and, after the last
//! layer, the tail (logits / hidden state). When the
//! decoder's immediate count is reached its callback verifies every byte of
//! the request (against [`expected_kv_byte`] / [`expected_tail_byte`]) and
//! completes the [`RequestHandle`].
//!
//! ## Layout
//! KvCache bytes are `[layer][head][page][page_len]`: heads before pages,
//! so consecutive pages of one head are contiguous. Page `p` of head `h` in
//! layer `l` is at `((l * heads + h) * num_pages + p) * page_len`.
//!
//! ## Cancellation and liveness
//! [`Decoder::cancel`] sends a cancel; pages stay reserved until the
//! prefiller confirms that no write of the request can still land
//! ([`Msg::CancelAck`], sent only after every posted write's delivery
//! completion). Both sides send heartbeats; a decoder that hears nothing
//! for [`KvConfig::heartbeat_timeout`] (or whose SEND to the prefiller
//! fails) fails every pending request with [`KvError::PeerDead`]. The pages
//! of such requests are released: a dead NIC's pending writes are dropped
//! (weft's peer-death contract), so none can land later.

#![deny(unsafe_code)]

mod buf;

pub use buf::{pattern, HostBuf};

mod config;
mod decoder;
mod error;
mod layout;
mod prefiller;
mod wire;

pub use config::KvConfig;
pub use decoder::{Completed, Decoder, RequestHandle};
pub use error::KvError;
pub use layout::{expected_kv_byte, expected_tail_byte, KvLayout};
pub use prefiller::{LayerHook, PrefillStats, Prefiller};
pub use wire::{KvRequest, Msg};
