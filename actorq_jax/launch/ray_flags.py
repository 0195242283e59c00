"""`--launcher ray`'s flags, checked before anything starts (imports no Ray at module level).

Bad flags (`ray_flag_problems`) are found before a run starts: a --ray_address
that does not answer, a resource list that does not parse, resources that no
node (or not enough nodes for --num_actors) has.
"""

import math
import os
import re
import socket
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from actorq_jax.launch.runtime import LAUNCHERS

CONNECT_TIMEOUT_S = 3.0
RESOURCE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:/-]*$")


def parse_resources(text: str) -> Dict[str, float]:
    """Parses 'GPU=1,CPU=2,actor_node=1' into {name: amount}; ValueError naming the bad part."""
    resources: Dict[str, float] = {}
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, amount = part.partition("=")
        name = name.strip()
        if not sep or not RESOURCE_NAME.match(name):
            raise ValueError(f"malformed resource {part!r}: expected NAME=AMOUNT, e.g. CPU=1,GPU=1,actor_node=1")
        try:
            value = float(amount)
        except ValueError:
            raise ValueError(f"malformed amount in {part!r}: expected a number") from None
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"amount in {part!r} must be a positive number")
        if name in resources:
            raise ValueError(f"resource {name!r} given twice in {text!r}")
        resources[name] = value
    return resources


def actor_options(resources: Dict[str, float]) -> Dict[str, Any]:
    """Ray actor options that reserve `resources` (CPU and GPU by their own keywords)."""
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
    options: Dict[str, Any] = {"num_cpus": resources.get("CPU", 0), "num_gpus": resources.get("GPU", 0)}
    if custom:
        options["resources"] = custom
    return options


def address_problem(address: str) -> Optional[str]:
    """Why --ray_address cannot be joined (None when a cluster answers there)."""
    if address == "auto":
        from ray._private import services

        try:
            found = services.canonicalize_bootstrap_address(address)
        except (ConnectionError, ValueError) as error:
            return f"no running Ray cluster found on this machine ({error}); start one with `ray start --head`"
        if not found:
            return "no running Ray cluster found on this machine; start one with `ray start --head`"
        address = found
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        return f"{address!r} is neither 'auto' nor HOST:PORT"
    try:
        with socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as error:
        return f"nothing answers at {address} ({error.strerror or error}); is the Ray head running there?"
    return None


def local_node_resources() -> List[Dict[str, float]]:
    """The resources a Ray instance started here would have (CPUs, GPUs; no custom ones)."""
    gpus = len(list(Path("/proc/driver/nvidia/gpus").glob("*"))) if Path("/proc/driver/nvidia/gpus").exists() else 0
    return [{"CPU": float(os.cpu_count() or 1), "GPU": float(gpus)}]


def cluster_node_resources(address: str) -> List[Dict[str, float]]:
    """Total resources of each live node of the cluster at `address` (connects, reads, disconnects)."""
    import ray

    already = ray.is_initialized()
    if not already:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        return [dict(node["Resources"]) for node in ray.nodes() if node.get("Alive")]
    finally:
        if not already:
            ray.shutdown()


def placement_problems(learner: Dict[str, float], actor: Dict[str, float], num_actors: int,
                       nodes: List[Dict[str, float]]) -> List[Tuple[str, str]]:
    """(flag, message) when the nodes cannot hold the learner and `num_actors` actors with these resources."""
    def fits(need: Dict[str, float], node: Dict[str, float]) -> bool:
        return all(node.get(k, 0.0) >= v for k, v in need.items())

    def describe(need: Dict[str, float]) -> str:
        return ",".join(f"{k}={v:g}" for k, v in need.items())

    problems = []
    for flag, need in (("learner_resources", learner), ("actor_resources", actor)):
        if not any(fits(need, n) for n in nodes):
            missing = sorted(k for k, v in need.items() if not any(n.get(k, 0.0) >= v for n in nodes))
            problems.append((flag, f"no node has {describe(need)} (lacking: {', '.join(missing) or 'all at once'}); "
                             f"nodes have: {_describe_nodes(nodes)}"))
    if problems:
        return problems
    # Enough room for the learner and every actor at once (first fit, the learner tried on each node).
    for first in range(len(nodes)):
        if not fits(learner, nodes[first]):
            continue
        free = [dict(n) for n in nodes]
        for k, v in learner.items():
            free[first][k] -= v
        placed = 0
        for node in free:
            while placed < num_actors and fits(actor, node) and actor:
                for k, v in actor.items():
                    node[k] -= v
                placed += 1
        if placed >= num_actors or not actor:
            return []
    return [("actor_resources", f"the nodes hold fewer than --num_actors {num_actors} actors of {describe(actor)} "
             f"beside the learner's {describe(learner) or 'nothing'}; nodes have: {_describe_nodes(nodes)}")]


def _describe_nodes(nodes: List[Dict[str, float]]) -> str:
    shown = []
    for node in nodes:
        useful = {k: v for k, v in node.items() if not k.startswith("node:") and k not in ("memory", "object_store_memory")}
        shown.append("{" + ",".join(f"{k}={v:g}" for k, v in sorted(useful.items())) + "}")
    return " ".join(shown)


def ray_flag_problems(run: Any) -> List[Tuple[str, str]]:
    """(flag, message) for every Ray flag that cannot work; connects to --ray_address to check resources."""
    launcher = run.launcher
    if launcher not in LAUNCHERS:
        return [("launcher", f"{launcher!r} not in {LAUNCHERS}")]
    problems: List[Tuple[str, str]] = []
    parsed: Dict[str, Dict[str, float]] = {}
    for flag in ("learner_resources", "replay_resources", "actor_resources"):
        try:
            parsed[flag] = parse_resources(getattr(run, flag))
        except ValueError as error:
            problems.append((flag, str(error)))
    if launcher != "ray":
        for flag in ("ray_address", "learner_resources", "replay_resources", "actor_resources"):
            if getattr(run, flag):
                problems.append((flag, "needs --launcher ray"))
        return problems
    address = run.ray_address
    if address:
        problem = address_problem(address)
        if problem:
            return problems + [("ray_address", problem)]
    if problems:
        return problems
    try:
        nodes = cluster_node_resources(address) if address else local_node_resources()
    except Exception as error:  # noqa: BLE001 (whatever stops us joining, e.g. a token mismatch, is the flag's problem)
        return [("ray_address", f"cannot join the Ray cluster at {address}: {type(error).__name__}: {error}")]
    # The replay service is placed like a second learner: both must fit beside the actors.
    learner = dict(parsed["learner_resources"])
    for k, v in parsed["replay_resources"].items():
        learner[k] = learner.get(k, 0.0) + v
    return placement_problems(learner, parsed["actor_resources"], run.num_actors, nodes)
