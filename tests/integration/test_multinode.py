"""Two Ray nodes on one machine (head + a second node on loopback ports): the gateway on the head routes
to a worker placed on the second node by a custom resource, as a GB10 + Thor desk cluster would."""
from __future__ import annotations

import json
import urllib.request

import pytest
import ray
from ray.cluster_utils import Cluster

from tests.conftest import PulseProcess

CONFIG = """
model: {name: gemma-3-270m}  # one model (a config naming none serves both bundled ones)
workers:
  backend: loadtest
  count: 1
  resources: {box2: 1}
  loadtest: {tokens: 8}
"""


@pytest.fixture
def two_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1, resources={"box2": 1})
    cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()


def test_gateway_on_head_routes_to_worker_on_second_node(two_nodes, tmp_path):
    srv = PulseProcess(["--ray-address", two_nodes.address], CONFIG, tmp_path).wait_ready()
    try:
        with urllib.request.urlopen(srv.base + "/pulse/workers") as r:
            workers = json.loads(r.read())["workers"]
        body = json.dumps({"model": "gemma-3-270m", "messages": [{"role": "user", "content": "hi"}]}).encode()
        req = urllib.request.Request(srv.base + "/v1/chat/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200
            assert r.headers["x-pulse-worker"] == workers[0]["worker_id"]
            assert json.loads(r.read())["usage"]["completion_tokens"] == 8
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
    ray.init(address=two_nodes.address)
    try:
        box2 = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("box2")]
    finally:
        ray.shutdown()
    assert len(workers) == 1 and workers[0]["stats"]["healthy"]
    assert workers[0]["url"] and box2


def test_worker_node_is_the_second_node(two_nodes, tmp_path):
    srv = PulseProcess(["--ray-address", two_nodes.address], CONFIG, tmp_path).wait_ready()
    try:
        with urllib.request.urlopen(srv.base + "/pulse/workers") as r:
            worker = json.loads(r.read())["workers"][0]
    finally:
        srv.stop()
    ray.init(address=two_nodes.address)
    try:
        nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
    finally:
        ray.shutdown()
    assert nodes[worker["node_id"]]["Resources"].get("box2") == 1
    assert not nodes[worker["node_id"]]["Resources"].get("node:__internal_head__")
