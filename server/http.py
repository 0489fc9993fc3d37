"""The HTTP server's connection settings: uvicorn over h11 with Canvas' `HttpLimits`.

uvicorn itself bounds the head size (h11's incomplete-event limit) and idle keep-alive
connections, but a client that opens a connection and sends its head slowly (slowloris) is
held forever; `head_deadline_protocol` closes such a connection after `header_timeout_s`. The
body deadline and the size limits that need the request are in `server.edge`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from server.state import HttpLimits


def head_deadline_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request head is not complete within
    `header_timeout_s` of the connection opening or of the head's first byte."""

    class HeadDeadlineH11(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_timer()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:  # part of a head: the clock runs
                self._arm_head_timer()
            else:
                self._cancel_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            super().connection_lost(exc)

        def _arm_head_timer(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(header_timeout_s, self._head_timed_out)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.logger.info("closing a connection that sent no request head in time")
                self.transport.close()

    return HeadDeadlineH11


def uvicorn_config(app: Any, limits: HttpLimits, **options: Any) -> uvicorn.Config:
    """A uvicorn config serving `app` under `limits` (plus any other uvicorn `options`)."""
    return uvicorn.Config(
        app,
        http=head_deadline_protocol(limits.header_timeout_s),
        h11_max_incomplete_event_size=limits.max_header_bytes,
        timeout_keep_alive=limits.keep_alive_timeout_s,
        **options,
    )
