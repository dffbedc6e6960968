"""The OS sandbox for model-written code: bubblewrap or rlimits runs, workspaces as bytes, fork servers; no other ptx.

`inside/` holds the programs that run by path inside a sandbox (standard
library only, never imported).
"""
