"""Runs D4PG with quantized actors: learner + Reverb, N actors and an evaluator.

    python experiments/run_d4pg.py --task cartpole_balance --num_actors 2 --actor_bits 8 --max_seconds 300

Prints the results directory; see --help for every flag.
"""

import sys

from actorq_jax.launch.launcher import run_experiment


def main(argv=None) -> int:
    """Parses flags, launches the run, prints where its results are."""
    return run_experiment("d4pg", argv, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
