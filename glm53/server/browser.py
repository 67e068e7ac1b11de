"""Browser safety: what a web page the user happens to open must not be able to do to this server.

A key-less server on 127.0.0.1 is reachable by every page the user's browser shows. Three checks stop those
pages, before anything reads the request (a refusal says why, and how to allow what was meant):

- Host (DNS rebinding): a page on attacker.example whose name its owner re-points at 127.0.0.1 talks to this
  server as "its own" site and reads every answer; its requests say `Host: attacker.example`. Served by default
  are only names no outside DNS answers for: localhost and *.localhost (browsers resolve them to loopback
  themselves), any IP address (an address names itself: the page's site would be this server), the name the
  server binds to (GLM53_HOST), and the hosts of GLM53_ALLOWED_ORIGINS. Anything else gets 421.
- Origin (cross-site requests): a browser names the site of the page that sent a request; another site's is
  refused (403) unless GLM53_ALLOWED_ORIGINS lists it. This server's own pages (/docs) are its own site. Clients
  that are not browsers (the SDKs, Claude Code, Codex, curl) send no Origin.
- Content-Type: a page may POST text/plain, a form or a Blob to any address without asking first (no CORS
  preflight); a POST here must be `application/json` (415 otherwise), which a page can send to another site
  only after a preflight that the Origin check refuses.

GLM53_ALLOWED_ORIGINS=* turns the Host and Origin checks off (any site may use the server).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from glm53.server.asgi import drain, send_error
from glm53.server.errors import APIError

ANY = "*"
SETTING = "GLM53_ALLOWED_ORIGINS"
DEFAULT_PORTS = {"http": "80", "https": "443"}


@dataclass(frozen=True)
class BrowserPolicy:
    """Who may reach the server from a browser: origins as browsers write them (scheme://host[:port]), and host
    names served beyond the ones no outside DNS answers for."""

    origins: frozenset[str] = frozenset()
    hosts: frozenset[str] = frozenset()
    any_site: bool = False


def policy_for(origins: Iterable[str], bind_host: str) -> BrowserPolicy:
    """The policy of GLM53_ALLOWED_ORIGINS (normalized by the settings) and GLM53_HOST."""
    listed = frozenset(origins)
    hosts = {host_name(authority_of(o)) for o in listed if "://" in o}
    hosts.add(host_name(bind_host))
    return BrowserPolicy(origins=listed - {ANY}, hosts=frozenset(h for h in hosts if h), any_site=ANY in listed)


def authority_of(origin: str) -> str:
    """'http://box:8000' -> 'box:8000'."""
    return origin.partition("://")[2]


def host_name(authority: str) -> str:
    """The host of a Host header or an origin's authority, lower case, without port, brackets or final dot."""
    value = authority.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value[1:]
    if value.count(":") == 1:
        value = value.partition(":")[0]
    return value.rstrip(".")


def is_local_name(name: str) -> bool:
    """A name no outside DNS can answer for: localhost, *.localhost, or an IP address."""
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def host_refusal(host: str | None, policy: BrowserPolicy) -> APIError | None:
    """421 for a Host the server does not answer to, or None. A request without Host (HTTP/1.0) is no browser's."""
    if not host or policy.any_site:
        return None
    name = host_name(host)
    if is_local_name(name) or name in policy.hosts:
        return None
    example = f"http://{host.strip().lower()}"
    return APIError(421, f"This server does not answer to the name {name!r} (the request's Host header): a web "
                         f"page could reach it under a name its owner points at this machine (DNS rebinding). Use "
                         f"localhost or an IP address, or, if {name!r} is this machine, list the address clients "
                         f"use: {SETTING}={example}.", code="host_not_allowed")


def same_site(origin: str, host: str | None) -> bool:
    """The Origin names the site the request went to (this server's own page, e.g. /docs). Browsers leave the
    scheme's default port out of both."""
    if not host or "://" not in origin:
        return False
    scheme, authority = origin.partition("://")[::2]
    host = host.strip().lower()
    return authority == host or f"{authority}:{DEFAULT_PORTS.get(scheme, '')}" == host


def origin_refusal(origin: str | None, host: str | None, policy: BrowserPolicy) -> APIError | None:
    """403 for a page of another site that GLM53_ALLOWED_ORIGINS does not list, or None."""
    if origin is None or policy.any_site:
        return None
    origin = origin.strip().lower()
    if origin in policy.origins or same_site(origin, host):
        return None
    return APIError(403, f"Requests from web pages of {origin!r} are refused (the request's Origin header): a site "
                         f"the user opens must not use this server. If that page is yours, allow it with "
                         f"{SETTING}={origin} (comma-separated; * allows every site).", code="origin_not_allowed")


def content_type_refusal(method: str, content_type: str | None) -> APIError | None:
    """415 for a POST whose body is not declared JSON (what a page may send anywhere without a preflight)."""
    if method != "POST":
        return None
    media = (content_type or "").partition(";")[0].strip().lower()
    if media == "application/json":
        return None
    got = f"'Content-Type: {content_type}'" if content_type else "no Content-Type"
    return APIError(415, f"The request body must be JSON sent with 'Content-Type: application/json' (this one has "
                         f"{got}). With curl: -H 'Content-Type: application/json', or --json.",
                    code="unsupported_media_type")


def refusal(scope: Scope, policy: BrowserPolicy) -> APIError | None:
    """The first check the request fails (Host, then Origin, then Content-Type), or None."""
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
    host = headers.get("host")
    return (host_refusal(host, policy) or origin_refusal(headers.get("origin"), host, policy)
            or content_type_refusal(scope.get("method", ""), headers.get("content-type")))


class BrowserGuard:
    """Pure ASGI middleware applying `refusal` before the body is read; a refused body is read and dropped (up
    to a bound) so a client that writes its whole request first gets the answer, not a reset."""

    def __init__(self, app: ASGIApp, policy: BrowserPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        err = refusal(scope, self.policy) if scope["type"] == "http" else None
        if err is None:
            await self.app(scope, receive, send)
            return
        await send_error(scope, send, err)
        await drain(receive)
