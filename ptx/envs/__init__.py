"""Environments and what they hand the model: the built-in tasks, tools, context builders, evaluation suites."""
