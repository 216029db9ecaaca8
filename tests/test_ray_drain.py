"""`hermes-sup ray drain NODE`: the node found in the registry is drained
with the router's key the registry holds for it. The registry is stood in
for (its read is the only Ray call); the node is a real supervisor."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from hermes_sup.cli.ray import ray_group
from hermes_sup.client import Client
from hermes_sup.cluster import ray_agents
from hermes_sup.cluster.nodes import spec_from_map

from .test_cli_remote import hs
from .test_clients import free_port

pytestmark = pytest.mark.e2e


def test_ray_drain_drains_a_registered_node_with_its_router_key(
    supervisor_factory, workdir, monkeypatch
) -> None:
    port = free_port()
    config = workdir / "node.toml"
    config.write_text('node = "gpu-a"\n')
    sup = supervisor_factory("--tcp", str(port), "--config", str(config))
    conn = workdir / "router-gpu-a.json"
    made = hs("keys", "generate", "router-gpu-a", "--endpoint", f"127.0.0.1:{port}",
              "-o", str(conn), "--data-dir", str(sup.data_dir))  # fmt: skip
    assert made.returncode == 0, made.stderr
    spec = spec_from_map({"name": "gpu-a", "connection": str(conn)}, "test")
    monkeypatch.setattr(ray_agents, "connect", lambda address: None)
    monkeypatch.setattr(ray_agents, "read_registry", lambda: [spec])
    with Client(sup.state_dir, timeout=30.0) as c:
        assert c.run("held:1", "env HERMES_SESSION_KEY").text == "held:1"

    runner = CliRunner()
    done = runner.invoke(ray_group, ["drain", "--address", "x:1", "gpu-a", "--wait"])
    assert done.exit_code == 0, done.output
    assert "node gpu-a draining" in done.output and "drained: no session left" in done.output
    with Client(sup.state_dir, timeout=30.0) as c:
        assert c.status()["node"]["draining"] is True
    back = runner.invoke(ray_group, ["drain", "--address", "x:1", "gpu-a", "--off"])
    assert back.exit_code == 0 and "taking new sessions again" in back.output

    unknown = runner.invoke(ray_group, ["drain", "--address", "x:1", "gpu-b"])
    assert unknown.exit_code == 1
    assert "no node 'gpu-b' is registered" in unknown.output and "gpu-a" in unknown.output
