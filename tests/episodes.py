"""Playing environment episodes in tests."""


def one_step(env, task, action):
  """Resets `env` on `task`, takes `action`, closes the episode; returns the Step."""
  episode = env.reset(task)
  try:
    return episode.step(action)
  finally:
    episode.close()
