"""vLLM engines: embedded or a fleet of servers (`build_engines`), in-place weight updates, routed experts."""
