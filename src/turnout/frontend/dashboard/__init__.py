"""The frontend's live dashboard (``GET /dashboard``): the fleet as this frontend sees it."""
