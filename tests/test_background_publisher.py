"""The background publisher: SGD never waits on publishing, versions stay in order, the final one always goes out."""

import threading

import jax
import numpy as np
import pytest

from actorq_jax.agents.d4pg.config import D4PGConfig
from actorq_jax.agents.registry import get_agent
from actorq_jax.environments import EnvironmentSpec
from actorq_jax.quantization import QuantConfig, from_wire
from actorq_jax.replay import ReplayBatch, ReplayServer, Transition, VariablePublisher, make_variables_table
from actorq_jax.replay.background import BackgroundPublisher


class HeldPublisher(VariablePublisher):
    """A real publisher whose serialization waits on an event (as a slow 2048x3 payload would)."""

    def __init__(self, *args, release: threading.Event, **kwargs):
        super().__init__(*args, **kwargs)
        self.release = release
        self.started = threading.Event()
        self.versions = []

    def publish(self, params, version, meta=None):
        self.started.set()
        assert self.release.wait(60), "the test never released the publisher"
        self.versions.append(version)
        return super().publish(params, version, meta=meta)


def _builder():
    config = D4PGConfig(policy_layers=(8,), critic_layers=(8,), batch_size=4)
    spec = EnvironmentSpec(observation_dim=3, discrete=False, action_dim=1, num_actions=None,
                           action_minimum=np.full(1, -1.0, np.float32), action_maximum=np.full(1, 1.0, np.float32))
    return get_agent("d4pg").make_builder(config, spec)


def _batch(size: int = 4) -> ReplayBatch:
    rng = np.random.default_rng(0)
    data = Transition(rng.normal(size=(size, 3)).astype(np.float32), rng.uniform(-1, 1, (size, 1)).astype(np.float32),
                      np.ones(size, np.float32), np.full(size, 0.9, np.float32), rng.normal(size=(size, 3)).astype(np.float32))
    return ReplayBatch(data, np.arange(size, dtype=np.uint64), np.full(size, 1 / size), np.full(size, size, np.int64))


def _version_on_server(server: ReplayServer, table: str) -> int:
    sample = next(server.client().sample(table, num_samples=1, emit_timesteps=False))
    return from_wire(list(sample.data))[1]


@pytest.mark.process
@pytest.mark.timeout(120)
def test_sgd_steps_complete_while_a_publication_is_held_and_versions_arrive_in_order():
    builder = _builder()
    state = builder.init_state(jax.random.PRNGKey(0))
    batch = _batch()
    release = threading.Event()
    with ReplayServer([make_variables_table("variables"), make_variables_table("eval")]) as server:
        held = HeldPublisher(server.client(), "variables", QuantConfig(bits=8), release=release)
        evaluation = VariablePublisher(server.client(), "eval", QuantConfig(bits=32))
        background = BackgroundPublisher([held, evaluation])
        try:
            background.submit(builder.actor_params(state), 0, evaluation=True)
            assert held.started.wait(30)
            # The first publication is stuck; the learner's loop must go on regardless.
            for step in range(1, 31):
                state, _ = builder.sgd_step(state, batch)
                background.submit(builder.actor_params(state), step, evaluation=step % 10 == 0)
            assert not release.is_set() and int(state.steps) == 30
            release.set()
            assert background.close(timeout_s=60)
        finally:
            release.set()
        totals = background.totals()
        # Version 0 went out, 1..29 were replaced while it was held, 30 (the final one) went out.
        assert held.versions == [0, 30]
        assert totals.published == 2 and totals.dropped == 29 and totals.last_version == 30 and totals.errors == 0
        assert totals.nbytes > 0 and totals.publish_s > 0
        assert _version_on_server(server, "variables") == 30
        assert _version_on_server(server, "eval") == 30  # a dropped evaluation version is carried by the newer one


@pytest.mark.process
@pytest.mark.timeout(60)
def test_versions_must_increase_and_a_closed_publisher_refuses_work():
    with ReplayServer([make_variables_table("variables")]) as server:
        background = BackgroundPublisher([VariablePublisher(server.client(), "variables", QuantConfig(bits=8))])
        params = {"params": {"w": np.ones((4, 4), np.float32)}}
        background.submit(params, 5)
        with pytest.raises(ValueError, match="versions must not go back"):
            background.submit(params, 4)
        assert background.close(timeout_s=30)
        assert _version_on_server(server, "variables") == 5
        with pytest.raises(RuntimeError, match="closed"):
            background.submit(params, 6)
