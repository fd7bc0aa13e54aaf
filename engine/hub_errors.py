"""What can go wrong getting a model, each as an exception whose message says what to do, and the
mapping from huggingface_hub's HTTP errors (which carry the Hub's X-Error-Code) to them."""
from __future__ import annotations

from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, OfflineModeIsEnabled,
                                    RepositoryNotFoundError, RevisionNotFoundError)
from huggingface_hub.utils import get_token

try:  # huggingface_hub >= 2 ships its own httpx fork; 1.x uses httpx
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

from .registry import ModelSource, known_names


class HubError(Exception):
    """Any failure a user can act on; the message says what to do."""


class ChecksumMismatch(HubError):
    pass


class DownloadFailed(HubError):
    pass


class ModelNotFound(HubError):
    pass


class AccessDenied(HubError):
    pass


class NotEnoughDisk(HubError):
    pass


class OfflineMissing(HubError):
    pass


class HubUnreachable(HubError):
    pass


def token_in_use(token: str | bool | None) -> str | None:
    if token is False:
        return None
    return token if isinstance(token, str) else get_token()


def explain(e: Exception, src: ModelSource, endpoint: str, token: str | bool | None) -> HubError:
    """huggingface_hub / transport errors -> one message saying what to do."""
    repo, page = src.repo_id, f"{endpoint}/{src.repo_id}"
    logged_in = token_in_use(token) is not None
    login = "run `hf auth login` (or set HF_TOKEN) and try again"
    if isinstance(e, GatedRepoError):
        if logged_in:
            return AccessDenied(f"{repo} is gated and your token has no access yet: open {page}, accept the "
                                f"license there with the account of your token, then try again")
        return AccessDenied(f"{repo} is gated: open {page}, sign in and accept the license, then {login}")
    if isinstance(e, RevisionNotFoundError):
        return ModelNotFound(f"{repo} has no revision {src.revision or 'main'!r}")
    if isinstance(e, RepositoryNotFoundError):
        private = "" if logged_in else f"; if it is private or gated, {login}"
        return ModelNotFound(f"model repo {repo!r} was not found on {endpoint}{private}. "
                             f"Known models: {known_names()}")
    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, HfHubHTTPError) and status in (401, 403):
        return AccessDenied(f"the Hub refused access to {repo} (HTTP {status}): if it is gated, accept the "
                            f"license at {page}; then {login}")
    if isinstance(e, HfHubHTTPError):
        return HubError(f"the Hub answered HTTP {status} for {repo}: {str(e).strip().splitlines()[0]}")
    if isinstance(e, OfflineModeIsEnabled):
        return OfflineMissing(f"offline mode is on (HF_HUB_OFFLINE) and {src.name} is not complete in the cache")
    if isinstance(e, (httpx.TransportError, OSError)):
        return HubUnreachable(f"cannot reach {endpoint} ({type(e).__name__}: {e}); check the network, or run "
                              f"offline from the cache (--offline) after a completed pull")
    return HubError(f"{repo}: {e}")
