"""`KineticTaskRunner`: launcher, attempt ends, reattach, ownership, warm pods."""
