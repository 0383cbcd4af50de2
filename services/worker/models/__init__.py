"""The worker's own model implementations and the registry that picks one."""
