"""API keys and tenants: the key a request carries (read one way, for authentication and for its
tenant alike), checked in constant time, and the tenant it stands for."""

from __future__ import annotations

import hashlib
import hmac
from typing import Mapping

from starlette.requests import Request

from stratum.server.errors import AuthenticationFailed


def api_key_of(headers: Mapping[str, str]) -> str | None:
    """`x-api-key`, else an `Authorization: Bearer` token (the scheme in any case); None when neither is given."""
    key = headers.get("x-api-key")
    auth = headers.get("authorization", "")
    if key is None and auth[:7].lower() == "bearer ":
        key = auth[7:].strip()
    return key or None


def key_digests(keys: tuple[str, ...]) -> tuple[bytes, ...]:
    """What the server keeps of its keys: their SHA-256 digests."""
    return tuple(hashlib.sha256(k.encode()).digest() for k in keys)


def authenticate(request: Request, digests: tuple[bytes, ...]) -> None:
    """Raises AuthenticationFailed (401) unless the request carries one of the keys."""
    key = api_key_of(request.headers)
    if key is None:
        raise AuthenticationFailed("missing API key: send x-api-key or Authorization: Bearer")
    digest = hashlib.sha256(key.encode()).digest()
    ok = False
    for d in digests:  # every digest is compared, so timing does not reveal which one matched
        ok |= hmac.compare_digest(digest, d)
    if not ok:
        raise AuthenticationFailed("invalid API key")


def tenant_of(request: Request, user_id: str | None) -> str:
    """The API key, else metadata.user_id, else the client address; a batch request's is its batch's."""
    batch_tenant = getattr(request.state, "batch_tenant", None)
    if batch_tenant:
        return batch_tenant
    key = api_key_of(request.headers)
    if key:
        return "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]
    if user_id:
        return "user:" + user_id
    return "addr:" + (request.client.host if request.client else "unknown")


def owner_of(request: Request, keyed: bool) -> str:
    """Whose stored objects (Responses API responses) a request may see: its API key's, when the server
    has keys; without keys every client is one trust domain (""), as for the prefix cache."""
    key = api_key_of(request.headers) if keyed else None
    return "key:" + hashlib.sha256(key.encode()).hexdigest() if key else ""
