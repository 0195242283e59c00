"""RQ4's split of actor and learner time, on hand-made runs with hand-computed cells."""

import math

import pandas as pd

from actorq_jax.analysis.loading import PHASES
from actorq_jax.analysis.time_split import plot_time_split, short_machine, time_split, time_split_markdown

ZEN4 = "AMD EPYC 9R14 (AuthenticAMD family 25 model 17)"
XEON = "Intel(R) Xeon(R) Processor @ 2.60GHz (GenuineIntel family 6 model 106)"


def _runs() -> pd.DataFrame:
    base = {"agent": "d4pg", "task": "cartpole_balance", "layout": "pinned", "actors": "2x1", "policy": "256x3",
            "regime": "ratio 32", "complete": True, "machine": ZEN4}
    wire = {"comm_bits": 32}
    return pd.DataFrame([
        {**base, **wire, "run": "a", "bits": 32, "cpu_clock": "process", "env_steps": 2000, "replay_cpu_s": 1.0},
        {**base, **wire, "run": "b", "bits": 32, "cpu_clock": "process", "env_steps": 500, "replay_cpu_s": 1.0},
        {**base, "run": "c", "bits": 8, "comm_bits": 8, "cpu_clock": math.nan},  # timed before the process clock
        # 8-bit actors fed a float wire: another row than those fed 8 bits.
        {**base, "run": "e", "bits": 8, "comm_bits": 32, "cpu_clock": "process", "env_steps": 1000, "replay_cpu_s": 1.0},
        # One actor of two environments: another actor layout, never averaged with two single-environment actors.
        {**base, **wire, "run": "d", "bits": 32, "actors": "1x2", "cpu_clock": "process", "env_steps": 1000, "replay_cpu_s": 1.0},
        # A larger policy: another row, never averaged with the 256x3 runs.
        {**base, **wire, "run": "f", "bits": 32, "policy": "1024x3", "cpu_clock": "process", "env_steps": 1000,
         "replay_cpu_s": 1.0},
        # The same setting on another machine: another row, never averaged with the first machine's runs.
        {**base, **wire, "run": "g", "bits": 32, "machine": XEON, "cpu_clock": "process", "env_steps": 1000,
         "replay_cpu_s": 1.0},
        # A run older than the machine's record.
        {**base, **wire, "run": "h", "bits": 32, "machine": None, "cpu_clock": "process", "env_steps": 1000,
         "replay_cpu_s": 1.0},
    ])


def _episode(run: str, length: int, inference_s: float, wait_s: float, cpu_s: float) -> dict:
    row = {"run": run, "episode_length": length, **{f"{p}_s": 0.0 for p in PHASES},
           **{f"{p}_cpu_s": 0.0 for p in PHASES}}
    row.update(inference_s=inference_s, rate_limit_wait_s=wait_s, inference_cpu_s=cpu_s)
    return row


def test_cells_are_means_over_runs_of_per_step_milliseconds_and_the_bound_is_named():
    actors = pd.DataFrame([
        _episode("a", 1000, 1.0, 0.0, 0.5), _episode("a", 1000, 1.0, 0.0, 0.5),  # 1.0 ms inference, 0.5 ms CPU
        _episode("b", 500, 1.5, 0.0, 1.0),  # 3.0 ms inference, 2.0 ms CPU
        _episode("c", 1000, 0.2, 2.0, 0.1),  # waits on the limiter 91% of its time
        _episode("d", 1000, 7.0, 0.0, 1.0),
        _episode("e", 1000, 5.0, 0.0, 1.0),
        _episode("f", 1000, 4.0, 0.0, 1.0),
        _episode("g", 1000, 6.0, 0.0, 1.0),
        _episode("h", 1000, 8.0, 0.0, 1.0),
    ])
    learner = pd.DataFrame([
        {"run": "a", "learner_steps": 100, "wall_seconds": 50.0, "cpu_s_per_step": 9.0},  # warm-up row: left out
        {"run": "a", "learner_steps": 300, "wall_seconds": 54.0, "cpu_s_per_step": 0.01},  # 20 ms a step, 10 CPU
        {"run": "b", "learner_steps": 100, "wall_seconds": 10.0, "cpu_s_per_step": 1.0},
        {"run": "b", "learner_steps": 200, "wall_seconds": 13.0, "cpu_s_per_step": 0.02},  # 30 ms, 20 CPU
        {"run": "c", "learner_steps": 100, "wall_seconds": 10.0, "cpu_s_per_step": 1.0},
        {"run": "c", "learner_steps": 200, "wall_seconds": 12.0, "cpu_s_per_step": 0.02},
    ])
    table = time_split(_runs(), actors, learner)
    assert list(zip(table["actors"], table["policy"], table["machine"], table["bits"], table["comm_bits"])) == [
        ("1x2", "256x3", ZEN4, 32, 32), ("2x1", "1024x3", ZEN4, 32, 32), ("2x1", "256x3", ZEN4, 32, 32),
        ("2x1", "256x3", ZEN4, 8, 32), ("2x1", "256x3", ZEN4, 8, 8), ("2x1", "256x3", XEON, 32, 32),
        ("2x1", "256x3", "not recorded", 32, 32)]
    k2, large, q32, q8_float_wire, q8, xeon, unrecorded = (table.iloc[i] for i in range(7))
    assert xeon["runs"] == 1 and math.isclose(xeon["actor_inference_ms"], 6.0)
    assert unrecorded["runs"] == 1 and math.isclose(unrecorded["actor_inference_ms"], 8.0)
    assert large["runs"] == 1 and math.isclose(large["actor_inference_ms"], 4.0)
    assert q8_float_wire["runs"] == 1 and math.isclose(q8_float_wire["actor_inference_ms"], 5.0)
    assert k2["runs"] == 1 and math.isclose(k2["actor_inference_ms"], 7.0)
    assert q32["runs"] == 2 and q8["runs"] == 1
    assert math.isclose(q32["actor_inference_ms"], 2.0)  # mean of 1.0 and 3.0
    assert math.isclose(q32["actor_cpu_ms"], 1.25)  # mean of 0.5 and 2.0
    assert math.isclose(q32["learner_wall_ms"], 25.0) and math.isclose(q32["learner_cpu_ms"], 15.0)
    assert math.isnan(q8["actor_cpu_ms"]) and math.isnan(q8["learner_cpu_ms"])  # one thread's clock: not shown
    assert math.isclose(q32["service_cpu_ms"], 1.25)  # the service's CPU per env step: mean of 0.5 and 2.0 ms
    assert math.isnan(q8["service_cpu_ms"])  # not measured
    assert q8["bound_by"].startswith("learner (actors blocked on the rate limiter 91%")
    assert q32["bound_by"].startswith("actor inference (100%")
    markdown = time_split_markdown(table)
    assert f"| d4pg | cartpole_balance | pinned | 2x1 | 256x3 | ratio 32 | {ZEN4} | q=8 | 8 | 1 |" in markdown
    assert "(-)" in markdown
    assert "| 1.250 | 25.0 (15.0) |" in markdown
    assert plot_time_split(table) is not None


def test_runs_without_actor_episodes_give_an_empty_table():
    table = time_split(_runs(), pd.DataFrame(columns=["run", "episode_length"]), pd.DataFrame())
    assert table.empty and "bound_by" in table.columns


def test_a_machine_is_labelled_by_vendor_family_and_model():
    assert short_machine(ZEN4) == "AMD 25/17" and short_machine(XEON) == "Intel 6/106"
    assert short_machine("not recorded") == "not recorded"
    assert short_machine("Intel(R) Xeon(R) Processor @ 2.60GHz") == "Intel Xeon" and short_machine("AMD EPYC") == "AMD EPYC"
