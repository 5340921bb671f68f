"""`KineticWorker`: a Prefect server, a `kinetic` work pool, deployments and a worker process."""
