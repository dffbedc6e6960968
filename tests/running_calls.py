"""Counting calls that run at once, from the threads themselves (tests of concurrency limits)."""

import threading


class Running:
  """Counts calls running at once: `with running:` around each call; `peak` is the most at once."""

  def __init__(self):
    self.lock = threading.Lock()
    self.now = self.peak = 0

  def __enter__(self):
    with self.lock:
      self.now += 1
      self.peak = max(self.peak, self.now)

  def __exit__(self, *exc):
    with self.lock:
      self.now -= 1
