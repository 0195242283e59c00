"""Reverb data plane: n-step adder, rate limiting, priorities, variables across processes, failures.

Every test runs a real Reverb server on a free loopback port.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import threading
import time

import dm_env
import numpy as np
import portpicker
import pytest
import reverb

from actorq_jax.net import PortTaken
from actorq_jax.quantization import QuantConfig, quantize, to_wire
from actorq_jax.replay import (
    ItemLayout,
    NStepAdder,
    ReplayDataset,
    ReplayServer,
    ReplayTableConfig,
    Transition,
    VariableClient,
    VariablePublisher,
    WriteTimeout,
    make_replay_table,
    make_variables_table,
    packed_signature,
    parse_address,
    transition_signature,
    update_priorities,
    wait_for_server,
)
from actorq_jax.replay.server import CheckpointMismatch, checkpoint_table_size, prune_checkpoints
from actorq_jax.replay.variables import insert_wire

OBS_DIM, ACT_DIM = 3, 2
OBS = np.zeros(OBS_DIM, np.float32)
ACT = np.zeros(ACT_DIM, np.float32)
GAMMA = 0.9


# ----------------------------------------------------------------------------- helpers

def random_episode(rng: np.random.Generator, length: int, terminal: bool, discrete: bool = False):
    """(observations o_0..o_T, actions a_0..a_{T-1}, rewards r_1..r_T, env discounts d_1..d_T)."""
    obs = rng.normal(size=(length + 1, OBS_DIM)).astype(np.float32)
    if discrete:
        actions = rng.integers(0, 4, size=length).astype(np.int32)
    else:
        actions = rng.normal(size=(length, ACT_DIM)).astype(np.float32)
    rewards = rng.normal(size=length).astype(np.float32)
    discounts = np.ones(length, np.float32)
    if terminal:
        discounts[-1] = 0.0
    return obs, actions, rewards, discounts


def feed(adder: NStepAdder, episode) -> None:
    """Plays one episode into the adder as dm_env timesteps."""
    obs, actions, rewards, discounts = episode
    length = len(actions)
    adder.add_first(dm_env.restart(obs[0]))
    for t in range(length):
        if t == length - 1:
            step_type = dm_env.StepType.LAST
        else:
            step_type = dm_env.StepType.MID
        adder.add(actions[t], dm_env.TimeStep(step_type, rewards[t], discounts[t], obs[t + 1]))


def brute_force(episode, n: int, gamma: float):
    """Expected transitions of an episode, straight from the convention in Transition's doc."""
    obs, actions, rewards, discounts = episode
    length = len(actions)
    out = []
    for t in range(length):
        m = min(n, length - t)
        reward = sum(gamma ** k * float(rewards[t + k]) for k in range(m))
        discount = gamma ** m * float(np.prod(discounts[t:t + m], dtype=np.float64))
        out.append(Transition(obs[t], actions[t], np.float32(reward), np.float32(discount), obs[t + m]))
    return out


def read_all(address: str, table: str, count: int) -> Transition:
    """All `count` items of a FIFO queue table, in insertion order, stacked."""
    client = reverb.Client(address)
    samples = list(client.sample(table, num_samples=count, emit_timesteps=False,
                                 unpack_as_table_signature=True))
    layout = ItemLayout.from_table(client.server_info(timeout=5)[table].signature, table)
    return Transition(**layout.unpack({c: np.stack([s.data[c] for s in samples]) for c in layout.columns}))


def assert_transitions(batch: Transition, expected) -> None:
    want = Transition(*[np.stack([np.asarray(getattr(e, f)) for e in expected]) for f in Transition._fields])
    np.testing.assert_array_equal(batch.observation, want.observation)
    np.testing.assert_array_equal(batch.action, want.action)
    np.testing.assert_array_equal(batch.next_observation, want.next_observation)
    np.testing.assert_allclose(batch.reward, want.reward, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(batch.discount, want.discount, rtol=1e-6, atol=1e-7)


def queue_server(action_example=ACT, size=10_000) -> ReplayServer:
    """A server with a FIFO queue table 'q' of Transitions, to read items back in order."""
    return ReplayServer([reverb.Table.queue("q", size, signature=packed_signature(transition_signature(OBS, action_example)))])


def table_size(client: reverb.Client, table: str) -> int:
    return client.server_info(timeout=5)[table].current_size


# ----------------------------------------------------------------------------- adder

@pytest.mark.process
@pytest.mark.timeout(120)
@pytest.mark.parametrize("n, chunk_length", [(1, 1), (3, 1), (5, 1), (1, 4), (3, 4), (5, 16)])
def test_adder_matches_brute_force_n_step(n, chunk_length):
    rng = np.random.default_rng(n)
    # Lengths shorter than, equal to and longer than n; terminal and truncated endings.
    shapes = [(1, True), (2, False), (n, True), (n + 1, False), (7, True), (7, False),
              (max(n - 1, 1), False), (12, True)]
    episodes = [random_episode(rng, length, terminal) for length, terminal in shapes]
    expected = [tr for episode in episodes for tr in brute_force(episode, n, GAMMA)]
    with queue_server() as server:
        client = wait_for_server(server.address, 10)
        with NStepAdder(client, "q", n_step=n, discount=GAMMA, chunk_length=chunk_length) as adder:
            for episode in episodes:
                feed(adder, episode)
            assert adder.items_written == len(expected) == sum(length for length, _ in shapes)
            assert adder.episodes == len(episodes)
        assert table_size(client, "q") == len(expected)
        assert_transitions(read_all(server.address, "q", len(expected)), expected)


@pytest.mark.process
@pytest.mark.timeout(60)
def test_adder_terminal_cuts_bootstrap_truncation_keeps_it():
    rng = np.random.default_rng(7)
    terminal = random_episode(rng, 2, terminal=True)
    truncated = random_episode(rng, 2, terminal=False)
    with queue_server() as server:
        client = wait_for_server(server.address, 10)
        with NStepAdder(client, "q", n_step=3, discount=0.5) as adder:
            feed(adder, terminal)
            feed(adder, truncated)
        batch = read_all(server.address, "q", 4)
    # Terminal episode: both steps end in the terminal state -> no bootstrap.
    np.testing.assert_array_equal(batch.discount[:2], [0.0, 0.0])
    # Truncated episode: bootstrap from the last observation with gamma^m.
    np.testing.assert_allclose(batch.discount[2:], [0.25, 0.5])
    np.testing.assert_allclose(batch.reward[0], terminal[2][0] + 0.5 * terminal[2][1], rtol=1e-6)
    np.testing.assert_array_equal(batch.next_observation[3], truncated[0][2])


@pytest.mark.process
@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunk_length", [1, 2, 8])
def test_adder_discrete_actions_and_reset_drops_unfinished_steps(chunk_length):
    rng = np.random.default_rng(3)
    broken = random_episode(rng, 6, terminal=False, discrete=True)
    whole = random_episode(rng, 4, terminal=True, discrete=True)
    n = 3
    with queue_server(action_example=np.int32(0)) as server:
        client = wait_for_server(server.address, 10)
        with NStepAdder(client, "q", n_step=n, discount=GAMMA, chunk_length=chunk_length) as adder:
            obs, actions, rewards, discounts = broken
            adder.add_first(dm_env.restart(obs[0]))
            for t in range(5):  # 5 of 6 steps, then the actor abandons the episode
                adder.add(int(actions[t]), dm_env.transition(rewards[t], obs[t + 1], discounts[t]))
            with pytest.raises(ValueError, match="reset"):
                adder.add_first(dm_env.restart(obs[0]))
            adder.reset()
            feed(adder, whole)
        # Steps 0..2 of the broken episode had their full n-step return; 3 and 4 did not.
        full = brute_force(broken, n, GAMMA)[:3]
        expected = full + brute_force(whole, n, GAMMA)
        batch = read_all(server.address, "q", len(expected))
    assert batch.action.dtype == np.int32 and batch.action.shape == (len(expected),)
    assert_transitions(batch, expected)


@pytest.mark.process
@pytest.mark.timeout(60)
def test_adder_sends_items_a_chunk_at_a_time_and_wait_sends_the_rest():
    rng = np.random.default_rng(11)
    episode = random_episode(rng, 30, terminal=True)
    obs, actions, rewards, discounts = episode
    with queue_server() as server:
        client = wait_for_server(server.address, 10)
        with NStepAdder(client, "q", n_step=1, discount=GAMMA, chunk_length=8, max_in_flight_items=0) as adder:
            adder.add_first(dm_env.restart(obs[0]))

            def step(t):
                last = t == len(actions) - 1
                adder.add(actions[t], (dm_env.termination if last else dm_env.transition)(rewards[t], obs[t + 1]))

            for t in range(7):  # items 0..6 are complete (o_7 arrived) and wait for the eighth
                step(t)
            assert adder.items_written == 0
            step(7)  # o_8 completes item 7: the group of 8 goes out
            assert adder.items_written == 8
            for t in range(8, 11):  # items 8..10 complete, queued for the next group
                step(t)
            assert adder.items_written == 8
            adder.wait()  # sends the queued items too, and waits for all (max_in_flight_items=0)
            assert (adder.items_written, table_size(client, "q")) == (11, 11)
            for t in range(11, len(actions)):
                step(t)
            assert adder.items_written == len(actions)
        assert_transitions(read_all(server.address, "q", len(actions)), brute_force(episode, 1, GAMMA))


@pytest.mark.process
@pytest.mark.timeout(60)
def test_adder_rejects_bad_input_clearly():
    with queue_server() as server:
        client = wait_for_server(server.address, 10)
        with pytest.raises(ValueError, match="n_step"):
            NStepAdder(client, "q", n_step=0, discount=GAMMA)
        with pytest.raises(ValueError, match="chunk_length=0"):
            NStepAdder(client, "q", n_step=1, discount=GAMMA, chunk_length=0)
        with pytest.raises(ValueError, match="'nope' not found"):
            NStepAdder(client, "nope", n_step=1, discount=GAMMA)
        adder = NStepAdder(client, "q", n_step=1, discount=GAMMA)
        with pytest.raises(ValueError, match="before add_first"):
            adder.add(ACT, dm_env.transition(0.0, OBS))
        with pytest.raises(ValueError, match=r"observation has shape \(4,\)"):
            adder.add_first(dm_env.restart(np.zeros(4, np.float32)))
        adder.close()
        # A bad step in the middle of an episode is refused whole: the episode goes on as if it never came.
        obs, actions, rewards, discounts = episode = random_episode(np.random.default_rng(5), 4, terminal=True)
        with NStepAdder(client, "q", n_step=2, discount=GAMMA, chunk_length=1) as adder:
            adder.add_first(dm_env.restart(obs[0]))
            adder.add(actions[0], dm_env.transition(rewards[0], obs[1]))
            with pytest.raises(ValueError, match=r"observation has shape \(4,\)"):
                adder.add(actions[1], dm_env.transition(rewards[1], np.zeros(4, np.float32)))
            with pytest.raises(ValueError, match=r"action has shape \(3,\)"):
                adder.add(np.zeros(3, np.float32), dm_env.transition(rewards[1], obs[2]))
            for t in range(1, 4):
                adder.add(actions[t], (dm_env.termination if t == 3 else dm_env.transition)(rewards[t], obs[t + 1]))
        assert_transitions(read_all(server.address, "q", 4), brute_force(episode, 2, GAMMA))


# ----------------------------------------------------------------------------- tables and dataset

@pytest.mark.process
@pytest.mark.timeout(60)
def test_replay_table_signature_and_uniform_dataset():
    config = ReplayTableConfig(max_size=1000, min_size=5, samples_per_insert=None)
    rng = np.random.default_rng(11)
    episode = random_episode(rng, 20, terminal=True)
    expected = brute_force(episode, 2, GAMMA)
    by_obs = {e.observation.tobytes(): e for e in expected}
    with ReplayServer([make_replay_table(config, OBS, ACT)]) as server:
        client = wait_for_server(server.address, 10)
        with NStepAdder(client, "replay", n_step=2, discount=GAMMA) as adder:
            feed(adder, episode)
        dataset = ReplayDataset(server.address, "replay", batch_size=16, with_info=True)
        batch = next(dataset)
    assert batch.data.observation.shape == (16, OBS_DIM) and batch.data.reward.shape == (16,)
    assert batch.keys.dtype == np.uint64 and batch.probabilities.shape == (16,)
    np.testing.assert_allclose(batch.probabilities, 1.0 / len(expected))
    for i in range(16):  # every sampled item is one of the episode's transitions
        want = by_obs[batch.data.observation[i].tobytes()]
        np.testing.assert_array_equal(batch.data.next_observation[i], want.next_observation)
        np.testing.assert_allclose(batch.data.reward[i], want.reward, rtol=1e-5)


def test_table_config_validates():
    with pytest.raises(ValueError, match="min_size"):
        ReplayTableConfig(max_size=10, min_size=20)
    with pytest.raises(ValueError, match="error_tolerance"):
        ReplayTableConfig(samples_per_insert=8.0, error_tolerance=2.0)
    assert ReplayTableConfig(min_size=1000, samples_per_insert=8.0).effective_error_tolerance == 800.0
    assert ReplayTableConfig(min_size=10, samples_per_insert=8.0).effective_error_tolerance == 8.0


@pytest.mark.process
@pytest.mark.timeout(120)
def test_samples_per_insert_ratio_is_kept():
    spi, min_size, tolerance, inserts = 4.0, 20, 10.0, 300
    config = ReplayTableConfig(max_size=10_000, min_size=min_size, samples_per_insert=spi,
                               error_tolerance=tolerance)
    rng = np.random.default_rng(5)
    with ReplayServer([make_replay_table(config, OBS, ACT)]) as server:
        client = wait_for_server(server.address, 10)

        def actor():
            with NStepAdder(client, "replay", n_step=1, discount=GAMMA, max_in_flight_items=1) as adder:
                while adder.items_written < inserts:
                    feed(adder, random_episode(rng, 10, terminal=True))

        thread = threading.Thread(target=actor)
        thread.start()
        try:
            # The learner samples as fast as it can; a dataset ends once the rate
            # limiter has refused it for a while, so open a new one until the actor is done.
            while True:
                actor_done = not thread.is_alive()
                for _ in ReplayDataset(server.address, "replay", batch_size=4, prefetch=0,
                                       rate_limiter_timeout_ms=1000):
                    pass
                if actor_done:
                    break
        finally:
            thread.join(timeout=60)
        stats = client.server_info(timeout=5)["replay"].rate_limiter_info
    assert stats.insert_stats.completed == inserts
    samples = stats.sample_stats.completed
    # Reverb lets the learner run at most (spi * min_size - tolerance) behind the ratio
    # and `tolerance` ahead of it: samples = spi * inserts - spi * min_size + tolerance.
    assert abs(samples - (spi * inserts - spi * min_size + tolerance)) <= spi
    assert abs(samples / inserts - spi) <= (spi * min_size + tolerance) / inserts


@pytest.mark.process
@pytest.mark.timeout(60)
def test_priorities_written_back_change_sampling():
    config = ReplayTableConfig(max_size=1000, min_size=1, samples_per_insert=None, prioritized=True,
                               priority_exponent=1.0)
    rng = np.random.default_rng(2)
    with ReplayServer([make_replay_table(config, OBS, ACT)]) as server:
        client = wait_for_server(server.address, 10)
        with NStepAdder(client, "replay", n_step=1, discount=GAMMA) as adder:
            feed(adder, random_episode(rng, 10, terminal=True))
        dataset = ReplayDataset(server.address, "replay", batch_size=32, prefetch=0, with_info=True)
        first = next(dataset)
        np.testing.assert_allclose(first.probabilities, 0.1, rtol=1e-5)  # equal priorities
        favourite = int(first.keys[0])
        favourite_obs = first.data.observation[0]
        keys = np.unique(first.keys)
        update_priorities(client, "replay", keys, np.where(keys == favourite, 1000.0, 1e-3))
        with pytest.raises(ValueError, match="finite"):
            update_priorities(client, "replay", keys[:1], [np.nan])
        fresh = ReplayDataset(server.address, "replay", batch_size=64, prefetch=0, with_info=True)
        after = next(fresh)
    hits = after.keys == favourite
    assert hits.mean() > 0.9
    np.testing.assert_array_equal(after.data.observation[hits][0], favourite_obs)
    assert after.probabilities[hits][0] > 0.95


# ----------------------------------------------------------------------------- variables

def small_params(seed: int):
    """A tiny policy tree whose kernels are large enough to be quantized."""
    rng = np.random.default_rng(seed)
    return {"layer_0": {"kernel": rng.normal(size=(8, 160)).astype(np.float32),
                        "bias": rng.normal(size=160).astype(np.float32)},
            "layer_1": {"kernel": rng.normal(size=(160, 16)).astype(np.float32),
                        "bias": rng.normal(size=16).astype(np.float32)}}


INT8 = QuantConfig(bits=8, min_size=256)


def _publisher_main(address: str, advance, done) -> None:
    """Child process: publish version 1, wait for the parent, publish version 2."""
    client = wait_for_server(address, 30)
    publisher = VariablePublisher(client, "variables", INT8)
    publisher.publish(small_params(1), version=1)
    if advance.wait(60):
        publisher.publish(small_params(2), version=2)
    done.wait(60)


def wire_of(params_tree, version: int):
    return to_wire(params_tree, version)


@pytest.mark.process
@pytest.mark.timeout(150)
def test_variables_cross_processes_bit_exact_and_advance():
    ctx = mp.get_context("spawn")
    advance, done = ctx.Event(), ctx.Event()
    with ReplayServer([make_variables_table()]) as server:
        process = ctx.Process(target=_publisher_main, args=(server.address, advance, done), daemon=True)
        process.start()
        client = VariableClient(server.address, update_period=5, like=small_params(0))
        try:
            client.wait_for_first(timeout_s=90)
            assert client.version == 1
            expected = wire_of(quantize(small_params(1), INT8), 1)
            got = wire_of(client.params, client.version)
            assert len(got) == len(expected)
            for a, b in zip(got, expected):
                assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
            advance.set()
            deadline = time.monotonic() + 60
            while client.version != 2 and time.monotonic() < deadline:
                client.update()  # never blocks; refreshes every 5 calls
                time.sleep(0.01)
            assert client.version == 2
            expected = wire_of(quantize(small_params(2), INT8), 2)
            for a, b in zip(wire_of(client.params, 2), expected):
                assert a.tobytes() == b.tobytes()
            timing = client.timings[-1]
            assert timing.version == 2 and timing.pull_s > 0 and timing.deserialize_s > 0
            assert timing.nbytes == sum(a.nbytes for a in expected)
        finally:
            client.stop()
            done.set()
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
                process.join()
    assert process.exitcode == 0


@pytest.mark.process
@pytest.mark.timeout(60)
def test_variable_client_load_fn_and_surfaced_errors():
    calls = []

    def load(qparams):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("device full")
        return qparams

    with ReplayServer([make_variables_table()]) as server:
        publisher = VariablePublisher(wait_for_server(server.address, 10), config=INT8)
        stats = publisher.publish(small_params(1), version=10)
        assert stats.nbytes > 0 and stats.insert_s > 0
        with VariableClient(server.address, update_period=1, load_fn=load) as client:
            client.wait_for_first(timeout_s=20)
            assert client.version == 10 and len(calls) == 1
            assert client.refresh(timeout_s=10)  # same version: no new load
            assert len(calls) == 1 and client.skipped >= 1
            publisher.publish(small_params(2), version=11)
            with pytest.raises(RuntimeError, match="device full"):
                client.refresh(timeout_s=10)
            assert client.version == 10 and client.params is not None  # last good params kept
            publisher.publish(small_params(3), version=12)
            client.refresh(timeout_s=10)
            assert client.version == 12 and client.errors == 1


@pytest.mark.process
@pytest.mark.timeout(30)  # the bound: wait_for_first must return, not hang
def test_wait_for_first_times_out_with_clear_message():
    with ReplayServer([make_variables_table()]) as server:
        with VariableClient(server.address) as client:
            with pytest.raises(TimeoutError, match=f"no variables published on {server.address} "
                                                   "table variables after 1.5 s"):
                client.wait_for_first(timeout_s=1.5)


@pytest.mark.process
@pytest.mark.timeout(30)
def test_wait_for_first_ends_at_a_stop_before_anything_is_published():
    # An actor started beside a learner that is still starting (or never starts) leaves at once when stopped.
    with ReplayServer([make_variables_table()]) as server:
        with VariableClient(server.address) as client:
            stop = threading.Event()
            threading.Timer(0.5, stop.set).start()
            started = time.monotonic()
            assert client.wait_for_first(timeout_s=20, stopped=stop.is_set) is None
            assert 0.4 <= time.monotonic() - started < 5.0
            # Published before any stop: the parameters, as without one.
            VariablePublisher(wait_for_server(server.address, 10), config=INT8).publish(small_params(1), version=1)
            assert client.wait_for_first(timeout_s=20, stopped=threading.Event().is_set) is not None


@pytest.mark.process
@pytest.mark.timeout(60)
def test_update_counts_several_env_steps_at_once():
    with ReplayServer([make_variables_table()]) as server:
        publisher = VariablePublisher(wait_for_server(server.address, 10), config=INT8)
        publisher.publish(small_params(1), version=1)
        with VariableClient(server.address, update_period=10) as client:
            client.wait_for_first(timeout_s=20)
            publisher.publish(small_params(2), version=2)
            client.update(steps=9)  # 9 env steps: no refresh is due
            time.sleep(0.5)
            assert client.version == 1 and client.steps == 9
            client.update(steps=3)  # 12: the count passed 10
            while client.version != 2:
                time.sleep(0.05)
            with pytest.raises(ValueError, match="steps"):
                client.update(steps=0)


@pytest.mark.process
@pytest.mark.timeout(60)
def test_a_bad_payload_restored_from_a_checkpoint_is_not_rejected_twice(tmp_path):
    # A service checkpointed while the bad item was the latest comes back holding it; the client reconnects.
    server = ReplayServer([make_variables_table()], checkpoint_dir=tmp_path)
    port = server.port
    try:
        publisher = VariablePublisher(wait_for_server(server.address, 10), config=INT8)
        publisher.publish(small_params(1), version=5)
        with VariableClient(server.address, update_period=1, raise_errors=False) as client:
            client.wait_for_first(timeout_s=20)
            insert_wire(reverb.Client(server.address), "variables", [np.frombuffer(b"{not json", np.uint8)])
            client.refresh(timeout_s=10)
            assert client.rejected == 1 and client.version == 5
            server.checkpoint("bad")
            server.stop()
            server = ReplayServer([make_variables_table()], port=port, checkpoint_dir=tmp_path, restore="bad")
            client.reconnect()
            client.refresh(timeout_s=10)
            assert client.rejected == 1 and client.errors == 1 and client.version == 5
            VariablePublisher(wait_for_server(server.address, 10), config=INT8).publish(small_params(2), version=6)
            client.refresh(timeout_s=10)
            assert client.version == 6 and client.rejected == 1
    finally:
        server.stop()


@pytest.mark.process
@pytest.mark.timeout(60)
def test_bad_payload_is_rejected_once_and_last_params_kept():
    with ReplayServer([make_variables_table()]) as server:
        publisher = VariablePublisher(wait_for_server(server.address, 10), config=INT8)
        publisher.publish(small_params(1), version=5, meta={"max_priority": 3.0})
        like = quantize(small_params(0), INT8)
        with VariableClient(server.address, update_period=1, like=like, raise_errors=False) as client:
            client.wait_for_first(timeout_s=20)
            assert client.version == 5 and client.meta == {"max_priority": 3.0}
            # A stray client writes a payload for another network, then garbage.
            stray = reverb.Client(server.address)
            insert_wire(stray, "variables", to_wire(quantize({"w": np.ones((4, 4), np.float32)}, INT8), 6))
            for _ in range(3):
                client.refresh(timeout_s=10)  # the same bad item is not pulled again
            assert client.rejected == 1 and client.version == 5 and client.params is not None
            insert_wire(stray, "variables", [np.frombuffer(b"{not json", np.uint8)])
            client.refresh(timeout_s=10)
            assert client.rejected == 2 and client.version == 5
            # After a service pause the client reconnects; the bad item, still the latest, is not rejected again.
            client.reconnect()
            client.refresh(timeout_s=10)
            assert client.rejected == 2 and client.errors == 2 and client.version == 5
            publisher.publish(small_params(3), version=7)
            client.refresh(timeout_s=10)
            assert client.version == 7 and client.rejected == 2


@pytest.mark.process
@pytest.mark.timeout(60)
def test_adder_writes_time_out_when_the_server_is_gone():
    config = ReplayTableConfig(max_size=1000, min_size=1, samples_per_insert=None)
    server = ReplayServer([make_replay_table(config, OBS, ACT)])
    client = wait_for_server(server.address, 10)
    adder = NStepAdder(client, "replay", n_step=1, discount=GAMMA, max_in_flight_items=0, timeout_s=1.0)
    episode = random_episode(np.random.default_rng(0), 5, terminal=True)
    feed(adder, episode)
    server.stop()
    with pytest.raises(WriteTimeout):
        feed(adder, episode)  # the timeout bounds the wait for the server's confirmation
    with pytest.raises(WriteTimeout):
        adder.close()


@pytest.mark.process
@pytest.mark.timeout(60)
def test_new_items_enter_at_the_priority_set_on_the_adder():
    config = ReplayTableConfig(max_size=1000, min_size=1, samples_per_insert=None, prioritized=True)
    with ReplayServer([make_replay_table(config, OBS, ACT)]) as server:
        client = wait_for_server(server.address, 10)
        with NStepAdder(client, "replay", n_step=1, discount=GAMMA, timeout_s=10) as adder:
            adder.priority = 7.5
            feed(adder, random_episode(np.random.default_rng(1), 4, terminal=True))
        samples = list(client.sample("replay", num_samples=8, emit_timesteps=False))
        assert {s.info.priority for s in samples} == {7.5}


@pytest.mark.process
@pytest.mark.timeout(120)
def test_replay_checkpoint_restores_the_table(tmp_path):
    config = ReplayTableConfig(max_size=1000, min_size=1, samples_per_insert=None, prioritized=True)
    rng = np.random.default_rng(3)
    with ReplayServer([make_replay_table(config, OBS, ACT)], checkpoint_dir=tmp_path) as server:
        client = wait_for_server(server.address, 10)
        with NStepAdder(client, "replay", n_step=2, discount=GAMMA, timeout_s=10) as adder:
            feed(adder, random_episode(rng, 40, terminal=True))
            assert server.checkpoint("first") == "first"
            feed(adder, random_episode(rng, 10, terminal=True))
            server.checkpoint("second")
        port = server.port
    assert checkpoint_table_size(tmp_path, "first", "replay") == 40
    assert checkpoint_table_size(tmp_path, "second", "replay") == 50
    # Restored on the same port, from the older checkpoint: exactly what it held.
    with ReplayServer([make_replay_table(config, OBS, ACT)], port=port, checkpoint_dir=tmp_path,
                      restore="first") as server:
        client = wait_for_server(server.address, 10)
        info = client.server_info(timeout=5)["replay"]
        assert info.current_size == 40 and info.rate_limiter_info.insert_stats.completed == 40
        batch = next(ReplayDataset(server.address, "replay", batch_size=8, prefetch=0))
        assert batch.observation.shape == (8, OBS_DIM)
        prune_checkpoints(tmp_path, ["first"])
        assert not (tmp_path / "second").exists() and (tmp_path / "first").exists()
    with ReplayServer([make_replay_table(config, OBS, ACT)], checkpoint_dir=tmp_path) as server:
        assert wait_for_server(server.address, 10).server_info(timeout=5)["replay"].current_size == 0
    with pytest.raises(FileNotFoundError, match="missing"):
        ReplayServer([make_replay_table(config, OBS, ACT)], checkpoint_dir=tmp_path, restore="missing")


@pytest.mark.process
@pytest.mark.timeout(120)
def test_the_server_reaches_itself_over_the_loopback_whatever_host_it_advertises(tmp_path):
    # Other machines' way in may not lead back here (a NAT's public address, a name only the cluster resolves).
    config = ReplayTableConfig(max_size=100, min_size=1, samples_per_insert=None)
    with ReplayServer([make_replay_table(config, OBS, ACT)], advertised_host="replay-host.example",
                      checkpoint_dir=tmp_path) as server:
        assert server.address == f"replay-host.example:{server.port}"
        client = server.client()
        # Checked before any call, so a wrong target never sends a packet off this machine.
        assert client.server_address == server.local_address == f"127.0.0.1:{server.port}"
        assert client.server_info(timeout=5)[config.name].current_size == 0
        assert server.checkpoint("first") == "first" and (tmp_path / "first" / "DONE").exists()


@pytest.mark.process
@pytest.mark.timeout(60)
def test_a_server_without_a_checkpoint_dir_leaves_nothing_in_the_temp_folder(tmp_path, monkeypatch):
    # Reverb's default checkpointer makes a temporary directory that nothing removes.
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    config = ReplayTableConfig(max_size=100, min_size=1, samples_per_insert=None)
    with ReplayServer([make_replay_table(config, OBS, ACT)]) as server:
        assert server.client().server_info(timeout=5)[config.name].current_size == 0
        assert len(list(tmp_path.iterdir())) == 1  # where a checkpoint asked of the running server would go
    assert list(tmp_path.iterdir()) == []
    # Nor does one that could not start.
    with pytest.raises(PortTaken):
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", 0))
            holder.listen()
            ReplayServer([make_replay_table(config, OBS, ACT)], port=holder.getsockname()[1])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.process
@pytest.mark.timeout(60)
def test_a_message_read_that_finds_the_table_emptied_gives_up_at_its_deadline():
    # A reader that counted its messages on one server and samples from the server restarted behind the same
    # address meets an empty table: Reverb's own sampler would wait there for ever.
    from actorq_jax.replay.messages import make_message_table, sample_within, send_message, take_messages

    with ReplayServer([make_message_table("inbox")]) as server:
        client = server.client()
        start = time.monotonic()
        with pytest.raises(reverb.DeadlineExceededError, match="1 item\\(s\\) of table 'inbox' did not come within 0.5 s"):
            sample_within(client, "inbox", 1, 0.5)
        assert time.monotonic() - start < 5
        send_message(client, "inbox", {"n": 1}, 5)
        send_message(client, "inbox", {"n": 2}, 5)
        # The reader left behind takes one message when it comes; the next read gets what remains, in order.
        deadline = time.monotonic() + 10
        while server.client().server_info(timeout=5)["inbox"].current_size > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert take_messages(client, "inbox") == [{"n": 2}]


@pytest.mark.process
@pytest.mark.timeout(120)
def test_messages_that_reach_a_timed_out_take_are_handed_over_by_the_next_one(monkeypatch):
    # A reply or row taken by the sampler of a take that gave up would otherwise be lost to everyone.
    from actorq_jax.replay.messages import make_message_table, send_message, take_messages

    port = portpicker.pick_unused_port()
    servers = [ReplayServer([make_message_table("inbox")], port=port)]
    try:
        client = reverb.Client(f"127.0.0.1:{port}")
        send_message(client, "inbox", {"n": 0}, 5)
        counted = client.server_info

        def count_then_restart(timeout=None):
            # The reader counts a message on one server, which restarts empty behind the address before it samples.
            info = counted(timeout=timeout)
            servers[-1].stop()
            servers.append(ReplayServer([make_message_table("inbox")], port=port))
            return info

        monkeypatch.setattr(client, "server_info", count_then_restart)
        with pytest.raises(reverb.DeadlineExceededError, match="messages of table 'inbox' did not come within 1 s"):
            take_messages(client, "inbox", timeout_s=1)
        monkeypatch.setattr(client, "server_info", counted)
        for n in (1, 2):
            send_message(servers[-1].client(), "inbox", {"n": n}, 5)
        taken, deadline = [], time.monotonic() + 30
        while len(taken) < 2 and time.monotonic() < deadline:
            taken += take_messages(client, "inbox", timeout_s=1)
        assert taken == [{"n": 1}, {"n": 2}]
        assert take_messages(client, "inbox", timeout_s=1) == []
    finally:
        servers[-1].stop()


@pytest.mark.process
@pytest.mark.timeout(120)
def test_a_checkpoint_of_unpacked_items_is_refused_by_name_and_kept(tmp_path):
    # A table as an older version stored it: one column per Transition field.
    config = ReplayTableConfig(max_size=100, min_size=1, samples_per_insert=None)
    unpacked = reverb.Table(name="replay", sampler=reverb.selectors.Uniform(), remover=reverb.selectors.Fifo(),
                            max_size=100, rate_limiter=reverb.rate_limiters.MinSize(1),
                            signature=transition_signature(OBS, ACT))
    with ReplayServer([unpacked], checkpoint_dir=tmp_path) as server:
        with server.client().trajectory_writer(num_keep_alive_refs=1) as writer:
            writer.append({"observation": OBS, "action": ACT, "reward": np.float32(1), "discount": np.float32(1),
                           "next_observation": OBS})
            writer.create_item("replay", 1.0, {k: column[-1] for k, column in writer.history.items()})
        server.checkpoint("old")
    with pytest.raises(CheckpointMismatch, match="checkpoint 'old' holds table 'replay'.*start a new run"):
        ReplayServer([make_replay_table(config, OBS, ACT)], checkpoint_dir=tmp_path, restore="old")
    assert checkpoint_table_size(tmp_path, "old", "replay") == 1  # nothing collected is lost


@pytest.mark.process
@pytest.mark.timeout(60)
def test_a_server_on_a_port_another_process_holds_says_the_port_is_taken():
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen(1)
    port = held.getsockname()[1]
    config = ReplayTableConfig(max_size=100, min_size=1, samples_per_insert=None)
    try:
        with pytest.raises(PortTaken, match=f"port {port} is taken by another process"):
            ReplayServer([make_replay_table(config, OBS, ACT)], port=port)
    finally:
        held.close()


# ----------------------------------------------------------------------------- failures

def _actor_main(address: str, seed: int) -> None:
    """Child process: write episodes forever (until killed)."""
    client = wait_for_server(address, 30)
    rng = np.random.default_rng(seed)
    adder = NStepAdder(client, "replay", n_step=3, discount=GAMMA)
    while True:
        feed(adder, random_episode(rng, 50, terminal=False))


@pytest.mark.process
@pytest.mark.timeout(150)
def test_killed_actor_leaves_server_usable():
    config = ReplayTableConfig(max_size=100_000, min_size=1, samples_per_insert=None)
    ctx = mp.get_context("spawn")
    with ReplayServer([make_replay_table(config, OBS, ACT)]) as server:
        client = wait_for_server(server.address, 10)
        process = ctx.Process(target=_actor_main, args=(server.address, 1), daemon=True)
        process.start()
        try:
            deadline = time.monotonic() + 90
            while table_size(client, "replay") < 200 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert table_size(client, "replay") >= 200
            os.kill(process.pid, signal.SIGKILL)  # mid-write: it never stops writing
            process.join(timeout=30)
            assert process.exitcode == -signal.SIGKILL
        finally:
            if process.is_alive():
                process.kill()
                process.join()
        before = table_size(client, "replay")
        rng = np.random.default_rng(9)
        episode = random_episode(rng, 30, terminal=True)
        with NStepAdder(client, "replay", n_step=3, discount=GAMMA) as adder:
            feed(adder, episode)
        assert table_size(client, "replay") == before + 30
        batch = next(ReplayDataset(server.address, "replay", batch_size=64, prefetch=0))
        assert batch.observation.shape == (64, OBS_DIM) and np.all(np.isfinite(batch.reward))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", ["127.0.0.1", "127.0.0.1:", ":1234", "127.0.0.1:99999", "host:port"])
def test_malformed_address_is_rejected(bad):
    with pytest.raises(ValueError, match="host:port"):
        parse_address(bad)
    with pytest.raises(ValueError, match="host:port"):
        wait_for_server(bad, 1)
    with pytest.raises(ValueError, match="host:port"):
        VariableClient(bad)


@pytest.mark.timeout(60)  # the bound: every call below must give up, not hang
def test_unreachable_address_fails_within_bounded_time():
    dead = f"127.0.0.1:{portpicker.pick_unused_port()}"
    for address in (dead, "nonexistent.invalid:4321"):
        with pytest.raises(TimeoutError, match=address):
            wait_for_server(address, timeout_s=1.5)
    with pytest.raises(TimeoutError, match=dead):
        ReplayDataset(dead, "replay", batch_size=4, connect_timeout_s=1)
    with VariableClient(dead) as client:
        with pytest.raises(TimeoutError, match=f"no variables published on {dead}"):
            client.wait_for_first(timeout_s=1.5)
    with pytest.raises(TimeoutError, match=dead):
        NStepAdder(reverb.Client(dead), "replay", n_step=1, discount=GAMMA, connect_timeout_s=1)
