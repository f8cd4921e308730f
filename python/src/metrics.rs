//! Metrics from Python: `weft.metrics_text()` (every live engine on one
//! page, in Prometheus' text format) and `weft.serve_metrics()` (an opt-in
//! HTTP endpoint serving that page).

use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::transfer::BindingStats;

/// One page for `engines`; with `label`, each engine's samples carry
/// `engine="<incarnation in hex>"` (a process may run several).
pub(crate) fn page(
    engines: &[(weft::TransferEngine, Arc<BindingStats>)],
    label: bool,
) -> Result<String, weft::metrics::InvalidMetricName> {
    let mut m = weft::metrics::Metrics::new();
    for (e, stats) in engines {
        let inc = format!("{:016x}", e.incarnation().0);
        let labels: &[(&str, &str)] = if label { &[("engine", &inc)] } else { &[] };
        m.add_engine(e, labels).and_then(|()| {
            m.add(
                "weft_python_callback_errors_total",
                "Python callbacks that raised (reported through sys.unraisablehook).",
                weft::metrics::MetricKind::Counter,
                labels,
                stats.callback_errors.load(Ordering::Relaxed) as f64,
            )
        })?;
    }
    Ok(m.render())
}

/// Every live engine of this process on one page, in Prometheus' text
/// format; each sample is labelled with its engine's incarnation
/// (`engine="..."`, hex).
#[pyfunction]
pub fn metrics_text() -> PyResult<String> {
    page(&crate::live::live(), true).map_err(value_err)
}

pub(crate) fn value_err(e: weft::metrics::InvalidMetricName) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// An HTTP endpoint serving `metrics_text()` at `/metrics` (see
/// `weft.serve_metrics`). Stops with `close()`, at exit of a `with` block,
/// or when garbage-collected.
#[pyclass(name = "MetricsServer", module = "weft._weft")]
pub struct PyMetricsServer {
    server: Option<weft::MetricsServer>,
    addr: std::net::SocketAddr,
}

impl Drop for PyMetricsServer {
    fn drop(&mut self) {
        // Stopping joins the server thread (up to one client's time): never
        // with the GIL held.
        if let Some(s) = self.server.take() {
            let _ = Python::try_attach(|py| py.detach(|| s.stop()));
        }
    }
}

#[pymethods]
impl PyMetricsServer {
    /// `(host, port)` the server listens on.
    #[getter]
    fn address(&self) -> (String, u16) {
        (self.addr.ip().to_string(), self.addr.port())
    }

    /// The URL to scrape.
    #[getter]
    fn url(&self) -> String {
        format!("http://{}/metrics", self.addr)
    }

    /// Stops serving (idempotent).
    fn close(&mut self, py: Python<'_>) {
        if let Some(s) = self.server.take() {
            py.detach(|| s.stop());
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&mut self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.close(py);
        false
    }

    fn __repr__(&self) -> String {
        let state = if self.server.is_some() {
            "serving"
        } else {
            "closed"
        };
        format!("MetricsServer({}, {state})", self.url())
    }
}

/// Serves `metrics_text()` over HTTP at `http://host:port/metrics` from a
/// background thread (no GIL needed to answer). `port=0` picks a free
/// port (see `MetricsServer.address`). Binds loopback by default; pass
/// `host="0.0.0.0"` to let a scraper on another machine in.
#[pyfunction]
#[pyo3(signature = (port=0, host="127.0.0.1"))]
pub fn serve_metrics(py: Python<'_>, port: u16, host: &str) -> PyResult<PyMetricsServer> {
    let addr = (host.to_string(), port);
    let server = py
        .detach(|| {
            weft::MetricsServer::start(addr, || {
                page(&crate::live::live(), true).unwrap_or_else(|e| format!("# error: {e}\n"))
            })
        })
        .map_err(|e| PyOSError::new_err(format!("cannot serve metrics on {host}:{port}: {e}")))?;
    Ok(PyMetricsServer {
        addr: server.local_addr(),
        server: Some(server),
    })
}
