"""Where a session may connect to: the egress policy, pure (no sockets).

Theory of operation
-------------------
A sealed session has a network namespace of its own with only `lo` in it.
The one way out is the supervisor's proxy (supervisor/proxy.py), which
asks this module about every destination before it dials, in two steps:

1. `Policy.check_name(host, port)`, before any lookup: a name or port the
   operator denied, or `network = "none"`, is refused without resolving.
2. `Policy.check_addresses(host, port, addresses)`, after the supervisor
   resolved the name itself: refused if ANY address is refused, so a name
   that resolves to one public and one private address cannot be used to
   reach the private one. The proxy then connects to an address it vetted,
   never to the name again (no window for DNS rebinding).

For one address the order is:

- an operator's deny rule (name, range or port) always wins;
- the supervisor's own ports on the host's own addresses are refused, even
  when allowed (a session must not drive its supervisor);
- a default-denied range (loopback, private, link-local, CGNAT, multicast,
  unspecified and reserved, the host's own addresses, and IPv4 inside IPv6
  forms of these) is opened only by an allow rule naming an address range
  (never a host name: a name is what an attacker's DNS controls);
- anything else, the public internet, is allowed, unless the deny list has
  the catch-all `*`: then only what an allow rule names.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

NETWORK_CHOICES = ("egress", "none", "host")
# The deny list's catch-all: only what the allow list names goes out.
EVERYTHING = "*"

# What no session reaches unless an operator opens it by range. Names say
# why in logs and metrics (a reason label: a handful of values).
DEFAULT_DENIED: tuple[tuple[str, IPNetwork], ...] = tuple(
    (reason, ipaddress.ip_network(cidr))
    for reason, cidr in (
        ("loopback", "127.0.0.0/8"),
        ("loopback", "::1/128"),
        ("unspecified", "0.0.0.0/8"),
        ("unspecified", "::/128"),
        ("private", "10.0.0.0/8"),
        ("private", "172.16.0.0/12"),
        ("private", "192.168.0.0/16"),
        ("private", "fc00::/7"),
        ("link_local", "169.254.0.0/16"),  # cloud metadata endpoints live here
        ("link_local", "fe80::/10"),
        ("cgnat", "100.64.0.0/10"),
        ("multicast", "224.0.0.0/4"),
        ("multicast", "ff00::/8"),
        ("reserved", "240.0.0.0/4"),  # 255.255.255.255 included
        ("reserved", "192.0.0.0/24"),  # IETF protocol assignments
        ("reserved", "198.18.0.0/15"),  # benchmarking; fake-IP DNS uses it
    )
)

# IPv6 forms that carry an IPv4 address a host may route to as IPv4:
# mapped (::ffff:a.b.c.d), compatible (::a.b.c.d), NAT64 (64:ff9b::/96)
# and 6to4 (2002:AABB:CCDD::/48). Each is judged as its IPv4 address too.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_COMPAT = ipaddress.ip_network("::/96")


def embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address stands for, or None."""
    if isinstance(address, ipaddress.IPv4Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in _NAT64 or (address in _COMPAT and int(address) > 1):
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


@dataclass(frozen=True)
class Rule:
    """One entry of an allow or deny list: a host name (`example.com`, or
    `*.example.com` for its subdomains), an address range (`10.1.0.0/16`,
    an address alone is its /32 or /128), or any host (`*`), each with an
    optional port or port range (`:443`, `:8000-8100`)."""

    text: str
    name: str | None = None  # lower-case, without a leading "*."
    suffix: bool = False  # the name's subdomains, not the name itself
    network: IPNetwork | None = None
    ports: tuple[int, int] | None = None  # inclusive; None: every port

    @property
    def any_host(self) -> bool:
        return self.name is None and self.network is None

    def matches_port(self, port: int) -> bool:
        return self.ports is None or self.ports[0] <= port <= self.ports[1]

    def matches_name(self, host: str) -> bool:
        if self.name is None:
            return False
        host = host.lower().rstrip(".")
        if self.suffix:
            return host.endswith("." + self.name)
        return host == self.name

    def matches_address(self, address: IPAddress) -> bool:
        if self.network is None:
            return False
        if address.version == self.network.version and address in self.network:
            return True
        inner = embedded_ipv4(address)
        return inner is not None and self.network.version == 4 and inner in self.network


def parse_rule(text: str) -> Rule:
    """A Rule from its text; ValueError saying what is wrong with it."""
    spec = text.strip()
    if not spec:
        raise ValueError("an empty egress rule")
    host, ports = spec, None
    if spec.startswith("["):  # [v6 range]:port
        close = spec.find("]")
        if close < 0:
            raise ValueError(f"egress rule {text!r}: no closing ']'")
        host, rest = spec[1:close], spec[close + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"egress rule {text!r}: expected ':PORT' after ']'")
            ports = _parse_ports(rest[1:], text)
    elif spec.count(":") == 1:  # a v6 range has more than one
        host, port_text = spec.split(":")
        ports = _parse_ports(port_text, text)
    if host in ("", EVERYTHING):
        return Rule(spec, ports=ports)
    try:
        return Rule(spec, network=ipaddress.ip_network(host, strict=False), ports=ports)
    except ValueError:
        pass
    suffix = host.startswith("*.")
    name = (host[2:] if suffix else host).lower().rstrip(".")
    if not name or not all(_label_ok(label) for label in name.split(".")):
        raise ValueError(
            f"egress rule {text!r}: not a host name (example.com, *.example.com), an "
            "address range (10.0.0.0/8, [fd00::/8]) or '*', with an optional :PORT or "
            ":LOW-HIGH"
        )
    return Rule(spec, name=name, suffix=suffix, ports=ports)


def _label_ok(label: str) -> bool:
    return 0 < len(label) <= 63 and all(c.isalnum() or c in "-_" for c in label)


def _parse_ports(text: str, rule: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    try:
        first, last = int(low), int(high or low)
    except ValueError:
        raise ValueError(f"egress rule {rule!r}: the port must be a number or LOW-HIGH") from None
    if not 1 <= first <= last <= 65535:
        raise ValueError(f"egress rule {rule!r}: ports must be 1-65535, low before high")
    return first, last


def check_rules(rules: Iterable[str]) -> str | None:
    """Why a list of rules cannot be used (for config checks), or None."""
    for text in rules:
        try:
            parse_rule(text)
        except ValueError as exc:
            return str(exc)
    return None


@dataclass(frozen=True)
class Verdict:
    """What the policy says of one destination: allowed or not, why (a
    short label for logs and metrics) and the rule that decided, if any."""

    allowed: bool
    reason: str
    rule: str = ""


ALLOWED = Verdict(True, "public")


@dataclass(frozen=True)
class Policy:
    """The egress policy of a supervisor: its network mode, the operator's
    allow and deny lists, the host's own addresses and the supervisor's own
    ports (those two are learned at start, never configured)."""

    network: str = "egress"
    allow: tuple[Rule, ...] = ()
    deny: tuple[Rule, ...] = ()
    host_addresses: frozenset[IPAddress] = field(default_factory=frozenset)
    own_ports: frozenset[int] = field(default_factory=frozenset)

    @classmethod
    def from_lists(
        cls,
        network: str,
        allow: Iterable[str],
        deny: Iterable[str],
        host_addresses: Iterable[str] = (),
        own_ports: Iterable[int] = (),
    ) -> Policy:
        """A policy from the settings' text; ValueError names a bad rule."""
        if network not in NETWORK_CHOICES:
            raise ValueError(f"network {network!r}: choose one of {', '.join(NETWORK_CHOICES)}")
        addresses = frozenset(ipaddress.ip_address(a.split("%")[0]) for a in host_addresses)
        return cls(
            network,
            tuple(parse_rule(r) for r in allow),
            tuple(parse_rule(r) for r in deny),
            addresses,
            frozenset(own_ports),
        )

    @property
    def closed_by_default(self) -> bool:
        """The deny list's `*`: only what the allow list names goes out."""
        return any(r.any_host and r.ports is None for r in self.deny)

    def check_name(self, host: str, port: int) -> Verdict | None:
        """The verdict that needs no lookup (a refusal), or None: resolve
        `host` and ask `check_addresses`."""
        if self.network == "none":
            return Verdict(False, "network_none")
        if not 0 < port < 65536:
            return Verdict(False, "bad_port")
        for rule in self.deny:
            if rule.any_host and rule.ports is None:
                continue  # the catch-all is a default, not a rule that wins
            if rule.matches_port(port) and (rule.any_host or rule.matches_name(host)):
                return Verdict(False, "denied", rule.text)
        return None

    def check_addresses(self, host: str, port: int, addresses: Iterable[IPAddress]) -> Verdict:
        """One verdict for every address `host` resolved to: the first
        refusal, else the last allowance (no address: refused)."""
        verdict = Verdict(False, "unresolved")
        for address in addresses:
            verdict = self.check_address(host, port, address)
            if not verdict.allowed:
                return verdict
        return verdict

    def check_address(self, host: str, port: int, address: IPAddress) -> Verdict:
        """The verdict for one resolved address of `host` (see the module's
        docstring for the order)."""
        early = self.check_name(host, port)
        if early is not None:
            return early
        for rule in self.deny:
            if rule.matches_port(port) and rule.matches_address(address):
                return Verdict(False, "denied", rule.text)
        special = self.default_denied(address)
        if special is not None and special in ("loopback", "host") and port in self.own_ports:
            return Verdict(False, "supervisor")
        named = self._allowed_by(host, port, address)
        if special is not None:
            # Only an address range opens a default-denied one: a name's
            # addresses are whatever its DNS says.
            if named is not None and named.network is not None:
                return Verdict(True, "allowed", named.text)
            return Verdict(False, special)
        if named is not None:
            return Verdict(True, "allowed", named.text)
        if self.closed_by_default:
            return Verdict(False, "not_allowed", EVERYTHING)
        return ALLOWED

    def _allowed_by(self, host: str, port: int, address: IPAddress) -> Rule | None:
        """The allow rule naming this destination (a range first), or None."""
        found = None
        for rule in self.allow:
            if not rule.matches_port(port):
                continue
            if rule.matches_address(address):
                return rule
            if rule.any_host or rule.matches_name(host):
                found = found or rule
        return found

    def default_denied(self, address: IPAddress) -> str | None:
        """Why `address` is closed unless opened by range, or None."""
        candidates = [a for a in (address, embedded_ipv4(address)) if a is not None]
        for candidate in candidates:
            for reason, network in DEFAULT_DENIED:
                if candidate.version == network.version and candidate in network:
                    return reason
        if any(candidate in self.host_addresses for candidate in candidates):
            return "host"  # a public address of this host's
        return None


def parse_target(target: str, default_port: int | None = None) -> tuple[str, int]:
    """(host, port) of `host:port`, `[v6]:port` or a bare host (with
    `default_port`); ValueError saying what is wrong."""
    if target.startswith("["):
        close = target.find("]")
        if close < 0:
            raise ValueError(f"bad address {target!r}")
        host, rest = target[1:close], target[close + 1 :]
        if rest and not rest.startswith(":"):
            raise ValueError(f"bad address {target!r}")
        port_text = rest[1:]
    else:
        host, sep, port_text = target.rpartition(":")
        if not sep:
            host, port_text = target, ""
        elif ":" in host:
            raise ValueError(f"bad address {target!r}: write an IPv6 address as [addr]:port")
    if not port_text:
        if default_port is None:
            raise ValueError(f"bad address {target!r}: no port")
        return _check_host(host, target), default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"bad address {target!r}: the port must be 1-65535")
    return _check_host(host, target), int(port_text)


def _check_host(host: str, target: str) -> str:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    name = host.lower().rstrip(".")
    if not name or len(name) > 253 or not all(_label_ok(label) for label in name.split(".")):
        raise ValueError(f"bad address {target!r}: not a host name or an IP address")
    return name
