"""Checkpoints from the Hugging Face hub: a model named `org/name` or `org/name@revision`.

`locate` decides what a model argument names. A path that exists is a local directory and
always wins (so a directory that happens to look like `org/name` is read as it is); otherwise a
hub id, downloaded with huggingface_hub's `snapshot_download` (its progress bars, `HF_TOKEN`,
interrupted files resumed) into a download directory (None: huggingface_hub's cache,
`HF_HUB_CACHE`, under `HF_HOME`), fetching only what serving reads (`ALLOW_PATTERNS`: not the
`.bin`, `.gguf`, `.pt` or ONNX copies, nor sub-folders such as `original/`). Offline
(`HF_HUB_OFFLINE=1`, or the hub unreachable) the cached snapshot is served, and the log says so.
Every failure is a `HubError` (a ValueError) of one line that names the model and what to
change; huggingface_hub's own exceptions never reach the caller."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from engine.model.adapter import ADAPTER_SUBDIR
from engine.model.config import CheckpointError

logger = logging.getLogger(__name__)

# `org/name[@revision]`: each part starts with a letter or digit, as the hub requires, so a
# relative path (`./x/y`, `../x`) or an absolute one is never taken for a hub id.
HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[^\s@]+))?")

# What Canvas reads from a checkpoint: the model and generation configs, the weights (one file
# or shards and their index), the tokenizer and chat template, the image processor's config
# and the checkpoint's own decoder adapter. The BPE vocabulary files serve `canvas convert`'s
# sources, whose tokenizers may come without a tokenizer.json.
ALLOW_PATTERNS = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
    f"{ADAPTER_SUBDIR}/*",
)


def outside_folder(folder: str) -> tuple[str, ...]:
    """fnmatch patterns that match every file inside a sub-folder other than `folder`.
    huggingface_hub filters with fnmatch, whose `*` also matches `/`, so `*.safetensors`
    alone would fetch `original/*.safetensors` too; fnmatch has no negation, so "a first
    path component other than `folder`" is spelt as: it differs from `folder` at some
    character (`adapter` vs `original`, `adapters`), or it is a strict prefix of it (`ad`)."""
    differs = (f"{folder[:i]}[!{c}]*/*" for i, c in enumerate(folder + "/"))
    prefixes = (f"{folder[:i]}/*" for i in range(1, len(folder)))
    return (*differs, *prefixes)


IGNORE_PATTERNS = outside_folder(ADAPTER_SUBDIR)


class HubError(ValueError):
    """A hub id that cannot be served: unknown, gated, a bad revision, neither the hub nor the
    download cache has it, or the download failed. One line naming the model."""


@dataclass(frozen=True, slots=True)
class HubId:
    """A model on the hub: its repository and revision (a branch, tag or commit; None: the
    default branch)."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"


def parse_hub_id(text: str) -> HubId | None:
    """`text` as a hub id (`org/name` or `org/name@revision`, within the hub's own rules for
    names); None when it is not one."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    match = HUB_ID.fullmatch(text)
    if match is None:
        return None
    try:
        validate_repo_id(match["repo"])
    except HFValidationError:
        return None
    return HubId(match["repo"], match["revision"])


def locate(model: str | Path, download_dir: Path | None = None) -> tuple[Path, str]:
    """(directory, name) of the checkpoint `model` names. A path that exists: itself, named
    by its last component. Else a hub id: its snapshot (`download`), named by its repo id
    (without the revision). Anything else: CheckpointError."""
    path = Path(model).expanduser()
    if path.exists():
        return path, Path(os.path.abspath(path)).name  # `--model .` too: the directory's name
    hub = parse_hub_id(str(model))
    if hub is None:
        raise CheckpointError(
            f"{model}: no such directory (config.json not found), and not a hub id "
            "(org/name or org/name@revision)"
        )
    return download(hub, download_dir), hub.repo_id


def download(hub: HubId, download_dir: Path | None = None) -> Path:
    """The directory of `hub`'s snapshot in `download_dir` (None: huggingface_hub's cache):
    fetched from the hub when it answers (files already there are kept, partial ones resumed),
    the cached snapshot when offline. HubError when neither works."""
    import httpx2
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    where = download_dir or Path(constants.HF_HUB_CACHE)
    offline = unreachable(hub)
    if offline is None:
        logger.info("Downloading %s from %s into %s", hub, constants.ENDPOINT, where)
    try:
        snapshot = snapshot_download(
            hub.repo_id,
            revision=hub.revision,
            cache_dir=download_dir,
            allow_patterns=list(ALLOW_PATTERNS),
            ignore_patterns=list(IGNORE_PATTERNS),
            local_files_only=offline is not None,
        )
    except LocalEntryNotFoundError:  # offline, and not (completely) in the cache
        raise HubError(
            f"model {hub}: {offline or 'the hub stopped answering'}, and the download cache "
            f"{where} does not hold it "
            "(complete): start once with the hub reachable (HF_HUB_OFFLINE unset), or point "
            "--download-dir at the cache that holds it"
        ) from None
    except HfHubHTTPError as exc:
        raise hub_error(hub, exc) from None
    except (httpx2.HTTPError, OSError) as exc:  # lost mid-download, after the retries
        raise HubError(
            f"model {hub}: the download into {where} failed ({type(exc).__name__}: "
            f"{first_line(exc)}); start again to resume it"
        ) from exc
    if offline is not None:
        logger.warning("%s: %s; serving the cached snapshot %s", hub, offline, snapshot)
    return Path(snapshot)


def unreachable(hub: HubId) -> str | None:
    """Why the hub cannot be asked for `hub` (offline mode, no connection, the hub down), or
    None when it answered. An answer that the model cannot be had (unknown, gated, no such
    revision, refused) is a HubError: the cache is no way around it."""
    import httpx2
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError

    if constants.is_offline_mode():
        return "offline (HF_HUB_OFFLINE is set)"
    try:
        HfApi().repo_info(hub.repo_id, revision=hub.revision, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except httpx2.TransportError as exc:
        return f"the hub at {constants.ENDPOINT} cannot be reached: {type(exc).__name__}"
    except HfHubHTTPError as exc:
        if exc.response.status_code >= 500:
            return f"the hub at {constants.ENDPOINT} answered {exc.response.status_code}"
        raise hub_error(hub, exc) from None
    return None


def hub_error(hub: HubId, exc: Exception) -> HubError:
    """The HubError for the hub's refusal `exc` (huggingface_hub's, raised from its answer)."""
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, GatedRepoError):
        why = "gated: accept its terms on the hub and set HF_TOKEN to a token of that account"
    elif isinstance(exc, RepositoryNotFoundError):
        why = (
            "no such model on the hub, and no such local directory (a private or gated model "
            "needs HF_TOKEN set to a token that can read it)"
        )
    elif isinstance(exc, RevisionNotFoundError):
        why = f"no revision {hub.revision!r} (a branch, tag or commit of {hub.repo_id})"
    else:
        why = f"the hub refused it ({first_line(exc)}; check HF_TOKEN)"
    return HubError(f"model {hub}: {why}")


def first_line(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
