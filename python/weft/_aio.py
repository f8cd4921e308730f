"""asyncio glue: weft's callback thread schedules ``_resolve`` on the
awaiting loop with ``loop.call_soon_threadsafe`` (no thread per transfer)."""

from __future__ import annotations

import asyncio
from typing import Optional


def _resolve(fut: "asyncio.Future[None]", exc: Optional[BaseException]) -> None:
    # The awaiting task may have been cancelled meanwhile: the transfer
    # itself goes on, only the wait is gone.
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)
