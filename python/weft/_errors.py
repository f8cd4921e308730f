"""The weft exception hierarchy.

Pure Python (it does not import ``weft._weft``), so the extension can look
classes up here by name when it turns a Rust error into a Python one. Every
exception carries ``kind``, a short snake_case string to branch on: the
Rust error variant for engine and transport errors (``"out_of_bounds"``,
``"shut_down"``, ``"peer_removed"``, ...), or what the binding refused
(``"not_contiguous"``, ``"unsupported_dtype"``, ``"read_only"``,
``"invalid_argument"``, ...). An exception built by hand gets its class's
default (``"wait_timeout"`` for ``WaitTimeoutError``, ...).
"""

from __future__ import annotations

import re


def _default_kind(cls_name: str) -> str:
    """``"WaitTimeoutError"`` -> ``"wait_timeout"``."""
    stem = cls_name[: -len("Error")] if cls_name.endswith("Error") else cls_name
    return re.sub(r"(?<!^)(?=[A-Z])", "_", stem).lower()


class WeftError(Exception):
    """Base class of every error weft raises."""

    #: What went wrong, machine-readable (see the module docstring).
    kind: str = "weft"

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "kind" not in cls.__dict__:
            cls.kind = _default_kind(cls.__name__)


class ProviderError(WeftError):
    """A provider spec could not be parsed, or its backend not opened."""


class UnknownProviderError(ProviderError, ValueError):
    """The spec names no known backend, or is malformed."""


class ProviderUnavailableError(ProviderError):
    """The backend is known but cannot be used on this host (compiled out,
    native library not loadable, no device, too few NICs)."""


class InvalidArgumentError(WeftError, ValueError):
    """An argument was refused before anything was submitted."""


class OutOfBoundsError(InvalidArgumentError):
    """An offset/length pair does not fit the registered region."""


class NicCountMismatchError(InvalidArgumentError):
    """The destination descriptor has a different NIC count than the group."""


class DescriptorError(InvalidArgumentError):
    """Bytes could not be decoded into a descriptor (truncated, trailing or
    garbage input)."""

    kind = "wire"


class ReadOnlyBufferError(InvalidArgumentError):
    """Read-only memory was asked to be a write target."""

    kind = "read_only"


class StaleRegistrationError(InvalidArgumentError):
    """The registration was already released (``unreg``) or is unknown."""

    kind = "stale_mr"


class ShutDownError(WeftError):
    """The engine is shut down."""


class QueueFullError(WeftError):
    """The submission queue is full."""


class ImmError(WeftError):
    """Base class of immediate-value errors."""


class ImmAlreadyArmedError(ImmError):
    """A round for this immediate value is already armed."""


class ImmInUseError(ImmError):
    """The immediate value is already taken."""


class ExhaustedError(ImmError):
    """No free immediate value (or receive buffer pool) is left."""


class TransportError(WeftError):
    """The fabric failed a transfer or a control operation."""


class PeerUnreachableError(TransportError):
    """The peer could not be reached."""


class RemoteAccessError(TransportError):
    """The peer refused the access (unknown key, not writable, out of bounds)."""


class LocalAccessError(TransportError):
    """The local memory could not be accessed (e.g. deregistered in flight)."""


class ReceiverNotReadyError(TransportError):
    """The receiver had no buffer posted."""


class MessageTooLongError(TransportError):
    """The message exceeds what the peer or the fabric accepts."""


class NicDownError(TransportError):
    """A NIC of the group is down."""


class CanceledError(TransportError):
    """The backend canceled the operation."""


class PeerRemovedError(TransportError):
    """The peer was removed (``TransferEngine.remove_peer``, or replaced by
    a newer incarnation at its address): work for it fails with this."""


class PeerGoneError(WeftError):
    """A round armed with ``peers=`` waited on a peer that was removed
    (``TransferEngine.remove_peer``): its immediates will not come."""


class IncarnationUnprovenError(InvalidArgumentError):
    """A descriptor or address names a newer incarnation of a peer whose live
    incarnation was neither removed nor reported unreachable: refused for this
    transfer only (call ``remove_peer`` with the old address if the peer did
    restart)."""


class UnsupportedError(TransportError):
    """The backend does not support the operation."""


class SetupError(WeftError):
    """The engine could not be built."""


class WorkerFailedError(WeftError):
    """An engine worker thread failed."""


class WaitTimeoutError(WeftError, TimeoutError):
    """``wait(timeout)`` returned before the transfer finished (the transfer
    itself goes on)."""


class CallbackDeadlockError(WeftError, RuntimeError):
    """A blocking call was made from a weft callback, where it would hang."""


class RendezvousError(WeftError):
    """A rendezvous store or record failed (``kind``: ``protocol``, ``io``,
    ``record``, ``watch_closed``, ``closed``, ...)."""


class StoreUnavailableError(RendezvousError):
    """The store cannot be reached right now (transient: retry)."""

    kind = "unavailable"


class LeaseLostError(RendezvousError):
    """The session's lease expired or was revoked."""

    kind = "lease_not_found"


class RendezvousTimeoutError(RendezvousError, TimeoutError):
    """What was awaited in the store did not appear in time."""

    kind = "timeout"


class InvalidRendezvousArgumentError(RendezvousError, ValueError):
    """A store spec, namespace or name was refused (``kind``: ``spec`` or
    ``invalid_key``)."""

    kind = "spec"


class KvError(WeftError):
    """A KvCache transfer (``weft.kv``) was refused or failed. ``kind`` is
    the Rust ``KvError`` variant in snake_case: ``refused``,
    ``prefiller_dead``, ``decoder_dead``, ``cancelled``, ``page_taken``,
    ``expired``, ``layout``, ``invalid_route``, ``shut_down``, ..."""


class RlError(WeftError):
    """An RL weight update (``weft.rl``) was refused or failed. ``kind``:
    ``layout`` (the parameter or target tables), ``plan``, ``config``,
    ``engine`` (a WRITE or registration failed), ``timeout`` (a peer dead
    or stalled past the step's deadline), ``unknown_rank``, ``buffer``."""


class MoeError(WeftError):
    """MoE dispatch/combine (``weft.moe``) was refused or failed. ``kind``:
    ``config``, ``shape``, ``too_many_tokens``, ``expert_out_of_range``,
    ``bad_routes`` (a peer's route row), ``peer_info`` (a peer's
    ``info()``), ``engine``, ``timeout`` (a peer dead or stalled past the
    timeout), ``poisoned`` (an earlier step failed), ``not_connected``,
    ``stale_layout``, ``out_of_order``, ``destroyed`` (a destroyed
    ``Buffer``), ``moe`` (anything else: allocation, a rank number out of
    range)."""


__all__ = [name for name, v in list(globals().items()) if isinstance(v, type) and issubclass(v, WeftError)]
