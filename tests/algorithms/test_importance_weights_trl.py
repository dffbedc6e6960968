"""GRPO's off-policy correction against TRL's own code: TRL 1.16's importance-sampling block, run as it is written.

The block sits inline in `GRPOTrainer._generate_and_score_completions`, so it is cut from the installed source (the
`trl` fixture `make test` installs without its dependencies, never imported) and executed with torch on the same
log-probs that `ptx.algorithms.grpo.importance_weights` gets. A TRL release that moves the block fails the cut, by name.
"""

import importlib.util
import math
import pathlib
import textwrap
import types

import jax.numpy as jnp
import numpy as np
import pytest

from ptx.algorithms import grpo
from ptx.config import GRPOConfig

torch = pytest.importorskip("torch")  # the parity extra, installed by `make test`
_START = "if self.use_vllm and self.vllm_importance_sampling_correction:"
_END = "# Compute the per-token log probabilities for the reference model"


def _trl_block() -> str:
  spec = importlib.util.find_spec("trl")
  if spec is None:
    pytest.skip("trl is not installed (`make test` installs it as a --no-deps fixture)")
  source = (pathlib.Path(spec.submodule_search_locations[0]) / "trainer" / "grpo_trainer.py").read_text()
  start, end = source.find(_START), source.find(_END)
  assert 0 <= start < end, "TRL's importance-sampling block moved: update _START/_END for the pinned trl"
  return textwrap.dedent(source[source.index("\n", start) + 1:end])


def _trl_weights(mode: str, old: np.ndarray, sampler: np.ndarray, mask: np.ndarray, *, clip_min, clip_max):
  trainer = types.SimpleNamespace(vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=clip_min,
                                  vllm_importance_sampling_clip_max=clip_max)
  scope = {"self": trainer, "torch": torch, "math": math, "completion_mask": torch.tensor(mask), "tool_mask": None,
           "old_per_token_logps": torch.tensor(old), "sampling_per_token_logps": torch.tensor(sampler)}
  exec(_trl_block(), scope)  # noqa: S102  (TRL's own lines, from the pinned package)
  return np.broadcast_to(scope["vllm_importance_sampling_ratio"].numpy(), old.shape)


def _logps(seed: int = 0, rows: int = 32, length: int = 12):
  """Log-probs whose sequences straddle the bands: per-token differences of a few tenths, ragged lengths."""
  rng = np.random.default_rng(seed)
  sampler = rng.normal(-2.0, 1.0, (rows, length)).astype(np.float32)
  old = (sampler + rng.normal(0.0, 0.4, (rows, length))).astype(np.float32)
  lengths = rng.integers(1, length + 1, rows)
  mask = (np.arange(length)[None] < lengths[:, None]).astype(np.float32)
  return old, sampler, mask


@pytest.mark.parametrize("trl_mode,ptx_mode,clip_min,clip_max", [
    ("token_truncate", "token", None, 1.3),
    ("sequence_mask", "sequence_product_mask", None, 3.0),  # TRL's defaults
    ("sequence_mask", "sequence_product_mask", 0.5, 1.5),
])
def test_ptx_equals_trl(trl_mode, ptx_mode, clip_min, clip_max):
  old, sampler, mask = _logps()
  ours = grpo.importance_weights(jnp.asarray(old), jnp.asarray(sampler), jnp.asarray(mask),
                                 GRPOConfig(tis_mode=ptx_mode, tis_cap=clip_max, tis_min=clip_min or 0.0))
  theirs = _trl_weights(trl_mode, old, sampler, mask, clip_min=clip_min, clip_max=clip_max)
  on = mask > 0  # padded positions leave the loss on both sides, whatever weight they carry
  # float32 on both sides; a sum of 12 log-ratios then exp: a few ulps.
  np.testing.assert_allclose(np.asarray(ours)[on], theirs[on], rtol=1e-5, atol=1e-7)
  if ptx_mode != "token":
    assert 0 < (theirs[:, 0] == 0).sum() < len(old), "the sample must straddle the band, or the mask is untested"


def test_the_geometric_mean_gate_is_not_trls_rule():
  """`tis_mode="sequence_mask"` (ptx, OpenRLHF's and NeMo-RL's gate) keeps other sequences than TRL's sequence_mask."""
  old, sampler, mask = _logps()
  ours = grpo.importance_weights(jnp.asarray(old), jnp.asarray(sampler), jnp.asarray(mask),
                                 GRPOConfig(tis_mode="sequence_mask", tis_cap=1.5, tis_min=0.5))
  theirs = _trl_weights("sequence_mask", old, sampler, mask, clip_min=0.5, clip_max=1.5)
  assert ((np.asarray(ours)[:, 0] > 0) != (theirs[:, 0] > 0)).any()
