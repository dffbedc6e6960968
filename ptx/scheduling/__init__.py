"""Runs host work concurrently: the scheduler (limits, priorities, timeouts, retries), executors; no other ptx."""
