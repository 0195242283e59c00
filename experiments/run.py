"""Runs any registered agent with quantized actors: `python experiments/run.py --agent NAME [flags]`.

    python experiments/run.py --agent d4pg --task cartpole_balance --actor_bits 8 --max_seconds 300
    python experiments/run.py --agent dqn --help

run_d4pg.py and run_dqn.py are this script with the agent fixed.
"""

import argparse
import sys
from typing import List, Optional

from actorq_jax.agents.registry import agent_names
from actorq_jax.launch.launcher import run_experiment


def main(argv: Optional[List[str]] = None) -> int:
    """Reads --agent, then parses that agent's flags, launches the run and prints where its results are."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False, allow_abbrev=False)
    parser.add_argument("--agent", required=True, choices=agent_names(), help="which registered agent to run")
    args, rest = parser.parse_known_args(argv)
    return run_experiment(args.agent, rest)


if __name__ == "__main__":
    sys.exit(main())
