"""xdist's file-by-file scheduling, made to end after a worker crashes.

pytest-xdist 3.8 (the newest release) can wait forever once a crashed worker
is replaced under `--dist loadfile`: it puts the dead worker's whole workload
back on the queue, finished files included, so a replacement can be handed a
file with nothing left to run; and a replacement handed the last file is never
told that no more will come, so it waits for a next test before running its
last one. It also stops the run with an internal error when it sends work to a
worker that died right after its last report. All three reproduce with a test
that calls `os._exit` (tests/test_worker_crash.py).
"""

from xdist.scheduler import LoadFileScheduling


class CrashSafeLoadFileScheduling(LoadFileScheduling):
  """`--dist loadfile` whose crashed test fails once, by name, and whose run always ends."""

  def remove_node(self, node):
    """Drops `node`, queues the tests it had not run, and returns the one it died in (or None).

    The test it died in is not run again: xdist reports it failed ("worker 'gwN' crashed while
    running ..."), and a test that kills its worker would only kill the replacement too.
    """
    workload = self.assigned_work.pop(node)
    # The worker runs its files in the order they were sent, and a file's tests in order, so
    # the first test not reported is the one it was running.
    unfinished = {scope: [nodeid for nodeid, done in unit.items() if not done] for scope, unit in workload.items()}
    unfinished = {scope: nodeids for scope, nodeids in unfinished.items() if nodeids}
    if not unfinished:
      return None
    crashed = unfinished[next(iter(unfinished))].pop(0)
    for scope, nodeids in unfinished.items():
      if nodeids:
        self.workqueue[scope] = dict.fromkeys(nodeids, False)
    for other in self.assigned_work:
      self._reschedule(other)
    return crashed

  def _assign_work_unit(self, node):
    """Sends `node` its next file, unless it has died since its last report.

    A worker that reports a test and dies at once (the next test kills it) is still listed until
    the controller reads that it died; xdist stops the whole run with an OSError when it tries to
    send it work meanwhile. The file stays assigned to the dead worker, and `remove_node` puts it back.
    """
    try:
      super()._assign_work_unit(node)
    except OSError:
      pass

  def schedule(self):
    """Hands out work, and tells every worker when nothing is left to hand out.

    xdist says so only when the first distribution empties the queue, or when a worker reports a
    test; a replacement handed the last file would otherwise wait for a next test forever.
    """
    super().schedule()
    if self.collection and not self.workqueue:
      for node in self.nodes:
        if not node.shutting_down:
          node.shutdown()
