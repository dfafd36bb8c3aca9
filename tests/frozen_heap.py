"""Imported last by the tests' fork server (``fork_server.PRELOAD``): freezes what the imports before it left, as
the project's fork server does before its first fork (``async_rlhf.startup.fork_serving.freeze_heap`` says why).
multiprocessing's server runs only imports before it forks, so the freeze is this module's import."""

from async_rlhf.startup.fork_serving import freeze_heap

freeze_heap()
