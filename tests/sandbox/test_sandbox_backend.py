"""Choosing the sandbox backend: bwrap by default, the weaker one only by name, a refusal that says what to do."""

import numpy as np
import pytest

from ptx.data.tokenizer import ByteTokenizer
from ptx.sandbox import run as sandbox
from ptx.envs import shell
from ptx.episodes.scoring import EnvReward

LIMITS = sandbox.Limits(timeout_s=20.0, cpu_s=2, memory_bytes=256 << 20)


@pytest.fixture
def fresh_choice(monkeypatch):
  """Forgets the process's choice and probe for the test, and restores them after."""
  monkeypatch.setattr(sandbox, "_chosen", None)
  monkeypatch.delenv(sandbox.MODE_VARIABLE, raising=False)
  return monkeypatch


@pytest.fixture
def no_bwrap(fresh_choice):
  fresh_choice.setattr(sandbox, "_bwrap_problem", "user namespaces are disabled (test)")
  return fresh_choice


def test_bwrap_is_the_default_here_and_every_result_names_it(fresh_choice):
  assert sandbox.bwrap_problem() == ""
  result = sandbox.run(["true"], limits=LIMITS)
  assert sandbox.backend() == sandbox.Backend.BWRAP and result.backend == "bwrap" and result.notes == ()


def test_without_bwrap_runs_refuse_and_say_how_to_opt_in(no_bwrap):
  with pytest.raises(sandbox.SandboxUnavailable, match="user namespaces are disabled.*PTX_SANDBOX=rlimits"):
    sandbox.run(["true"], limits=LIMITS)
  with pytest.raises(sandbox.SandboxUnavailable):
    shell.ShellEnv().reset({"prompt": "p", "files": {}, "check": "true"})
  with pytest.raises(sandbox.SandboxUnavailable):  # at job build time, not at the first step
    EnvReward(shell.ShellEnv(max_turns=1), ByteTokenizer(), (0,), 2)
  with pytest.raises(sandbox.SandboxUnavailable, match="does not work here"):
    sandbox.use("bwrap")


def test_the_weaker_backend_runs_only_by_name_and_says_so(no_bwrap):
  no_bwrap.setenv(sandbox.MODE_VARIABLE, "rlimits")
  result = sandbox.run(["sh", "-c", "echo hi"], limits=LIMITS)
  assert result.outcome == sandbox.Outcome.OK and result.stdout_text == "hi\n"
  assert result.backend == "rlimits" and any("weaker rlimits backend" in n for n in result.notes)
  tok = ByteTokenizer()
  reward = EnvReward(shell.ShellEnv(max_turns=1, limits=LIMITS), tok, (0,), 1)  # one command, then the check
  reward(np.asarray([tok.encode("true")]), np.asarray([4]), [{"prompt": "p", "files": {}, "check": "true"}])
  assert reward.take_metrics()["rewards/sandbox"] == "rlimits"


def test_an_unknown_backend_name_is_refused(fresh_choice):
  fresh_choice.setenv(sandbox.MODE_VARIABLE, "docker")
  with pytest.raises(ValueError, match="PTX_SANDBOX.*'bwrap', 'rlimits'.*'docker'"):
    sandbox.run(["true"])

