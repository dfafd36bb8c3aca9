"""The pure parts of running across nodes: which addresses, per-run keys, per-node CPU plans, custom resources,
bundle placement estimates, paths made absolute, Redis beyond loopback."""

from __future__ import annotations

from pathlib import Path

import pytest

from async_rlhf.buffer.build import client_keys, server_keys
from async_rlhf.config import Config, ConfigError, load_config, make_paths_absolute, parse_custom_resources
from async_rlhf.driver.cpu_plan import plan_nodes
from async_rlhf.driver.placement import assign_to_nodes, format_nodes, plan_placement
from async_rlhf.driver.provision import make_run_keys
from async_rlhf.endpoints import CURVE_ENV, NETWORK_ENV, run_keys_env, use_node_addresses


def test_node_addresses_only_when_the_cluster_has_several_nodes_or_asked() -> None:
    assert not use_node_addresses("auto", 1)
    assert use_node_addresses("auto", 2)
    assert use_node_addresses("node", 1)
    assert not use_node_addresses("loopback", 5)


def test_run_keys_reach_the_buffer_and_its_clients_through_the_environment(monkeypatch) -> None:
    b = Config().buffer
    monkeypatch.delenv(CURVE_ENV, raising=False)
    assert server_keys(b) is None and client_keys(b) is None
    keys = make_run_keys()
    assert len({keys["server_public"], keys["server_secret"], keys["client_public"], keys["client_secret"]}) == 4
    monkeypatch.setenv(CURVE_ENV, run_keys_env(keys)[CURVE_ENV])
    server, client = server_keys(b), client_keys(b)
    assert server.allowed_clients == [keys["client_public"]] and server.secret_key == keys["server_secret"]
    assert client.server_key == server.public_key and client.public_key == keys["client_public"]
    assert keys["server_secret"] not in Config().to_json(), "per-run keys never enter the config"


def test_node_mode_is_read_from_the_environment(monkeypatch) -> None:
    from async_rlhf.endpoints import listen_host, node_mode

    monkeypatch.delenv(NETWORK_ENV, raising=False)
    assert not node_mode() and listen_host() == "127.0.0.1"
    monkeypatch.setenv(NETWORK_ENV, "node")
    assert node_mode()


def test_each_node_is_planned_from_its_own_cores() -> None:
    cfg = load_config(None, ["generators=3", "learners=2"])
    plan = plan_nodes(cfg, {
        "10.0.0.1": {"cores": [0, 1, 2, 3], "generators": [], "learners": [0], "buffer": True},
        "10.0.0.2": {"cores": [8, 9], "generators": [0, 1, 2], "learners": [1]},
    })
    assert set(plan.placements) == {"generator 0", "generator 1", "generator 2", "learner 0", "learner 1", "buffer"}
    assert plan.placements["learner 0"].cores == (0, 1, 2, 3), "alone on its node, a learner takes every core"
    assert set(plan.placements["learner 1"].cores) <= {8, 9}
    assert all(set(plan.placements[f"generator {g}"].cores) <= {8, 9} for g in range(3))
    assert plan.placements["buffer"].cores == (0, 1, 2, 3)


def test_one_node_that_is_not_the_drivers_is_planned_from_its_own_cores() -> None:
    """All roles on one worker node (--address): its core ids, not the driver's, as plan_cpus would place them."""
    from async_rlhf.driver.cpu_plan import plan_cpus

    cfg = load_config(None, ["generators=2", "learners=1"])
    plan = plan_nodes(cfg, {"10.0.0.9": {"cores": [4, 5, 6, 7], "generators": [0, 1], "learners": [0],
                                         "buffer": True}})
    alone = plan_cpus((4, 5, 6, 7), 2, 1)
    assert plan.available == (4, 5, 6, 7)
    assert {n: p.cores for n, p in plan.placements.items()} == {n: p.cores for n, p in alone.placements.items()}


def test_a_core_list_a_node_lacks_is_refused_naming_the_node() -> None:
    cfg = load_config(None, ["generators=1", "learners=1", "learner.cpus=6,7"])
    with pytest.raises(ValueError, match="node 10.0.0.2.*learner.cpus"):
        plan_nodes(cfg, {"10.0.0.2": {"cores": [0, 1], "generators": [0], "learners": [0]}})


def test_custom_resources_are_parsed_and_asked_for_by_every_bundle() -> None:
    assert parse_custom_resources("gen_node:1, fast:0.5", "k") == {"gen_node": 1.0, "fast": 0.5}
    assert parse_custom_resources("", "k") == {}
    for bad in ("CPU:1", "x:0", "x:abc", ":1"):
        with pytest.raises(ConfigError, match="k: entry"):
            parse_custom_resources(bad, "k")
    with pytest.raises(ConfigError, match="resources.generator_custom"):
        load_config(None, ["resources.generator_custom=GPU:1"])
    plan = plan_placement(load_config(None, ["resources.generator_custom=worker:1", "generators=2"]))
    assert all(b["worker"] == 1.0 for b in plan.role("generators").ray_bundles())
    assert plan.role("generators").custom() == {"worker": 1.0}
    assert plan.role("learners").custom() == {}


def test_dry_run_estimates_where_bundles_go() -> None:
    plan = plan_placement(load_config(None, ["generators=2", "learners=2", "resources.placement=spread",
                                             "resources.generator_custom=worker:1"]))
    nodes = {"A": {"CPU": 4.0}, "B": {"CPU": 3.0, "worker": 3.0}}
    where = assign_to_nodes(plan, nodes)
    assert where["generators"] == ["B", "B"], "only B offers the custom resource"
    assert sorted(where["learners"]) == ["A", "B"], "spread over both nodes"
    assert "node B: generator 0, generator 1" in format_nodes(where)
    tight = assign_to_nodes(plan, {"A": {"CPU": 1.0}})
    assert tight["generators"] == ["(no room)", "(no room)"]


def test_paths_are_made_absolute_on_the_driver(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["run.dir=runs/x", "train.ppo.reward_models=rm:0.5,/abs/rm2"])
    make_paths_absolute(cfg)
    assert cfg.run.dir == str(tmp_path / "runs" / "x")
    assert cfg.train.ppo.reward_models == f"{tmp_path / 'rm'}:0.5,/abs/rm2:1"


def test_redis_beyond_loopback_needs_a_password() -> None:
    load_config(None, ["buffer.store=redis", "buffer.redis_url=redis://127.0.0.1:6379/0"])
    load_config(None, ["buffer.store=redis", "buffer.redis_url=redis://:s3cret@10.0.0.5:6379/0"])
    with pytest.raises(ConfigError, match="without a password"):
        load_config(None, ["buffer.store=redis", "buffer.redis_url=redis://10.0.0.5:6379/0"])
    with pytest.raises(ConfigError, match="expected redis://"):
        load_config(None, ["buffer.store=redis", "buffer.redis_url=http://10.0.0.5"])


def test_a_node_is_probed_once_for_all_its_bundles() -> None:
    """On a Ray the driver joined, one probe task per node answers for every bundle there (a task per bundle
    started a worker process per bundle); each bundle still gets a port of its own, and the roles' lists keep
    their bundle order."""
    from async_rlhf.driver.provision import answers_per_bundle, bundles_by_node

    where = {("buffer", 0): "n0", ("generators", 0): "n1", ("generators", 1): "n0", ("learners", 0): "n0",
             ("learners", 1): "n1"}
    groups = bundles_by_node(where)
    assert groups == [[("buffer", 0), ("generators", 1), ("learners", 0)], [("generators", 0), ("learners", 1)]]
    answers = [{"node": "10.0.0.1", "ports": [7001, 7002, 7003]}, {"node": "10.0.0.2", "ports": [8001, 8002]}]
    nodes = answers_per_bundle(groups, answers, [("buffer", 1), ("generators", 2), ("learners", 2)])
    assert [n["node"] for n in nodes["generators"]] == ["10.0.0.2", "10.0.0.1"]
    assert [n["node"] for n in nodes["learners"]] == ["10.0.0.1", "10.0.0.2"]
    ports = [n["port"] for found in nodes.values() for n in found]
    assert sorted(ports) == [7001, 7002, 7003, 8001, 8002], "every bundle a port of its own"
    assert nodes["learners"][0]["port"] == 7003 and nodes["buffer"][0]["port"] == 7001
    assert all("ports" not in n for found in nodes.values() for n in found), "a bundle holds its own port only"
    with pytest.raises(ValueError):  # fewer ports than bundles is an error, not a shared port
        answers_per_bundle(groups, [answers[0], {"node": "10.0.0.2", "ports": [8001]}],
                           [("buffer", 1), ("generators", 2), ("learners", 2)])
    with pytest.raises(ValueError):  # an answer missing for a node is an error, not a silent gap
        answers_per_bundle(groups, answers[:1], [("buffer", 1), ("generators", 2), ("learners", 2)])


def test_free_ports_are_distinct() -> None:
    from async_rlhf.endpoints import LOOPBACK_HOST, free_ports

    ports = free_ports(LOOPBACK_HOST, 5)
    assert len(set(ports)) == 5 and all(p > 0 for p in ports)
