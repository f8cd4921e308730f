//! Serving prompts by key: [`Offers`] puts a [`Prefiller`] in the mode
//! serving stacks need when the prefill side finishes a prompt before the
//! decode side asks for it (vLLM's and SGLang's disaggregated flow). The
//! application *offers* a prompt's pages under a key (the request id its
//! router hands both sides) and reports its layers as they are computed;
//! the decoder's request carries the key as its metadata
//! ([`request_meta`]: the key and the first offered page it wants, for a
//! decoder that holds a prefix of the prompt already), and the first
//! request naming the key is served from the offered pages.
//!
//! Who may ask for what: a request names only a key. The pages served are
//! the ones the application offered under it, never pages the decoder
//! names, so a decoder learns at most the prompts whose keys it was given
//! (keys are capabilities: make them unguessable). Each offer serves one
//! request; a request for a key not offered (yet) waits up to the hold time
//! for the offer, then is refused; an offer nobody asked for within its
//! time to live expires ([`KvError::Expired`]), and one whose request ended
//! before it was served (cancelled by its decoder, or the decoder died)
//! ends with it ([`KvError::Cancelled`]); either way its pages are the
//! application's again.

use crate::{Incoming, KvError, Prefiller, Serve, ServeOutcome};
use crossbeam_channel::{select, tick, Receiver, Sender};
use parking_lot::Mutex;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The metadata of a request for the offer `key`, from its page `first` on
/// (0: the whole prompt; a decoder holding the prompt's first pages in its
/// own prefix cache skips them).
pub fn request_meta(key: &[u8], first: u32) -> Vec<u8> {
    let mut m = Vec::with_capacity(4 + key.len());
    m.extend_from_slice(&first.to_le_bytes());
    m.extend_from_slice(key);
    m
}

/// `(first, key)` of a request's metadata ([`request_meta`]).
fn parse_meta(meta: &[u8]) -> Option<(u32, &[u8])> {
    let (f, key) = meta.split_first_chunk::<4>()?;
    Some((u32::from_le_bytes(*f), key))
}

/// How an offer ended.
#[derive(Debug, Clone)]
pub struct OfferDone {
    /// The offer's key.
    pub key: Vec<u8>,
    /// `Ok`: every write of it was delivered; otherwise why not
    /// ([`KvError::Expired`] when nobody asked for it in time). Either way
    /// no write from its pages can land any more: they are the
    /// application's again.
    pub outcome: ServeOutcome,
}

struct Offer {
    pages: Vec<u32>,
    tail_slot: u32,
    /// Steps computed so far (layers, then the tail).
    ready: u64,
    expires: Instant,
    /// Requests it serves in all (1, or one per decode rank reading it).
    total: u32,
    /// Requests it may still take.
    left: u32,
    /// Requests taken and not yet accepted or refused.
    accepting: u32,
    /// Serves accepted and not yet ended.
    running: u32,
    /// The serves accepted (layer reports go to each).
    serves: Vec<Serve>,
    /// The first failure among its requests.
    failure: Option<KvError>,
}

impl Offer {
    /// Whether no request of it is being accepted or served.
    fn idle(&self) -> bool {
        self.accepting == 0 && self.running == 0
    }

    /// Whether it ended: every request it serves came and ended.
    fn ended(&self) -> bool {
        self.left == 0 && self.idle()
    }
}

/// Ends `key`'s offer if it ended: removed, reported once.
fn settle(b: &mut Book, key: &[u8]) {
    if b.offers.get(key).is_some_and(Offer::ended) {
        if let Some(o) = b.offers.remove(key) {
            b.done.push(OfferDone {
                key: key.to_vec(),
                outcome: o.failure.map_or(Ok(()), Err),
            });
        }
    }
}

struct Book {
    offers: BTreeMap<Vec<u8>, Offer>,
    /// Requests for keys not offered yet, with when they stop waiting.
    waiting: VecDeque<(Incoming, Instant)>,
    done: Vec<OfferDone>,
    /// Longest a request waits for its offer.
    hold: Duration,
    /// Most requests waiting at once.
    max_waiting: usize,
}

/// A [`Prefiller`] serving offered prompts by key (see the module docs).
/// It takes every request of the prefiller: do not call
/// [`Prefiller::next_request`] beside it.
pub struct Offers {
    pre: Arc<Prefiller>,
    book: Arc<Mutex<Book>>,
    stop: Option<Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Offers {
    /// Serves `pre`'s requests from offers; a request waits at most `hold`
    /// for its offer (and at most 4096 wait at once; more are refused).
    pub fn new(pre: Arc<Prefiller>, hold: Duration) -> Result<Self, KvError> {
        let book = Arc::new(Mutex::new(Book {
            offers: BTreeMap::new(),
            waiting: VecDeque::new(),
            done: Vec::new(),
            hold,
            max_waiting: 4096,
        }));
        let (stop_tx, stop_rx) = crossbeam_channel::bounded::<()>(0);
        let (p, b) = (pre.clone(), book.clone());
        let incoming = pre.incoming().clone();
        let thread = std::thread::Builder::new()
            .name("kv-offers".into())
            .spawn(move || run(&p, &b, &incoming, &stop_rx))
            .map_err(|e| KvError::Spawn {
                name: "kv-offers",
                error: e.to_string(),
            })?;
        Ok(Self {
            pre,
            book,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }

    /// The prefiller.
    pub fn prefiller(&self) -> &Arc<Prefiller> {
        &self.pre
    }

    /// Offers the prompt in `pages` (prompt order) and tail slot
    /// `tail_slot` under `key`, with `ready` steps already computed (all
    /// layers, plus one for the tail if the layout has one, when the prompt
    /// is complete). A request takes the pages it asks for ([`request_meta`]:
    /// from its first page on, as many as it has room for). Expires
    /// after `ttl` unless a request took it. A key offered and not yet
    /// ended is refused ([`KvError::InvalidRoute`]).
    pub fn offer(
        &self,
        key: Vec<u8>,
        pages: Vec<u32>,
        tail_slot: u32,
        ready: u64,
        ttl: Duration,
    ) -> Result<(), KvError> {
        self.offer_to(key, pages, tail_slot, ready, ttl, 1)
    }

    /// [`Self::offer`] for `requests` requests (at least 1): one per decode
    /// rank that reads this prefill rank's heads under a TP mismatch or
    /// MLA ([`TpShape::plan`](crate::TpShape::plan)). It ends once all of
    /// them were served (its outcome: the first failure, if any); expiry
    /// ends it too when some never came.
    pub fn offer_to(
        &self,
        key: Vec<u8>,
        pages: Vec<u32>,
        tail_slot: u32,
        ready: u64,
        ttl: Duration,
        requests: u32,
    ) -> Result<(), KvError> {
        if pages.is_empty() {
            return Err(KvError::NoPages { need: 0, free: 0 });
        }
        let requests = requests.max(1);
        let mut b = self.book.lock();
        if b.offers.contains_key(&key) {
            return Err(KvError::InvalidRoute {
                what: format!("key {} is already offered", show(&key)),
            });
        }
        let now = Instant::now();
        b.offers.insert(
            key.clone(),
            Offer {
                pages,
                tail_slot,
                ready,
                expires: now + ttl,
                total: requests,
                left: requests,
                accepting: 0,
                running: 0,
                serves: Vec::new(),
                failure: None,
            },
        );
        // Requests may have come first.
        let mut first = Vec::new();
        while first.len() < requests as usize {
            let Some(i) = b
                .waiting
                .iter()
                .position(|(inc, _)| parse_meta(&inc.meta).is_some_and(|(_, k)| k == key))
            else {
                break;
            };
            if let Some((inc, _)) = b.waiting.remove(i) {
                first.push(inc);
            }
        }
        drop(b);
        for inc in first {
            take(&self.pre, &self.book, inc);
        }
        Ok(())
    }

    /// Steps `0..steps` of the offer `key` are computed (layer-wise
    /// transfer: layers, then the tail). Posts them if a request took it.
    pub fn ready(&self, key: &[u8], steps: u64) -> Result<(), KvError> {
        let mut b = self.book.lock();
        let Some(o) = b.offers.get_mut(key) else {
            return Err(KvError::InvalidRoute {
                what: format!("key {} is not offered", show(key)),
            });
        };
        o.ready = o.ready.max(steps);
        let (serves, ready) = (o.serves.clone(), o.ready);
        drop(b);
        for s in serves {
            s.ready(ready.min(u64::from(s.steps())))?;
        }
        Ok(())
    }

    /// Withdraws an offer no request took yet (its pages are the
    /// application's at once: `true`). One being served is not withdrawn
    /// (`false`): it ends on its own, reported by [`Self::take_done`].
    pub fn withdraw(&self, key: &[u8]) -> bool {
        let mut b = self.book.lock();
        match b.offers.get(key) {
            Some(o) if o.left == o.total && o.idle() => {
                b.offers.remove(key);
                true
            }
            _ => false,
        }
    }

    /// Offers that ended since the last call (served, failed or expired).
    pub fn take_done(&self) -> Vec<OfferDone> {
        std::mem::take(&mut self.book.lock().done)
    }

    /// Offers not ended yet.
    pub fn pending(&self) -> usize {
        self.book.lock().offers.len()
    }

    /// Stops taking requests (the prefiller itself is the caller's to shut
    /// down; offers being served end as it does).
    pub fn stop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Offers {
    fn drop(&mut self) {
        self.stop();
    }
}

fn show(key: &[u8]) -> String {
    match std::str::from_utf8(key) {
        Ok(s) if s.len() <= 80 => format!("{s:?}"),
        _ => format!("<{} bytes>", key.len()),
    }
}

fn run(
    pre: &Arc<Prefiller>,
    book: &Arc<Mutex<Book>>,
    incoming: &Receiver<Incoming>,
    stop: &Receiver<()>,
) {
    let ticks = tick(Duration::from_millis(20));
    loop {
        select! {
            recv(incoming) -> inc => match inc {
                Ok(inc) => {
                    let Some((_, key)) = parse_meta(&inc.meta) else {
                        pre.reject(&inc, "request metadata is not an offer request");
                        continue;
                    };
                    let mut b = book.lock();
                    if b.offers.get(key).is_some_and(|o| o.left > 0) {
                        drop(b);
                        take(pre, book, inc);
                    } else if b.waiting.len() >= b.max_waiting {
                        drop(b);
                        pre.reject(&inc, "too many requests waiting for their prompts");
                    } else {
                        let until = Instant::now() + b.hold;
                        b.waiting.push_back((inc, until));
                    }
                }
                Err(_) => return, // the prefiller shut down
            },
            recv(ticks) -> _ => expire(pre, book, Instant::now()),
            recv(stop) -> _ => return,
        }
    }
}

/// Serves `inc` from the offer named by its key, if that offer is there
/// and takes more requests. The book is not locked while the prefiller is
/// called (its callbacks lock the book).
fn take(pre: &Arc<Prefiller>, book: &Arc<Mutex<Book>>, inc: Incoming) {
    let Some((first, key)) = parse_meta(&inc.meta) else {
        pre.reject(&inc, "request metadata is not an offer request");
        return;
    };
    let (first, key) = (first as usize, key.to_vec());
    let (pages, tail_slot) = {
        let mut b = book.lock();
        match b.offers.get_mut(&key) {
            Some(o) if o.left > 0 => {
                o.left -= 1;
                o.accepting += 1;
                (o.pages.clone(), o.tail_slot)
            }
            _ => {
                drop(b);
                pre.reject(&inc, "no prompt offered under this key");
                return;
            }
        }
    };
    let n = inc.pages as usize;
    let accepted = match first.checked_add(n) {
        Some(end) if n > 0 && end <= pages.len() => pre
            .accept(&inc, &pages[first..end], tail_slot)
            .map_err(|e| (e.to_string(), Some(e))),
        _ => Err((
            format!(
                "pages {first}..{first}+{n} asked for, {} offered",
                pages.len()
            ),
            None,
        )),
    };
    let serve = match accepted {
        Ok(s) => s,
        Err((_, Some(KvError::NotIncoming { request, .. }))) => {
            // The request that claimed the offer ended before it was
            // served (its decoder cancelled it, or died): it counts as
            // served, failed; with no other request to come the offer ends
            // at once and its pages are free.
            let mut b = book.lock();
            if let Some(o) = b.offers.get_mut(&key) {
                o.accepting -= 1;
                o.failure.get_or_insert(KvError::Cancelled { request });
            }
            settle(&mut b, &key);
            return;
        }
        Err((why, _)) => {
            tracing::warn!("offers: cannot serve {}: {why}", show(&key));
            // The offer stays for a request that fits.
            if let Some(o) = book.lock().offers.get_mut(&key) {
                o.accepting -= 1;
                o.left += 1;
            }
            pre.reject(&inc, &why);
            return;
        }
    };
    let ready = {
        let mut b = book.lock();
        match b.offers.get_mut(&key) {
            Some(o) => {
                o.accepting -= 1;
                o.running += 1;
                o.serves.push(serve.clone());
                o.ready
            }
            None => 0,
        }
    };
    if ready > 0 {
        if let Err(e) = serve.ready(ready.min(u64::from(serve.steps()))) {
            tracing::warn!("offers: {}: {e}", show(&key));
        }
    }
    let weak = Arc::downgrade(book);
    serve.on_complete(move |r| {
        if let Some(book) = weak.upgrade() {
            let mut b = book.lock();
            if let Some(o) = b.offers.get_mut(&key) {
                o.running -= 1;
                if let Err(e) = r {
                    o.failure.get_or_insert(e.clone());
                }
            }
            settle(&mut b, &key);
        }
    });
}

fn expire(pre: &Prefiller, book: &Mutex<Book>, now: Instant) {
    let mut refuse = Vec::new();
    {
        let mut b = book.lock();
        while b.waiting.front().is_some_and(|(_, until)| *until <= now) {
            if let Some((inc, _)) = b.waiting.pop_front() {
                refuse.push(inc);
            }
        }
        // Offers still waiting for requests, with none in progress.
        let gone: Vec<Vec<u8>> = b
            .offers
            .iter()
            .filter(|(_, o)| o.left > 0 && o.idle() && o.expires <= now)
            .map(|(k, _)| k.clone())
            .collect();
        for key in gone {
            if let Some(o) = b.offers.get_mut(&key) {
                let what = format!(
                    "offer {}: {} of {} requests did not come in time",
                    show(&key),
                    o.left,
                    o.total
                );
                o.left = 0;
                o.failure.get_or_insert(KvError::Expired { what });
            }
            settle(&mut b, &key);
        }
    }
    for inc in refuse {
        pre.reject(&inc, "no prompt offered under this key");
    }
}
