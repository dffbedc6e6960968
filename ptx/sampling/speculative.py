"""Speculative sampling's acceptance rule for deterministic drafters: drafts kept while the policy's own tokens match.

A drafter proposes d_1..d_k after a row's pending token; one forward of the
policy over [pending, d_1..d_k] gives its distribution p_j after each fed
token (after the sampling rules). The standard rule (Leviathan et al. 2023,
Chen et al. 2023) accepts d_j with probability min(1, p_j(d_j) / q_j(d_j)),
draws the token at the first rejection from normalize(max(0, p_j - q_j)), and
a bonus token from p_k when all k hold. A deterministic drafter (n-gram
lookup, a scripted one) has q_j = one-hot(d_j), so d_j is accepted with
probability p_j(d_j) and a rejection draws from p_j without d_j, renormalised.

Drawing t_j from p_j by inverting its CDF (`rules.sample_tokens`) and
accepting d_j exactly when t_j == d_j realises that rule: t_j == d_j has
probability p_j(d_j), and t_j given t_j != d_j is distributed as p_j without
d_j. The emitted tokens are t_1..t_{a+1} (a accepted drafts): the tokens
plain decoding draws with the same uniforms, so speculative and standard
sampling give the same tokens for the same seed, whatever is drafted (greedy:
accept while the draft is the argmax, then emit the argmax).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def accepted_drafts(tokens_RT: jax.Array, drafts_RK: jax.Array, n_drafts_R: jax.Array) -> jax.Array:
  """How many leading drafts of each row the policy's tokens equal.

  Args:
    tokens_RT: int32 [R, K + 1]: the policy's token after each fed token
      (the pending one, then the drafts).
    drafts_RK: int32 [R, K]: the drafts, padded past n_drafts_R.
    n_drafts_R: int32 [R]: each row's real drafts.

  Returns:
    int32 [R]: accepted drafts a; the row emits tokens_RT[r, :a + 1].
  """
  K = drafts_RK.shape[1]
  holds_RK = (tokens_RT[:, :K] == drafts_RK) & (jnp.arange(K)[None] < n_drafts_R[:, None])
  return jnp.sum(jnp.cumprod(holds_RK.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
