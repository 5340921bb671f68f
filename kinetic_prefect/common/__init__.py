"""The orchestrator–pod contract: `KINETIC_*` names, jobs-store layout, records, storage clients."""
