"""The egress policy, pure: which destinations a session may reach through
its proxy, decided without a socket (supervisor/egress.py)."""

from __future__ import annotations

import ipaddress

import pytest

from hermes_sup.supervisor.config import SETTINGS
from hermes_sup.supervisor.egress import (
    Policy,
    check_rules,
    embedded_ipv4,
    parse_rule,
    parse_target,
)

PUBLIC = "93.184.215.14"


def verdict(policy: Policy, address: str, port: int = 443, host: str = "example.com") -> str:
    v = policy.check_address(host, port, ipaddress.ip_address(address))
    return "allowed" if v.allowed else v.reason


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "127.8.9.10",
        "::1",
        "0.0.0.0",
        "::",
        "10.1.2.3",
        "172.16.0.1",
        "172.31.255.255",
        "192.168.1.1",
        "fd00::1",
        "169.254.169.254",  # a cloud's metadata endpoint
        "fe80::1",
        "100.64.0.1",
        "224.0.0.1",
        "ff02::1",
        "255.255.255.255",
        "::ffff:127.0.0.1",  # IPv4-mapped
        "::ffff:169.254.169.254",
        "::10.0.0.1",  # IPv4-compatible
        "64:ff9b::a9fe:a9fe",  # NAT64 of 169.254.169.254
        "2002:7f00:1::1",  # 6to4 of 127.0.0.1
    ],
)
def test_the_default_denies_what_is_not_the_public_internet(address: str) -> None:
    assert verdict(Policy(), address) != "allowed"


@pytest.mark.parametrize(
    "address", [PUBLIC, "2606:4700::6810:85e5", "172.32.0.1", "::ffff:8.8.8.8"]
)
def test_the_default_allows_the_public_internet(address: str) -> None:
    assert verdict(Policy(), address) == "allowed"


def test_a_name_that_resolves_to_any_denied_address_is_denied() -> None:
    addresses = [ipaddress.ip_address(a) for a in (PUBLIC, "10.0.0.5")]
    v = Policy().check_addresses("rebind.example", 443, addresses)
    assert not v.allowed and v.reason == "private"
    assert not Policy().check_addresses("nothing.example", 443, []).allowed


def test_the_hosts_own_addresses_are_denied() -> None:
    policy = Policy.from_lists("egress", (), (), host_addresses=["203.0.113.7", "fe80::1%eth0"])
    assert verdict(policy, "203.0.113.7") == "host"
    assert verdict(policy, "::ffff:203.0.113.7") == "host"
    assert verdict(policy, "203.0.113.8") == "allowed"


def test_an_allowed_range_opens_a_default_denied_one_and_a_name_does_not() -> None:
    policy = Policy.from_lists("egress", ["127.0.0.1/32:8080", "intranet.example"], [])
    assert verdict(policy, "127.0.0.1", 8080) == "allowed"
    assert verdict(policy, "127.0.0.1", 8081) == "loopback"
    assert verdict(policy, "127.0.0.2", 8080) == "loopback"
    # A name's addresses are whatever its DNS says: no way into private ranges.
    assert verdict(policy, "10.0.0.1", 443, host="intranet.example") == "private"


def test_the_supervisors_own_ports_stay_denied_even_when_allowed() -> None:
    policy = Policy.from_lists("egress", ["127.0.0.0/8"], [], own_ports=[9464])
    assert verdict(policy, "127.0.0.1", 9464) == "supervisor"
    assert verdict(policy, "127.0.0.1", 9465) == "allowed"


def test_a_deny_always_wins() -> None:
    policy = Policy.from_lists(
        "egress", ["*.example.com", "10.0.0.0/8"], ["bad.example.com", "10.9.0.0/16", ":25"]
    )
    assert verdict(policy, PUBLIC, host="good.example.com") == "allowed"
    assert verdict(policy, PUBLIC, host="bad.example.com") == "denied"
    assert verdict(policy, PUBLIC, host="BAD.example.com.") == "denied"
    assert verdict(policy, "10.1.0.1") == "allowed"
    assert verdict(policy, "10.9.0.1") == "denied"
    assert verdict(policy, PUBLIC, 25) == "denied"
    # A name denied is refused before any lookup.
    refused = policy.check_name("bad.example.com", 443)
    assert refused is not None and refused.rule == "bad.example.com"
    assert policy.check_name("good.example.com", 443) is None


def test_the_catch_all_deny_leaves_only_what_is_allowed() -> None:
    policy = Policy.from_lists("egress", ["pypi.org:443", "*.github.com"], ["*"])
    assert verdict(policy, PUBLIC, host="pypi.org") == "allowed"
    assert verdict(policy, PUBLIC, 80, host="pypi.org") == "not_allowed"
    assert verdict(policy, PUBLIC, host="api.github.com") == "allowed"
    assert verdict(policy, PUBLIC, host="github.com") == "not_allowed"  # *. is subdomains
    assert verdict(policy, PUBLIC, host="example.com") == "not_allowed"


def test_network_none_refuses_everything() -> None:
    policy = Policy.from_lists("none", ["*"], [])
    assert verdict(policy, PUBLIC) == "network_none"
    assert policy.check_name("example.com", 443) is not None


def test_ipv4_inside_ipv6_forms_are_judged_as_ipv4() -> None:
    assert str(embedded_ipv4(ipaddress.ip_address("::ffff:1.2.3.4"))) == "1.2.3.4"
    assert str(embedded_ipv4(ipaddress.ip_address("64:ff9b::102:304"))) == "1.2.3.4"
    assert embedded_ipv4(ipaddress.ip_address("::1")) is None
    assert embedded_ipv4(ipaddress.ip_address("1.2.3.4")) is None
    policy = Policy.from_lists("egress", [], ["1.2.3.0/24"])
    assert verdict(policy, "::ffff:1.2.3.4") == "denied"


@pytest.mark.parametrize(
    ("text", "shape"),
    [
        ("example.com", ("example.com", False, None, None)),
        ("*.Example.COM:443", ("example.com", True, None, (443, 443))),
        ("10.0.0.0/8", (None, False, "10.0.0.0/8", None)),
        ("10.0.0.1:5432", (None, False, "10.0.0.1/32", (5432, 5432))),
        ("[fd00::/8]:8000-8100", (None, False, "fd00::/8", (8000, 8100))),
        ("fd00::/8", (None, False, "fd00::/8", None)),
        ("*:443", (None, False, None, (443, 443))),
    ],
)
def test_rules_parse(text: str, shape: tuple[object, ...]) -> None:
    rule = parse_rule(text)
    network = str(rule.network) if rule.network is not None else None
    assert (rule.name, rule.suffix, network, rule.ports) == shape


@pytest.mark.parametrize(
    "text",
    ["", "exa mple.com", "host:0", "host:70000", "host:9-1", "host:http", "[fd00::/8", "a..b"],
)
def test_bad_rules_are_refused_with_their_text(text: str) -> None:
    with pytest.raises(ValueError, match="egress rule"):
        parse_rule(text)


def test_the_settings_check_their_rules() -> None:
    assert check_rules(["example.com", "10.0.0.0/8:22"]) is None
    why = SETTINGS["egress_allow"].check(["ok.example", "no way"])  # type: ignore[misc]
    assert why is not None and "'no way'" in why
    assert SETTINGS["network"].choices == ("egress", "none", "host")
    assert SETTINGS["network"].default == "egress"


@pytest.mark.parametrize(
    ("target", "default", "parsed"),
    [
        ("example.com:443", None, ("example.com", 443)),
        ("Example.com", 80, ("example.com", 80)),
        ("[::1]:8080", None, ("::1", 8080)),
        ("127.0.0.1:3128", None, ("127.0.0.1", 3128)),
    ],
)
def test_targets_parse(target: str, default: int | None, parsed: tuple[str, int]) -> None:
    assert parse_target(target, default) == parsed


@pytest.mark.parametrize("target", ["example.com", "::1:80", "host:0", "ho st:80", "[::1", ":80"])
def test_bad_targets_are_refused(target: str) -> None:
    with pytest.raises(ValueError, match="bad address"):
        parse_target(target)
