"""The SSRF guard for remote image URLs: which addresses the gateway may connect to.

`forbidden_reason(ip)` classifies one address (a pure function, tested over literal IPs of every
class). `FetchPolicy` adds the operator's allowlist (`--image-fetch-allow` hosts and CIDRs) and
resolves a host once, checking every address it resolves to; the fetcher then connects to the
checked address itself, so a DNS answer that changes between check and connect (rebinding)
cannot steer it elsewhere.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from cachekey.errors import ImageFetchError

log = logging.getLogger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

ALLOW_FLAG = "--image-fetch-allow"
METADATA_HOSTS = frozenset({"metadata.google.internal", "metadata.goog", "metadata"})
METADATA_IPS = frozenset(
    ipaddress.ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200")
)

# Checked in order: the first match names the reason. Besides the familiar classes this is the
# whole of IANA's IPv4 and IPv6 Special-Purpose Address Registries (even the entries marked
# globally reachable: anycast relays and AS112 sinks serve no images), plus the deprecated
# site-local fec0::/10.
_CLASSES: tuple[tuple[str, tuple[IPNetwork, ...]], ...] = tuple(
    (name, tuple(ipaddress.ip_network(n) for n in nets))
    for name, nets in (
        ("an unspecified", ("0.0.0.0/8", "::/128")),
        ("a loopback", ("127.0.0.0/8", "::1/128")),
        ("a private", ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7")),
        ("a site-local", ("fec0::/10",)),
        ("a link-local", ("169.254.0.0/16", "fe80::/10")),
        ("a carrier-grade NAT", ("100.64.0.0/10",)),
        ("a multicast", ("224.0.0.0/4", "ff00::/8")),
        (
            "an IPv4/IPv6 translation",  # SIIT (RFC 7915) and local-use NAT64 (RFC 8215)
            ("::ffff:0:0:0/96", "64:ff9b:1::/48"),
        ),
        (
            "a special-purpose",
            (
                "192.0.0.0/24",  # IETF protocol assignments (DS-Lite, NAT64 discovery, ...)
                "192.0.2.0/24",  # documentation
                "192.31.196.0/24",  # AS112
                "192.52.193.0/24",  # AMT
                "192.88.99.0/24",  # 6to4 relay anycast (deprecated)
                "192.175.48.0/24",  # AS112 direct delegation
                "198.18.0.0/15",  # benchmarking
                "198.51.100.0/24",  # documentation
                "203.0.113.0/24",  # documentation
                "100::/64",  # discard-only
                "100:0:0:1::/64",  # dummy prefix
                "2001::/23",  # IETF protocol assignments (Teredo, ORCHID, AMT, ...)
                "2001:db8::/32",  # documentation
                "2620:4f:8000::/48",  # AS112
                "3fff::/20",  # documentation
                "5f00::/16",  # SRv6 SIDs
            ),
        ),
        ("a reserved", ("240.0.0.0/4", "255.255.255.255/32")),
    )
)
# IPv6 unicast on the Internet is 2000::/3; the rest is reserved, special or embeds IPv4.
_GLOBAL_UNICAST_V6 = ipaddress.ip_network("2000::/3")


class ImageFetchRefused(ImageFetchError):
    """The URL is refused by policy (not a network failure): the client must change it."""

    status_code = 400


def not_allowed(host: str) -> ImageFetchRefused:
    """The one refusal a client sees: never the resolved address, nor why it was refused."""
    return ImageFetchRefused(
        f"image URL host {host[:253]!r} is not allowed: this gateway fetches images only from "
        f"public addresses (operators: see {ALLOW_FLAG})"
    )


def _embedded_v4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 form carries (mapped ::ffff:a.b.c.d, 6to4, NAT64), if any."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in _NAT64 or ip in _V4_COMPAT:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_V4_COMPAT = ipaddress.ip_network("::/96")
_TRANSLATED = (ipaddress.ip_network("::ffff:0:0:0/96"), ipaddress.ip_network("64:ff9b:1::/48"))


def _is_metadata(ip: IPAddress) -> bool:
    """A metadata address, also in any IPv6 form that carries it (mapped, SIIT, NAT64, ...)."""
    if ip in METADATA_IPS or _embedded_v4(ip) in METADATA_IPS:
        return True
    if any(ip in net for net in _TRANSLATED):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF) in METADATA_IPS
    return False


def forbidden_reason(ip: IPAddress) -> str | None:
    """Why `ip` may not be fetched from without an allowlist entry, or None for a public one."""
    inner = _embedded_v4(ip)
    if inner is not None and not (isinstance(ip, ipaddress.IPv6Address) and int(ip) <= 1):
        reason = forbidden_reason(inner)
        return f"{reason} (IPv4 {inner} inside IPv6)" if reason else None
    if ip in METADATA_IPS:
        return "a cloud metadata"
    for name, nets in _CLASSES:
        if any(ip in n for n in nets):
            return name
    if ip.version == 6 and ip not in _GLOBAL_UNICAST_V6:
        return "a reserved"
    if not ip.is_global:  # whatever this Python's tables know beyond the registry
        return "a reserved"
    return None


@dataclass(frozen=True, slots=True)
class AllowList:
    """Operator exceptions: exact host names, and address ranges (an IP literal is a /32)."""

    hosts: frozenset[str] = frozenset()
    networks: tuple[IPNetwork, ...] = ()

    @classmethod
    def parse(cls, entries: Iterable[str]) -> AllowList:
        hosts, nets = set(), []
        for raw in entries:
            entry = raw.strip().lower()
            if not entry:
                continue
            try:
                nets.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
            except ValueError:
                if "/" in entry or ":" in entry:
                    raise ValueError(f"{ALLOW_FLAG}: not a host name or CIDR: {raw!r}") from None
                hosts.add(entry.rstrip("."))
        return cls(frozenset(hosts), tuple(nets))

    def allows_host(self, host: str) -> bool:
        return host in self.hosts

    def allows_address(self, ip: IPAddress) -> bool:
        return any(ip.version == n.version and ip in n for n in self.networks)


Resolver = Callable[[str, int], list[str]]


def system_resolve(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class FetchPolicy:
    """Resolves a URL's host once and returns the one address the fetcher may connect to."""

    def __init__(
        self,
        allow: AllowList = AllowList(),
        resolver: Resolver = system_resolve,
        max_resolvers: int = 4,
    ) -> None:
        self.allow = allow
        self._resolver = resolver
        # getaddrinfo has no timeout of its own: it runs here and is waited on with one.
        self._pool = ThreadPoolExecutor(max_resolvers, thread_name_prefix="kvgate-dns")

    def check_address(self, host: str, ip: IPAddress) -> None:
        """Refuses `ip` unless it is public or allowlisted; cloud metadata is never allowed."""
        reason = "a cloud metadata" if _is_metadata(ip) else forbidden_reason(ip)
        if reason is None:
            return
        if reason == "a cloud metadata" or not (
            self.allow.allows_host(host) or self.allow.allows_address(ip)
        ):
            # The operator's log says why; the client learns only that the host is not allowed.
            log.info("image URL host %r refused: %s address %s", host[:253], reason, ip)
            raise not_allowed(host)

    def resolve(self, host: str, port: int, timeout: float) -> IPAddress:
        """The checked address to connect to; refuses if ANY resolved address is forbidden.

        Raises TimeoutError when the lookup outlasts `timeout`.
        """
        host = host.lower().rstrip(".")
        if host in METADATA_HOSTS:
            raise not_allowed(host)
        try:
            literal = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            literal = None
        if literal is not None:
            self.check_address(host, literal)
            return literal
        if timeout <= 0:
            raise TimeoutError(f"no time left to resolve {host}")
        try:
            found = self._pool.submit(self._resolver, host, port).result(timeout=timeout)
        except FutureTimeout:
            raise TimeoutError(f"resolving {host} timed out") from None
        except OSError as e:
            log.info("image URL host %r did not resolve: %s", host[:253], e)
            raise ImageFetchError(
                f"could not fetch the image: its host {host[:253]!r} did not resolve"
            ) from e
        addrs = [ipaddress.ip_address(a.split("%", 1)[0]) for a in found]
        if not addrs:
            raise ImageFetchError(
                f"could not fetch the image: its host {host[:253]!r} did not resolve"
            )
        for ip in addrs:
            self.check_address(host, ip)
        return addrs[0]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
