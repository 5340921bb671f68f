"""`KineticWorker` (work pool type `kinetic`) and the flow pod a deployed flow run runs in."""
