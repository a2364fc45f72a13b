"""Coding tasks: function task sources, repository tasks, their workspaces and the pool that draws them."""
