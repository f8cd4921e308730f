"""Type stubs of the extension module ``weft._weft``."""

from __future__ import annotations

from types import TracebackType
from typing import Any, List, Optional, Type, Union

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

def provider(spec: str, *, nics: int = 1, profile: str = "adversarial", seed: int = 0) -> Backend:
    """Opens the backend named by ``spec`` with ``nics`` NICs per host."""

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
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...

class ImmCounts:
    """How many immediates a submit delivers to its destination."""

    def single_write(self, nbytes: int) -> int: ...
    def paged_writes(self, page_len: int, pages: int) -> int: ...
    @property
    def nics(self) -> int: ...

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

class TransferEngine:
    """A weft transfer engine over one backend."""

    def __init__(
        self,
        provider: Union[str, Backend, None] = None,
        *,
        nics: int = 1,
        profile: str = "adversarial",
        seed: int = 0,
    ) -> None: ...
    @property
    def provider(self) -> str: ...
    def reg_mr(self, obj: Any, *, writable: Optional[bool] = None) -> Registration: ...
    def submit_single_write(
        self,
        nbytes: int,
        src: Registration,
        dst: MrDesc,
        *,
        src_offset: int = 0,
        dst_offset: int = 0,
        imm: Optional[int] = None,
    ) -> Transfer: ...
    def alloc_imm(self) -> int: ...
    def free_imm(self, imm: int) -> None: ...
    def expect_imm_count(self, imm: int, count: int) -> Transfer: ...
    def imm_counts(self, group: int = 0) -> ImmCounts: ...
    def shutdown(self) -> None: ...
    def __enter__(self) -> TransferEngine: ...
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...
