"""Programs run by path inside a sandbox (PID 1, the rlimits child, the fork loop, the workspace format): stdlib."""
