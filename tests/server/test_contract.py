"""The server's side of the engine contract: it loads no torch, and text streams only append."""

from __future__ import annotations

import subprocess
import sys

import httpx

from server.text import TextStream


def test_importing_the_contract_and_the_server_loads_no_torch():
    code = (
        "import engine.types, engine.params, engine.validation, server.app; import sys; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def decode(ids: list[int]) -> str:
    return bytes(ids).decode(errors="replace")


def test_a_stop_string_split_across_canvases_is_never_sent_in_part():
    text = TextStream(decode, ["de"])
    assert text.add(list(b"abcd")) == "abc"  # "d" might start "de": held back
    assert text.add(list(b"efgh")) == "" and text.stopped and text.text == "abc"


def test_a_held_back_tail_is_sent_when_it_turns_out_not_to_stop():
    text = TextStream(decode, ["dx"])
    assert text.add(list(b"abcd")) == "abc"
    assert text.add(list(b"efgh")) == "defgh"
    assert text.add(list(b"ij"), final=True) == "ij"


def test_the_async_engine_derives_its_limits_from_the_engine(live_server):
    async_engine = live_server.state.engine
    limits, pages = async_engine.limits, async_engine.engine.pages
    assert (limits.max_context_positions, limits.canvas_length) == (8192, 16)
    assert limits.max_inflight == 64 + 1024 and limits.vocab_size > 0
    assert pages.fits_ever(limits.max_fit_positions)
    assert limits.max_fit_positions == 8192 or not pages.fits_ever(limits.max_fit_positions + 1)
    version = httpx.get(f"{live_server.url}/version").json()
    from kernels.native import build

    # auto on the CPU: the native kernels where they build here, and named so
    backend = "native" if build.available() else "twins"
    assert (version["numerics"], version["kernels"]) == ("fast", backend)
