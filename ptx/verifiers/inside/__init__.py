"""Programs run by path in another process (the code grader, the solution server, the sympy worker): stdlib only."""
