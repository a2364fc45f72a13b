"""The agent loop, its harness (tools, chat format) and the coding environment it acts in."""
