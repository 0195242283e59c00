"""The one list of agents: each agent's folder registers its name, config, builder and default task here.

Flag parsing, the launcher, the sweep and every worker process look agents up by
name through this module, which imports no JAX: builders are named as
"module:Class" strings and imported only when a process builds one.

A new agent is a folder `actorq_jax/agents/<name>/` whose `__init__.py` calls
`register_agent(AgentEntry(...))`; every sub-package of `actorq_jax.agents` is
imported on the first lookup, so nothing else needs editing.
"""

import dataclasses
import importlib
import pkgutil
from typing import Any, Callable, Dict, Tuple, Union

_AGENTS: Dict[str, "AgentEntry"] = {}
_DISCOVERED = False


@dataclasses.dataclass(frozen=True)
class AgentEntry:
    """What the launcher needs to know of an agent before it builds one."""

    name: str  # what --agent, config.json and results directories call it
    config_class: type  # frozen dataclass of hyper-parameters; every field with a simple type becomes a flag
    builder: Union[str, Callable[..., Any]]  # "package.module:Class", or the class; called as builder(config, spec)
    default_task: str  # the --task default
    description: str = ""  # one line for --help

    def __post_init__(self) -> None:
        if not self.name or not self.name.isidentifier():
            raise ValueError(f"agent name must be an identifier, got {self.name!r}")
        if not dataclasses.is_dataclass(self.config_class):
            raise ValueError(f"agent {self.name!r}: config_class must be a dataclass, got {self.config_class!r}")
        if isinstance(self.builder, str) and ":" not in self.builder:
            raise ValueError(f"agent {self.name!r}: builder must be 'module:Class', got {self.builder!r}")

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
