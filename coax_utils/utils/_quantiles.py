"""Quantile fractions and their cosine embedding (for quantile-based distributional RL)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from coax_utils._checks import check_int

__all__ = ["quantile_cos_embedding", "quantiles", "quantiles_uniform"]


def quantiles(batch_size: int, num_quantiles: int = 200) -> jax.Array:
    r"""Equally spaced quantile fractions, repeated for every item of a batch.

    Row :math:`b` holds :math:`\tau_i = i / N` for :math:`i = 0, \dots, N-1`, which split
    :math:`[0, 1]` into :math:`N` = ``num_quantiles`` equal parts (as in coax). Jittable with
    static arguments.

    Parameters
    ----------
    batch_size : int
        The batch size for which the quantile fractions are generated (>= 0).
    num_quantiles : int, optional
        The number of quantile fractions :math:`N` (>= 1). Default: 200.

    Returns
    -------
    quantile_fractions : jax.Array, float32, shape ``(batch_size, num_quantiles)``
        The quantile fractions.

    Raises
    ------
    TypeError
        If a size is not an int.
    ValueError
        If ``batch_size < 0`` or ``num_quantiles < 1``.

    Examples
    --------
    >>> quantiles(2, num_quantiles=4)
    Array([[0.  , 0.25, 0.5 , 0.75],
           [0.  , 0.25, 0.5 , 0.75]], dtype=float32)
    """
    batch_size = check_int(batch_size, "batch_size", low=0)
    num_quantiles = check_int(num_quantiles, "num_quantiles", low=1)
    fractions = jnp.arange(num_quantiles, dtype=jnp.float32) / num_quantiles
    return jnp.broadcast_to(fractions, (batch_size, num_quantiles))


def quantiles_uniform(rng: jax.Array, batch_size: int, num_quantiles: int = 32) -> jax.Array:
    r"""Random quantile fractions: a sorted random partition of :math:`[0, 1]` per batch item.

    For every row, :math:`N` = ``num_quantiles`` numbers :math:`u_j \sim \mathcal{U}(0, 1)` are
    drawn and normalized, and their cumulative sums are returned:

    .. math::

        \tau_i = \sum_{j \le i} \frac{u_j}{\sum_k u_k}, \qquad i = 0, \dots, N-1

    so every row is increasing, lies in :math:`(0, 1]` and ends at exactly 1 (as in coax).
    With thousands of fractions an increment can be below the float32 spacing near 1, and
    neighbouring fractions can then be equal; a row never decreases.
    Jittable and vmappable over ``rng`` (sizes static). As quantile levels of a
    quantile-regression loss, :math:`\tau = 1` targets the maximum of the distribution,
    which the loss can only push up; the midpoints :math:`(\tau_{i-1} + \tau_i) / 2` (with
    :math:`\tau_{-1} = 0`) avoid that (``examples/iqn_cartpole.py`` uses them).

    Parameters
    ----------
    rng : jax.Array
        A pseudo-random number generator key.
    batch_size : int
        The batch size for which the quantile fractions are generated (>= 0).
    num_quantiles : int, optional
        The number of quantile fractions :math:`N` (>= 1). Default: 32.

    Returns
    -------
    quantile_fractions : jax.Array, float32, shape ``(batch_size, num_quantiles)``
        The quantile fractions.

    Examples
    --------
    >>> import jax
    >>> tau = quantiles_uniform(jax.random.PRNGKey(0), batch_size=3, num_quantiles=5)
    >>> tau.shape, bool((tau[:, -1] == 1).all()), bool((jax.numpy.diff(tau) > 0).all())
    ((3, 5), True, True)
    """
    batch_size = check_int(batch_size, "batch_size", low=0)
    num_quantiles = check_int(num_quantiles, "num_quantiles", low=1)
    # minval > 0 keeps every increment positive, so rows are strictly increasing.
    u = jax.random.uniform(
        rng, (batch_size, num_quantiles), dtype=jnp.float32, minval=1e-6, maxval=1.0
    )
    # the running sums divided by the last one, kept from decreasing (where a parallel
    # cumsum rounds unevenly) and from exceeding 1 (summing normalized increments rounded
    # past 1 early in rows of 10**5 fractions); the last is set to 1 (XLA may divide by
    # multiplying with a rounded reciprocal)
    sums = jnp.cumsum(u, axis=-1)
    tau = jnp.minimum(jax.lax.cummax(sums / sums[:, -1:], axis=1), 1.0)
    return tau.at[:, -1].set(1.0)


def quantile_cos_embedding(quantile_fractions: Any, n: int = 64) -> jax.Array:
    r"""Embed quantile fractions :math:`\tau` in ``n`` dimensions with cosine basis functions.

    .. math::

        \phi_i(\tau) = \cos(\pi\,i\,\tau) \qquad 0 \leq i \lt n

    (the documented formula; coax's code used :math:`i = 1, \dots, n`). The embedding is
    applied element-wise and appended as a new last axis, so 1-d fractions of shape ``(k,)``
    give ``(k, n)``, 2-d fractions ``(b, k)`` give ``(b, k, n)``, and any other rank works the
    same way. Jittable and vmappable (``n`` static).

    Parameters
    ----------
    quantile_fractions : array_like
        Quantile fractions :math:`\tau` to be embedded.
    n : int, optional
        The dimensionality of the embedding. Default: 64.

    Returns
    -------
    quantile_embs : jax.Array, shape ``quantile_fractions.shape + (n,)``
        The embeddings, of the fractions' floating dtype (computed in float32 at least).

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> quantile_cos_embedding(jnp.array([0.0, 1.0]), n=3)
    Array([[ 1.,  1.,  1.],
           [ 1., -1.,  1.]], dtype=float32)
    """
    n = check_int(n, "n", low=1)
    tau = jnp.asarray(quantile_fractions)
    if not jnp.issubdtype(tau.dtype, jnp.floating):
        tau = tau.astype(jnp.result_type(float))
    # computed in float32 at least: half floats hold integers exactly only up to 2048
    # (float16) or 256 (bfloat16), so i itself, and then pi * i * tau, would be wrong
    wide = jnp.promote_types(tau.dtype, jnp.float32)
    i = jnp.arange(n, dtype=wide)
    return jnp.cos(jnp.pi * i * tau[..., None].astype(wide)).astype(tau.dtype)
