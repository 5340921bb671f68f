"""`KineticTaskRunner` against a real Prefect API with local pods."""
