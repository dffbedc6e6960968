"""Episodes in environments: the multi-turn loop, turn formats, scoring of completions, evaluation (pass@k)."""
