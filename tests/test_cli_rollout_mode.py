"""`ptx eval --rollout.mode=...`: the rollout section's overrides are taken, any other override or value is refused."""

import re

import pytest

from ptx import cli


@pytest.mark.parametrize("extra, message", [
    (["--rollout.mode=turbo"], "rollout.mode"),
    (["--rollout.mode=fast", "--grpo.beta=0.1"], "--rollout.\\* overrides only"),
])
def test_eval_takes_the_rollout_switch_and_refuses_other_overrides(tmp_path, capsys, extra, message):
  with pytest.raises(SystemExit) as stop:
    cli.main(["eval", "--model", str(tmp_path), "--task", "arithmetic", *extra])
  assert stop.value.code == 2
  assert re.search(message, capsys.readouterr().err)
