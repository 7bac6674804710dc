"""Loading weights by Hugging Face Hub id: one place that turns the hub's failures into one line.

`from_pretrained` and `hf_hub_download` fail deep inside diffusers, transformers and huggingface_hub with chained
tracebacks. Inside `hub_errors(repo_id, what)` such a failure becomes a `HubUnavailableError` (a
FileNotFoundError, so `flowrl` prints it as one line) naming the id, why it cannot load and the fix:

- not in the local cache while `HF_HUB_OFFLINE=1`   -> `hf download <id>` with network access, or unset it
- the hub cannot be reached (no network, proxy)     -> check the network, or copy a cache made elsewhere
- a gated repository, not logged in (HTTP 401)      -> accept the license on its page, then `hf auth login`
- a gated repository, license not accepted (403)    -> accept the license on its page with the token's account
- no such repository (404, or 401 for a private one) -> check the id, or log in with an account that can read it
- no such file in the repository, another HTTP error -> the file name; retry later

Works with huggingface_hub 0.x (requests) and 1.x/2.x (httpx): errors are matched by class and, for network
failures, by the class names of the HTTP libraries.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

# network failures of the HTTP stacks under huggingface_hub (requests/urllib3 for 0.x, httpx/httpcore for 1.x+)
_NETWORK_MODULES = ("requests", "urllib3", "httpx", "httpx2", "httpcore", "httpcore2", "socket", "ssl")
_NETWORK_NAMES = ("ConnectionError", "ConnectError", "ConnectTimeout", "NetworkError", "TimeoutException", "Timeout")
# diffusers logs a multi-line warning before it falls back to the cache; the error below says it in one line
_FALLBACK_LOGGERS = ("diffusers.pipelines.pipeline_utils", "diffusers.pipelines.pipeline_loading_utils")
_FALLBACK_PREFIX = "Couldn't connect to the Hub"


class HubUnavailableError(FileNotFoundError):
    """Weights named by a hub id that cannot be loaded; `reason` is one of offline, network, gated, no_repo,
    no_file, http."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def is_hub_id(name: str) -> bool:
    """`org/name` that is not an existing path: what `from_pretrained` looks up on the hub."""
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~")) and not os.path.exists(name)


def _chain(err: BaseException) -> list[BaseException]:
    out, seen = [], set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        out.append(err)
        err = err.__cause__ or err.__context__
    return out


def _is_network(err: BaseException) -> bool:
    if isinstance(err, (ConnectionError, TimeoutError)):
        return True
    return any(
        c.__name__ in _NETWORK_NAMES and c.__module__.split(".")[0] in _NETWORK_MODULES for c in type(err).__mro__
    )


def _status(err: BaseException) -> int | None:
    return getattr(getattr(err, "response", None), "status_code", None)


def _detail(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:100]}" if text else type(err).__name__


def explain(
    err: BaseException, repo_id: str, what: str = "model", filename: str | None = None
) -> tuple[str, str] | None:
    """(reason, one-line message) for a hub failure anywhere in `err`'s chain; None for any other error."""
    from huggingface_hub import constants, errors

    chain = _chain(err)
    found = lambda cls: next((e for e in chain if isinstance(e, cls)), None)  # noqa: E731
    page = f"{constants.ENDPOINT.rstrip('/')}/{repo_id}"
    subject = f"{what} {filename} of {repo_id!r}" if filename else f"{what} {repo_id!r}"
    get = f"`hf download {repo_id}{' ' + filename if filename else ''}`"
    if (e := found(errors.GatedRepoError)) is not None:
        if _status(e) == 401:
            return "gated", (
                f"{subject} is a gated repository and this machine is not logged in to the Hugging Face Hub "
                f"(HTTP 401); accept its license on {page}, then run `hf auth login` (or set HF_TOKEN)"
            )
        return "gated", (
            f"{subject} is a gated repository whose license the account of your token has not accepted "
            f"(HTTP {_status(e) or 403}); accept it on {page} with that account (`hf auth whoami` shows which)"
        )
    if (e := found(errors.RepositoryNotFoundError)) is not None:
        return "no_repo", (
            f"{subject} does not exist on the Hugging Face Hub, or it is private and this machine cannot see it "
            f"(HTTP {_status(e) or 404}); check the id (org/name), or run `hf auth login` with an account that can "
            "read it"
        )
    local = found(errors.LocalEntryNotFoundError)
    if found(errors.OfflineModeIsEnabled) is not None or (constants.HF_HUB_OFFLINE and (local or found(OSError))):
        return "offline", (
            f"{subject} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE=1 forbids "
            f"downloading it; run {get} on a machine with network access (same HF_HOME), or unset HF_HUB_OFFLINE"
        )
    if (e := next((x for x in reversed(chain) if _is_network(x)), None)) is not None:  # the root cause
        return "network", (
            f"{subject} is not in the local Hugging Face cache and {constants.ENDPOINT} cannot be reached "
            f"({_detail(e)}); check the network or proxy (HTTPS_PROXY), or run {get} where there is network and copy "
            f"{constants.HF_HUB_CACHE} here"
        )
    if local is not None:
        return "offline", (
            f"{subject} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and could not be fetched "
            f"({_detail(local)}); run {get} on a machine with network access"
        )
    missing_file = (
        getattr(errors, "RemoteEntryNotFoundError", None) or errors.EntryNotFoundError,
        errors.RevisionNotFoundError,
    )
    if (e := found(missing_file)) is not None:
        return "no_file", (
            f"{subject}: the Hugging Face repository has no such file or revision (HTTP {_status(e) or 404}); "
            f"check the name on {page}, or pass a local path"
        )
    if (e := found(errors.HfHubHTTPError)) is not None:
        return "http", (
            f"{subject}: the Hugging Face Hub answered HTTP {_status(e)} ({_detail(e)}); retry later, "
            f"or check the token's permissions (`hf auth whoami`)"
        )
    return None


@contextlib.contextmanager
def hub_errors(repo_id: str, what: str = "model", filename: str | None = None) -> Iterator[None]:
    """Turn a hub failure inside the block into a one-line HubUnavailableError; any other error passes unchanged."""
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:  # keep diffusers' cache-fallback warning until the outcome is known
        if str(record.msg).startswith(_FALLBACK_PREFIX):
            held.append(record)
            return False
        return True

    loggers = [logging.getLogger(name) for name in _FALLBACK_LOGGERS]
    for logger in loggers:
        logger.addFilter(hold)
    try:
        yield
    except Exception as err:
        found = explain(err, repo_id, what, filename)
        if found is None:
            raise
        raise HubUnavailableError(found[1], found[0]) from None
    finally:
        for logger in loggers:
            logger.removeFilter(hold)
    for record in held:  # loaded from the cache after all: the warning stands
        logging.getLogger(record.name).handle(record)


def download_file(repo_id: str, filename: str, what: str) -> str:
    """`hf_hub_download` (the cached copy, or a download unless HF_HUB_OFFLINE) with one-line errors."""
    from huggingface_hub import hf_hub_download

    with hub_errors(repo_id, what, filename):
        return hf_hub_download(repo_id, filename)
