"""Start-up of a run's roles, phase by phase: what each rank is doing, deadlines per phase, progress, figures.

    rank (generator / learner actor)          board (tiny Ray actor)          driver (driver/startup_watch.py)
    reporter.phase("op build", "shm_comm") ->  phase + time of arrival   <-   snapshot every second
    heartbeat thread: CPU seconds every 2 s -> last beat, CPU samples         phases.StartupClock: deadlines,
                                                                              slow / stop, progress line, figures

``phases`` is pure (the tests drive it with made-up times); ``reporter`` and ``board`` import Ray lazily.
"""
