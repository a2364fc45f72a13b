"""What every command shares at run time: the run directory, processes, run status, reports, progress."""
