"""What a run leaves and how it is read back: the results schema and writer, statistics over rollouts,
collecting runs into tables, and the figures drawn from them."""
