"""Finding the first non-finite value in a pytree (losses, parameters) with one jitted reduction."""

from functools import lru_cache
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np


@lru_cache(maxsize=None)
def _leaf_flags(treedef: Any) -> Callable[..., Any]:
    # One executable per tree structure: per leaf, (has a NaN, has an inf).
    def flags(*leaves: Any) -> Any:
        return jnp.stack([jnp.stack([jnp.any(jnp.isnan(x)), jnp.any(jnp.isinf(x))]) for x in leaves])

    return jax.jit(flags)


def first_non_finite(tree: Any, what: str = "") -> Optional[str]:
    """'<path> is nan' (or inf) for the first leaf of `tree` holding a NaN or an inf; None when all are finite."""
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    floats = [(path, leaf) for path, leaf in leaves_with_paths if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)]
    if not floats:
        return None
    flags = np.asarray(_leaf_flags(jax.tree_util.tree_structure([leaf for _, leaf in floats]))(
        *[leaf for _, leaf in floats]))
    for (path, _), (nan, inf) in zip(floats, flags):
        if nan or inf:
            name = jax.tree_util.keystr(path).strip("[]'\"").replace("']['", "/").replace("'", "")
            return f"{what}{name} is {'nan' if nan else 'inf'}"
    return None
