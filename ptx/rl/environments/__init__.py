"""Built-in environments: exact-answer math, countdown, Python code against tests, a shell task."""
