//! [`ProviderSpec`]: a backend selection as written on a command line
//! (`loopback`, `libfabric:efa`, `verbs:mlx5_0`, ...).

use std::fmt;
use std::str::FromStr;

use crate::error::ProviderError;
use crate::registry::Registry;

/// Which backend to run on, parsed from a spec string.
///
/// The grammar is `NAME[:ARG]`: `loopback`, `loopback-null` (alias `null`),
/// `libfabric:<provider>` (`tcp`, `shm`, `efa`, any libfabric provider
/// name), `verbs` and `verbs:<device>`, `nvlink`, plus any name added with
/// [`Registry::register`] ([`ProviderSpec::Custom`]). [`FromStr`] accepts
/// the built-in names and the names registered in the process-wide
/// registry ([`crate::register`]); [`fmt::Display`] writes the canonical
/// form back, so `spec.to_string().parse()` round-trips.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum ProviderSpec {
    /// The simulated fabric, realtime-driven, with the profile of
    /// [`crate::LoopbackOptions`] (adversarial by default).
    Loopback,
    /// The simulated fabric in null mode: WRs are validated and completed at
    /// the next poll, nothing is copied. Isolates engine cost.
    LoopbackNull,
    /// libfabric with this provider (`tcp`, `shm`, `efa`, ...).
    Libfabric(String),
    /// libibverbs (ConnectX / any RC NIC): every device, or only the named
    /// one (`verbs:mlx5_0`).
    Verbs(Option<String>),
    /// The same-host backend (`weft-nvlink`): processes of one host,
    /// GPU memory through CUDA IPC (see [`crate::NvlinkOptions`]).
    Nvlink,
    /// A backend added with [`Registry::register`].
    Custom {
        /// The name it was registered under.
        name: String,
        /// What follows the first `:`, if anything.
        arg: Option<String>,
    },
}

impl ProviderSpec {
    /// The registry name this spec is served by: `loopback`,
    /// `loopback-null`, `libfabric`, `verbs` or a custom name.
    pub fn name(&self) -> &str {
        match self {
            ProviderSpec::Loopback => "loopback",
            ProviderSpec::LoopbackNull => "loopback-null",
            ProviderSpec::Libfabric(_) => "libfabric",
            ProviderSpec::Verbs(_) => "verbs",
            ProviderSpec::Nvlink => "nvlink",
            ProviderSpec::Custom { name, .. } => name,
        }
    }

    /// What follows the name (libfabric provider, verbs device, custom
    /// argument), if anything.
    pub fn arg(&self) -> Option<&str> {
        match self {
            ProviderSpec::Loopback | ProviderSpec::LoopbackNull | ProviderSpec::Nvlink => None,
            ProviderSpec::Libfabric(p) => Some(p),
            ProviderSpec::Verbs(d) => d.as_deref(),
            ProviderSpec::Custom { arg, .. } => arg.as_deref(),
        }
    }

    /// Whether this is one of the simulated fabrics.
    pub fn is_loopback(&self) -> bool {
        matches!(self, ProviderSpec::Loopback | ProviderSpec::LoopbackNull)
    }

    /// Parses the built-in grammar; `Ok(None)` for a name that is not
    /// built in (the registry then looks it up).
    pub(crate) fn parse_builtin(s: &str) -> Result<Option<Self>, ProviderError> {
        let s = s.trim();
        let (name, arg) = match s.split_once(':') {
            Some((n, a)) => (n, Some(a)),
            None => (s, None),
        };
        let invalid = |reason: &str| ProviderError::Invalid {
            spec: s.to_string(),
            reason: reason.to_string(),
        };
        let spec = match (name, arg) {
            ("loopback", None) => ProviderSpec::Loopback,
            ("loopback-null" | "null", None) => ProviderSpec::LoopbackNull,
            ("loopback" | "loopback-null" | "null", Some(_)) => {
                return Err(invalid("the loopback fabrics take no argument"))
            }
            ("libfabric", Some(p)) if !p.is_empty() => ProviderSpec::Libfabric(p.to_string()),
            ("libfabric", _) => return Err(invalid(
                "libfabric needs a provider name, e.g. libfabric:tcp, libfabric:shm, libfabric:efa",
            )),
            ("nvlink", None) => ProviderSpec::Nvlink,
            ("nvlink", Some(_)) => return Err(invalid("nvlink takes no argument")),
            ("verbs", None) => ProviderSpec::Verbs(None),
            ("verbs", Some(d)) if !d.is_empty() => ProviderSpec::Verbs(Some(d.to_string())),
            ("verbs", Some(_)) => {
                return Err(invalid(
                    "verbs:DEVICE needs a device name, e.g. verbs:mlx5_0",
                ))
            }
            _ => return Ok(None),
        };
        Ok(Some(spec))
    }
}

impl fmt::Display for ProviderSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())?;
        match self.arg() {
            Some(a) => write!(f, ":{a}"),
            None => Ok(()),
        }
    }
}

impl FromStr for ProviderSpec {
    type Err = ProviderError;

    /// Parses against the process-wide registry (built-in names plus those
    /// added with [`crate::register`]).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Registry::global().read().parse(s)
    }
}
