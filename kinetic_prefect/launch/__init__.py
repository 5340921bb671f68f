"""From a submission to a Job manifest: settings, accelerators, packaging, pod settings, checks."""
