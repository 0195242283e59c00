"""Runs DQN with quantized epsilon-greedy actors: learner + Reverb, N actors and an evaluator.

    python experiments/run_dqn.py --task CartPole-v1 --num_actors 2 --actor_bits 8 --max_seconds 300

Prints the results directory; see --help for every flag.
"""

import json
import sys

from actorq_jax.agents.dqn.config import DQNConfig
from actorq_jax.launch.flags import parse_run


def main(argv=None) -> int:
    """Parses flags, launches the run, prints where its results are."""
    run, config = parse_run("dqn", DQNConfig, argv, description=__doc__.splitlines()[0])
    from actorq_jax.launch.launcher import launch

    summary = launch(run, config)
    print(json.dumps({k: v for k, v in summary.items() if k != "events"}, indent=2))
    print(f"results: {run.results_dir}")
    return int(summary["exit_code"])


if __name__ == "__main__":
    sys.exit(main())
