"""Results analysis for ActorQ runs and sweeps (pandas and matplotlib only, no JAX).

    from actorq_jax import analysis
    sweep = analysis.load_sweep("results/sweep_cartpole")        # runs, evals, actors, learner DataFrames
    view = sweep.select(bits=[32, 8], seed=0)                     # slice by task, bits, seed
    table = analysis.results_table(view.runs, view.evals)        # time to target, speedup, energy ratio
    fig = analysis.plot_return_curves(analysis.eval_points(view.evals), "wall_seconds")

experiments/plot.py and notebooks/results.ipynb both use these helpers.
"""

from actorq_jax.analysis.aggregate import (
    actor_time_breakdown,
    curve_band,
    eval_points,
    first_reach,
    results_table,
    run_time_to_target,
    sweep_targets,
    target_returns,
)
from actorq_jax.analysis.loading import (
    PHASES,
    Sweep,
    find_run_dirs,
    is_run_dir,
    load_actor_episodes,
    load_evals,
    load_learner,
    load_runs,
    load_sweep,
    read_run,
)
from actorq_jax.analysis.plots import bits_color, plot_actor_time, plot_ptq, plot_return_curves, save_figure
from actorq_jax.analysis.report import (
    describe_target,
    display_table,
    results_markdown,
    to_markdown,
    write_report,
)

__all__ = [
    "PHASES",
    "Sweep",
    "actor_time_breakdown",
    "bits_color",
    "curve_band",
    "describe_target",
    "display_table",
    "eval_points",
    "find_run_dirs",
    "first_reach",
    "is_run_dir",
    "load_actor_episodes",
    "load_evals",
    "load_learner",
    "load_runs",
    "load_sweep",
    "plot_actor_time",
    "plot_ptq",
    "plot_return_curves",
    "read_run",
    "results_markdown",
    "results_table",
    "run_time_to_target",
    "save_figure",
    "sweep_targets",
    "target_returns",
    "to_markdown",
    "write_report",
]
