"""Typed config dataclasses: documented fields, shared validation rules, and flags derived from the fields.

Every config of the project (RunConfig, each agent's config) declares a field
once, with `documented(default, "help")`; the entry points turn the fields into
command-line flags with `add_config_flags`, so a default and its help text are
written in one place. Imports no JAX: flag parsing stays cheap.
"""

import argparse
import dataclasses
import typing
from typing import Any, Callable, Iterable, Optional, Sequence, Tuple


def documented(default: Any, help: str, flag: bool = True) -> Any:
    """A dataclass field with its help text; `flag=False` keeps it off the command line (say why in the help)."""
    return dataclasses.field(default=default, metadata={"help": help, "flag": flag})


# -- validation -------------------------------------------------------------------------


def check(condition: bool, config: Any, name: str, rule: str) -> None:
    """Raises ValueError('<Config>.<name> <rule>, got <value>') unless condition holds."""
    if not condition:
        value = getattr(config, name)
        raise ValueError(f"{type(config).__name__}.{name} {rule}, got {value!r}")


def check_ints(config: Any, names: Iterable[str], minimum: int = 1) -> None:
    """Each named field is an int (not a bool) >= minimum."""
    for name in names:
        value = getattr(config, name)
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
        check(ok, config, name, f"must be an integer >= {minimum}")


def check_positive(config: Any, names: Iterable[str]) -> None:
    """Each named field is a finite number > 0."""
    for name in names:
        check(_finite(getattr(config, name)) and getattr(config, name) > 0, config, name, "must be > 0")


def check_non_negative(config: Any, names: Iterable[str]) -> None:
    """Each named field is a finite number >= 0."""
    for name in names:
        check(_finite(getattr(config, name)) and getattr(config, name) >= 0, config, name, "must be >= 0")


def check_layers(config: Any, names: Iterable[str]) -> None:
    """Each named field is a non-empty tuple of positive integer layer sizes."""
    for name in names:
        value = getattr(config, name)
        ok = isinstance(value, tuple) and len(value) > 0 and all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
        check(ok, config, name, "must be a non-empty tuple of positive integers")


RATE_LIMITERS = ("ratio", "min_size")


def check_replay(config: Any) -> None:
    """The replay fields every agent config has: sizes, the rate-limiting regime and its parameters."""
    check_ints(config, ("batch_size", "min_replay_size", "max_replay_size"))
    check(config.min_replay_size <= config.max_replay_size, config, "min_replay_size",
          f"must be <= max_replay_size ({config.max_replay_size})")
    check(config.rate_limiter in RATE_LIMITERS, config, "rate_limiter", f"must be one of {RATE_LIMITERS}")
    check_positive(config, ("samples_per_insert",))
    check_ints(config, ("max_times_sampled",), minimum=0)
    if config.rate_limiter == "min_size":
        check(config.max_times_sampled >= 1, config, "max_times_sampled",
              "must be >= 1 with rate_limiter min_size (otherwise the learner resamples the first items forever)")
    else:
        check(config.max_times_sampled == 0, config, "max_times_sampled",
              "applies only with rate_limiter min_size (the ratio regime already bounds sampling)")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and abs(value) != float("inf")


def actor_position(actor_id: int, num_actors: int) -> float:
    """Where actor `actor_id` of `num_actors` sits in a per-actor spread: 0 for the first, 1 for the last.

    Ids beyond the local actors (remote actors join with id 100 by default) sit at
    the last position, so they get the last local actor's setting, never one outside the spread.
    """
    if num_actors < 1 or actor_id < 0:
        raise ValueError(f"need num_actors >= 1 and actor_id >= 0, got actor_id={actor_id}, num_actors={num_actors}")
    if num_actors == 1:
        return 0.0
    return min(actor_id, num_actors - 1) / (num_actors - 1)


# -- the fields every agent config has ----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """Base of every agent's config: the fields the agent contract reads (n-step return, batches, replay regime).

    An agent's config subclasses it, adds its own fields, may redeclare a field to
    change its default, and calls `super().__post_init__()` from its own.
    """

    n_step: int = documented(5, "n of the n-step return")
    discount: float = documented(0.99, "per-step discount gamma, in (0, 1]")
    batch_size: int = documented(256, "transitions per SGD step")
    samples_per_insert: float = documented(32.0, "replay ratio enforced by Reverb's rate limiter (rate_limiter ratio)")
    rate_limiter: str = documented(
        "ratio", "ratio: actors and learner held to samples_per_insert; min_size: actors run free (the paper's actorQ)")
    max_times_sampled: int = documented(
        0, "with rate_limiter min_size: an item is removed after this many samples (a learner as fast as the actors "
           "then keeps the table near min_replay_size: its batches come from that many newest transitions)")
    min_replay_size: int = documented(1000, "transitions before learning starts (the table never samples below it)")
    max_replay_size: int = documented(1_000_000, "FIFO capacity of the replay table")

    def __post_init__(self) -> None:
        check_ints(self, ("n_step",))
        check(_finite(self.discount) and 0.0 < self.discount <= 1.0, self, "discount", "must be in (0, 1]")
        check_replay(self)


# -- flags --------------------------------------------------------------------------------


def parse_int_tuple(text: str) -> Tuple[int, ...]:
    """Parses a comma list such as '256,256,256' into positive integers, raising ValueError when malformed."""
    parts = [p.strip() for p in str(text).split(",")]
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"malformed list {text!r}: expected positive integers like 256,256")
    return tuple(int(p) for p in parts)


def parse_bool(text: str) -> bool:
    """Parses true/false, yes/no, 1/0."""
    lowered = str(text).lower()
    if lowered in ("1", "true", "yes"):
        return True
    if lowered in ("0", "false", "no"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def _argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def flag_type(hint: Any) -> Optional[Callable[[str], Any]]:
    """The parser of a field's flag from its type hint; None for types that are not flags."""
    if typing.get_origin(hint) is typing.Union:  # Optional[X]: the flag parses X, its absence means None
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return flag_type(args[0]) if len(args) == 1 else None
    if hint is bool:
        return _argparse_type(parse_bool)
    if hint in (int, float, str):
        return hint
    if typing.get_origin(hint) is tuple and typing.get_args(hint) == (int, Ellipsis):
        return _argparse_type(parse_int_tuple)
    return None


def flag_fields(cls: type, skip: Sequence[str] = ()) -> Tuple[dataclasses.Field, ...]:
    """The fields of a config that are command-line flags."""
    hints = typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.metadata.get("flag", True):
            continue
        if flag_type(hints[f.name]) is None:
            raise TypeError(f"{cls.__name__}.{f.name}: type {hints[f.name]} has no flag parser; "
                            f"declare it with documented(..., flag=False) and say why")
        fields.append(f)
    return tuple(fields)


def add_config_flags(group: Any, cls: type, skip: Sequence[str] = ()) -> None:
    """Adds `--<field>` for every flag field of a config dataclass, with its default and help."""
    hints = typing.get_type_hints(cls)
    for f in flag_fields(cls, skip):
        default = f.default if f.default is not dataclasses.MISSING else None
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        text = f.metadata.get("help", "") + ("" if shown in (None, "") else f" (default: {shown})")
        group.add_argument(f"--{f.name}", type=flag_type(hints[f.name]), default=default, help=text)
