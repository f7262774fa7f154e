"""Tools of the daemon side (benchmarks), apart from the runtime modules."""
