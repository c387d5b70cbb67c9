"""Clearance: which endpoints are hosted, and which records may reach them.

One rule for every transport that sends records over the network: the
``openai`` engine (in a batch worker or in the fallback pool), the fallback
pool itself, and the hosted batch transports (``batch_inference.hosted``),
which call :func:`check_clearance` with ``hosted=True`` in their constructor,
before any claim and before anything is sent.

An endpoint is **hosted** (outside the company) or **internal**:

1. A caller's ``hosted=True`` (``fallback.hosted: true`` for the fallback
   pool, the fallback CLI's ``--hosted``) makes it hosted, and so does
   ``fallback.hosted: true`` for the host of ``fallback.base_url`` whatever
   transport uses it. Nothing a caller passes makes it internal: only the
   spec can declare that.
2. The spec's ``endpoints`` list, matched on the URL's host (exact name or
   address, or ``*.domain`` for any name below ``domain``). The first match
   decides.
3. Otherwise the address decides. An IP literal in loopback (127.0.0.0/8,
   ::1), a private range (RFC 1918: 10/8, 172.16/12, 192.168/16; RFC 4193:
   fc00::/7) or link-local (169.254/16, fe80::/10), also written as an
   IPv4-mapped IPv6 address, is internal; the name ``localhost`` is
   internal. Every other host is hosted: public addresses, and every other
   host name, ``.local``, ``.internal`` and cluster service names included,
   because a name is resolved by whatever DNS the worker sees. The rule never
   resolves a name; declare internal names in the spec.

Records of a class not cleared for hosted APIs (``cleared_for_hosted:
false``) never reach a hosted endpoint: :func:`check_clearance` raises
:class:`NotCleared` with one line, and every caller checks before its first
request, before any claim and before any change of the job's mode.

The host is the URL's host after any user info (``http://10.0.0.1@api.example.com/``
names ``api.example.com``, as every HTTP client reads it). A URL whose host
is ambiguous (a backslash, white space or control characters, a percent
sign in the host, no host, a malformed port, a scheme other than
http/https) is refused for every record class: clients disagree on which
host such a URL names. Messages never show the URL's password.
"""

from __future__ import annotations

import ipaddress
import re
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from batch_inference.breaker import public_url
from batch_inference.exceptions import NotCleared

if TYPE_CHECKING:
    from batch_inference.spec import JobSpec

INTERNAL_NETWORKS = tuple(ipaddress.ip_network(n) for n in (
    "127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16",
    "::1/128", "fc00::/7", "fe80::/10",
))
INTERNAL_NAMES = frozenset({"localhost"})


def _shown(url: str) -> str:
    """The URL for a message: no password (it may be a key), one line."""
    try:
        url = public_url(url)
    except ValueError:   # unparsable: drop everything between the scheme and the last '@'
        url = re.sub(r"//[^/]*@", "//***@", url)
    return repr(url) if not url.isprintable() else url


def endpoint_host(url: str) -> str:
    """The host ``url`` names, lower case, without brackets or a trailing dot; NotCleared if ambiguous."""
    if not isinstance(url, str) or not url.isprintable() or any(c in url for c in " \\"):
        raise NotCleared(f"refused: endpoint URL {_shown(str(url))} holds white space, control characters or a "
                         "backslash")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a malformed port
    except ValueError as exc:
        raise NotCleared(f"refused: endpoint URL {_shown(url)} cannot be parsed ({exc})") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise NotCleared(f"refused: endpoint URL {_shown(url)} must start with http:// or https://")
    if "%" in parts.netloc.rpartition("@")[2]:
        raise NotCleared(f"refused: endpoint URL {_shown(url)} holds a percent sign in its host")
    host = (parts.hostname or "").rstrip(".")
    if not host:
        raise NotCleared(f"refused: endpoint URL {_shown(url)} names no host")
    return host


def _host_or_none(url: str) -> str | None:
    try:
        return endpoint_host(url)
    except NotCleared:
        return None


def _internal_address(host: str) -> bool | None:
    """True/False for an IP literal, None for a host name."""
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return any(addr in net for net in INTERNAL_NETWORKS)


def _declared(spec: "JobSpec", host: str) -> bool | None:
    for decl in spec.endpoints:
        if decl.host == host or (decl.host.startswith("*.") and host.endswith(decl.host[1:])):
            return decl.hosted
    return None


def classify(spec: "JobSpec", url: str | None, hosted: bool | None = None) -> tuple[bool, str]:
    """(hosted, why) for ``url`` under ``spec`` (see the module docstring).

    ``url=None`` (no endpoint chosen yet) is hosted only when ``hosted`` marks it so.
    """
    host = endpoint_host(url) if url is not None else None
    if hosted:
        return True, "marked hosted by the caller or fallback.hosted"
    if host is None:
        return False, "no endpoint given yet"
    if spec.fallback.hosted and spec.fallback.base_url and _host_or_none(spec.fallback.base_url) == host:
        return True, "the host of fallback.base_url, which fallback.hosted marks hosted"
    declared = _declared(spec, host)
    if declared is not None:
        return declared, f"declared {'hosted' if declared else 'internal'} in the spec's endpoints"
    internal = _internal_address(host)
    if internal is None:
        if host in INTERNAL_NAMES:
            return False, "localhost"
        return True, "a host name the spec's endpoints do not declare internal"
    return (not internal), ("a loopback, private or link-local address" if internal else "a public address")


def endpoint_is_hosted(spec: "JobSpec", url: str | None, hosted: bool | None = None) -> bool:
    return classify(spec, url, hosted)[0]


def check_clearance(spec: "JobSpec", url: str | None, *, hosted: bool | None = None, job_version: str | None = None,
                    role: str = "") -> bool:
    """Refuse ``url`` unless ``spec``'s records may go there; returns whether it is hosted.

    ``role`` names the transport in the message ("fallback", ...). Raises
    :class:`NotCleared` (one line) for a hosted endpoint and a record class
    not cleared for hosted APIs, and for an ambiguous URL.
    """
    is_hosted, why = classify(spec, url, hosted)
    if is_hosted and not spec.cleared_for_hosted:
        who = f"job {job_version}" if job_version else "this job"
        raise NotCleared(
            f"refused: {who} holds record class '{spec.record_class}', which is not cleared for hosted APIs "
            f"(cleared_for_hosted: false), and the {role + ' ' if role else ''}endpoint "
            f"{_shown(url) if url else '(none given yet)'} is hosted "
            f"({why}); use an internal endpoint, or declare this one in the spec's endpoints"
        )
    return is_hosted
