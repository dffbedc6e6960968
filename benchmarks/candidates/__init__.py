"""Candidate rewrites of ptx code that only an accelerator can judge, carried with the tree to the device machine.

Each module says what it replaces, why it is here and when to delete or promote it; nothing in ptx imports them.
"""
