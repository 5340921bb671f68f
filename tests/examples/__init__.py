"""What the README tells a user to run: the example flows and the block scripts."""
