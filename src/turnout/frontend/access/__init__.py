"""Who may use the frontend, and how much: API keys and JWTs (``auth``), tenants' limits
and usage (``limits``, ``usage``), and the audit log of admin actions."""
