//! etcd watches: one streaming `/v3/watch` connection per [`Watch`], on a
//! dedicated thread that re-lists and re-establishes the stream (with
//! backoff) whenever it breaks, telling the watcher what changed meanwhile.

use std::collections::BTreeMap;
use std::net::{Shutdown, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::Sender;
use parking_lot::{Condvar, Mutex};
use serde_json::{json, Value};

use super::http::{self, b64_encode};
use super::{int, prefix_end, EtcdStore};
use crate::watch::{diff, Event};
use crate::{StoreError, Watch};

struct Shared {
    stop: Mutex<bool>,
    cv: Condvar,
    conn: Mutex<Option<TcpStream>>,
}

struct Guard(Arc<Shared>);

impl Drop for Guard {
    fn drop(&mut self) {
        *self.0.stop.lock() = true;
        self.0.cv.notify_all();
        if let Some(c) = self.0.conn.lock().take() {
            // Unblocks the thread's read; it then sees `stop`.
            let _ = c.shutdown(Shutdown::Both);
        }
    }
}

struct Watcher {
    store: EtcdStore,
    prefix: String,
    known: BTreeMap<String, Vec<u8>>,
    rev: i64,
    tx: Sender<Event>,
    shared: Arc<Shared>,
}

/// Why a stream ended.
enum End {
    /// The watcher was dropped.
    Stopped,
    /// The connection or the stream broke; re-list and reconnect.
    Broken(String),
}

pub(super) fn start(store: EtcdStore, prefix: &str) -> Result<Watch, StoreError> {
    let (rev, known) = store.range_prefix(prefix)?;
    let (tx, rx) = crossbeam_channel::unbounded();
    for ev in diff(&BTreeMap::new(), &known) {
        let _ = tx.send(ev);
    }
    let shared = Arc::new(Shared {
        stop: Mutex::new(false),
        cv: Condvar::new(),
        conn: Mutex::new(None),
    });
    let endpoint = store.endpoint.clone();
    let mut w = Watcher {
        store,
        prefix: prefix.to_string(),
        known,
        rev,
        tx,
        shared: shared.clone(),
    };
    std::thread::Builder::new()
        .name("weft-rendezvous-etcdwatch".into())
        .spawn(move || w.run())
        .map_err(|e| StoreError::Unavailable {
            endpoint: endpoint.clone(),
            op: format!("watch {prefix}"),
            reason: format!("spawn watch thread: {e}"),
        })?;
    Ok(Watch::new(rx, &endpoint, prefix, Box::new(Guard(shared))))
}

impl Watcher {
    fn stopped(&self) -> bool {
        *self.shared.stop.lock()
    }

    /// Waits `d` unless the watch is dropped first; whether it was.
    fn pause(&self, d: Duration) -> bool {
        let mut s = self.shared.stop.lock();
        if !*s {
            self.shared.cv.wait_for(&mut s, d);
        }
        *s
    }

    fn run(&mut self) {
        let min = Duration::from_millis(20);
        let mut backoff = min;
        loop {
            match self.stream() {
                End::Stopped => return,
                End::Broken(why) => {
                    if self.stopped() {
                        return;
                    }
                    tracing::info!(store = %self.store.endpoint, prefix = %self.prefix, reason = %why, "etcd watch broken; re-establishing");
                }
            }
            // Re-list until the store answers, then report what changed
            // while the stream was down and watch on from there.
            loop {
                if self.pause(backoff) {
                    return;
                }
                match self.store.range_prefix(&self.prefix) {
                    Ok((rev, now)) => {
                        for ev in diff(&self.known, &now) {
                            if self.tx.send(ev).is_err() {
                                return;
                            }
                        }
                        self.known = now;
                        self.rev = rev;
                        backoff = min;
                        break;
                    }
                    Err(e) => {
                        backoff = (backoff * 2).min(self.store.opts.max_backoff.max(min));
                        tracing::debug!(store = %self.store.endpoint, error = %e, retry_ms = backoff.as_millis() as u64, "etcd watch: re-list failed");
                    }
                }
            }
        }
    }

    /// Runs one watch stream from `rev + 1` until it breaks or the watch is
    /// dropped.
    fn stream(&mut self) -> End {
        let body = json!({"create_request": {
            "key": b64_encode(if self.prefix.is_empty() { &[0] } else { self.prefix.as_bytes() }),
            "range_end": b64_encode(&prefix_end(self.prefix.as_bytes())),
            "start_revision": (self.rev + 1).to_string(),
        }});
        let opts = &self.store.opts;
        let mut last = String::new();
        let mut opened = None;
        for host in &self.store.hosts {
            match http::post(
                host,
                "/v3/watch",
                body.to_string().as_bytes(),
                opts.request_timeout,
                Some(opts.watch_idle),
            ) {
                Ok(x) => {
                    opened = Some(x);
                    break;
                }
                Err(e) => last = format!("{host}: {e}"),
            }
        }
        let Some((reader, conn)) = opened else {
            return End::Broken(last);
        };
        *self.shared.conn.lock() = Some(conn);
        if self.stopped() {
            return End::Stopped;
        }
        let mut msgs = serde_json::Deserializer::from_reader(reader).into_iter::<Value>();
        loop {
            let msg = match msgs.next() {
                None => return End::Broken("stream ended".into()),
                Some(Err(e)) => return End::Broken(format!("stream: {e}")),
                Some(Ok(m)) => m,
            };
            if self.stopped() {
                return End::Stopped;
            }
            let Some(res) = msg.get("result") else {
                return End::Broken(format!("unexpected message {msg}"));
            };
            if res.get("canceled").and_then(Value::as_bool) == Some(true)
                || res.get("compact_revision").and_then(int).unwrap_or(0) > 0
            {
                return End::Broken(format!("watch canceled by the server: {res}"));
            }
            if let Some(rev) = res.pointer("/header/revision").and_then(int) {
                self.rev = self.rev.max(rev);
            }
            for ev in res
                .get("events")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                let Some(kv) = ev.get("kv") else { continue };
                let Ok((key, value)) = self.store.decode_kv(kv, "watch") else {
                    return End::Broken("undecodable event".into());
                };
                if let Some(r) = kv.get("mod_revision").and_then(int) {
                    self.rev = self.rev.max(r);
                }
                let out = if ev.get("type").and_then(Value::as_str) == Some("DELETE") {
                    self.known.remove(&key).map(|_| Event::Leave { key })
                } else {
                    match self.known.insert(key.clone(), value.clone()) {
                        None => Some(Event::Join { key, value }),
                        Some(old) if old != value => Some(Event::Update { key, value }),
                        Some(_) => None,
                    }
                };
                if let Some(e) = out {
                    if self.tx.send(e).is_err() {
                        return End::Stopped;
                    }
                }
            }
        }
    }
}
