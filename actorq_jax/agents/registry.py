"""The one list of agents: each agent's folder registers its name, config, builder and default task here.

Flag parsing, the launcher, the sweep and every worker process look agents up by
name through this module, which imports no JAX: builders are named as
"module:Class" strings and imported only when a process builds one.

A new agent is a folder `actorq_jax/agents/<name>/` whose `__init__.py` calls
`register_agent(AgentEntry(...))`; every sub-package of `actorq_jax.agents` is
imported on the first lookup, so nothing else needs editing.

An agent outside the package (a plugin, or a test's own agent) is a module that
calls `register_agent` when imported, named in the environment variable
ACTORQ_AGENT_MODULES (comma-separated module names, importable on the
process's path). The first lookup imports those too, and the launcher's
worker processes inherit the environment, so every process of a run finds it.
"""

import dataclasses
import importlib
import os
import pkgutil
from typing import Any, Callable, Dict, Tuple, Union

_AGENTS: Dict[str, "AgentEntry"] = {}
_DISCOVERED = False
# Modules outside actorq_jax.agents that register agents when imported (comma-separated).
AGENT_MODULES_ENV = "ACTORQ_AGENT_MODULES"
ACTION_KINDS = ("discrete", "continuous", "any")


@dataclasses.dataclass(frozen=True)
class AgentEntry:
    """What the launcher needs to know of an agent before it builds one."""

    name: str  # what --agent, config.json and results directories call it
    config_class: type  # frozen dataclass of hyper-parameters; every field with a simple type becomes a flag
    builder: Union[str, Callable[..., Any]]  # "package.module:Class", or the class; called as builder(config, spec)
    default_task: str  # the --task default
    description: str = ""  # one line for --help
    # Run flags of the smallest run that still exercises every part (warm-up, learning, publication, evaluation,
    # checkpoints): what tests start.
    tiny: Tuple[str, ...] = ()
    # Run flags of a short but meaningful run (small networks, short warm-up): what the --quick smoke runs of the
    # demo and benchmarks start; no --task (they choose it).
    quick: Tuple[str, ...] = ()
    # The tasks it can act in: "discrete" or "continuous" actions, or "any". Checked when flags are parsed,
    # so a mismatch is a usage error naming --task instead of a failed run.
    actions: str = "any"

    def __post_init__(self) -> None:
        if not self.name or not self.name.isidentifier():
            raise ValueError(f"agent name must be an identifier, got {self.name!r}")
        if not dataclasses.is_dataclass(self.config_class):
            raise ValueError(f"agent {self.name!r}: config_class must be a dataclass, got {self.config_class!r}")
        if isinstance(self.builder, str) and ":" not in self.builder:
            raise ValueError(f"agent {self.name!r}: builder must be 'module:Class', got {self.builder!r}")
        if self.actions not in ACTION_KINDS:
            raise ValueError(f"agent {self.name!r}: actions must be one of {ACTION_KINDS}, got {self.actions!r}")
        for preset in ("tiny", "quick"):
            flags = getattr(self, preset)
            if not isinstance(flags, tuple) or not all(isinstance(f, str) for f in flags):
                raise ValueError(f"agent {self.name!r}: {preset} must be a tuple of flag strings, got {flags!r}")

    def builder_class(self) -> Callable[..., Any]:
        """The builder class (imported on first use)."""
        if not isinstance(self.builder, str):
            return self.builder
        module, _, name = self.builder.partition(":")
        return getattr(importlib.import_module(module), name)

    def make_builder(self, config: Any, spec: Any) -> Any:
        """The agent's builder for a task's spec."""
        if not isinstance(config, self.config_class):
            raise TypeError(f"agent {self.name!r} needs a {self.config_class.__name__}, got {type(config).__name__}")
        return self.builder_class()(config, spec)


def register_agent(entry: AgentEntry) -> AgentEntry:
    """Adds an agent; registering the same name twice with another entry is an error."""
    existing = _AGENTS.get(entry.name)
    if existing is not None and existing != entry:
        raise ValueError(f"agent {entry.name!r} is already registered (by {existing.builder!r})")
    _AGENTS[entry.name] = entry
    return entry


def unregister_agent(name: str) -> None:
    """Removes an agent (for tests that register one of their own)."""
    _AGENTS.pop(name, None)


def _discover() -> None:
    # Importing each agent package runs its register_agent call; configs import no JAX.
    global _DISCOVERED
    if _DISCOVERED:
        return
    _DISCOVERED = True
    import actorq_jax.agents as package

    for module in pkgutil.iter_modules(package.__path__):
        if module.ispkg:
            importlib.import_module(f"{package.__name__}.{module.name}")
    for name in filter(None, (n.strip() for n in os.environ.get(AGENT_MODULES_ENV, "").split(","))):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as error:
            raise ImportError(f"{AGENT_MODULES_ENV} names module {name!r}, which cannot be imported: {error}") from error


def agent_names() -> Tuple[str, ...]:
    """Names of every registered agent, sorted."""
    _discover()
    return tuple(sorted(_AGENTS))


def get_agent(name: str) -> AgentEntry:
    """The registered agent called `name`; ValueError listing the known ones otherwise."""
    _discover()
    try:
        return _AGENTS[name]
    except KeyError:
        raise ValueError(f"unknown agent {name!r}; registered agents: {', '.join(sorted(_AGENTS))}") from None
