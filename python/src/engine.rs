//! `TransferEngine`: building an engine from a provider, registering memory,
//! submits and immediate rounds.

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyTuple;
use std::collections::HashMap;
use std::sync::Arc;

use crate::buffer_ffi::BufferGuard;
use crate::errors;
use crate::imm::PyImm;
use crate::memory::{self, PyRegistration, RegKeep};
use crate::provider::{self, PyBackend};
use crate::recvq::PyRecvQueue;
use crate::transfer::{self, BindingStats, PyTransfer};
use crate::types::{
    self, PyImmCounts, PyMrDesc, PyPeerAddress, PyPeerGroup, PyScatterDst, PyScatterTargets,
};
use crate::watcher::{self, PyUvmWatcher};

/// A weft transfer engine over one backend: register memory, write into
/// peers' memory, count immediates. Shut it down with `shutdown()` or by
/// using it as a context manager.
#[pyclass(name = "TransferEngine", module = "weft._weft", frozen, weakref)]
pub struct PyTransferEngine {
    pub(crate) engine: weft::TransferEngine,
    backend: Arc<weft::Backend>,
    /// Live registrations and their keep-alives: memory stays registered
    /// and valid until `unreg` or shutdown even if the `Registration`
    /// handle is dropped. The guard is first in the pair, so it
    /// deregisters before the memory's keep-alive goes.
    regs: Mutex<HashMap<weft::MrHandle, (weft::Registration, Arc<RegKeep>)>>,
    pub(crate) stats: Arc<BindingStats>,
    serial: u64,
}

impl PyTransferEngine {
    /// Takes a registration (and its keep-alive) out of the table.
    pub(crate) fn take_registration(
        &self,
        h: &weft::MrHandle,
    ) -> Option<(weft::Registration, Arc<RegKeep>)> {
        self.regs.lock().remove(h)
    }

    fn shutdown_inner(&self, py: Python<'_>) -> PyResult<()> {
        if transfer::in_callback() {
            return Err(transfer::deadlock_err(py, "shutdown()"));
        }
        // A shut-down engine leaves the process's metrics page.
        crate::live::remove(self.serial);
        // Shutdown joins the callback thread, which may need the GIL to
        // drop a registration: never hold it here.
        py.detach(|| self.engine.shutdown());
        let regs = std::mem::take(&mut *self.regs.lock());
        drop(regs);
        Ok(())
    }

    /// A fresh transfer state using `keep`.
    fn on_done(&self, keep: Vec<Arc<RegKeep>>) -> (Arc<transfer::State>, weft::OnDone) {
        transfer::on_done(keep, &self.stats)
    }

    fn err(&self, py: Python<'_>, e: weft::EngineError) -> PyErr {
        errors::engine_err(py, &e)
    }

    /// `ShutDownError` once the engine is shut down: every call that uses
    /// the engine checks this first, so none of them half-works afterwards
    /// (hands out an immediate, arms a watcher, checks arguments).
    fn live(&self, py: Python<'_>) -> PyResult<()> {
        if self.engine.is_shut_down() {
            Err(errors::shut_down(py))
        } else {
            Ok(())
        }
    }
}

/// Refuses a host without enough NICs as `ProviderUnavailableError` (as
/// `weft::Backend::probe` does, without opening another host), before the
/// engine build would fail with a less telling setup error.
fn check_nics(py: Python<'_>, backend: &weft::Backend, host: &dyn weft::Provider) -> PyResult<()> {
    let spec = backend.spec();
    let nics = py
        .detach(|| host.nics())
        .map_err(|e| errors::provider_err(py, &weft::ProviderError::transport(spec, e)))?;
    let err = if nics.is_empty() {
        weft::ProviderError::transport(
            spec,
            weft::TransportError::NoDevice {
                what: spec.to_string(),
            },
        )
    } else if nics.len() < backend.nics() {
        weft::ProviderError::TooFewNics {
            spec: spec.to_string(),
            have: nics.len(),
            want: backend.nics(),
        }
    } else {
        return Ok(());
    };
    Err(errors::provider_err(py, &err))
}

impl Drop for PyTransferEngine {
    fn drop(&mut self) {
        crate::live::remove(self.serial);
        let _ = Python::try_attach(|py| py.detach(|| self.engine.shutdown()));
    }
}

#[pymethods]
impl PyTransferEngine {
    /// Builds an engine over `provider` (default `"loopback"`): a spec string (a fresh backend
    /// with `nics`, `profile`, `seed`) or a `Backend` (engines of one
    /// backend share its fabric). One domain group over all of the
    /// backend's NICs; `same_host=True` adds an `nvlink` NIC after them,
    /// through which peers on this host are reached (the rest through the
    /// backend's NICs; peers must build their engines alike).
    #[new]
    #[pyo3(signature = (provider=None, *, nics=1, profile="adversarial", seed=0, device=None, domain=None, write_timeout=None, connect_timeout=None, hmem=false, hmem_ipc=false, same_host=false))]
    // One parameter per Python argument (keywords included).
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        provider: Option<&Bound<'_, PyAny>>,
        nics: usize,
        profile: &str,
        seed: u64,
        device: Option<&Bound<'_, PyAny>>,
        domain: Option<&str>,
        write_timeout: Option<f64>,
        connect_timeout: Option<f64>,
        hmem: bool,
        hmem_ipc: bool,
        same_host: bool,
    ) -> PyResult<Self> {
        let device = match device {
            Some(d) => memory::parse_device(py, d)?,
            None => weft::Device::Host,
        };
        let timeouts = provider::Knobs {
            write: write_timeout,
            connect: connect_timeout,
            hmem,
            hmem_ipc,
            // A spec string opened for a GPU group: `nvlink` maps its memory.
            gpu: match device {
                weft::Device::Cuda(i) => Some(i),
                _ => None,
            },
        };
        let backend = match provider {
            None => Arc::new(provider::open(
                py, "loopback", nics, profile, seed, domain, timeouts,
            )?),
            Some(p) => {
                if let Ok(b) = p.cast::<PyBackend>() {
                    Arc::clone(&b.get().inner)
                } else if let Ok(spec) = p.extract::<String>() {
                    Arc::new(provider::open(
                        py, &spec, nics, profile, seed, domain, timeouts,
                    )?)
                } else {
                    return Err(pyo3::exceptions::PyTypeError::new_err(
                        "provider must be a spec string or a weft.Backend",
                    ));
                }
            }
        };
        let host = py
            .detach(|| backend.host())
            .map_err(|e| errors::provider_err(py, &e))?;
        check_nics(py, &backend, &*host)?;
        if let weft::Device::Cuda(ordinal) = device {
            crate::cuda::attach_copy(py, &backend, ordinal)?;
        }
        let nic_idx: Vec<usize> = (0..backend.nics()).collect();
        let mut spec = weft::DomainGroupSpec::new(host, nic_idx).device(device);
        if same_host {
            if matches!(backend.spec(), weft::ProviderSpec::Nvlink) {
                return Err(errors::invalid(
                    py,
                    "same_host=True adds nvlink to another backend; this one is nvlink",
                ));
            }
            let gpu = match device {
                weft::Device::Cuda(i) => Some(i),
                _ => None,
            };
            let knobs = provider::Knobs {
                write: None,
                connect: None,
                hmem: false,
                hmem_ipc: false,
                gpu,
            };
            let nv = provider::open(py, "nvlink", 1, "adversarial", 0, None, knobs)?;
            let nv_host = py
                .detach(|| nv.host())
                .map_err(|e| errors::provider_err(py, &e))?;
            spec = spec.same_host(nv_host, 0);
        }
        let engine = py
            .detach(|| weft::TransferEngine::builder().group(spec).build())
            .map_err(|e| errors::engine_err(py, &e))?;
        let serial = crate::live::next_serial();
        let stats = Arc::<BindingStats>::default();
        crate::live::add(serial, &engine, &stats);
        Ok(PyTransferEngine {
            engine,
            backend,
            regs: Mutex::new(HashMap::new()),
            stats,
            serial,
        })
    }

    /// The provider spec of the engine's backend.
    #[getter]
    fn provider(&self) -> String {
        self.backend.spec().to_string()
    }

    /// Registers memory: a buffer-protocol object (numpy array,
    /// `bytearray`, `memoryview`, `mmap`, ...), a torch tensor (CPU or
    /// CUDA, contiguous), a DLPack capsule or `__dlpack__` object, or a raw
    /// `(ptr, nbytes, device)` tuple. The object (and its buffer export or
    /// DLPack tensor; `keepalive` instead for a raw tuple) is kept until
    /// `unreg()` or shutdown, so the memory can neither be freed nor
    /// resized meanwhile. `device` (if given) must match where the memory
    /// is; `writable=True` refuses read-only memory; `writable=False`
    /// registers writable memory as a source only (no `desc`); read-only
    /// memory registers as a source only. Refused with
    /// `InvalidArgumentError`: items that are not plain bytes (Python
    /// objects, pointers: kind `"unsupported_dtype"`), non-contiguous memory
    /// (kind `"not_contiguous"`), empty memory. CUDA memory needs an engine
    /// built with `device="cuda:N"`.
    #[pyo3(signature = (obj, *, device=None, writable=None, keepalive=None))]
    fn reg_mr(
        slf: &Bound<'_, Self>,
        obj: &Bound<'_, PyAny>,
        device: Option<&Bound<'_, PyAny>>,
        writable: Option<bool>,
        keepalive: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyRegistration> {
        slf.get().live(slf.py())?;
        let py = slf.py();
        let this = slf.get();
        let r = memory::resolve(obj, device, writable, keepalive)?;
        let region = r.region;
        let reg = py
            .detach(|| this.engine.register(region))
            .map_err(|e| errors::engine_err(py, &e))?;
        let (h, desc) = (reg.handle(), reg.desc().clone());
        this.regs.lock().insert(h, (reg, Arc::clone(&r.keep)));
        Ok(PyRegistration::new(
            slf.clone().unbind(),
            h,
            desc,
            r.writable,
            keepalive.unwrap_or(obj).clone().unbind(),
            r.keep,
        ))
    }

    /// Writes `nbytes` bytes from `src` (at `src_offset`) into the peer
    /// memory `dst` (at `dst_offset`), sharded over the NICs; with `imm`,
    /// every piece carries that immediate value (see `imm_counts`).
    /// Argument errors raise here; the returned `Transfer` reports the rest.
    #[pyo3(signature = (nbytes, src, dst, *, src_offset=0, dst_offset=0, imm=None, callback=None))]
    // One parameter per Python argument (keywords included).
    #[allow(clippy::too_many_arguments)]
    fn submit_single_write(
        &self,
        py: Python<'_>,
        nbytes: u64,
        src: &Bound<'_, PyRegistration>,
        dst: &Bound<'_, PyMrDesc>,
        src_offset: u64,
        dst_offset: u64,
        imm: Option<&Bound<'_, PyAny>>,
        callback: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyTransfer>> {
        self.live(py)?;
        let imm = imm.map(PyImm::value_of).transpose()?;
        let src = src.get();
        let keep = src.live_keep(py)?;
        let (state, on_done) = self.on_done(vec![keep]);
        let id = self
            .engine
            .submit_single_write(
                nbytes,
                imm,
                (&src.handle, src_offset),
                (&dst.get().inner, dst_offset),
                on_done,
            )
            .map_err(|e| errors::engine_err(py, &e))?;
        transfer::submitted(py, Some(id.0), state, callback)
    }

    /// SENDs a copy of `data` (any bytes-like object) to the peer's receive
    /// pool (`submit_recvs` there).
    #[pyo3(signature = (peer, data, *, callback=None))]
    fn submit_send(
        &self,
        py: Python<'_>,
        peer: &Bound<'_, PyPeerAddress>,
        data: &Bound<'_, PyAny>,
        callback: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyTransfer>> {
        self.live(py)?;
        let mut buf = BufferGuard::acquire(data).map_err(|e| {
            pyo3::exceptions::PyTypeError::new_err(format!("data must be bytes-like: {e}"))
        })?;
        if let Some(why) = crate::items::format_refusal(&buf.format()) {
            buf.release(py);
            let what = crate::items::describe(data);
            return Err(errors::refused(
                py,
                crate::items::UNSUPPORTED_DTYPE,
                format!("cannot send the {what}: {why}; send plain bytes"),
            ));
        }
        let (state, on_done) = self.on_done(Vec::new());
        // The engine copies the message before returning.
        let r = self
            .engine
            .submit_send(&peer.get().inner, buf.as_slice(), on_done);
        buf.release(py);
        let id = r.map_err(|e| self.err(py, e))?;
        transfer::submitted(py, Some(id.0), state, callback)
    }

    /// Posts `count` receive buffers of `nbytes` bytes; `on_message(data:
    /// bytes)` runs on weft's callback thread for each message received
    /// (order across senders is not guaranteed). With `peers` (a list of
    /// `PeerAddress`) it is `on_message(data, i)`, `i` the index in `peers`
    /// of the engine the message came from or `None` (the sender as
    /// `RecvQueue.recv_from` gives it). `on_error(exc)` gets receive errors
    /// (without it they go to `sys.unraisablehook`). An exception raised by
    /// either goes to `sys.unraisablehook`; the engine goes on.
    #[pyo3(signature = (nbytes, count, on_message, *, on_error=None, peers=None))]
    fn submit_recvs(
        &self,
        py: Python<'_>,
        nbytes: u64,
        count: u32,
        on_message: &Bound<'_, PyAny>,
        on_error: Option<&Bound<'_, PyAny>>,
        peers: Option<Vec<PyRef<'_, PyPeerAddress>>>,
    ) -> PyResult<()> {
        self.live(py)?;
        let peers = peers.map(|ps| ps.iter().map(|p| p.inner.clone()).collect());
        let cb = watcher::recv_callback(on_message, on_error, peers, &self.stats)?;
        py.detach(|| self.engine.submit_recvs_from(nbytes, count, cb))
            .map_err(|e| self.err(py, e))
    }

    /// Posts `count` receive buffers of `nbytes` bytes whose messages the
    /// caller takes from the returned `RecvQueue` (`try_recv()`,
    /// `recv(timeout)`) instead of a callback: no Python call per message
    /// on weft's threads. Messages held in the queue count against the
    /// engine's receive backlog bound, past which peers' SENDs wait.
    fn recv_queue(&self, py: Python<'_>, nbytes: u64, count: u32) -> PyResult<PyRecvQueue> {
        self.live(py)?;
        py.detach(|| self.engine.recv_queue(nbytes, count))
            .map(PyRecvQueue::new)
            .map_err(|e| self.err(py, e))
    }

    /// Page `i` of `src_pages` goes to page `i` of `dst_pages`, `page_len`
    /// bytes each. Pages are indices (a list of ints or a 1-D integer numpy
    /// array) times a stride (default `page_len`) plus an offset.
    #[pyo3(signature = (page_len, src, src_pages, dst, dst_pages, *, src_stride=None, dst_stride=None, src_offset=0, dst_offset=0, imm=None, callback=None))]
    // One parameter per Python argument (keywords included).
    #[allow(clippy::too_many_arguments)]
    fn submit_paged_writes(
        &self,
        py: Python<'_>,
        page_len: u64,
        src: &Bound<'_, PyRegistration>,
        src_pages: &Bound<'_, PyAny>,
        dst: &Bound<'_, PyMrDesc>,
        dst_pages: &Bound<'_, PyAny>,
        src_stride: Option<u64>,
        dst_stride: Option<u64>,
        src_offset: u64,
        dst_offset: u64,
        imm: Option<&Bound<'_, PyAny>>,
        callback: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyTransfer>> {
        self.live(py)?;
        let imm = imm.map(PyImm::value_of).transpose()?;
        let sp = types::pages(src_pages, src_stride.unwrap_or(page_len), src_offset)?;
        let dp = types::pages(dst_pages, dst_stride.unwrap_or(page_len), dst_offset)?;
        let src = src.get();
        let keep = src.live_keep(py)?;
        let (state, on_done) = self.on_done(vec![keep]);
        let id = self
            .engine
            .submit_paged_writes(
                page_len,
                imm,
                (&src.handle, &sp),
                (&dst.get().inner, &dp),
                on_done,
            )
            .map_err(|e| self.err(py, e))?;
        transfer::submitted(py, Some(id.0), state, callback)
    }

    /// Removes `peer` (its `address`, at its incarnation) on every group,
    /// e.g. one whose process died: its queued work fails with
    /// `PeerRemovedError`, the backends free its connection state, and
    /// descriptors of that incarnation are refused from now on (a restarted
    /// peer, with a new address, is reached as usual). Removing an unknown
    /// or already removed peer does nothing.
    fn remove_peer(&self, py: Python<'_>, peer: PyRef<'_, PyPeerAddress>) -> PyResult<()> {
        self.live(py)?;
        let addr = peer.inner.clone();
        py.detach(|| self.engine.remove_peer(&addr))
            .map_err(|e| self.err(py, e))
    }

    /// Resolves peers (their `address`) for `submit_scatter` and
    /// `submit_barrier`: member `j` receives destination `j`.
    fn add_peer_group(
        &self,
        py: Python<'_>,
        peers: Vec<PyRef<'_, PyPeerAddress>>,
    ) -> PyResult<PyPeerGroup> {
        self.live(py)?;
        let addrs: Vec<weft::GroupAddress> = peers.iter().map(|p| p.inner.clone()).collect();
        py.detach(|| self.engine.add_peer_group(&addrs))
            .map(|inner| PyPeerGroup { inner })
            .map_err(|e| self.err(py, e))
    }

    /// One write per member of `group` (`dsts[j]`, a `ScatterDst`, to member
    /// `j`) from `src`; `mode` `"by_peer"` (default) or `"by_bytes"`.
    #[pyo3(signature = (group, src, dsts, *, imm=None, mode=None, callback=None))]
    // One parameter per Python argument (keywords included).
    #[allow(clippy::too_many_arguments)]
    fn submit_scatter(
        &self,
        py: Python<'_>,
        group: &Bound<'_, PyPeerGroup>,
        src: &Bound<'_, PyRegistration>,
        dsts: Vec<PyRef<'_, PyScatterDst>>,
        imm: Option<&Bound<'_, PyAny>>,
        mode: Option<&str>,
        callback: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyTransfer>> {
        self.live(py)?;
        let imm = imm.map(PyImm::value_of).transpose()?;
        let dsts: Vec<weft::ScatterDst> = dsts.iter().map(|d| d.inner.clone()).collect();
        let mode = mode.map(|m| types::scatter_mode(py, m)).transpose()?;
        let src = src.get();
        let keep = src.live_keep(py)?;
        let (state, on_done) = self.on_done(vec![keep]);
        let g = &group.get().inner;
        let r = match mode {
            Some(m) => self
                .engine
                .submit_scatter_mode(g, on_done, imm, &src.handle, &dsts, m),
            None => self
                .engine
                .submit_scatter(g, on_done, imm, &src.handle, &dsts),
        };
        let id = r.map_err(|e| self.err(py, e))?;
        transfer::submitted(py, Some(id.0), state, callback)
    }

    /// Checks scatter destinations once for any number of
    /// `submit_scatter_to` calls: `dsts[j]` (an `MrDesc`) is a region of
    /// member `j` of `group`. A MoE dispatch writes into the same receive
    /// buffers every step; only the offsets and lengths change.
    fn scatter_targets(
        &self,
        py: Python<'_>,
        group: &Bound<'_, PyPeerGroup>,
        dsts: Vec<PyRef<'_, PyMrDesc>>,
    ) -> PyResult<PyScatterTargets> {
        self.live(py)?;
        let descs: Vec<weft::MrDesc> = dsts.iter().map(|d| d.inner.clone()).collect();
        self.engine
            .scatter_targets(&group.get().inner, &descs)
            .map(|inner| PyScatterTargets { inner })
            .map_err(|e| self.err(py, e))
    }

    /// One write per destination of `targets` from `src`: `slices[j]`, a
    /// `(src_offset, dst_offset, nbytes)` triple (or row of an `(n, 3)`
    /// integer numpy array), to destination `j`; `mode` as in
    /// `submit_scatter`.
    #[pyo3(signature = (targets, src, slices, *, imm=None, mode=None, callback=None))]
    // One parameter per Python argument (keywords included).
    #[allow(clippy::too_many_arguments)]
    fn submit_scatter_to(
        &self,
        py: Python<'_>,
        targets: &Bound<'_, PyScatterTargets>,
        src: &Bound<'_, PyRegistration>,
        slices: &Bound<'_, PyAny>,
        imm: Option<&Bound<'_, PyAny>>,
        mode: Option<&str>,
        callback: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyTransfer>> {
        self.live(py)?;
        let imm = imm.map(PyImm::value_of).transpose()?;
        let slices = types::scatter_slices(slices)?;
        let mode = mode.map(|m| types::scatter_mode(py, m)).transpose()?;
        let src = src.get();
        let keep = src.live_keep(py)?;
        let (state, on_done) = self.on_done(vec![keep]);
        let t = &targets.get().inner;
        let r = match mode {
            Some(m) => self
                .engine
                .submit_scatter_to_mode(t, on_done, imm, &src.handle, &slices, m),
            None => self
                .engine
                .submit_scatter_to(t, on_done, imm, &src.handle, &slices),
        };
        let id = r.map_err(|e| self.err(py, e))?;
        transfer::submitted(py, Some(id.0), state, callback)
    }

    /// An immediate-only write of `imm` to every member of `group`
    /// (`dsts[j]` is member `j`'s descriptor): each receives one immediate.
    #[pyo3(signature = (group, imm, dsts, *, callback=None))]
    fn submit_barrier(
        &self,
        py: Python<'_>,
        group: &Bound<'_, PyPeerGroup>,
        imm: &Bound<'_, PyAny>,
        dsts: Vec<PyRef<'_, PyMrDesc>>,
        callback: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyTransfer>> {
        self.live(py)?;
        let imm = PyImm::value_of(imm)?;
        let dsts: Vec<weft::MrDesc> = dsts.iter().map(|d| d.inner.clone()).collect();
        let (state, on_done) = self.on_done(Vec::new());
        let id = self
            .engine
            .submit_barrier(&group.get().inner, on_done, imm, &dsts)
            .map_err(|e| self.err(py, e))?;
        transfer::submitted(py, Some(id.0), state, callback)
    }

    /// A watched 64-bit word: `callback(old, new)` runs on weft's watcher
    /// thread when it changes (changes may coalesce). Without `word` the
    /// engine allocates it; with `word` (a pinned CPU tensor, an int64
    /// numpy array, a `(ptr, nbytes, "cpu")` tuple: 8-byte aligned host
    /// memory, kept alive) that memory is watched, so a GPU kernel can bump
    /// it through its mapped address (`torch.as_tensor(watcher,
    /// device="cuda")` uses `__cuda_array_interface__`).
    #[pyo3(signature = (callback, *, word=None))]
    fn alloc_uvm_watcher(
        &self,
        py: Python<'_>,
        callback: &Bound<'_, PyAny>,
        word: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyUvmWatcher> {
        self.live(py)?;
        watcher::alloc(py, &self.engine, &self.stats, callback, word)
    }

    /// Binding and engine counters: `callback_errors` (Python callbacks
    /// that raised), `imm_excess`, `imm_dropped`, and per group
    /// `queued`/`in_flight`/`pending_wrs`, `transfers_ok` and
    /// `transfers_failed` (a dict: error kind to count). `metrics_text()`
    /// has the rest (per NIC, per peer, the data path).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let s = self.engine.stats();
        let d = pyo3::types::PyDict::new(py);
        d.set_item(
            "callback_errors",
            self.stats
                .callback_errors
                .load(std::sync::atomic::Ordering::Relaxed),
        )?;
        d.set_item("imm_excess", s.imm_excess)?;
        d.set_item("imm_dropped", s.imm_dropped)?;
        let groups = pyo3::types::PyList::empty(py);
        for g in &s.groups {
            let gd = pyo3::types::PyDict::new(py);
            gd.set_item("queued", g.queued)?;
            gd.set_item("in_flight", g.in_flight)?;
            gd.set_item("pending_wrs", g.pending_wrs)?;
            gd.set_item("transfers_ok", g.transfers_ok)?;
            let failed = pyo3::types::PyDict::new(py);
            for (k, n) in &g.transfers_failed {
                failed.set_item(*k, *n)?;
            }
            gd.set_item("transfers_failed", failed)?;
            groups.append(gd)?;
        }
        d.set_item("groups", groups)?;
        Ok(d)
    }

    /// This engine's counters in Prometheus' text format: per NIC and per
    /// peer WRs and bytes, transfers by outcome and failures by kind, the
    /// data path of every NIC (provider, fabric, GPU memory direct or
    /// staged), and the binding's callback errors.
    fn metrics_text(&self) -> PyResult<String> {
        crate::metrics::page(&[(self.engine.clone(), Arc::clone(&self.stats))], false)
            .map_err(crate::metrics::value_err)
    }

    /// The NICs WRITEs to `desc` take (names, in NIC order): with
    /// `same_host=True`, the nvlink NIC alone for a peer on this host and
    /// the backend's NICs for the rest.
    fn paths_to(&self, py: Python<'_>, desc: &PyMrDesc) -> PyResult<Vec<String>> {
        let d = desc.inner.clone();
        py.detach(|| self.engine.paths_to(0, &d))
            .map(|v| v.into_iter().map(|r| r.name).collect())
            .map_err(|e| errors::engine_err(py, &e))
    }

    /// The engine's incarnation: drawn when it was built, carried by its
    /// address and descriptors so peers tell a restarted process from the
    /// old one at the same NIC addresses.
    #[getter]
    fn incarnation(&self) -> u64 {
        self.engine.incarnation().0
    }

    /// The engine's address (its main domain group), for peers.
    #[getter]
    fn address(&self) -> PyPeerAddress {
        PyPeerAddress {
            inner: self.engine.main_address(),
        }
    }

    /// How many immediate values the allocator hands out.
    #[getter]
    fn imm_capacity(&self) -> u32 {
        self.engine.imm_capacity()
    }

    /// Takes the specific immediate value `imm` (a value every member of a
    /// peer group reserves); returns it as an `Imm`, returned to the
    /// allocator when released or garbage-collected.
    fn reserve_imm(&self, py: Python<'_>, imm: u32) -> PyResult<PyImm> {
        self.live(py)?;
        self.engine
            .lease_imm_value(imm)
            .map(PyImm::new)
            .map_err(|e| self.err(py, e))
    }

    /// Immediates `imm` received and not yet consumed by a round.
    fn imm_pending(&self, py: Python<'_>, imm: &Bound<'_, PyAny>) -> PyResult<u64> {
        self.live(py)?;
        Ok(self.engine.imm_pending(PyImm::value_of(imm)?))
    }

    /// Allocates an immediate value, as an `Imm` returned to the allocator
    /// when released or garbage-collected.
    fn alloc_imm(&self, py: Python<'_>) -> PyResult<PyImm> {
        self.live(py)?;
        self.engine
            .lease_imm()
            .map(PyImm::new)
            .map_err(|e| errors::engine_err(py, &e))
    }

    /// Arms a round: the returned `Transfer` finishes once `count`
    /// immediates `imm` have arrived (counting earlier arrivals). Re-arm
    /// after it finished for the next round. An `Imm` passed here is kept
    /// alive until the round ends. With `peers` (the writers' addresses),
    /// removing one of them (`remove_peer`) before the round fires fails it
    /// with `PeerGoneError`.
    #[pyo3(signature = (imm, count, *, callback=None, peers=None))]
    fn expect_imm_count(
        &self,
        py: Python<'_>,
        imm: &Bound<'_, PyAny>,
        count: u64,
        callback: Option<&Bound<'_, PyAny>>,
        peers: Option<Vec<PyRef<'_, PyPeerAddress>>>,
    ) -> PyResult<Py<PyTransfer>> {
        self.live(py)?;
        let value = PyImm::value_of(imm)?;
        let keep = if imm.is_instance_of::<PyImm>() {
            vec![RegKeep::object(imm.clone().unbind())]
        } else {
            Vec::new()
        };
        let (state, on_done) = self.on_done(keep);
        let from: Option<Vec<weft::GroupAddress>> =
            peers.map(|p| p.iter().map(|a| a.inner.clone()).collect());
        py.detach(|| match &from {
            Some(from) => self
                .engine
                .expect_imm_count_from(value, count, from, on_done),
            None => self.engine.expect_imm_count_with(value, count, on_done),
        })
        .map_err(|e| errors::engine_err(py, &e))?;
        transfer::submitted(py, None, state, callback)
    }

    /// How many immediates a submit from domain group `group` delivers.
    #[pyo3(signature = (group=0))]
    fn imm_counts(&self, py: Python<'_>, group: usize) -> PyResult<PyImmCounts> {
        self.live(py)?;
        self.engine
            .imm_counts(group)
            .map(|inner| PyImmCounts { inner })
            .map_err(|e| errors::engine_err(py, &e))
    }

    /// Stops the engine (idempotent): pending work fails, the registered
    /// objects are released, and every later call raises `ShutDownError`
    /// except `shutdown()`, `stats()`, `metrics_text()` and the `provider`, `incarnation`,
    /// `address` and `imm_capacity` properties.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        self.shutdown_inner(py)
    }

    fn __enter__(slf: Bound<'_, Self>) -> PyResult<Bound<'_, Self>> {
        slf.get().live(slf.py())?;
        Ok(slf)
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, PyTuple>) -> PyResult<bool> {
        self.shutdown_inner(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!(
            "TransferEngine({:?}, nics={})",
            self.backend.spec().to_string(),
            self.backend.nics()
        )
    }
}
