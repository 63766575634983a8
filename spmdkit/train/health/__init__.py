"""The job's health: where each process is (`phases`), a hung job ended (`watchdog`), slow processes named
(`stragglers`), the time lost (`goodput`), stop requests (`preemption`), traces (`profiling`), test-only faults."""
