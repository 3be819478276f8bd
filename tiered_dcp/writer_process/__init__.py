"""The long-lived writer process (process), its run directory (run_dir), the trainer's
side of it (client), the timings both record."""
