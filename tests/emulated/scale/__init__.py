"""Timing-bound scale tests: run last, alone (tests/support/scheduling.py)."""
