//! The two roles in demo mode: pattern "compute" at the prefiller, byte
//! checks at the decoder.

use crate::{addr_from_str, addr_to_string, DecodeArgs, PrefillArgs};
use std::collections::{BTreeSet, VecDeque};
use std::io::{BufRead, Write};
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use weft::HostBuffer;
use weft_kvcache::{CacheRegions, Decoder, KvLayout, Prefiller, Route, Serve};

fn out(line: &str) {
    let mut o = std::io::stdout().lock();
    let _ = writeln!(o, "{line}");
    let _ = o.flush();
}

fn pattern(tag: u64, i: u64) -> u8 {
    let x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ tag.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    (x >> 29) as u8
}

fn kv_tag(seed: u64, layer: u32, head: u32, j: u32) -> u64 {
    seed ^ (u64::from(layer) << 44) ^ (u64::from(head) << 32) ^ (u64::from(j) << 8)
}

fn tail_tag(seed: u64) -> u64 {
    seed ^ 0x7a11_0000_0000_0000
}

struct Cache {
    kv: HostBuffer,
    tail: HostBuffer,
}

impl Cache {
    fn new(l: &KvLayout) -> Result<Self, String> {
        let kv = l.kv_bytes().map_err(|e| e.to_string())? as usize;
        let tail = l.tail_bytes().map_err(|e| e.to_string())?.max(1) as usize;
        Ok(Self {
            kv: HostBuffer::new(kv).map_err(|e| e.to_string())?,
            tail: HostBuffer::new(tail).map_err(|e| e.to_string())?,
        })
    }

    fn regions(&self) -> CacheRegions {
        CacheRegions::whole(self.kv.region(), self.tail.region())
    }
}

pub(crate) fn prefill(a: PrefillArgs) -> Result<ExitCode, String> {
    let l = a.common.layout();
    let engine = a.common.engine()?;
    let cache = Cache::new(&l)?;
    let pre = Arc::new(
        Prefiller::new(engine.clone(), l, cache.regions(), a.common.config())
            .map_err(|e| e.to_string())?,
    );
    // With a store: announce this prefiller, drop the work of decoders
    // that leave.
    let rdv = match a.common.rendezvous("prefill")? {
        Some((rdv, session, name)) => {
            rdv.announce_prefiller(&session, &name, &pre, 1)
                .map_err(|e| e.to_string())?;
            let follower = rdv.follow_decoders(&pre).map_err(|e| e.to_string())?;
            eprintln!(
                "weft-kvcache: prefiller {name} in {}",
                rdv.store().endpoint()
            );
            Some((session, follower))
        }
        None => None,
    };
    let addr = addr_to_string(&pre.address());
    if a.addr_out != "-" {
        let tmp = format!("{}.tmp", a.addr_out);
        std::fs::write(&tmp, &addr).map_err(|e| format!("{tmp}: {e}"))?;
        std::fs::rename(&tmp, &a.addr_out).map_err(|e| format!("{}: {e}", a.addr_out))?;
    }
    out(&format!("ready {addr}"));
    let free = Arc::new(Mutex::new((0..l.num_pages).collect::<BTreeSet<u32>>()));
    let (ended_tx, ended_rx) = crossbeam_channel::unbounded::<bool>();
    let mut watches = Vec::new();
    let (mut ended, mut failed) = (0u64, 0u64);
    let drain = |ended: &mut u64, failed: &mut u64| {
        if let Ok(ok) = ended_rx.try_recv() {
            *ended += 1;
            *failed += u64::from(!ok);
            true
        } else {
            false
        }
    };
    loop {
        while drain(&mut ended, &mut failed) {}
        if a.max_requests > 0 && ended >= a.max_requests {
            break;
        }
        let Some(inc) = pre.next_request_timeout(Duration::from_millis(50)) else {
            continue;
        };
        let seed = u64::from_le_bytes(
            inc.meta
                .get(..8)
                .and_then(|m| m.try_into().ok())
                .unwrap_or([0; 8]),
        );
        let src: Vec<u32> = {
            let mut f = free.lock().unwrap_or_else(|e| e.into_inner());
            (0..inc.pages).filter_map(|_| f.pop_first()).collect()
        };
        let slot = src.first().copied().unwrap_or(0);
        let serve: Serve = match pre.accept(&inc, &src, slot) {
            Ok(s) => s,
            Err(e) => {
                free.lock().unwrap_or_else(|e| e.into_inner()).extend(src);
                out(&format!(
                    "serve-error id={} kind={} msg={e}",
                    inc.key.id,
                    e.kind()
                ));
                continue;
            }
        };
        out(&format!("accepted id={}", inc.key.id));
        {
            let (f, tx, id) = (free.clone(), ended_tx.clone(), inc.key.id);
            let src = src.clone();
            serve.on_complete(move |r| {
                f.lock().unwrap_or_else(|e| e.into_inner()).extend(src);
                match r {
                    Ok(()) => out(&format!("served id={id}")),
                    Err(e) => out(&format!("serve-error id={id} kind={} msg={e}", e.kind())),
                }
                let _ = tx.send(r.is_ok());
            });
        }
        let watch = a.watcher.then(|| serve.watch());
        let mut page = vec![0u8; l.page_len as usize];
        for layer in 0..l.layers {
            let t0 = Instant::now();
            for h in 0..l.kv_heads {
                for (j, &p) in src.iter().enumerate() {
                    let tag = kv_tag(seed, layer, h, j as u32);
                    for (i, b) in page.iter_mut().enumerate() {
                        *b = pattern(tag, i as u64);
                    }
                    if let Some(off) = l.offset(layer, h, p) {
                        cache.kv.write(off as usize, &page);
                    }
                }
            }
            // the simulated rest of the layer's compute
            let left = Duration::from_micros(a.layer_us).saturating_sub(t0.elapsed());
            if !left.is_zero() {
                std::thread::sleep(left);
            }
            match &watch {
                Some(w) => w.word().store(u64::from(layer) + 1, Ordering::Release),
                None => {
                    let _ = serve.layer_ready(layer);
                }
            }
        }
        if inc.tail {
            let t: Vec<u8> = (0..l.tail_len)
                .map(|i| pattern(tail_tag(seed), i))
                .collect();
            if let Some(off) = l.tail_offset(slot) {
                cache.tail.write(off as usize, &t);
            }
            match &watch {
                Some(w) => w.word().store(u64::from(serve.steps()), Ordering::Release),
                None => {
                    let _ = serve.tail_ready();
                }
            }
        }
        if let Some(w) = watch {
            watches.push((serve, w));
        }
        watches.retain(|(s, _)| !s.is_done());
    }
    if let Some((session, follower)) = rdv {
        drop(follower);
        // A clean leave: decoders stop routing here.
        let _ = session.close();
    }
    pre.shutdown(Duration::from_secs(2));
    drop(watches);
    engine.shutdown();
    Ok(if failed > 0 {
        ExitCode::from(3)
    } else {
        ExitCode::SUCCESS
    })
}

fn verify(c: &Cache, l: &KvLayout, pages: &[u32], slot: u32, seed: u64) -> Result<u64, String> {
    let mut bytes = 0;
    for layer in 0..l.layers {
        for h in 0..l.kv_heads {
            for (j, &p) in pages.iter().enumerate() {
                let off = l.offset(layer, h, p).ok_or("offset")? as usize;
                let got = c.kv.read(off, l.page_len as usize).ok_or("read")?;
                let tag = kv_tag(seed, layer, h, j as u32);
                if let Some(i) = (0..got.len()).find(|&i| got[i] != pattern(tag, i as u64)) {
                    return Err(format!("layer {layer} head {h} page {p} byte {i} differs"));
                }
                bytes += l.page_len;
            }
        }
    }
    let off = l.tail_offset(slot).ok_or("tail")? as usize;
    let got = c.tail.read(off, l.tail_len as usize).ok_or("read")?;
    if (0..got.len()).any(|i| got[i] != pattern(tail_tag(seed), i as u64)) {
        return Err("tail differs".into());
    }
    Ok(bytes + l.tail_len)
}

pub(crate) fn decode(a: DecodeArgs) -> Result<ExitCode, String> {
    let l = a.common.layout();
    let rdv = a.common.rendezvous("decode")?;
    let peer = match (&a.peer, &rdv) {
        (_, Some(_)) => None,
        (Some(p), None) => Some(read_peer(p)?),
        (None, None) => return Err("--peer or --rendezvous is required".into()),
    };
    let engine = a.common.engine()?;
    let cache = Cache::new(&l)?;
    let dec = Arc::new(
        Decoder::new(engine.clone(), l, cache.regions(), a.common.config())
            .map_err(|e| e.to_string())?,
    );
    // With a store: follow the prefillers, route to the first one listed,
    // announce this decoder.
    let mut found = None;
    let p = match (peer, rdv) {
        (Some(peer), _) => dec.add_prefiller(peer),
        (None, Some((rdv, session, name))) => {
            let follower = rdv.follow_prefillers(&dec).map_err(|e| e.to_string())?;
            let wait = Duration::from_millis(a.wait_ms);
            if !follower.wait_until(wait, |m| m.iter().any(|x| x.prefiller.is_some())) {
                return Err(format!(
                    "no prefiller in {} namespace {} within {wait:?}",
                    rdv.store().endpoint(),
                    a.common.namespace
                ));
            }
            let m = follower
                .members()
                .into_iter()
                .find(|x| x.prefiller.is_some())
                .ok_or("the prefiller left")?;
            rdv.announce_decoder(&session, &name, &dec, 1)
                .map_err(|e| e.to_string())?;
            eprintln!(
                "weft-kvcache: decoder {name} routes to prefiller {}",
                m.name
            );
            found = Some((session, follower));
            m.prefiller.ok_or("the prefiller left")?
        }
        (None, None) => return Err("--peer or --rendezvous is required".into()),
    };
    let route = Route::single(p, l.kv_heads);
    let t0 = Instant::now();
    let mut inflight = VecDeque::new();
    let (mut next, mut bytes, mut code) = (0u64, 0u64, ExitCode::SUCCESS);
    let mut done = 0u64;
    while done < a.requests {
        while next < a.requests && inflight.len() < a.concurrency.max(1) {
            let seed = a.seed.wrapping_mul(1_000_003).wrapping_add(next);
            let lease = dec.alloc(a.prompt_pages).map_err(|e| e.to_string())?;
            match dec.request(&route, &lease, &seed.to_le_bytes()) {
                Ok(h) => inflight.push_back((lease, h, seed)),
                Err(e) => {
                    out(&format!("error id=- kind={} msg={e}", e.kind()));
                    dec.free(lease);
                    code = ExitCode::from(3);
                    done = a.requests;
                    break;
                }
            }
            next += 1;
        }
        let Some((lease, h, seed)) = inflight.pop_front() else {
            break;
        };
        match h.wait() {
            Ok(_) => match verify(&cache, &l, lease.pages(), lease.tail_slot(), seed) {
                Ok(b) => {
                    bytes += b;
                    out(&format!("done id={} bytes={b}", h.id()));
                }
                Err(e) => {
                    out(&format!("error id={} kind=Corrupt msg={e}", h.id()));
                    code = ExitCode::from(3);
                }
            },
            Err(e) => {
                out(&format!("error id={} kind={} msg={e}", h.id(), e.kind()));
                code = ExitCode::from(3);
            }
        }
        dec.free(lease);
        done += 1;
    }
    for (lease, h, _) in inflight {
        if let Err(e) = h.wait() {
            out(&format!("error id={} kind={} msg={e}", h.id(), e.kind()));
        }
        dec.free(lease);
    }
    let secs = t0.elapsed().as_secs_f64();
    out(&format!(
        "summary requests={done} bytes={bytes} secs={secs:.3} gbps={:.3}",
        bytes as f64 * 8.0 / secs / 1e9
    ));
    if let Some((session, follower)) = found {
        drop(follower);
        let _ = session.close();
    }
    dec.shutdown();
    engine.shutdown();
    Ok(code)
}

/// The prefiller's address from a file, or from a line on stdin (`-`).
fn read_peer(p: &str) -> Result<weft::GroupAddress, String> {
    let peer = if p == "-" {
        let mut line = String::new();
        std::io::stdin()
            .lock()
            .read_line(&mut line)
            .map_err(|e| format!("stdin: {e}"))?;
        line
    } else {
        std::fs::read_to_string(p).map_err(|e| format!("{p}: {e}"))?
    };
    addr_from_str(peer.trim().trim_start_matches("ready "))
}
