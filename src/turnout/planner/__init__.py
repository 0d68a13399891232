"""The SLO planner: sizes each worker pool to the load it predicts, so that requests meet
their time-to-first-token and inter-token-latency targets with as few workers as that takes.

``observe`` reads the frontends' metrics, ``predict`` forecasts the next interval's load,
``capacity`` says what one worker sustains within the targets, ``decide`` turns those into a
replica count per pool (with bounds, budget, hysteresis and cool-downs), a connector
(``connectors``) acts on it, and ``service`` runs the loop under a leader lease (``leader``).
"""
