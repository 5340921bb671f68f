"""Fixtures other test modules share (none yet beyond conftest)."""
