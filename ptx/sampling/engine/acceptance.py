"""Speculative sampling's acceptance rules: which drafts the policy keeps, so that emitted tokens follow the policy.

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

A drafter that samples (a draft model) gives a q of its own, so its drafts go
through the rule itself (`rejection_sample`), with uniforms of their own.

Every uniform is drawn by token index (`uniforms`): row r's token t takes
fold_in(fold_in(key, seq), t), and a draft model's draws and tests take the
same from the key folded with their own stream, so no draw depends on how a
turn's tokens fall into calls.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ptx.sampling.rules import SamplingConfig, invert_cdf, sample_tokens

# Streams of uniforms besides the tokens' own (key itself): a draft model's draws, and its drafts' tests.
DRAFT_STREAM, ACCEPT_STREAM = 1, 2


def uniforms(key: jax.Array, seq_ids: jax.Array, first: jax.Array, n: int) -> jax.Array:
  """Uniforms [R, n]: row r's of its tokens first[r] .. first[r] + n - 1, each fold_in(fold_in(key, seq), token)."""
  draw = lambda seq, t: jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, seq), t))  # noqa: E731
  return jax.vmap(lambda seq, t0: jax.vmap(lambda i: draw(seq, t0 + i))(jnp.arange(n)))(seq_ids, first)


def accept_deterministic(logits_RTV: jax.Array, drafts_RK: jax.Array, n_drafts_R: jax.Array, uniforms_RT: jax.Array,
                         sampling: SamplingConfig) -> tuple[jax.Array, jax.Array]:
  """The rule for deterministic drafts: the policy's token after each fed one, and the leading drafts they equal.

  Args:
    logits_RTV: the policy's logits [R, K + 1, V] after the pending token and
      after each draft.
    drafts_RK: int32 [R, K]: the drafts, padded past n_drafts_R.
    n_drafts_R: int32 [R]: each row's real drafts.
    uniforms_RT: float32 [R, K + 1]: each sampled token's own uniform.
    sampling: the sampling rules.

  Returns:
    (int32 tokens [R, K + 1], int32 accepted [R]); row r emits tokens[r, :a + 1].
  """
  R, T, V = logits_RTV.shape
  tokens_RT = sample_tokens(logits_RTV.reshape(R * T, V), uniforms_RT.reshape(-1), sampling).reshape(R, T)
  return tokens_RT, accepted_drafts(tokens_RT, drafts_RK, n_drafts_R)


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


def rejection_sample(p_RTV: jax.Array, q_RKV: jax.Array, drafts_RK: jax.Array, n_drafts_R: jax.Array,
                     accept_u_RK: jax.Array, sample_u_RT: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The standard rule for drafts sampled from q: the tokens each row emits, and how many drafts it accepts.

  Draft j is accepted when u_j q_j(d_j) < p_j(d_j), with probability
  min(1, p_j(d_j) / q_j(d_j)); the token after the a accepted ones is drawn
  from max(0, p_a - q_a) (`invert_cdf` renormalises) when draft a + 1 was
  rejected, else from p_a. Greedy is the case of p and q one-hot.

  Args:
    p_RTV: float32 [R, K + 1, V]: the policy's distribution after the pending
      token and after each draft (`rules.probabilities`).
    q_RKV: float32 [R, K, V]: the drafter's distribution of each draft.
    drafts_RK: int32 [R, K]: the drafts, padded past n_drafts_R.
    n_drafts_R: int32 [R]: each row's real drafts.
    accept_u_RK: float32 [R, K]: the uniform of each draft's test.
    sample_u_RT: float32 [R, K + 1]: the uniform of the token drawn after a
      accepted drafts, at index a.

  Returns:
    (int32 tokens [R, K + 1], int32 accepted [R]); row r emits tokens[r, :a + 1].
  """
  R, T, V = p_RTV.shape
  K = T - 1
  at_draft = lambda probs_RKV: jnp.take_along_axis(probs_RKV, drafts_RK[..., None], axis=-1)[..., 0]  # noqa: E731
  holds_RK = (accept_u_RK * at_draft(q_RKV) < at_draft(p_RTV[:, :K])) & (jnp.arange(K)[None] < n_drafts_R[:, None])
  accepted_R = jnp.sum(jnp.cumprod(holds_RK.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
  row = lambda x, i: jnp.take_along_axis(x, i[:, None, None], axis=1)[:, 0]  # noqa: E731
  q_RV = row(jnp.pad(q_RKV, ((0, 0), (0, 1), (0, 0))), accepted_R)  # zeros after the last draft
  rejected_R1 = (accepted_R < n_drafts_R)[:, None]
  residual_RV = jnp.maximum(row(p_RTV, accepted_R) - jnp.where(rejected_R1, q_RV, 0.0), 0.0)
  final_R = invert_cdf(residual_RV, jnp.take_along_axis(sample_u_RT, accepted_R[:, None], axis=1)[:, 0])
  drafted_RT = jnp.pad(drafts_RK, ((0, 0), (0, 1)))
  tokens_RT = jnp.where(jnp.arange(T)[None] < accepted_R[:, None], drafted_RT, final_R[:, None])
  return tokens_RT.astype(jnp.int32), accepted_R
