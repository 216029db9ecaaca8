"""The documentation and what ships beside it: the README stays a short
front page whose links land, the references generated while the site builds
cover every command and setting, and the Grafana dashboard and Prometheus
rules in contrib/ ask only for metrics a real supervisor exports."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import socket
import subprocess
import urllib.request
from pathlib import Path
from types import ModuleType

import click

ROOT = Path(__file__).parent.parent
DASHBOARD = ROOT / "contrib" / "grafana" / "hermes-sup.json"
RULES = ROOT / "contrib" / "prometheus" / "hermes-sup.rules.yml"
METRIC = re.compile(r"\b(hermes_sup_[a-z_]+)(\{[^}]*\})?")


def reference_hook() -> ModuleType:
    """docs/hooks/reference.py, the mkdocs hook, loaded as a module."""
    spec = importlib.util.spec_from_file_location(
        "docs_reference", ROOT / "docs/hooks/reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_is_a_short_front_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    first_block = readme.split("```sh\n", 1)[1].split("```", 1)[0].splitlines()
    assert first_block[0].startswith("make run ") and first_block[1].startswith("make test ")
    # A Hermes quick start on the first screen: before line 60.
    head = "\n".join(readme.splitlines()[:60])
    assert "serve --agent hermes" in head and "agent.toml" in head


def test_the_home_page_gets_a_hermes_operator_running() -> None:
    home = (ROOT / "docs" / "index.md").read_text()
    readme = (ROOT / "README.md").read_text()
    # The README's two commands, then Hermes served, then over HTTP.
    for words in ("make run ", "make test ", "--agent-config agent.toml", "hermes-sup send "):
        assert words in home, words
    assert readme.split("```sh\n", 1)[1].split("```")[0] in home
    serve = home.index("serve --agent hermes --agent-config agent.toml --http 127.0.0.1:8642")
    assert home.index("keys http generate") < serve < home.index("/v1/chat/completions")


def test_extras_keep_the_strict_editable_install() -> None:
    # A plain `pip install -e` swaps the link tree `make` installs for a
    # lenient one; every such line in the front pages keeps strict mode.
    for page in ("README.md", "docs/index.md", "docs/install.md", "docs/getting-started.md"):
        for line in (ROOT / page).read_text().splitlines():
            if "pip install -e" in line:
                assert "--config-settings editable_mode=strict" in line, f"{page}: {line}"


def test_the_front_pages_read_as_reference_not_history() -> None:
    history = re.compile(r"\b(no longer|used to|anymore|is now|was fixed)\b", re.IGNORECASE)
    for page in ("README.md", "docs/index.md", "docs/install.md", "docs/getting-started.md"):
        found = history.findall((ROOT / page).read_text())
        assert not found, f"{page}: {found}"


def test_the_readmes_links_into_the_docs_land() -> None:
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if not link.startswith(("http://", "https://"))]
    assert any(link.startswith("docs/") for link in local)
    for link in local:
        assert (ROOT / link).exists(), link


def test_every_docs_page_is_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in (ROOT / "docs").glob("*.md"):
        assert f": {page.name}" in nav, page.name


def test_the_cli_reference_has_every_command_and_option() -> None:
    from hermes_sup.cli.main import cli

    text = reference_hook().cli_reference()
    page = (ROOT / "docs" / "cli.md").read_text()
    assert "\n<!-- reference: cli -->\n" in page

    def visit(command: click.Command, path: str) -> int:
        assert f"`{path}`\n" in text, path
        ctx = click.Context(command, info_name=path)
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden:
                assert param.opts[0] in text, f"{path} {param.opts[0]}"
        seen = 1
        if isinstance(command, click.Group):
            for name in command.list_commands(ctx):
                sub = command.get_command(ctx, name)
                assert sub is not None
                if not sub.hidden:
                    seen += visit(sub, f"{path} {name}")
        return seen

    assert visit(cli, "hermes-sup") > 20


def test_an_include_marker_brings_the_file_in_whole() -> None:
    hook = reference_hook()
    page = hook.on_page_markdown("<!-- include: protocol/PROTOCOL.md -->\n")
    assert page == (ROOT / "protocol" / "PROTOCOL.md").read_text() + "\n"


# ---------------------------------------------------------------- contrib


def used_metrics() -> dict[str, set[str]]:
    """Every hermes_sup_* series the dashboard and the rules ask for, with the
    label names their selectors name."""
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    exprs.append(RULES.read_text())
    used: dict[str, set[str]] = {}
    for expr in exprs:
        for name, selector in METRIC.findall(expr):
            labels = set(re.findall(r"(\w+)\s*[=!]~?", selector))
            used.setdefault(name, set()).update(labels - {"instance", "job"})
    return used


def test_dashboard_and_rules_ask_only_for_exported_metrics(supervisor_factory) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sup = supervisor_factory("--metrics", str(port))
    with sup.client() as client:
        client.run("m1", "pid")
        client.run("m2", "pid")
        client.kill("m2")  # an exit with its reason
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    # Series names as Prometheus stores them: a counter's _total, a
    # histogram's _bucket, _sum and _count; with the label names seen.
    exported: dict[str, set[str]] = {}
    documented = set()  # a histogram by its family's name, as docs name it
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split()
            family = family.removesuffix("_total") if kind == "counter" else family
            documented.add(family)
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
            for suffix in suffixes.get(kind, [""]):
                exported.setdefault(family + suffix, set())
        elif line and not line.startswith("#"):
            name, _, rest = line.partition("{")
            labels = re.findall(r'(\w+)="', rest.split("}")[0]) if rest else []
            exported.setdefault(name.split()[0], set()).update(labels)
    used = used_metrics()
    assert len(used) >= 10
    for name, labels in used.items():
        assert name in exported, f"{name} is not exported"
        assert labels <= exported[name] | {"le"}, f"{name}: {labels - exported[name]}"
    # The operations page's table of metrics names each as it is exported.
    listed = set(METRIC.findall((ROOT / "docs" / "operations.md").read_text()))
    assert len(listed) >= 10
    for name, _ in listed:
        assert name in exported or name in documented, f"docs/operations.md: {name}"
    # Where Prometheus's own rule checker is installed, the rules parse too.
    if shutil.which("promtool"):
        check = subprocess.run(
            ["promtool", "check", "rules", str(RULES)], capture_output=True, text=True
        )
        assert check.returncode == 0, check.stdout + check.stderr
