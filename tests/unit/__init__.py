"""Tests that need no server, pod or cluster: settings, manifests, packaging, layering."""
