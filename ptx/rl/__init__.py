"""Tests for ptx.rl: sandbox, scheduler, environments, evaluation."""
