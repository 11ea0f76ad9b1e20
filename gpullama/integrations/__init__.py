"""Integrations with the serving stacks that run gpullama beyond one process (Ray Serve: `gpullama.integrations.ray`)."""
