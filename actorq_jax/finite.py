"""Finding the first non-finite value in a pytree (losses, parameters): one jitted check, the leaf named on a find.

The learner checks its whole state before every publication, log row and checkpoint, so the common case
(everything finite) is kept to one flatten and one small executable; leaf paths are built only when
something is not finite.
"""

from functools import lru_cache
from typing import Any, Callable, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np


@lru_cache(maxsize=None)
def _float_positions(treedef: Any, dtypes: Tuple[Any, ...]) -> Tuple[int, ...]:
    # Integer leaves (step counters, replay keys) cannot be non-finite; which leaves are floats is a
    # property of the structure and dtypes, so it is worked out once per pair.
    del treedef  # part of the cache key only
    return tuple(i for i, dtype in enumerate(dtypes) if jnp.issubdtype(dtype, jnp.inexact))  # bfloat16 too


@jax.jit
def _all_finite(leaves: List[Any]) -> Any:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


@lru_cache(maxsize=None)
def _leaf_flags(treedef: Any) -> Callable[..., Any]:
    # One executable per tree structure: per leaf, (has a NaN, has an inf).
    def flags(*leaves: Any) -> Any:
        return jnp.stack([jnp.stack([jnp.any(jnp.isnan(x)), jnp.any(jnp.isinf(x))]) for x in leaves])

    return jax.jit(flags)


def _dtype(leaf: Any) -> Any:
    dtype = getattr(leaf, "dtype", None)
    return np.result_type(leaf) if dtype is None else dtype  # Python scalars have none


def first_non_finite(tree: Any, what: str = "") -> Optional[str]:
    """'<path> is nan' (or inf) for the first leaf of `tree` holding a NaN or an inf; None when all are finite."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    positions = _float_positions(treedef, tuple(_dtype(leaf) for leaf in leaves))
    if not positions or bool(_all_finite([leaves[i] for i in positions])):
        return None
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    floats = [(paths[i], leaves[i]) for i in positions]
    flags = np.asarray(_leaf_flags(jax.tree_util.tree_structure([leaf for _, leaf in floats]))(
        *[leaf for _, leaf in floats]))
    for (path, _), (nan, inf) in zip(floats, flags):
        if nan or inf:
            name = jax.tree_util.keystr(path).strip("[]'\"").replace("']['", "/").replace("'", "")
            return f"{what}{name} is {'nan' if nan else 'inf'}"
    return None
