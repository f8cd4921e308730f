//! The etcd store: etcd v3's JSON gateway (`/v3/kv/*`, `/v3/lease/*`,
//! `/v3/watch`) over plain HTTP/1.1, one short connection per request (a
//! watch holds one streaming connection).

mod http;
mod watch;

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{json, Value};

use crate::{check_key, LeaseId, Store, StoreError, Watch};
use http::{b64_decode, b64_encode, HttpError};

/// Settings of an [`EtcdStore`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct EtcdOptions {
    /// Bound on connecting and on each read of a request (default 5 s).
    pub request_timeout: Duration,
    /// A watch stream that carried nothing this long is re-established
    /// (re-listing the prefix), which also detects a silently dead
    /// connection (default 30 s).
    pub watch_idle: Duration,
    /// Longest wait between reconnection attempts of a watch (default 1 s;
    /// the wait starts at 20 ms and doubles).
    pub max_backoff: Duration,
}

impl Default for EtcdOptions {
    fn default() -> Self {
        EtcdOptions {
            request_timeout: Duration::from_secs(5),
            watch_idle: Duration::from_secs(30),
            max_backoff: Duration::from_secs(1),
        }
    }
}

impl EtcdOptions {
    /// Sets [`EtcdOptions::max_backoff`].
    pub fn with_max_backoff(mut self, d: Duration) -> Self {
        self.max_backoff = d;
        self
    }

    /// Sets [`EtcdOptions::request_timeout`].
    pub fn with_request_timeout(mut self, d: Duration) -> Self {
        self.request_timeout = d;
        self
    }
}

/// A store in an etcd v3 cluster (3.4 or later), reached through its JSON
/// gateway. Several endpoints (`http://a:2379,http://b:2379`) are tried in
/// order on every request.
#[derive(Debug, Clone)]
pub struct EtcdStore {
    hosts: Vec<String>,
    endpoint: String,
    opts: EtcdOptions,
}

/// `prefix`'s range end: the smallest key greater than every key that
/// starts with it (`\0` for the empty prefix: every key).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// An int64 of the gateway's JSON (a string, sometimes a number).
fn int(v: &Value) -> Option<i64> {
    match v {
        Value::String(s) => s.parse().ok(),
        Value::Number(n) => n.as_i64(),
        _ => None,
    }
}

impl EtcdStore {
    /// A client for the endpoints in `urls` (comma-separated
    /// `http://host:port`). Connects lazily: no request is made here.
    pub fn new(urls: &str, opts: EtcdOptions) -> Result<Self, StoreError> {
        let mut hosts = Vec::new();
        for u in urls.split(',').map(str::trim).filter(|u| !u.is_empty()) {
            let Some(rest) = u.strip_prefix("http://") else {
                return Err(StoreError::Spec {
                    spec: urls.to_string(),
                    reason: format!("{u}: only http:// endpoints are supported"),
                });
            };
            let host = rest.trim_end_matches('/');
            if host.is_empty() || host.contains('/') {
                return Err(StoreError::Spec {
                    spec: urls.to_string(),
                    reason: format!("{u}: expected http://host:port"),
                });
            }
            hosts.push(if host.contains(':') {
                host.to_string()
            } else {
                format!("{host}:2379")
            });
        }
        if hosts.is_empty() {
            return Err(StoreError::Spec {
                spec: urls.to_string(),
                reason: "no endpoint".into(),
            });
        }
        Ok(EtcdStore {
            endpoint: format!("etcd:{}", urls.trim()),
            hosts,
            opts,
        })
    }

    /// One JSON request; the first endpoint that answers. Maps a gRPC
    /// "lease not found" to [`StoreError::LeaseNotFound`] when `lease` is set.
    fn call(
        &self,
        path: &str,
        body: &Value,
        op: &str,
        lease: Option<u64>,
    ) -> Result<Value, StoreError> {
        let bytes = body.to_string().into_bytes();
        let mut last = String::new();
        for host in &self.hosts {
            let t = self.opts.request_timeout;
            match http::post(host, path, &bytes, t, Some(t)) {
                Ok((body, _)) => {
                    return serde_json::from_reader(body).map_err(|e| StoreError::Protocol {
                        endpoint: self.endpoint.clone(),
                        op: op.to_string(),
                        reason: format!("JSON: {e}"),
                    })
                }
                Err(HttpError::Status(status, text)) => {
                    if let Some(l) = lease.filter(|_| text.contains("lease not found")) {
                        return Err(StoreError::LeaseNotFound {
                            endpoint: self.endpoint.clone(),
                            lease: l,
                        });
                    }
                    let unavailable = status == 503 || text.contains("\"code\":14");
                    let reason = format!("HTTP {status}: {}", text.trim());
                    if !unavailable {
                        return Err(StoreError::Protocol {
                            endpoint: self.endpoint.clone(),
                            op: op.to_string(),
                            reason,
                        });
                    }
                    last = reason;
                }
                Err(e) => last = format!("{host}: {e}"),
            }
        }
        Err(StoreError::Unavailable {
            endpoint: self.endpoint.clone(),
            op: op.to_string(),
            reason: last,
        })
    }

    fn bad(&self, op: &str, reason: &str) -> StoreError {
        StoreError::Protocol {
            endpoint: self.endpoint.clone(),
            op: op.to_string(),
            reason: reason.to_string(),
        }
    }

    /// Every entry under `prefix` and the store revision of that view.
    pub(crate) fn range_prefix(
        &self,
        prefix: &str,
    ) -> Result<(i64, BTreeMap<String, Vec<u8>>), StoreError> {
        let op = format!("list {prefix}");
        let key = if prefix.is_empty() {
            vec![0]
        } else {
            prefix.as_bytes().to_vec()
        };
        let body = json!({
            "key": b64_encode(&key),
            "range_end": b64_encode(&prefix_end(prefix.as_bytes())),
        });
        let resp = self.call("/v3/kv/range", &body, &op, None)?;
        let rev = resp
            .pointer("/header/revision")
            .and_then(int)
            .ok_or_else(|| self.bad(&op, "no header.revision"))?;
        let mut out = BTreeMap::new();
        for kv in resp
            .get("kvs")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let (k, v) = self.decode_kv(kv, &op)?;
            out.insert(k, v);
        }
        Ok((rev, out))
    }

    fn decode_kv(&self, kv: &Value, op: &str) -> Result<(String, Vec<u8>), StoreError> {
        let key = kv
            .get("key")
            .and_then(Value::as_str)
            .and_then(b64_decode)
            .and_then(|k| String::from_utf8(k).ok())
            .ok_or_else(|| self.bad(op, "kv without a valid key"))?;
        let value = match kv.get("value").and_then(Value::as_str) {
            None => Vec::new(),
            Some(v) => b64_decode(v).ok_or_else(|| self.bad(op, "value is not base64"))?,
        };
        Ok((key, value))
    }
}

impl Store for EtcdStore {
    fn endpoint(&self) -> &str {
        &self.endpoint
    }

    fn put(&self, key: &str, value: &[u8], lease: Option<LeaseId>) -> Result<(), StoreError> {
        check_key(&self.endpoint, key)?;
        let mut body = json!({"key": b64_encode(key.as_bytes()), "value": b64_encode(value)});
        if let Some(l) = lease {
            body["lease"] = Value::String(l.0.to_string());
        }
        self.call(
            "/v3/kv/put",
            &body,
            &format!("put {key}"),
            lease.map(|l| l.0),
        )?;
        Ok(())
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        check_key(&self.endpoint, key)?;
        let op = format!("get {key}");
        let resp = self.call(
            "/v3/kv/range",
            &json!({"key": b64_encode(key.as_bytes())}),
            &op,
            None,
        )?;
        match resp
            .get("kvs")
            .and_then(Value::as_array)
            .and_then(|a| a.first())
        {
            None => Ok(None),
            Some(kv) => Ok(Some(self.decode_kv(kv, &op)?.1)),
        }
    }

    fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        Ok(self.range_prefix(prefix)?.1.into_iter().collect())
    }

    fn delete(&self, key: &str) -> Result<bool, StoreError> {
        check_key(&self.endpoint, key)?;
        let resp = self.call(
            "/v3/kv/deleterange",
            &json!({"key": b64_encode(key.as_bytes())}),
            &format!("delete {key}"),
            None,
        )?;
        Ok(resp.get("deleted").and_then(int).unwrap_or(0) > 0)
    }

    fn grant(&self, ttl: Duration) -> Result<LeaseId, StoreError> {
        let secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
        let resp = self.call(
            "/v3/lease/grant",
            &json!({"TTL": secs.max(1).to_string()}),
            "lease grant",
            None,
        )?;
        if let Some(e) = resp
            .get("error")
            .and_then(Value::as_str)
            .filter(|e| !e.is_empty())
        {
            return Err(self.bad("lease grant", e));
        }
        let id = resp
            .get("ID")
            .and_then(int)
            .ok_or_else(|| self.bad("lease grant", "no ID"))?;
        u64::try_from(id)
            .map(LeaseId)
            .map_err(|_| self.bad("lease grant", "negative ID"))
    }

    fn keep_alive(&self, lease: LeaseId) -> Result<(), StoreError> {
        let op = format!("lease keep-alive {:#x}", lease.0);
        let resp = self.call(
            "/v3/lease/keepalive",
            &json!({"ID": lease.0.to_string()}),
            &op,
            Some(lease.0),
        )?;
        // The gateway streams `{"result": {...}}`; a lease it does not know
        // comes back with TTL 0 (omitted).
        let ttl = resp.pointer("/result/TTL").and_then(int).unwrap_or(0);
        if ttl <= 0 {
            return Err(StoreError::LeaseNotFound {
                endpoint: self.endpoint.clone(),
                lease: lease.0,
            });
        }
        Ok(())
    }

    fn revoke(&self, lease: LeaseId) -> Result<(), StoreError> {
        let op = format!("lease revoke {:#x}", lease.0);
        self.call(
            "/v3/lease/revoke",
            &json!({"ID": lease.0.to_string()}),
            &op,
            Some(lease.0),
        )?;
        Ok(())
    }

    fn watch(&self, prefix: &str) -> Result<Watch, StoreError> {
        watch::start(self.clone(), prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_ends() {
        assert_eq!(prefix_end(b"ab"), b"ac");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
        assert_eq!(prefix_end(b""), vec![0]);
    }

    #[test]
    fn endpoints_parse() {
        let s = EtcdStore::new("http://127.0.0.1:1234, http://h", EtcdOptions::default()).unwrap();
        assert_eq!(
            s.hosts,
            vec!["127.0.0.1:1234".to_string(), "h:2379".to_string()]
        );
        assert!(EtcdStore::new("https://h:1", EtcdOptions::default()).is_err());
        assert!(EtcdStore::new("", EtcdOptions::default()).is_err());
        assert!(EtcdStore::new("http://h:1/x", EtcdOptions::default()).is_err());
    }

    #[test]
    fn unreachable_is_transient() {
        // Port 1 on loopback: nothing listens there.
        let s = EtcdStore::new("http://127.0.0.1:1", EtcdOptions::default()).unwrap();
        let e = s.get("k").unwrap_err();
        assert!(e.is_transient(), "{e}");
        assert!(e.to_string().contains("127.0.0.1:1"), "{e}");
    }
}
