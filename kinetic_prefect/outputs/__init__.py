"""What task code calls: `output_dir()`, `checkpoint_manager()`, progress reporting."""
