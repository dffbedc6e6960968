"""Finds and kills every process of a sandbox uid, also those that left its group.

A program can escape its process group (setsid, double fork) and outlive the
run. Each sandbox workspace has a uid of its own when the caller is root, so
the uid, unlike the group, cannot be escaped: /proc lists its processes, and a
helper that becomes the uid and calls kill(-1, SIGKILL) kills them all in one
step, faster than a fork bomb can replace them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

_ROUNDS = 50  # kill rounds before giving up on a process that will not die


def live_pids(uid: int) -> list[int]:
  """Returns the pids owned by `uid` that are not zombies.

  Args:
    uid: the user id.

  Returns:
    Their process ids (zombies are dead already and hold nothing but a pid).
  """
  pids = []
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      if os.stat(f"/proc/{name}").st_uid != uid:
        continue
      with open(f"/proc/{name}/stat", "rb") as f:
        # The state follows the parenthesised command name, which may hold ")".
        state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
      continue  # it exited while we looked
    if state != b"Z":
      pids.append(int(name))
  return pids


def kill_user(uid: int, child_script: str) -> list[int]:
  """Kills every process of `uid` and waits until none is left alive.

  Args:
    uid: an unprivileged uid that belongs to one sandbox workspace.
    child_script: path of `child.py`, which does the kill as `uid`.

  Returns:
    The pids that survived every round (normally none; a process stuck in
    the kernel cannot be killed until it returns).
  """
  for _ in range(_ROUNDS):
    if not live_pids(uid):
      return []
    subprocess.run([sys.executable, "-I", "-S", child_script, "--reap", str(uid)], check=True,
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    time.sleep(0.005)  # SIGKILL is delivered asynchronously
  return live_pids(uid)
