"""The ``turnout`` command line: ``serve``, ``frontend``, ``worker``."""
