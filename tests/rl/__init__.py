"""Tests for ptx.rl."""
