"""Vectorized actors (--envs_per_actor K): K environments per actor process, one batched policy call per step.

Each test runs real actors (launch.actor.run_actor, in this process) against a real Reverb
server on a free loopback port that holds a fixed published policy, and reads their items back.
A launched run of two environments per actor (and its restarted actor) is in test_launch.py.
"""

import collections
import dataclasses
import json
import threading

import jax
import numpy as np
import pytest
import reverb
from launch_support import usage_error

from actorq_jax import kernels
from actorq_jax.environments import environment_spec, make_environment
from actorq_jax.launch import actor as actor_module
from actorq_jax.launch import runtime, vector_env
from actorq_jax.launch.config import RunConfig
from actorq_jax.launch.flags import parse_run
from actorq_jax.launch.precision import ActorPrecision, make_param_loader
from actorq_jax.quantization import QuantConfig, quantize
from actorq_jax.replay import (
    ItemLayout,
    ReplayServer,
    Transition,
    VariablePublisher,
    make_variables_table,
    packed_signature,
    transition_signature,
)
from actorq_jax.telemetry import read_csv

SEEDS = (11, 22, 33)
# W8A8 against fakequant at 8 bits: the same weights, differing only by the 8-bit activations (see test_haiku.py).
W8A8_VS_FAKEQUANT_ATOL = 0.05


def _dqn_runs(task: str, tmp_path):
    """A small DQN's config, a run of three one-environment actors, and the same run as one actor with K = 3."""
    from actorq_jax.agents.dqn.config import DQNConfig

    one = RunConfig(agent="dqn", task=task, results_dir=str(tmp_path), seed=0, num_actors=3, actor_bits=32,
                    update_period=1000)
    return DQNConfig(q_layers=(32, 32)), one, dataclasses.replace(one, num_actors=1, envs_per_actor=3)


def _serve(run: RunConfig, agent_config) -> ReplayServer:
    """A learner's server with a FIFO queue as replay (items read back in full) and one published policy."""
    spec = environment_spec(make_environment(run.task, seed=0))
    builder = runtime.make_builder(run.agent, agent_config, spec)
    observation = np.zeros((spec.observation_dim,), np.float32)
    server = ReplayServer([
        reverb.Table.queue(builder.adder_config().table, 100_000,
                           signature=packed_signature(transition_signature(observation, builder.example_action()))),
        make_variables_table(runtime.VARIABLES_TABLE), make_variables_table(runtime.EVAL_VARIABLES_TABLE),
        make_variables_table(runtime.CONFIG_TABLE)])
    client = server.client()
    runtime.publish_config(client, json.dumps({"run": dataclasses.asdict(run), "agent": dataclasses.asdict(agent_config)}))
    params = jax.device_get(builder.actor_network.init(jax.random.PRNGKey(5), observation[None]))
    VariablePublisher(client, runtime.VARIABLES_TABLE, QuantConfig(bits=run.wire_bits)).publish(params, 1)
    return server


def _items(server: ReplayServer) -> collections.Counter:
    """Every item of the queue (emptying it), as a multiset of byte strings."""
    client = server.client()
    count = client.server_info(timeout=5)["replay"].current_size
    samples = client.sample("replay", num_samples=count, emit_timesteps=False, unpack_as_table_signature=True)
    layout = ItemLayout.from_table(client.server_info(timeout=5)["replay"].signature)
    return collections.Counter(
        tuple(np.asarray(layout.unpack(s.data)[f]).tobytes() for f in Transition._fields) for s in samples)


def _act(server, run, agent_config, actor_id, seeds, episodes, log_dir, monkeypatch):
    """Runs one actor with environment seeds `seeds` for `episodes` episodes; its CSV rows and the items it wrote."""
    monkeypatch.setattr(vector_env, "env_seeds", lambda *args: list(seeds))
    code = actor_module.run_actor(run, agent_config, actor_id, server.address, threading.Event(), log_dir,
                                  max_episodes=episodes)
    assert code == 0
    return read_csv(log_dir / f"actor_{actor_id}.csv"), _items(server)


@pytest.mark.process
@pytest.mark.timeout(300)
def test_k3_actor_writes_the_items_of_three_one_environment_actors(tmp_path, monkeypatch):
    # MountainCar episodes are cut at 200 steps (a fresh Q-network never reaches the flag), so all K
    # environments end together and both setups stop at the same point of every environment.
    agent_config, one, vector = _dqn_runs("MountainCar-v0", tmp_path)
    with _serve(one, agent_config) as server:
        singles = collections.Counter()
        for j, seed in enumerate(SEEDS):  # actor j of 3 explores as slot j of 3
            rows, items = _act(server, one, agent_config, j, [seed], 1, tmp_path / f"k1_{j}", monkeypatch)
            assert [r["episode_length"] for r in rows] == [200]
            singles += items
        rows, batched = _act(server, vector, agent_config, 0, SEEDS, 3, tmp_path / "k3", monkeypatch)
    assert sorted(r["env_index"] for r in rows) == [0, 1, 2] and {r["episode_length"] for r in rows} == {200}
    assert rows[-1]["env_steps"] == 600
    assert sum(batched.values()) == 600 and batched == singles


@pytest.mark.process
@pytest.mark.timeout(300)
def test_environments_end_and_restart_their_episodes_on_their_own(tmp_path, monkeypatch):
    agent_config, one, vector = _dqn_runs("CartPole-v1", tmp_path)
    with _serve(one, agent_config) as server:
        rows, batched = _act(server, vector, agent_config, 0, SEEDS, 7, tmp_path / "k3", monkeypatch)
        by_env = {k: [r for r in rows if r["env_index"] == k] for k in range(3)}
        assert all(by_env.values()), by_env  # every environment finished episodes of its own
        assert [r["episode"] for r in rows] == list(range(1, len(rows) + 1))
        for env_rows in by_env.values():
            # Every environment steps at every actor step: its j-th episode ends at actor step
            # (sum of its first j lengths), whatever the others do.
            ends = np.cumsum([r["episode_length"] for r in env_rows])
            assert [r["env_steps"] for r in env_rows] == [3 * int(e) for e in ends]
        assert len({r["episode_length"] for r in rows}) > 1
        for k, seed in enumerate(SEEDS):
            single, items = _act(server, one, agent_config, k, [seed], len(by_env[k]), tmp_path / f"k1_{k}", monkeypatch)
            assert [(r["episode_length"], r["episode_return"]) for r in single] == \
                [(r["episode_length"], r["episode_return"]) for r in by_env[k]]
            # Its finished episodes' items are among the K = 3 actor's (which also wrote unfinished ones).
            assert not items - batched
            batched -= items


@pytest.mark.timeout(120)
@pytest.mark.skipif(not kernels.kernel_available(), reason=f"int8 kernel not built here: {kernels.describe_kernel()}")
def test_k4_int8_actions_match_the_fakequant_reference():
    from actorq_jax.agents.d4pg.config import D4PGConfig

    spec = environment_spec(make_environment("walker_walk", seed=0))
    builder = runtime.make_builder("d4pg", D4PGConfig(policy_layers=(256, 256, 256)), spec)
    act = vector_env.make_vector_act(builder.vector_behaviour_policy(0, 2, 4))
    wire = quantize(jax.device_get(builder.init_actor_params(jax.random.PRNGKey(0))), QuantConfig(bits=8))
    envs = vector_env.VectorEnv("walker_walk", vector_env.env_seeds(0, 0, 0, 4))
    for k in range(4):
        envs.reset(k)
    observations = envs.observations()
    assert observations.shape == (4, spec.observation_dim)
    actions = {backend: np.asarray(act(make_param_loader(ActorPrecision(8, 8, backend=backend))(wire), envs.keys, 3,
                                       observations))
               for backend in ("int8", "fakequant")}
    assert actions["int8"].shape == (4, spec.action_dim)
    np.testing.assert_allclose(actions["int8"], actions["fakequant"], atol=W8A8_VS_FAKEQUANT_ATOL, rtol=0)
    # Rows explore apart: each has its own key and its own noise scale.
    assert len({row.tobytes() for row in actions["fakequant"]}) == 4


def test_environment_seeds_keep_the_one_environment_actor_and_differ_across_environments():
    assert vector_env.env_seeds(7, 2, 1, 1) == [runtime.derive_seed(7, 2, 1)]
    seeds = vector_env.env_seeds(7, 2, 1, 4)
    assert len(set(seeds)) == 4 and seeds != vector_env.env_seeds(7, 3, 1, 4) != vector_env.env_seeds(7, 2, 2, 4)
    with pytest.raises(ValueError, match="envs_per_actor"):
        vector_env.env_seeds(7, 2, 1, 0)


@pytest.mark.parametrize("value", ["0", "-3"])
def test_bad_envs_per_actor_exits_2_naming_the_flag(value, tmp_path, capsys):
    err = usage_error(capsys, lambda: parse_run("d4pg", ["--envs_per_actor", value, "--results_dir", str(tmp_path / "r")]))
    assert "--envs_per_actor" in err, err[-2000:]
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("flags, says", [
    (["--actor_id", "-1"], "--actor_id must be >= 0 (it seeds the actor's environments), got -1"),
    (["--envs_per_actor", "0"], "--envs_per_actor must be >= 1, got 0"),
    (["--server", "127.0.0.1"], "--server: server address must look like 'host:port'"),
    (["--log_dir", __file__], f"--log_dir: {__file__} cannot be created: {__file__} is a file, not a directory"),
])
def test_a_joining_actors_bad_flags_exit_2_before_it_connects(flags, says, capsys):
    assert says in usage_error(capsys, lambda: actor_module.main(["--server", "127.0.0.1:1", *flags]))
