"""Results analysis for ActorQ runs and sweeps (pandas and matplotlib only, no JAX).

    from actorq_jax import analysis
    sweep = analysis.load_sweep("results/sweep_cartpole")        # runs, evals, actors, learner DataFrames
    view = sweep.select(bits=[32, 8], seed=0)                     # slice by task, bits, seed
    table = analysis.results_table(view.runs, view.evals)        # time to target, speedup, energy ratio
    reach = analysis.time_to_target(one_run_evals, 900.0)        # the one definition of reaching a target
    fig = analysis.plot_return_curves(analysis.eval_points(view.evals), "wall_seconds")

experiments/plot.py and notebooks/results.ipynb both use these helpers.
"""

from actorq_jax.analysis.aggregate import (
    TargetReach,
    actor_time_breakdown,
    bits_table,
    curve_band,
    eval_points,
    fewest_bits_within,
    final_and_best_returns,
    results_table,
    run_time_to_target,
    sweep_targets,
    target_returns,
    time_to_target,
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
from actorq_jax.analysis.plots import (
    bits_color,
    plot_actor_time,
    plot_ptq,
    plot_return_curves,
    plot_return_vs_bits,
    save_figure,
)
from actorq_jax.analysis.records import collect, finished_runs, read_study, record_files
from actorq_jax.analysis.report import (
    bits_markdown,
    describe_target,
    display_table,
    results_markdown,
    to_markdown,
    write_report,
)

__all__ = [
    "PHASES",
    "Sweep",
    "TargetReach",
    "actor_time_breakdown",
    "bits_color",
    "bits_markdown",
    "bits_table",
    "collect",
    "curve_band",
    "describe_target",
    "display_table",
    "eval_points",
    "fewest_bits_within",
    "final_and_best_returns",
    "find_run_dirs",
    "finished_runs",
    "is_run_dir",
    "load_actor_episodes",
    "load_evals",
    "load_learner",
    "load_runs",
    "load_sweep",
    "plot_actor_time",
    "plot_ptq",
    "plot_return_curves",
    "plot_return_vs_bits",
    "read_run",
    "read_study",
    "record_files",
    "results_markdown",
    "results_table",
    "run_time_to_target",
    "save_figure",
    "sweep_targets",
    "target_returns",
    "time_to_target",
    "to_markdown",
    "write_report",
]
