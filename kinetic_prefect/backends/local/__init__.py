"""The local backend: pods as local process groups, run from the same Job manifest."""
