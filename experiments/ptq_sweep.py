"""Post-training quantization sweep: how few bits a trained policy survives.

    python experiments/ptq_sweep.py --checkpoint results/sweep/d4pg_cartpole_balance_q32_s0 \\
        --bits 2,3,4,5,6,7,8,16,32 --episodes 10 --granularity per_channel,per_tensor

Restores the learner state from RUN_DIR's newest checkpoint, quantizes the
policy's parameters after training at each bit-width and granularity, and runs
greedy episodes with each. Every setting plays the same episodes (the same
environment seed), so differences between rows come from the weights alone.
The weights are made runnable by the loader actors use
(``launch.precision.make_param_loader``), so ``--backend int8`` runs what an
int8 actor of the run runs (its ``int8_mode``: by default the W8A8 kernel,
W4A8 at <= 4 bits; column ``kernel_mode``).
Writes RUN_DIR/ptq.csv (one row per bits and granularity: mean, std, min and
max return) and a PNG of return against bits beside it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from actorq_jax.quantization.config import GRANULARITIES, VALID_BITS
from actorq_jax.run_dir import RunDir

BACKENDS = ("fakequant", "int8")
COLUMNS = ("bits", "granularity", "backend", "kernel_mode", "episodes", "mean_return", "std_return", "min_return", "max_return",
           "quantized_fraction", "weight_rel_error", "checkpoint_step")


def _list(parser: argparse.ArgumentParser, flag: str, text: str, allowed: Sequence[Any], kind: type) -> List[Any]:
    values = []
    for part in (p.strip() for p in text.split(",")):
        try:
            value = kind(part)
        except ValueError:
            parser.error(f"{flag}: {part!r} in {text!r} is not a valid {kind.__name__}")
        if value not in allowed:
            parser.error(f"{flag}: {value!r} is not supported; choose from {tuple(allowed)}")
        if value in values:
            parser.error(f"{flag}: {text!r} repeats {value!r}")
        values.append(value)
    return values


def parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """Parses and checks the flags; exits 2 naming the flag on bad input."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    parser.add_argument("--checkpoint", required=True, metavar="RUN_DIR",
                        help="a run's results directory (its config.json and checkpoints/)")
    parser.add_argument("--bits", default="2,3,4,5,6,7,8,16,32", help=f"comma list of bit-widths from {VALID_BITS}")
    parser.add_argument("--episodes", type=int, default=10, help="greedy episodes per bit-width and granularity")
    parser.add_argument("--granularity", default="per_channel", help=f"comma list from {GRANULARITIES}")
    parser.add_argument("--backend", default="fakequant",
                        help=f"how b-bit weights run, one of {BACKENDS}: fakequant = float math on the quantized "
                             "values; int8 = the actors' int8 kernel (bits <= 8; 16 and 32 run as float)")
    parser.add_argument("--min_size", type=int, default=None,
                        help="kernels with fewer elements stay float32 (default: QuantConfig's, as the actors use)")
    parser.add_argument("--seed", type=int, default=0, help="environment seed of the evaluation episodes")
    parser.add_argument("--out", default=None, help="CSV path (default: RUN_DIR/ptq.csv); the plot goes beside it")
    args = parser.parse_args(argv)
    args.bits = _list(parser, "--bits", args.bits, VALID_BITS, int)
    args.granularity = _list(parser, "--granularity", args.granularity, GRANULARITIES, str)
    if args.episodes < 1:
        parser.error(f"--episodes: must be >= 1, got {args.episodes}")
    if args.backend not in BACKENDS:
        parser.error(f"--backend: {args.backend!r} not in {BACKENDS}")
    if args.min_size is not None and args.min_size < 0:
        parser.error(f"--min_size: must be >= 0, got {args.min_size}")
    if args.seed < 0:
        parser.error(f"--seed: must be >= 0, got {args.seed}")
    run_dir = Path(args.checkpoint)
    if not RunDir(run_dir).config.is_file():
        parser.error(f"--checkpoint: {run_dir} has no config.json (not a run's results directory)")
    if not RunDir(run_dir).checkpoints.is_dir():
        parser.error(f"--checkpoint: {run_dir} has no checkpoints/ folder")
    return args


def weight_stats(params: Any, qparams: Any, runnable_float: Any) -> Dict[str, float]:
    """Share of weight elements that are quantized, and the relative L2 error of the dequantized weights."""
    import jax
    import numpy as np

    from actorq_jax.quantization import is_quantized_leaf

    q_leaves = jax.tree_util.tree_leaves(qparams, is_leaf=is_quantized_leaf)
    total = sum(int(np.size(leaf)) for leaf in jax.tree_util.tree_leaves(params))
    quantized = sum(int(np.size(leaf.values)) for leaf in q_leaves if is_quantized_leaf(leaf))
    diff = sum(float(np.sum((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
               for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(runnable_float)))
    norm = sum(float(np.sum(np.asarray(a, np.float64) ** 2)) for a in jax.tree_util.tree_leaves(params))
    return {"quantized_fraction": quantized / total if total else 0.0,
            "weight_rel_error": (diff / norm) ** 0.5 if norm > 0 else 0.0}


def actor_precision(bits: int, granularity: str, backend: str, int8_mode: str = "w8a8") -> Any:
    """The precision of an actor that receives and runs `bits`-bit weights (fp32 at 32 bits, fakequant at 16)."""
    from actorq_jax.launch.precision import ActorPrecision

    if bits == 32:
        backend = "fp32"
    elif bits > 8:
        backend = "fakequant"  # the int8 kernel runs integer weights only
    return ActorPrecision(actor_bits=bits, comm_bits=bits, granularity=granularity, backend=backend, int8_mode=int8_mode)


def evaluate_setting(run: Any, args: argparse.Namespace, greedy: Any, params: Any, bits: int, granularity: str,
                     env_seed: int, step: Optional[int]) -> Dict[str, Any]:
    """One table row: the policy quantized at (bits, granularity), run as actors would, for args.episodes episodes."""
    import numpy as np

    from actorq_jax.environments import make_environment
    from actorq_jax.launch.evaluator import run_episode
    from actorq_jax.launch.precision import make_param_loader
    from actorq_jax.quantization import QuantConfig, dequantize, quantize

    kwargs = {} if args.min_size is None else {"min_size": args.min_size}
    qparams = quantize(params, QuantConfig(bits=bits, granularity=granularity, **kwargs))
    precision = actor_precision(bits, granularity, args.backend, run.int8_mode)
    # Sent and run at the same bits, the loader runs these weights as they are (no requantization).
    runnable = make_param_loader(precision)(qparams)
    # A fresh environment with the same seed: every setting plays the same episode starts.
    env = make_environment(run.task, seed=env_seed)
    returns = np.array([run_episode(env, greedy, runnable) for _ in range(args.episodes)])
    row = {
        "bits": bits, "granularity": granularity, "backend": precision.backend,
        "kernel_mode": precision.kernel_mode() if precision.backend == "int8" else "",
        "episodes": args.episodes, "mean_return": float(returns.mean()),
        "std_return": float(returns.std(ddof=1)) if len(returns) > 1 else 0.0,
        "min_return": float(returns.min()), "max_return": float(returns.max()),
        **weight_stats(params, qparams, dequantize(qparams)),
        "checkpoint_step": step,
    }
    print(f"[ptq] {granularity:11s} q={bits:<2d} return {returns.mean():9.2f} +- {row['std_return']:.2f}", flush=True)
    return row


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the sweep, writes the CSV and the plot, prints the table."""
    args = parse(argv)
    run_dir = Path(args.checkpoint)
    out = Path(args.out) if args.out else run_dir / "ptq.csv"

    import jax
    import pandas as pd

    from actorq_jax.analysis import plot_ptq, save_figure
    from actorq_jax.environments import environment_spec, make_environment
    from actorq_jax.launch import runtime
    from actorq_jax.launch.checkpoint import Checkpointer, CheckpointUnreadable
    from actorq_jax.launch.config import config_from_json

    run, agent_config = config_from_json(RunDir(run_dir).config.read_text())
    env_seed = runtime.derive_seed(args.seed, 20_000)
    spec = environment_spec(make_environment(run.task, seed=env_seed))
    builder = runtime.make_builder(run.agent, agent_config, spec)
    checkpointer = Checkpointer(RunDir(run_dir).checkpoints)
    try:
        # Read only: a damaged checkpoint is passed over, left where it is for the run to deal with.
        restored = checkpointer.restore(builder.init_state(jax.random.PRNGKey(0)), set_aside=False)
    except CheckpointUnreadable as error:
        print(f"ptq_sweep: --checkpoint: {error}", file=sys.stderr)
        return 2
    finally:
        checkpointer.close()
    step = checkpointer.restored_step
    if restored is None:
        print(f"ptq_sweep: --checkpoint: no checkpoint saved under {run_dir / 'checkpoints'}", file=sys.stderr)
        return 2
    params = builder.actor_params(restored[0])
    rows = [evaluate_setting(run, args, builder.greedy_policy(), params, bits, granularity, env_seed, step)
            for granularity in args.granularity for bits in sorted(args.bits)]
    table = pd.DataFrame(rows, columns=list(COLUMNS))
    out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(out, index=False)
    figure = save_figure(plot_ptq(table, title=f"{run.agent} {run.task}: policy quantized after training "
                                               f"(step {step}, {args.episodes} episodes)"), out.with_suffix(".png"))
    print(table.to_string(index=False))
    print(f"ptq: {out}\nplot: {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
