"""Type stubs of the extension module ``weft._weft``."""

from __future__ import annotations

from types import TracebackType
from typing import Any, Callable, Dict, Generator, List, Optional, Sequence, Tuple, Type, Union

__version__: str

class ProviderStatus:
    """One line of ``providers()``: a backend spec and whether it works here."""

    @property
    def spec(self) -> str: ...
    @property
    def available(self) -> bool: ...
    @property
    def reason(self) -> Optional[str]: ...
    @property
    def nics(self) -> List[str]: ...

def providers() -> List[ProviderStatus]:
    """Every known backend and whether it works on this host (and why not)."""

class Backend:
    """An opened backend; engines built from one backend share its fabric."""

    @property
    def spec(self) -> str: ...
    @property
    def nics(self) -> int: ...

def provider(
    spec: str,
    *,
    nics: int = 1,
    profile: str = "adversarial",
    seed: int = 0,
    domain: Optional[str] = None,
    write_timeout: Optional[float] = None,
    connect_timeout: Optional[float] = None,
    hmem: bool = False,
    hmem_ipc: bool = False,
    gpu: Optional[int] = None,
) -> Backend:
    """Opens the backend named by ``spec`` with ``nics`` NICs per host
    (``gpu=i``: ``"nvlink"`` maps GPU ``i``'s memory with CUDA IPC)."""

class MrDesc:
    """What a peer needs to write into a registered region."""

    @classmethod
    def from_bytes(cls, data: bytes) -> MrDesc:
        """Decodes ``to_bytes()`` output; raises ``DescriptorError`` on bad input."""
    def to_bytes(self) -> bytes: ...
    @property
    def addr(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def nic_count(self) -> int: ...
    @property
    def incarnation(self) -> int: ...
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...

class PeerAddress:
    """The address of a peer engine; ``to_bytes()``/``from_bytes()`` carry it."""

    @classmethod
    def from_bytes(cls, data: bytes) -> PeerAddress:
        """Decodes ``to_bytes()`` output; raises ``DescriptorError`` on bad input."""
    def to_bytes(self) -> bytes: ...
    @property
    def nic_count(self) -> int: ...
    @property
    def incarnation(self) -> int: ...
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...

class PeerGroup:
    """Peers resolved by one engine for scatter and barrier."""

    def __len__(self) -> int: ...

class ScatterDst:
    """One destination of ``submit_scatter``."""

    def __init__(self, dst: MrDesc, nbytes: int, *, src_offset: int = 0, dst_offset: int = 0) -> None: ...
    @property
    def nbytes(self) -> int: ...

class ScatterTargets:
    """Scatter destinations checked once (``scatter_targets``), for ``submit_scatter_to``."""

    def __len__(self) -> int: ...
    @property
    def nics(self) -> int: ...
    @property
    def matched(self) -> bool: ...

class UvmWatcher:
    """A watched 64-bit word; ``callback(old, new)`` runs when it changes."""

    @property
    def addr(self) -> int: ...
    @property
    def value(self) -> int: ...
    def store(self, value: int) -> None: ...
    def close(self) -> None: ...
    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]: ...
    @property
    def __array_interface__(self) -> Dict[str, Any]: ...

class ImmCounts:
    """How many immediates a submit delivers to its destination."""

    def single_write(self, nbytes: int) -> int: ...
    def paged_writes(self, page_len: int, pages: int) -> int: ...
    def scatter_dst(self, nbytes: int, mode: str = "by_peer") -> int: ...
    def barrier(self) -> int: ...
    @property
    def nics(self) -> int: ...

class Imm:
    """An immediate value taken from an engine; returned on release() or when garbage-collected."""

    @property
    def value(self) -> int: ...
    @property
    def held(self) -> bool: ...
    def release(self) -> None: ...
    def __index__(self) -> int: ...
    def __int__(self) -> int: ...
    def __hash__(self) -> int: ...
    def __enter__(self) -> "Imm": ...
    def __exit__(self, *args: Any) -> bool: ...

class Registration:
    """Memory registered with an engine; keeps the object alive until ``unreg``."""

    @property
    def desc(self) -> MrDesc: ...
    @property
    def addr(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def device(self) -> str: ...
    @property
    def writable(self) -> bool: ...
    @property
    def obj(self) -> Any: ...
    @property
    def registered(self) -> bool: ...
    def unreg(self) -> None: ...
    def __enter__(self) -> Registration: ...
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...

class Transfer:
    """A submitted transfer or an armed immediate round."""

    @property
    def id(self) -> Optional[int]: ...
    def done(self) -> bool: ...
    def exception(self) -> Optional[BaseException]: ...
    def wait(self, timeout: Optional[float] = None) -> None:
        """Blocks (GIL released) until done; raises its error or ``WaitTimeoutError``."""
    def add_done_callback(self, fn: Callable[[Transfer], Any]) -> None:
        """Calls ``fn(transfer)`` on weft's callback thread once done (at once if done)."""
    def __await__(self) -> Generator[Any, None, None]: ...

Callback = Callable[[Transfer], Any]
Pages = Union[Sequence[int], Any]

class TransferEngine:
    """A weft transfer engine over one backend."""

    def __init__(
        self,
        provider: Union[str, Backend, None] = None,
        *,
        nics: int = 1,
        profile: str = "adversarial",
        seed: int = 0,
        device: Union[str, Any, None] = None,
        domain: Optional[str] = None,
        write_timeout: Optional[float] = None,
        connect_timeout: Optional[float] = None,
        hmem: bool = False,
        hmem_ipc: bool = False,
        same_host: bool = False,
    ) -> None: ...
    @property
    def provider(self) -> str: ...
    def paths_to(self, desc: MrDesc) -> List[str]:
        """The NICs WRITEs to ``desc`` take (with ``same_host=True``: nvlink alone for a peer on this host)."""
    @property
    def incarnation(self) -> int: ...
    @property
    def address(self) -> PeerAddress: ...
    @property
    def imm_capacity(self) -> int: ...
    def reg_mr(
        self,
        obj: Any,
        *,
        device: Union[str, Any, None] = None,
        writable: Optional[bool] = None,
        keepalive: Any = None,
    ) -> Registration:
        """Registers a buffer-protocol object, torch tensor, DLPack capsule/object or ``(ptr, nbytes, device)``.

        Read-only memory registers as a source only. Raises ``InvalidArgumentError`` for memory
        whose items are not plain bytes (``kind="unsupported_dtype"``: numpy object dtypes,
        pointers) or that is not C-contiguous (``kind="not_contiguous"``).
        """
    def submit_single_write(
        self,
        nbytes: int,
        src: Registration,
        dst: MrDesc,
        *,
        src_offset: int = 0,
        dst_offset: int = 0,
        imm: Optional[Union[int, Imm]] = None,
        callback: Optional[Callback] = None,
    ) -> Transfer: ...
    def submit_paged_writes(
        self,
        page_len: int,
        src: Registration,
        src_pages: Pages,
        dst: MrDesc,
        dst_pages: Pages,
        *,
        src_stride: Optional[int] = None,
        dst_stride: Optional[int] = None,
        src_offset: int = 0,
        dst_offset: int = 0,
        imm: Optional[Union[int, Imm]] = None,
        callback: Optional[Callback] = None,
    ) -> Transfer: ...
    def submit_send(self, peer: PeerAddress, data: Any, *, callback: Optional[Callback] = None) -> Transfer: ...
    def submit_recvs(
        self,
        nbytes: int,
        count: int,
        on_message: Callable[[bytes], Any],
        *,
        on_error: Optional[Callable[[BaseException], Any]] = None,
    ) -> None: ...
    def remove_peer(self, peer: PeerAddress) -> None: ...
    def add_peer_group(self, peers: Sequence[PeerAddress]) -> PeerGroup: ...
    def submit_scatter(
        self,
        group: PeerGroup,
        src: Registration,
        dsts: Sequence[ScatterDst],
        *,
        imm: Optional[Union[int, Imm]] = None,
        mode: Optional[str] = None,
        callback: Optional[Callback] = None,
    ) -> Transfer: ...
    def scatter_targets(self, group: PeerGroup, dsts: Sequence[MrDesc]) -> ScatterTargets: ...
    def submit_scatter_to(
        self,
        targets: ScatterTargets,
        src: Registration,
        slices: Union[Sequence[Union[Tuple[int, int, int], Sequence[int]]], Any],
        *,
        imm: Optional[Union[int, Imm]] = None,
        mode: Optional[str] = None,
        callback: Optional[Callback] = None,
    ) -> Transfer: ...
    def submit_barrier(
        self, group: PeerGroup, imm: Union[int, Imm], dsts: Sequence[MrDesc], *, callback: Optional[Callback] = None
    ) -> Transfer: ...
    def alloc_uvm_watcher(self, callback: Callable[[int, int], Any], *, word: Any = None) -> UvmWatcher: ...
    def alloc_imm(self) -> Imm: ...
    def reserve_imm(self, imm: int) -> Imm: ...
    def imm_pending(self, imm: Union[int, Imm]) -> int: ...
    def expect_imm_count(
        self,
        imm: Union[int, Imm],
        count: int,
        *,
        callback: Optional[Callback] = None,
        peers: Optional[Sequence[PeerAddress]] = None,
    ) -> Transfer: ...
    def imm_counts(self, group: int = 0) -> ImmCounts: ...
    def stats(self) -> Dict[str, Any]: ...
    def metrics_text(self) -> str:
        """This engine's counters in Prometheus' text format."""
    def shutdown(self) -> None:
        """Stops the engine (idempotent); later calls raise ``ShutDownError``, except
        ``shutdown()``, ``stats()``, ``metrics_text()`` and the properties."""
    def __enter__(self) -> TransferEngine: ...
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...

def metrics_text() -> str:
    """Every live engine's counters on one page, in Prometheus' text format,
    each sample labelled ``engine="<incarnation hex>"``."""

class MetricsServer:
    """An HTTP endpoint serving ``metrics_text()`` at ``/metrics``."""

    @property
    def address(self) -> Tuple[str, int]: ...
    @property
    def url(self) -> str: ...
    def close(self) -> None: ...
    def __enter__(self) -> MetricsServer: ...
    def __exit__(self, *args: Any) -> bool: ...

def serve_metrics(port: int = 0, host: str = "127.0.0.1") -> MetricsServer:
    """Serves ``metrics_text()`` over HTTP from a background thread."""

class Store:
    """A rendezvous store (see ``weft.rendezvous``)."""

    @property
    def endpoint(self) -> str: ...

def open_store(spec: str) -> Store:
    """Opens ``mem``, ``dir:<path>`` or ``etcd:http://host:2379[,...]``."""

class Session:
    """A lease on a store, kept alive in the background; context manager = ``close()``."""

    def __init__(self, store: Store, ttl: float = 10.0) -> None: ...
    @property
    def lease(self) -> int: ...
    @property
    def healthy(self) -> bool: ...
    def close(self) -> None: ...
    def __enter__(self) -> Session: ...
    def __exit__(self, *args: Any) -> bool: ...

class PeerRecord:
    """One process's engine as others find it."""

    @property
    def name(self) -> str: ...
    @property
    def generation(self) -> int: ...
    @property
    def group_count(self) -> int: ...
    def address(self, group: int = 0) -> PeerAddress: ...

class PeerEvent:
    """A change among a namespace's peers."""

    @property
    def kind(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def record(self) -> Optional[PeerRecord]: ...

class PeerWatch:
    """A watch of a namespace's peers."""

    def recv(self, timeout: float = 1.0) -> Optional[PeerEvent]: ...

class Namespace:
    """The peers and memory regions of one job in a store."""

    def __init__(self, store: Store, name: str) -> None: ...
    @property
    def name(self) -> str: ...
    @property
    def skipped_records(self) -> int: ...
    def publish_engine(self, session: Session, name: str, engine: TransferEngine) -> None: ...
    def publish_mr(self, session: Session, name: str, mr: str, desc: MrDesc) -> None: ...
    def peer(self, name: str) -> Optional[PeerRecord]: ...
    def peers(self) -> List[PeerRecord]: ...
    def wait_peer(self, name: str, timeout: float = 30.0) -> PeerRecord: ...
    def mr(self, name: str, mr: str) -> Optional[MrDesc]: ...
    def wait_mr(self, name: str, mr: str, timeout: float = 30.0) -> MrDesc: ...
    def watch_peers(self) -> PeerWatch: ...

class KvLayout:
    """The shape of one rank's paged KV cache."""

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        page_len: int,
        num_pages: int,
        tail_len: int = 0,
        tail_slots: int = 0,
        order: str = "heads_before_pages",
    ) -> None: ...
    @property
    def layers(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def page_len(self) -> int: ...
    @property
    def num_pages(self) -> int: ...
    @property
    def tail_len(self) -> int: ...
    @property
    def tail_slots(self) -> int: ...
    @property
    def layer_bytes(self) -> int: ...
    @property
    def kv_bytes(self) -> int: ...
    @property
    def steps(self) -> int: ...

class KvDecoder:
    """The decode side of KvCache transfer."""

    def __init__(
        self,
        engine: TransferEngine,
        layout: KvLayout,
        kv: Any,
        tail: Any = None,
        heartbeat_interval: Optional[float] = None,
        heartbeat_timeout: Optional[float] = None,
    ) -> None: ...
    @property
    def address(self) -> PeerAddress: ...
    @property
    def layout(self) -> KvLayout: ...
    @property
    def pending(self) -> int: ...
    def add_prefiller(self, address: Union[PeerAddress, bytes]) -> int: ...
    def remove_prefiller(self, address: Union[PeerAddress, bytes]) -> None: ...
    def request(self, pages: Sequence[int], prefiller: int, key: bytes, first: int = 0) -> int: ...
    def request_tp(
        self,
        pages: Sequence[int],
        prefillers: Sequence[int],
        key: bytes,
        kv_heads: int,
        prefill_tp: int,
        decode_tp: int,
        decode_rank: int,
        first: int = 0,
        seed: int = 0,
    ) -> int: ...
    def cancel(self, request_id: int) -> bool: ...
    def poll(self) -> Tuple[List[int], List[Tuple[int, str, str]]]: ...
    def wait(self, request_id: int, timeout: Optional[float] = None) -> bool: ...
    def stats(self) -> Dict[str, Any]: ...
    def shutdown(self) -> None: ...
    def __enter__(self) -> "KvDecoder": ...
    def __exit__(self, *args: Any) -> bool: ...

class KvPrefiller:
    """The prefill side of KvCache transfer: serves offered prompts by key."""

    def __init__(
        self,
        engine: TransferEngine,
        layout: KvLayout,
        kv: Any,
        tail: Any = None,
        hold: float = 30.0,
        heartbeat_interval: Optional[float] = None,
        heartbeat_timeout: Optional[float] = None,
    ) -> None: ...
    @property
    def address(self) -> PeerAddress: ...
    @property
    def layout(self) -> KvLayout: ...
    @property
    def pending(self) -> int: ...
    def offer(
        self,
        key: bytes,
        pages: Sequence[int],
        tail_slot: int = 0,
        ready: Optional[int] = None,
        ttl: float = 120.0,
        requests: int = 1,
    ) -> None: ...
    def ready(self, key: bytes, steps: int) -> None: ...
    def withdraw(self, key: bytes) -> bool: ...
    def poll(self) -> Tuple[List[bytes], List[Tuple[bytes, str, str]]]: ...
    def remove_decoder(self, address: Union[PeerAddress, bytes]) -> None: ...
    def stats(self) -> Dict[str, Any]: ...
    def shutdown(self, drain: float = 5.0) -> None: ...
    def __enter__(self) -> "KvPrefiller": ...
    def __exit__(self, *args: Any) -> bool: ...

def tp_readers(kv_heads: int, prefill_tp: int, decode_tp: int, prefill_rank: int, seed: int = 0) -> int:
    """How many decode ranks read one prefill rank under a TP mismatch."""
    ...
