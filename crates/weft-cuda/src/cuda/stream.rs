//! Streams, stream capture and CUDA graphs.

use super::drv;
use crate::{CudaError, Gpu};
use cudarc::driver::{result, sys};
use parking_lot::Mutex;
use std::any::Any;
use std::fmt;
use std::sync::Arc;

type KeepAlive = Arc<dyn Any + Send + Sync>;

/// A non-blocking CUDA stream of one [`Gpu`].
///
/// Work enqueued through weft-cuda's API while the stream captures (between
/// [`Stream::begin_capture`] and [`Stream::end_capture`]) records the memory
/// it references, and the resulting [`Graph`] keeps that memory alive.
pub struct Stream {
    gpu: Gpu,
    raw: sys::CUstream,
    capturing: Mutex<Option<Vec<KeepAlive>>>,
}

// SAFETY: the stream handle is a driver object usable from any thread once
// its context is bound (every method binds it first); capture state is
// behind a mutex.
unsafe impl Send for Stream {}
// SAFETY: see `Send`.
unsafe impl Sync for Stream {}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stream")
            .field("device", &self.gpu.inner.label)
            .field("capturing", &self.capturing.lock().is_some())
            .finish()
    }
}

impl Stream {
    pub(crate) fn new(gpu: &Gpu) -> Result<Self, CudaError> {
        gpu.inner.bind()?;
        let raw = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(drv(&gpu.inner.label, "cuStreamCreate"))?;
        Ok(Stream {
            gpu: gpu.clone(),
            raw,
            capturing: Mutex::new(None),
        })
    }

    /// The GPU the stream belongs to.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// The raw `CUstream`, for launching your own work on it. Memory your
    /// own work references is not tracked by graph capture.
    pub fn raw(&self) -> sys::CUstream {
        self.raw
    }

    /// Waits until all work on the stream has finished.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.gpu.inner.bind()?;
        // SAFETY: the stream belongs to the (now current) context.
        unsafe { result::stream::synchronize(self.raw) }
            .map_err(drv(&self.gpu.inner.label, "cuStreamSynchronize"))
    }

    /// Starts capturing the stream's work into a graph
    /// (`CU_STREAM_CAPTURE_MODE_THREAD_LOCAL`).
    pub fn begin_capture(&self) -> Result<(), CudaError> {
        let mut cap = self.capturing.lock();
        if cap.is_some() {
            return Err(CudaError::InvalidArgument {
                device: self.gpu.inner.label.clone(),
                what: "stream is already capturing".into(),
            });
        }
        self.gpu.inner.bind()?;
        // SAFETY: the stream belongs to the current context.
        unsafe {
            result::stream::begin_capture(
                self.raw,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        }
        .map_err(drv(&self.gpu.inner.label, "cuStreamBeginCapture"))?;
        *cap = Some(Vec::new());
        Ok(())
    }

    /// Ends the capture and instantiates the captured work as a [`Graph`].
    pub fn end_capture(&self) -> Result<Graph, CudaError> {
        let label = &self.gpu.inner.label;
        let keep = self
            .capturing
            .lock()
            .take()
            .ok_or_else(|| CudaError::InvalidArgument {
                device: label.clone(),
                what: "end_capture without begin_capture".into(),
            })?;
        self.gpu.inner.bind()?;
        // SAFETY: the stream is capturing (begin_capture succeeded).
        let graph = unsafe { result::stream::end_capture(self.raw) }
            .map_err(drv(label, "cuStreamEndCapture"))?;
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: `graph` is a valid graph just produced by the capture;
        // `exec` is a valid out-pointer.
        let rc = unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) }
            .result()
            .map_err(drv(label, "cuGraphInstantiateWithFlags"));
        if let Err(e) = rc {
            // SAFETY: destroy the graph we own; it was never instantiated.
            let _ = unsafe { result::graph::destroy(graph) };
            return Err(e);
        }
        Ok(Graph {
            gpu: self.gpu.clone(),
            graph,
            exec,
            _keep: keep,
        })
    }

    /// Records `what` as referenced by work enqueued now, if capturing.
    pub(crate) fn note_use(&self, what: KeepAlive) {
        if let Some(v) = self.capturing.lock().as_mut() {
            v.push(what);
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.gpu.inner.bind().is_ok() {
            if self.capturing.get_mut().is_some() {
                // SAFETY: abandon an unfinished capture before destroying.
                if let Ok(g) = unsafe { result::stream::end_capture(self.raw) } {
                    // SAFETY: we own the graph the capture produced.
                    let _ = unsafe { result::graph::destroy(g) };
                }
            }
            // SAFETY: the stream belongs to this context. cuStreamDestroy
            // lets already enqueued work finish.
            if let Err(e) = unsafe { result::stream::destroy(self.raw) } {
                tracing::warn!(device = %self.gpu.inner.label, ?e, "cuStreamDestroy failed");
            }
        }
    }
}

/// An instantiated CUDA graph (from [`Stream::end_capture`]). It keeps the
/// weft-cuda memory its captured work references alive.
pub struct Graph {
    gpu: Gpu,
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    _keep: Vec<KeepAlive>,
}

// SAFETY: graph handles are driver objects usable from any thread with the
// context bound; launches are serialised by the driver.
unsafe impl Send for Graph {}
// SAFETY: see `Send`.
unsafe impl Sync for Graph {}

impl fmt::Debug for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Graph")
            .field("device", &self.gpu.inner.label)
            .finish()
    }
}

impl Graph {
    /// Launches the graph on `stream`, which must belong to the same GPU.
    pub fn launch(&self, stream: &Stream) -> Result<(), CudaError> {
        if !Arc::ptr_eq(&stream.gpu.inner, &self.gpu.inner) {
            return Err(CudaError::InvalidArgument {
                device: self.gpu.inner.label.clone(),
                what: format!("graph launched on a stream of {}", stream.gpu.inner.label),
            });
        }
        self.gpu.inner.bind()?;
        // SAFETY: `exec` is a valid instantiated graph of this context and the
        // memory it references is kept alive by `_keep`.
        unsafe { result::graph::launch(self.exec, stream.raw) }
            .map_err(drv(&self.gpu.inner.label, "cuGraphLaunch"))
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        if let Err(e) = self.gpu.inner.synchronize() {
            tracing::warn!(device = %self.gpu.inner.label, %e, "synchronize before graph destroy failed");
        }
        // SAFETY: we own both handles; the device is idle, so no launch of
        // this graph is still running.
        unsafe {
            let _ = result::graph::exec_destroy(self.exec);
            let _ = result::graph::destroy(self.graph);
        }
    }
}
