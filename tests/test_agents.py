"""The agent contract and registry: a new agent defined here runs through flags, config.json and the builder."""

import dataclasses
import subprocess
import sys
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from launch_support import ENV, ROOT

from actorq_jax.agents.builder import AgentBuilder
from actorq_jax.agents.d4pg.config import D4PGConfig
from actorq_jax.agents.dqn.config import DQNConfig
from actorq_jax.agents.registry import AgentEntry, agent_names, get_agent, register_agent, unregister_agent
from actorq_jax.config import AgentConfig, check_positive, documented
from actorq_jax.environments import environment_spec, make_environment
from actorq_jax.launch import runtime
from actorq_jax.launch.config import RunConfig, config_from_json, save_config
from actorq_jax.launch.flags import build_parser, parse_run
from actorq_jax.networks import QNetwork
from actorq_jax.replay import ReplayBatch, Transition


@dataclasses.dataclass(frozen=True)
class TinyConfig(AgentConfig):
    """A one-network agent: regress Q(o, a) on the n-step reward."""

    layers: Tuple[int, ...] = documented((8,), "hidden sizes")
    learning_rate: float = documented(0.1, "SGD step size")
    greedy: bool = documented(False, "act greedily even while exploring")
    seed_offset: Optional[int] = documented(None, "unused; shows Optional fields parse")
    n_step: int = documented(3, "n of the n-step return")  # a redeclared field: only the default changes
    discount: float = documented(0.9, "gamma")
    batch_size: int = documented(4, "transitions per step")
    samples_per_insert: float = documented(2.0, "replay ratio")
    min_replay_size: int = documented(1, "transitions before learning")
    max_replay_size: int = documented(100, "replay capacity")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self, ("learning_rate",))


class TinyBuilder(AgentBuilder):
    """The contract's minimum: a Q-network trained by plain SGD, greedy with a random tie-break."""

    def __init__(self, config: TinyConfig, spec):
        self.config, self.spec = config, spec
        self.actor_network = QNetwork(num_actions=int(spec.num_actions), layer_sizes=config.layers)
        self._opt = optax.sgd(config.learning_rate)

    def init_state(self, key):
        params = self.actor_network.init(key, jnp.zeros((1, self.spec.observation_dim)))
        return (params, self._opt.init(params))

    def sgd_step(self, state, batch: ReplayBatch):
        params, opt_state = state

        def loss(p):
            q = self.actor_network.apply(p, batch.data.observation)
            chosen = jnp.take_along_axis(q, batch.data.action[:, None].astype(jnp.int32), axis=1)[:, 0]
            return jnp.mean((chosen - batch.data.reward) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = self._opt.update(grads, opt_state)
        return (optax.apply_updates(params, updates), opt_state), {"loss": value}

    def actor_params(self, state):
        return state[0]

    def vector_behaviour_policy(self, actor_id, num_actors, envs_per_actor):
        return lambda params, keys, obs: jnp.argmax(self.actor_network.apply(params, obs), axis=-1).astype(jnp.int32)

    def greedy_policy(self):
        return lambda params, obs: jnp.argmax(self.actor_network.apply(params, obs[None])[0]).astype(jnp.int32)

    def example_action(self):
        return np.zeros((), np.int32)


@pytest.fixture
def tiny_agent():
    entry = register_agent(AgentEntry(name="tiny", config_class=TinyConfig, builder=TinyBuilder,
                                      default_task="CartPole-v1", description="a test agent"))
    yield entry
    unregister_agent("tiny")


def _batch(size: int = 4) -> ReplayBatch:
    rng = np.random.default_rng(0)
    data = Transition(observation=rng.normal(size=(size, 4)).astype(np.float32),
                      action=rng.integers(0, 2, size).astype(np.int32), reward=np.ones(size, np.float32),
                      discount=np.full(size, 0.9, np.float32), next_observation=rng.normal(size=(size, 4)).astype(np.float32))
    return ReplayBatch(data, np.arange(size, dtype=np.uint64), np.full(size, 1 / size), np.full(size, size, np.int64))


@pytest.mark.timeout(120)
def test_a_registered_agent_runs_through_flags_config_json_and_its_builder(tiny_agent, tmp_path):
    assert "tiny" in agent_names()
    run, config = parse_run("tiny", ["--layers", "16,8", "--learning_rate", "0.05", "--greedy", "true",
                                     "--results_dir", str(tmp_path / "r"), "--actor_bits", "4"])
    assert run.agent == "tiny" and run.task == "CartPole-v1"  # the agent's default task
    assert run.actor_bits == 4 and run.num_actors == RunConfig.num_actors
    assert config == TinyConfig(layers=(16, 8), learning_rate=0.05, greedy=True)
    # config.json round trip: what every worker process reads back.
    save_config(tmp_path / "config.json", run, config)
    assert config_from_json((tmp_path / "config.json").read_text()) == (run, config)

    spec = environment_spec(make_environment(run.task, seed=0))
    builder = runtime.make_builder(run.agent, config, spec)
    assert isinstance(builder, TinyBuilder)
    assert builder.adder_config() == ("replay", 3, 0.9)
    assert builder.replay_config().samples_per_insert == 2.0 and not builder.replay_config().prioritized
    assert builder.batch_size == 4
    state = builder.init_state(jax.random.PRNGKey(0))
    batch = _batch()
    _, first = builder.sgd_step(state, batch)
    for _ in range(20):
        state, metrics = builder.sgd_step(state, batch)
    assert float(metrics["loss"]) < float(first["loss"])
    assert builder.priority_update(batch, metrics) is None
    template = builder.params_template()
    assert jax.tree_util.tree_structure(template) == jax.tree_util.tree_structure(builder.actor_params(state))
    action = builder.behaviour_policy(0, 1)(builder.actor_params(state), jax.random.PRNGKey(1), jnp.zeros(4))
    assert action.dtype == jnp.int32 and 0 <= int(action) < 2  # the contract derives it from the vector policy


def test_registered_agent_flags_are_validated_by_its_config(tiny_agent, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_run("tiny", ["--learning_rate", "0", "--results_dir", str(tmp_path / "r")])
    assert exit_info.value.code == 2
    assert "--learning_rate" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_run("tiny", ["--layers", "8,x", "--results_dir", str(tmp_path / "r")])
    assert "--layers" in capsys.readouterr().err


def test_a_builder_missing_part_of_the_contract_cannot_be_built():
    class Incomplete(AgentBuilder):
        def init_state(self, key):
            return ()

    with pytest.raises(TypeError, match="abstract"):
        Incomplete()


def test_registry_names_agents_and_rejects_unknown_or_conflicting_ones():
    assert {"d4pg", "dqn"} <= set(agent_names())
    assert get_agent("d4pg").config_class is D4PGConfig and get_agent("dqn").default_task == "CartPole-v1"
    with pytest.raises(ValueError, match="unknown agent 'sac'.*d4pg"):
        get_agent("sac")
    with pytest.raises(ValueError, match="already registered"):
        register_agent(dataclasses.replace(get_agent("dqn"), default_task="Acrobot-v1"))
    with pytest.raises(ValueError, match="module:Class"):
        AgentEntry(name="x", config_class=TinyConfig, builder="no_colon", default_task="CartPole-v1")
    with pytest.raises(ValueError, match="actions must be one of"):
        AgentEntry(name="x", config_class=TinyConfig, builder=TinyBuilder, default_task="CartPole-v1", actions="box")


@pytest.mark.parametrize("agent, config_class", [("d4pg", D4PGConfig), ("dqn", DQNConfig)])
def test_flag_defaults_are_the_config_defaults(agent, config_class):
    args = vars(build_parser(agent).parse_args([]))
    for field in dataclasses.fields(config_class):
        assert args[field.name] == field.default, field.name
    for field in dataclasses.fields(RunConfig):
        if field.name in ("agent", "resume", "task", "results_dir"):
            continue  # not flags, or defaults the parser fills in (the agent's task, a stamped directory)
        assert args[field.name] == field.default, field.name
    assert args["task"] == get_agent(agent).default_task


@pytest.mark.parametrize(
    "agent, flags, named",
    [
        ("d4pg", ["--discount", "0"], "--discount"),
        ("d4pg", ["--sigma_spread", "3"], "--sigma_spread"),
        ("d4pg", ["--num_atoms", "1"], "--num_atoms"),
        ("d4pg", ["--min_replay_size", "20", "--max_replay_size", "10"], "--min_replay_size"),
        ("dqn", ["--epsilon", "1.5"], "--epsilon"),
        ("dqn", ["--q_layers", "0"], "--q_layers"),
        ("dqn", ["--policy_learning_rate", "1e-3"], "--policy_learning_rate"),  # a D4PG flag
        ("dqn", ["--max_actor_restarts", "-1"], "--max_actor_restarts"),
        ("dqn", ["--port", "70000"], "--port"),
        ("d4pg", ["--actor_hang_s", "0"], "--actor_hang_s"),
        ("dqn", ["--actor_hang_s", "nan"], "--actor_hang_s"),
    ],
)
def test_bad_agent_flags_exit_2_naming_the_flag(agent, flags, named, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_run(agent, [*flags, "--results_dir", str(tmp_path / "r")])
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


def test_configs_validate_as_thoroughly_in_both_agents():
    for config_class, bad in ((D4PGConfig, {"batch_size": 0}), (D4PGConfig, {"critic_layers": ()}),
                              (D4PGConfig, {"policy_learning_rate": -1.0}), (D4PGConfig, {"sigma": -0.1}),
                              (DQNConfig, {"batch_size": 0}), (DQNConfig, {"learning_rate": 0.0}),
                              (DQNConfig, {"huber_delta": -1.0}), (DQNConfig, {"n_step": 1.5})):
        name = next(iter(bad))
        with pytest.raises(ValueError, match=f"{config_class.__name__}.{name}"):
            config_class(**bad)


def test_remote_actor_ids_beyond_the_local_ones_act_as_the_last_actor():
    d4pg = D4PGConfig(sigma=0.3, sigma_spread=1.0)
    dqn = DQNConfig()
    assert d4pg.actor_sigma(100, 4) == d4pg.actor_sigma(3, 4) == pytest.approx(0.45)
    assert d4pg.actor_sigma(0, 4) == pytest.approx(0.15)
    assert dqn.actor_epsilon(100, 4) == dqn.actor_epsilon(3, 4)
    for config in (d4pg, dqn):
        with pytest.raises(ValueError, match="actor_id"):
            (config.actor_sigma if config is d4pg else config.actor_epsilon)(-1, 2)


def test_run_config_rejects_bad_values_naming_the_flag():
    with pytest.raises(ValueError, match="--actor_bits"):
        RunConfig(task="CartPole-v1", results_dir="r", actor_bits=12)
    with pytest.raises(ValueError, match="--task"):
        RunConfig(task="", results_dir="r")
    assert RunConfig(task="CartPole-v1", results_dir="r", comm_bits=16).wire_bits == 16


@pytest.mark.parametrize("agent", ["d4pg", "dqn", "tiny"])
def test_the_learners_jitted_init_gives_the_eager_init_bit_for_bit(agent, request):
    """The learner compiles init_state whole: seeded runs start from the state the eager init gives."""
    if agent == "tiny":
        request.getfixturevalue("tiny_agent")
    entry = get_agent(agent)
    config = entry.config_class()
    spec = environment_spec(make_environment(entry.default_task, seed=0))
    builder = runtime.make_builder(agent, config, spec)
    eager = builder.init_state(jax.random.PRNGKey(11))
    jitted = jax.jit(builder.init_state)(jax.random.PRNGKey(11))
    assert jax.tree_util.tree_structure(jitted) == jax.tree_util.tree_structure(eager)
    for a, b in zip(jax.tree_util.tree_leaves(eager), jax.tree_util.tree_leaves(jitted)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("agent", ["d4pg", "dqn"])
def test_the_params_template_describes_the_actor_parameters_without_values(agent):
    """Actors check payloads against the template: ShapeDtypeStructs of what the actor network's init gives."""
    entry = get_agent(agent)
    builder = runtime.make_builder(agent, entry.config_class(), environment_spec(make_environment(entry.default_task, seed=0)))
    template, params = builder.params_template(), builder.init_actor_params(jax.random.PRNGKey(3))
    assert jax.tree_util.tree_structure(template) == jax.tree_util.tree_structure(params)
    assert all(isinstance(t, jax.ShapeDtypeStruct) for t in jax.tree_util.tree_leaves(template))
    assert ([(t.shape, t.dtype) for t in jax.tree_util.tree_leaves(template)]
            == [(p.shape, p.dtype) for p in jax.tree_util.tree_leaves(params)])
    assert jax.tree_util.tree_structure(builder.actor_params(builder.init_state(jax.random.PRNGKey(0)))) == \
        jax.tree_util.tree_structure(template)


@pytest.mark.parametrize("agent", ["d4pg", "dqn"])
def test_a_vector_policy_acts_for_k_environments_as_k_single_environment_actors(agent):
    """Row k of one batched call equals what a one-environment actor in exploration slot k would do."""
    from actorq_jax.agents.builder import exploration_slots, single_env

    config_class = get_agent(agent).config_class
    config = config_class(**({"policy_layers": (16,), "critic_layers": (16,), "sigma": 0.3, "sigma_spread": 1.0}
                             if agent == "d4pg" else {"q_layers": (16,)}))
    task = "cartpole_balance" if agent == "d4pg" else "CartPole-v1"
    spec = environment_spec(make_environment(task, seed=0))
    builder = runtime.make_builder(agent, config, spec)
    params = builder.actor_params(builder.init_state(jax.random.PRNGKey(0)))
    k, num_actors, actor_id = 3, 2, 1
    observations = np.random.default_rng(0).normal(size=(k, spec.observation_dim)).astype(np.float32)
    keys = jax.random.split(jax.random.PRNGKey(5), k)
    batched = np.asarray(builder.vector_behaviour_policy(actor_id, num_actors, k)(params, keys, observations))
    assert batched.shape[0] == k
    # Env j of actor 1 (of 2, K = 3) explores as actor 3 + j of 6 would.
    assert exploration_slots(actor_id, num_actors, k) == [(3, 6), (4, 6), (5, 6)]
    for row, (slot, slots) in enumerate(exploration_slots(actor_id, num_actors, k)):
        single = single_env(builder.vector_behaviour_policy(slot, slots, 1))
        np.testing.assert_allclose(np.asarray(single(params, keys[row], observations[row])), batched[row],
                                   atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="envs_per_actor"):
        builder.vector_behaviour_policy(0, 1, 0)


class _MutationLog:
    """A Reverb client stand-in that records priority mutations."""

    def __init__(self):
        self.calls = []

    def mutate_priorities(self, table, updates):
        self.calls.append((table, dict(updates)))


def test_priority_feedback_writes_back_raises_the_max_publishes_and_checkpoints_it():
    from actorq_jax.agents.priorities import PriorityFeedback, PriorityUpdate

    def compute(batch, metrics):
        return PriorityUpdate(keys=batch.keys, priorities=np.asarray(metrics["priorities"]))

    feedback, client = PriorityFeedback("replay", compute), _MutationLog()
    assert feedback.meta() == feedback.counters() == {"max_priority": 1.0}
    # A stacked multi-step batch: every step's priorities, later steps last (key 2 keeps 0.5).
    batch = _batch(2)._replace(keys=np.array([[1, 2], [3, 2]], np.uint64))
    feedback.write_back(client, batch, {"priorities": np.array([[3.0, 2.0], [0.25, 0.5]])})
    assert client.calls == [("replay", {1: 3.0, 2: 0.5, 3: 0.25})]
    assert feedback.meta() == {"max_priority": 3.0}
    assert feedback.insertion_priority(feedback.meta()) == 3.0 and feedback.insertion_priority({}) is None
    feedback.write_back(client, batch, {"priorities": np.full((2, 2), 0.1)})
    assert feedback.max_priority == 3.0  # the largest so far, never lowered
    resumed = PriorityFeedback("replay", compute)
    resumed.restore({"learner_steps": 7, **feedback.counters()})
    assert resumed.max_priority == 3.0
    resumed.restore({"learner_steps": 7})  # a checkpoint without it leaves the value as it is
    assert resumed.max_priority == 3.0


def test_only_prioritized_agents_write_back_and_dqn_logs_no_per_item_priorities():
    from actorq_jax.agents.priorities import PriorityFeedback

    d4pg = runtime.make_builder("d4pg", D4PGConfig(policy_layers=(8,), critic_layers=(8,)),
                                environment_spec(make_environment("cartpole_balance", seed=0)))
    dqn = runtime.make_builder("dqn", DQNConfig(q_layers=(8,)), environment_spec(make_environment("CartPole-v1", seed=0)))
    assert d4pg.priority_feedback() is None
    assert isinstance(dqn.priority_feedback(), PriorityFeedback) and dqn.priority_feedback().table == "replay"
    metrics = {"loss": np.array(2.0, np.float32), "priorities": np.arange(4.0)}
    assert dqn.loggable_metrics(metrics) == {"loss": 2.0}
    assert d4pg.loggable_metrics(metrics) == {"loss": 2.0, "priorities": 1.5}


def test_registry_entries_carry_tiny_and_quick_presets_that_parse():
    for name in ("d4pg", "dqn"):
        entry = get_agent(name)
        assert entry.tiny and entry.quick
        run, _ = parse_run(name, [*entry.tiny, "--results_dir", "unused_results"])
        assert run.task == entry.default_task
        parse_run(name, [*entry.quick, "--results_dir", "unused_results"])
    with pytest.raises(ValueError, match="tiny must be a tuple"):
        AgentEntry(name="x", config_class=TinyConfig, builder=TinyBuilder, default_task="CartPole-v1",
                   tiny=["--task", "CartPole-v1"])


def test_modules_named_in_the_environment_register_agents_at_discovery(monkeypatch):
    from actorq_jax.agents import registry

    monkeypatch.setattr(registry, "_DISCOVERED", False)
    monkeypatch.setenv(registry.AGENT_MODULES_ENV, " third_agent ,")  # tests/ is on the path of the test run
    monkeypatch.delitem(sys.modules, "third_agent", raising=False)  # imported afresh, so it registers again
    try:
        assert "third" in agent_names()
        assert get_agent("third").builder == "third_agent:ThirdBuilder"
    finally:
        unregister_agent("third")
    monkeypatch.setattr(registry, "_DISCOVERED", False)
    monkeypatch.setenv(registry.AGENT_MODULES_ENV, "no_such_agent_module")
    with pytest.raises(ImportError, match="ACTORQ_AGENT_MODULES names module 'no_such_agent_module'"):
        agent_names()


ACTING_ONLY = """
import sys
from actorq_jax.agents.registry import get_agent
from actorq_jax.environments import environment_spec, make_environment
for name in ("d4pg", "dqn"):
    entry = get_agent(name)
    builder = entry.make_builder(entry.config_class(), environment_spec(make_environment(entry.default_task, seed=0)))
    builder.vector_behaviour_policy(0, 2, 1), builder.greedy_policy(), builder.item_signature()
print(sorted(m for m in ("rlax", "optax", "distrax") if m in sys.modules))
"""


@pytest.mark.process
@pytest.mark.timeout(120)
def test_building_what_actors_run_imports_no_loss_code():
    # Every actor, evaluator and replay service pays for each import at start-up; rlax and its distributions
    # are the learner's alone.
    out = subprocess.run([sys.executable, "-c", ACTING_ONLY], cwd=ROOT, env=ENV, capture_output=True, text=True,
                         timeout=110)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
