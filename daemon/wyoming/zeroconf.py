"""Zeroconf (mDNS) advertisement of the Wyoming listeners as
`_wyoming._tcp.local.`, the way Home Assistant discovers wyoming-piper and
wyoming-satellite (it then connects and asks `describe`). On by default when
a listener binds a non-loopback address; `[wyoming] zeroconf` switches it."""

from __future__ import annotations

import ipaddress
import logging
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zeroconf import ServiceInfo, Zeroconf

log = logging.getLogger(__name__)

SERVICE_TYPE = "_wyoming._tcp.local."


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: assume it is reachable from the network


def should_advertise(mode: str, host: str) -> bool:
    """`on`: always; `off`: never; `auto`: unless the listener binds loopback only."""
    return mode == "on" or (mode == "auto" and not is_loopback(host))


def advertised_addresses(host: str) -> list[str]:
    """The IPv4 addresses to announce: the bound one, or for 0.0.0.0 / :: every
    non-loopback address of the machine (loopback when there is none)."""
    if host not in ("", "0.0.0.0", "::"):
        try:
            return [str(ipaddress.ip_address(host))]
        except ValueError:
            return sorted({str(info[4][0]) for info in socket.getaddrinfo(host, None, socket.AF_INET)})
    import ifaddr  # a dependency of zeroconf

    found = sorted({
        str(ip.ip) for adapter in ifaddr.get_adapters() for ip in adapter.ips
        if isinstance(ip.ip, str) and not ipaddress.ip_address(ip.ip).is_loopback
    })
    return found or ["127.0.0.1"]


@dataclass(frozen=True)
class Advert:
    name: str  # instance name, e.g. cosyedge-kitchen
    port: int
    addresses: tuple[str, ...]


def service_info(advert: Advert) -> ServiceInfo:
    from zeroconf import ServiceInfo

    return ServiceInfo(
        SERVICE_TYPE,
        f"{advert.name}.{SERVICE_TYPE}",
        addresses=[socket.inet_aton(a) for a in advert.addresses],
        port=advert.port,
        server=f"{socket.gethostname().split('.')[0]}.local.",
    )


class Advertiser:
    """Registers the adverts on start, unregisters them (goodbye packets) on stop."""

    def __init__(self, adverts: list[Advert], interfaces: list[str] | None = None) -> None:
        self.adverts = adverts
        self.interfaces = interfaces
        self._zc: Zeroconf | None = None
        self._infos: list[ServiceInfo] = []

    def start(self) -> None:
        from zeroconf import InterfaceChoice, IPVersion, Zeroconf

        ifaces = self.interfaces or sorted({a for ad in self.adverts for a in ad.addresses})
        if any(a in ("0.0.0.0",) for a in ifaces):
            ifaces = InterfaceChoice.All  # type: ignore[assignment]
        self._zc = Zeroconf(interfaces=ifaces, ip_version=IPVersion.V4Only)
        for advert in self.adverts:
            info = service_info(advert)
            self._zc.register_service(info, allow_name_change=True)
            self._infos.append(info)
            log.info("zeroconf: advertising %s on %s:%d", info.name, ",".join(advert.addresses), advert.port)

    def stop(self) -> None:
        if self._zc is None:
            return
        for info in self._infos:
            try:
                self._zc.unregister_service(info)
            except Exception as exc:  # the network may be gone at shutdown
                log.debug("zeroconf: unregistering %s failed: %s", info.name, exc)
        self._zc.close()
        self._zc = None
        self._infos = []
