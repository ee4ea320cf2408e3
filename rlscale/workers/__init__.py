"""Policy workers and the groups that drive them."""
