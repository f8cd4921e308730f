//! [`Registry`]: backend names → factories, and the process-wide instance
//! behind [`crate::provider`], [`crate::providers`] and [`crate::register`].

use std::fmt;
use std::sync::{Arc, OnceLock};

use parking_lot::RwLock;
use weft_transport::TransportError;

use crate::backend::{Backend, HostSource};
use crate::config::ProviderConfig;
use crate::error::ProviderError;
use crate::spec::ProviderSpec;

/// A backend factory: opens the backend `spec` selects with `config`.
pub type Factory = dyn Fn(&ProviderSpec, &ProviderConfig) -> Result<Box<dyn HostSource>, ProviderError>
    + Send
    + Sync;

struct Entry {
    name: String,
    /// Specs `providers()` reports on and error messages list.
    listed: Vec<String>,
    /// Patterns shown in the list of known specs besides `listed`.
    patterns: Vec<String>,
    factory: Arc<Factory>,
}

/// Backend names and their factories, in registration order.
///
/// [`Registry::default`] holds the built-in backends (`loopback`,
/// `loopback-null`, `libfabric`, `verbs`; one compiled out by its cargo
/// feature is still listed and reports [`ProviderError::FeatureDisabled`]).
/// [`Registry::register`] adds one (or replaces one of the same name), so a
/// backend that lives outside this workspace is selected by spec string
/// like the built-in ones:
///
/// ```
/// use std::sync::Arc;
/// use weft::loopback::{Fabric, FabricConfig};
/// use weft::{Provider, Registry};
///
/// let mut reg = Registry::default();
/// reg.register("sim2", |_spec, _config| {
///     // The simulated fabric under a new name, with its own profile.
///     let fabric = Fabric::new_realtime(FabricConfig::ideal(7));
///     Ok(Box::new(move |nics: usize| {
///         Ok(Arc::new(fabric.provider(fabric.add_host(nics))) as Arc<dyn Provider>)
///     }))
/// });
/// let backend = reg.open("sim2").unwrap();
/// assert_eq!(backend.host().unwrap().nics().unwrap().len(), 1);
/// ```
pub struct Registry {
    entries: Vec<Entry>,
}

impl fmt::Debug for Registry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.entries.iter().map(|e| &e.name))
            .finish()
    }
}

impl Default for Registry {
    /// The built-in backends.
    fn default() -> Self {
        let mut r = Registry::empty();
        crate::builtin::register_all(&mut r);
        r
    }
}

/// Whether a listed backend can be used on this host.
#[derive(Debug)]
#[non_exhaustive]
pub enum Availability {
    /// Usable; these NICs were found.
    Available {
        /// NIC names of one host.
        nics: Vec<String>,
    },
    /// Compiled out: `weft` was built without this cargo feature.
    FeatureDisabled {
        /// The feature.
        feature: &'static str,
    },
    /// Its native library could not be loaded.
    LibraryUnavailable {
        /// The loader's message.
        reason: String,
    },
    /// The library loaded but no device was found.
    NoDevice {
        /// What was searched for.
        reason: String,
    },
    /// Opening it failed otherwise.
    Failed {
        /// The error.
        reason: String,
    },
}

impl Availability {
    /// Whether the backend is usable.
    pub fn is_available(&self) -> bool {
        matches!(self, Availability::Available { .. })
    }

    fn of_error(e: ProviderError) -> Self {
        match e {
            ProviderError::FeatureDisabled { feature, .. } => {
                Availability::FeatureDisabled { feature }
            }
            ProviderError::Transport {
                source: e @ TransportError::LibraryUnavailable { .. },
                ..
            } => Availability::LibraryUnavailable {
                reason: e.to_string(),
            },
            ProviderError::Transport {
                source: e @ TransportError::NoDevice { .. },
                ..
            } => Availability::NoDevice {
                reason: e.to_string(),
            },
            other => Availability::Failed {
                reason: other.to_string(),
            },
        }
    }
}

impl fmt::Display for Availability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Availability::Available { nics } => write!(f, "available ({})", nics.join(", ")),
            Availability::FeatureDisabled { feature } => {
                write!(f, "not built in (cargo feature `{feature}` off)")
            }
            Availability::LibraryUnavailable { reason }
            | Availability::NoDevice { reason }
            | Availability::Failed { reason } => f.write_str(reason),
        }
    }
}

/// One line of [`crate::providers`]: a backend spec and whether it works here.
#[derive(Debug)]
#[non_exhaustive]
pub struct ProviderStatus {
    /// The spec, e.g. `libfabric:efa`.
    pub spec: String,
    /// Whether it can be used on this host and, if not, why.
    pub availability: Availability,
}

impl Registry {
    /// A registry with no backends.
    pub fn empty() -> Self {
        Registry {
            entries: Vec::new(),
        }
    }

    /// The process-wide registry used by [`crate::provider`],
    /// [`crate::providers`], [`crate::register`] and
    /// [`ProviderSpec`]'s `FromStr`.
    pub(crate) fn global() -> &'static RwLock<Registry> {
        static GLOBAL: OnceLock<RwLock<Registry>> = OnceLock::new();
        GLOBAL.get_or_init(|| RwLock::new(Registry::default()))
    }

    /// Adds backend `name` (replacing one of that name), selected by the
    /// specs `name` and `name:ARG`. The factory receives the parsed spec
    /// (a [`ProviderSpec::Custom`] unless `name` is a built-in name) and
    /// the config, and returns the source of its hosts.
    pub fn register<F>(&mut self, name: &str, factory: F) -> &mut Self
    where
        F: Fn(&ProviderSpec, &ProviderConfig) -> Result<Box<dyn HostSource>, ProviderError>
            + Send
            + Sync
            + 'static,
    {
        self.insert(name, &[name], &[], Arc::new(factory))
    }

    /// [`Registry::register`] with the specs [`Registry::providers`] probes
    /// and the patterns error messages list (e.g. `libfabric:tcp`, …, and
    /// `libfabric:<provider>`).
    pub(crate) fn insert(
        &mut self,
        name: &str,
        listed: &[&str],
        patterns: &[&str],
        factory: Arc<Factory>,
    ) -> &mut Self {
        let strings = |v: &[&str]| v.iter().map(|s| s.to_string()).collect();
        let entry = Entry {
            name: name.to_string(),
            listed: strings(listed),
            patterns: strings(patterns),
            factory,
        };
        match self.entries.iter_mut().find(|e| e.name == name) {
            Some(e) => *e = entry,
            None => self.entries.push(entry),
        }
        self
    }

    /// Every spec and pattern this registry knows, for messages.
    pub fn known(&self) -> Vec<String> {
        self.entries
            .iter()
            .flat_map(|e| e.listed.iter().chain(&e.patterns).cloned())
            .collect()
    }

    /// Parses `s` against this registry: the built-in grammar, then the
    /// registered names.
    pub fn parse(&self, s: &str) -> Result<ProviderSpec, ProviderError> {
        if let Some(spec) = ProviderSpec::parse_builtin(s)? {
            return Ok(spec);
        }
        let s = s.trim();
        let (name, arg) = match s.split_once(':') {
            Some((n, a)) => (n, Some(a.to_string())),
            None => (s, None),
        };
        if self.entries.iter().any(|e| e.name == name) {
            return Ok(ProviderSpec::Custom {
                name: name.to_string(),
                arg,
            });
        }
        Err(ProviderError::Unknown {
            spec: s.to_string(),
            known: self.known(),
        })
    }

    /// Parses `spec` and opens it with the default [`ProviderConfig`].
    pub fn open(&self, spec: &str) -> Result<Backend, ProviderError> {
        self.open_with(&self.parse(spec)?, &ProviderConfig::default())
    }

    /// Opens the backend `spec` selects with `config`.
    pub fn open_with(
        &self,
        spec: &ProviderSpec,
        config: &ProviderConfig,
    ) -> Result<Backend, ProviderError> {
        open_by(&*self.factory(spec)?, spec, config)
    }

    /// The factory serving `spec`.
    fn factory(&self, spec: &ProviderSpec) -> Result<Arc<Factory>, ProviderError> {
        self.entries
            .iter()
            .find(|e| e.name == spec.name())
            .map(|e| e.factory.clone())
            .ok_or_else(|| ProviderError::Unknown {
                spec: spec.to_string(),
                known: self.known(),
            })
    }

    /// Every listed spec with whether it is usable on this host (each is
    /// opened with one NIC and its NICs listed).
    pub fn providers(&self) -> Vec<ProviderStatus> {
        probe_all(self.listed())
    }

    /// The listed specs with what serves them.
    fn listed(&self) -> Listed {
        self.entries
            .iter()
            .flat_map(|e| e.listed.iter())
            .map(|s| {
                let served = self
                    .parse(s)
                    .and_then(|spec| Ok((spec.clone(), self.factory(&spec)?)));
                (s.clone(), served)
            })
            .collect()
    }
}

/// Runs `factory` for `spec` (no registry lock held, so a factory may use
/// the process-wide registry itself).
fn open_by(
    factory: &Factory,
    spec: &ProviderSpec,
    config: &ProviderConfig,
) -> Result<Backend, ProviderError> {
    let source = factory(spec, config)?;
    Ok(Backend::new(spec.clone(), config.nics, source))
}

type Listed = Vec<(String, Result<(ProviderSpec, Arc<Factory>), ProviderError>)>;

fn probe_all(listed: Listed) -> Vec<ProviderStatus> {
    let config = ProviderConfig::default();
    listed
        .into_iter()
        .map(|(s, served)| {
            let availability = match served
                .and_then(|(spec, f)| open_by(&*f, &spec, &config))
                .and_then(|b| b.probe())
            {
                Ok(nics) => Availability::Available {
                    nics: nics.into_iter().map(|n| n.name).collect(),
                },
                Err(e) => Availability::of_error(e),
            };
            ProviderStatus {
                spec: s,
                availability,
            }
        })
        .collect()
}

/// Opens the backend `spec` selects (`loopback`, `loopback-null`,
/// `libfabric:efa`, `verbs:mlx5_0`, a registered name, ...) with the default
/// [`ProviderConfig`] (one NIC per host).
///
/// ```
/// let backend = weft::provider("loopback-null").unwrap();
/// let provider = backend.host().unwrap();
/// assert_eq!(provider.name(), "loopback");
/// assert!(weft::provider("rdma").unwrap_err().to_string().contains("libfabric:efa"));
/// ```
pub fn provider(spec: &str) -> Result<Backend, ProviderError> {
    let spec = spec.parse::<ProviderSpec>()?;
    provider_with(&spec, &ProviderConfig::default())
}

/// Opens the backend `spec` selects with `config`.
pub fn provider_with(
    spec: &ProviderSpec,
    config: &ProviderConfig,
) -> Result<Backend, ProviderError> {
    let factory = Registry::global().read().factory(spec)?;
    open_by(&*factory, spec, config)
}

/// Every known backend spec with whether it is usable on this host and, if
/// not, why (feature off, library not loadable, no device).
pub fn providers() -> Vec<ProviderStatus> {
    let listed = Registry::global().read().listed();
    probe_all(listed)
}

/// Adds a backend to the process-wide registry (see [`Registry::register`]).
pub fn register<F>(name: &str, factory: F)
where
    F: Fn(&ProviderSpec, &ProviderConfig) -> Result<Box<dyn HostSource>, ProviderError>
        + Send
        + Sync
        + 'static,
{
    Registry::global().write().register(name, factory);
}
